#!/usr/bin/env bash
# The GPU benchmark suite. From the repository root, on a machine with 2 GPUs (or more):
#   bash benchmarks/run.sh RESULTS_DIR SET [SET ...]
# Sets (train_flux_cp.py through benchmarks/bench_trainer.py: FLUX.1-dev shapes with random weights, bf16, LoRA r16,
# gradient checkpointing, one sample per step; one GPU against cp=2 on ddp_cp2.yaml):
#   lora       --compile, 1024 and 2048 px, LoRA on the default --lora_layers
#   lora_ro    the same with --compile_mode reduce-overhead (each block's forward and backward a CUDA graph)
#   diffusers  diffusers' built-in CP (Ulysses, cuDNN, blocks compiled) at 1024 and 2048 px
#              (benchmarks/bench_diffusers_cp.py), and ours with the same adapters (LoRA on the attention projections),
#              --compile_mode reduce-overhead
#   lora4096   4096 px, --compile
#   full       full fine-tuning at 2048 px, FSDP2 + cp=2 (fsdp2_cp2.yaml), --compile, no checkpoint written
#   kontext    FLUX.1 Kontext-shaped pairs (data/tiny_pairs: target + reference), LoRA on the attention, --compile
#   host       one GPU is enough: the 2048 px one-GPU step against cp=2's rank 0 with loopback peers (each exchange
#              one local copy, benchmarks/fake_peers.py): what a CP rank spends besides communication
#   flux2      FLUX.2 [dev] shapes (32B), LoRA r16, --compile_mode reduce-overhead, --gradient_checkpointing auto: one
#              GPU at 1024 and 2048 px, and at 2048 px a cp=2 rank with loopback peers (benchmarks/fake_peers.py)
#   flux2_cp   FLUX.2 [dev] shapes on 2 GPUs, LoRA r16 on the default layers, --compile_mode reduce-overhead,
#              --gradient_checkpointing auto: one GPU against cp=2 at 1024 and 2048 px, and diffusers' built-in CP
#              (Ulysses, cuDNN, blocks compiled, the same adapters) on Flux2Transformer2DModel
#   attention  benchmarks/bench_attention.py: cp.attention's modes against one-GPU cuDNN SDPA, forward + backward,
#              16,896 and 66,048 tokens, eager and compiled
#   memory     one GPU is enough: --gradient_checkpointing auto under GPU memory capped to 24, 48, 80 GiB and the whole
#              GPU, one GPU and a cp=2 rank with loopback peers, 1024 and 2048 px: the planner's picks, their measured
#              peaks and step times, and the fastest setting that runs (benchmarks/bench_memory.py; ~7 min of an H200)
#   small      one GPU is enough: the small-GPU rows, each capped (benchmarks/capped.py) to a smaller card's memory,
#              FLUX.1-dev shapes, 1024 px: diffusers' QLoRA recipe at 24 and 12 GiB (benchmarks/bench_diffusers_qlora.py;
#              nf4, 8-bit AdamW, checkpointing), and ours compiled with the planner's picks: nf4 at 12 GiB (offload
#              auto), nf4 at 24 GiB, fp8 at 24 GiB (offload auto). ~9.5 min of an H200
#   small_b    one GPU is enough: nf4 at 12 GiB eager and compiled with every block checkpointed, bf16 at 24 GiB
#              (offload auto, compiled), int8 at 16 GiB (offload auto, eager), and each base precision's per-block
#              error against bf16 (benchmarks/bench_precision_error.py). ~9.5 min of an H200
#   small_full one GPU is enough: whole runs (encoding, training, validation) with every component at full size
#              (random weights): FLUX.1-dev nf4 at 12 GiB, FLUX.2 [klein] 4B nf4 at 12 GiB, FLUX.2 [dev] nf4 at 24 GiB
#              (offload auto, its 24B text encoder streamed). ~8 min of an H200
#   small_2048 one GPU is enough: 2048 px, one rank of cp=2 (loopback peers) with an fp8 base under 24 GiB
#   peers      one GPU: the peers' small-GPU steps, each capped, FLUX.1-dev / FLUX.2 [dev] shapes, 1024 px, random
#              weights: kohya sd-scripts at its 24 GB setting (--fp8_base), bf16 with 8 blocks swapped at 24 GiB and its
#              12 GB setting (--fp8_base --blocks_to_swap 16) (benchmarks/bench_kohya.py; needs SD_SCRIPTS, a checkout,
#              default .whl/sd-scripts, and its wheels in .whl/kohya: benchmarks/carry.sh); diffusers' FLUX.2 example
#              at 24 GiB (benchmarks/bench_diffusers_flux2.py: nf4, --offload, --cache_latents, 8-bit AdamW) and ours
#              beside it (FLUX.2 [dev] nf4, offload auto, eager); diffusers' QLoRA recipe at 24 and 12 GiB.
#              ~8 min of an H100
#   pairs      one GPU: README's 24 GB command as printed (fp8, offload and checkpointing auto, --compile) beside kohya
#              sd-scripts at its 24 GB setting (--fp8_base), in one sitting. ~5 min of an H100
#   pairs_flux2 one GPU: diffusers' FLUX.2 example at 24 GiB beside ours (FLUX.2 [dev] nf4, offload auto), in one
#              sitting. ~5 min of an H100
#   table      one GPU: ours on the small-GPU table's FLUX.1 rows, each capped, 1024 px: fp8 + offload auto at 24 GiB
#              compiled (README's 24 GB command) and eager, bf16 with --offload_blocks --compile at 24 GiB, nf4 +
#              offload auto + compile at 12 GiB. ~8 min of an H100
#   table_b    one GPU: the table's other rows: FLUX.2 [klein] 4B nf4 at 12 GiB (eager), FLUX.2 [dev] fp8 + offload
#              auto + compile under 48 GiB, and the one-GPU 2048 px default step uncapped (--compile). ~7 min of an H100
#   picks      one GPU: the fastest lines of README's table that --plan recommends (an fp8 base, offload and checkpointing
#              auto, compiled): FLUX.1 [dev] at 12 GiB beside its nf4 line, FLUX.2 [klein] 4B at 12 GiB, FLUX.2 [dev] at
#              24 GiB. ~9 min of an H100
#   speed      one GPU is enough: the planner's speed model (benchmarks/bench_speed_model.py): this GPU class's figures
#              measured (FLUX.1-dev's blocks at 1024 px, every base precision, eager and compiled), written to
#              RESULTS_DIR/speed_data/CLASS.json (copy it over flux_cp/plan/speed_data/ to keep it), then the 24 GiB rows of
#              the small-GPU table (README's 24 GB command: fp8 with offload and --compile auto over 2000 steps; bf16
#              with offload compiled) predicted with it beside their
#              measured steps (RESULTS_DIR/speed_check.json; the set fails when one is off by more than 15% or out of
#              order). ~9 min of an H100 (SPEED_PRECISIONS=bf16,fp8 measures fewer precisions)
#   check      the GPU tests (pytest tests/gpu) and benchmarks/check_gpu.py (bf16 attention and a 4-block Flux model
#              with CP against fp32 and bf16 without CP, every CP size the machine has)
# EXTRA_FLAGS="..." is added to every trainer run of the sets (e.g. EXTRA_FLAGS="--cp_overlap passes" or
# "--cp_exchange_first"); DRY_RUN=1 prints the commands instead of running them. Each set writes result files in the
# suite's schema (benchmarks/schema.py) to RESULTS_DIR, and logs to RESULTS_DIR/logs; at the end
# `python -m benchmarks.render RESULTS_DIR` writes RESULTS_DIR/results.md (docs/benchmarks.md, how to measure).
set -euo pipefail
if [ $# -lt 2 ]; then
  awk 'NR > 1 && /^set -euo/ {exit} NR > 1' "$0"
  exit 2
fi
OUT=$1; shift
DRY=${DRY_RUN:-}
EXTRA=${EXTRA_FLAGS:-}
if [ -z "$DRY" ]; then
  . benchmarks/gpu_env.sh
  mkdir -p "$OUT/logs"
  N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
else
  N=2
fi

run() {  # run SECONDS COMMAND...: the command with a time limit, or printed under DRY_RUN
  local t=$1; shift
  if [ -n "$DRY" ]; then echo "+ $*"; return; fi
  # --foreground keeps the command in this shell's process group: a time limit around the whole set (`timeout N bash
  # benchmarks/run.sh ...`) then ends the command in flight too, where a nested timeout's own group outlived it.
  timeout --foreground "$t" "$@" || echo "exit $? after: $*"
}

trainer() {  # trainer SECONDS FILE "BENCH_TRAINER_OPTIONS" RUN...: each RUN as name:gpus:config:flags
  local t=$1 file=$2 opts=$3; shift 3
  local runs=() r
  for r in "$@"; do runs+=("$r${EXTRA:+ $EXTRA}"); done
  if [ -n "$DRY" ]; then
    # shellcheck disable=SC2086 # opts is a list of options
    python3 -m benchmarks.bench_trainer --out "$OUT/$file" --dry_run $opts "${runs[@]}"
    return
  fi
  # shellcheck disable=SC2086
  run "$t" python3 -m benchmarks.bench_trainer --out "$OUT/$file" --logs "$OUT/logs" --parallel $opts "${runs[@]}"
}

flux2_model() {  # sets MODEL: a FLUX.2 [dev]-shaped folder (config and tiny encoders; weights drawn at start)
  MODEL=${FLUX2_MODEL:-$(mktemp -d)/flux2-dev-shapes}
  if [ -n "$DRY" ]; then echo "+ (the model: python3 -m flux_cp.tiny --preset flux2-dev-shapes --out $MODEL)"; return; fi
  python3 -m flux_cp.tiny --preset flux2-dev-shapes --out "$MODEL" > /dev/null
}

klein_model() {  # sets KLEIN: a FLUX.2 [klein] 4B-shaped folder (config and tiny encoders; weights drawn at start)
  KLEIN=${KLEIN_MODEL:-$(mktemp -d)/flux2-klein-shapes}
  if [ -n "$DRY" ]; then echo "+ (the model: python3 -m flux_cp.tiny --preset flux2-klein-shapes --out $KLEIN)"; return; fi
  python3 -m flux_cp.tiny --preset flux2-klein-shapes --out "$KLEIN" > /dev/null
}

kohya_env() {  # sets SD_SCRIPTS (a kohya-ss/sd-scripts checkout) and KOHYA_SITE (its pinned dependencies, .whl/kohya)
  SD_SCRIPTS=${SD_SCRIPTS:-.whl/sd-scripts}
  if [ -z "${KOHYA_SITE:-}" ] && ls .whl/kohya/*.whl >/dev/null 2>&1; then
    KOHYA_SITE=$(mktemp -d)
    if [ -n "$DRY" ]; then echo "+ (kohya's wheels: pip install --target $KOHYA_SITE .whl/kohya/*.whl)"; return; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$KOHYA_SITE" .whl/kohya/*.whl
  fi
}

ATTN=attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out
RO="--compile_mode reduce-overhead"
for SET in "$@"; do
  echo "=== $SET $(date +%T)"
  case $SET in
    lora)
      trainer 600 trainer_lora.json "" \
        "cp1_2048:1:gpu1.yaml:--resolution 2048 --compile" \
        "cp1_1024:1:gpu1.yaml:--resolution 1024 --compile" \
        "cp2_2048:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile" \
        "cp2_1024:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 --compile" ;;
    lora_ro)
      trainer 600 trainer_lora_ro.json "" \
        "cp1_2048_ro:1:gpu1.yaml:--resolution 2048 $RO" \
        "cp1_1024_ro:1:gpu1.yaml:--resolution 1024 $RO" \
        "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 $RO" \
        "cp2_1024_ro:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 $RO" ;;
    diffusers)
      run 300 torchrun --nproc_per_node 2 -m benchmarks.bench_diffusers_cp --out "$OUT/diffusers_cp.json" \
        --resolution 1024 2048 --mode ulysses --lora_layers "$ATTN"
      trainer 600 trainer_attn_ro.json "" \
        "cp1_2048_ro_attn:1:gpu1.yaml:--resolution 2048 $RO --lora_layers $ATTN" \
        "cp1_1024_ro_attn:1:gpu1.yaml:--resolution 1024 $RO --lora_layers $ATTN" \
        "cp2_2048_ro_attn:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 $RO --lora_layers $ATTN" \
        "cp2_1024_ro_attn:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 $RO --lora_layers $ATTN" ;;
    lora4096)
      trainer 600 trainer_lora4096.json "" \
        "cp1_4096:1:gpu1.yaml:--resolution 4096 --compile" \
        "cp2_4096:2:ddp_cp2.yaml:--cp_size 2 --resolution 4096 --compile" ;;
    full)  # weights-only checkpoints: the trainer's disk check counts a full one (133 GiB) although none is written
      trainer 500 trainer_full.json "" \
        "cp2_2048_full:2:fsdp2_cp2.yaml:--cp_size 2 --resolution 2048 --compile --full_finetune --checkpoint_weights_only" ;;
    kontext)
      MODEL=${KONTEXT_MODEL:-$(mktemp -d)/kontext-shapes}  # config and tiny encoders: the weights are drawn at start
      [ -n "$DRY" ] || python3 -m flux_cp.tiny --preset flux1-dev-shapes --kontext --out "$MODEL" > /dev/null
      K="--compile --lora_layers $ATTN --dataset_name data/tiny_pairs"
      if [ -n "$DRY" ]; then echo "+ (the model: python3 -m flux_cp.tiny --preset flux1-dev-shapes --kontext --out $MODEL)"; fi
      trainer 900 trainer_kontext.json "--model $MODEL" \
        "cp1_2048_kontext:1:gpu1.yaml:--resolution 2048 $K" \
        "cp1_1024_kontext:1:gpu1.yaml:--resolution 1024 $K" \
        "cp2_2048_kontext:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 $K" \
        "cp2_1024_kontext:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 $K" ;;
    host)
      trainer 500 trainer_host.json "--fake_peers" \
        "cp1_2048_ro:1:gpu1.yaml:--resolution 2048 $RO" \
        "fake2_2048_ro:1:gpu1.yaml:--cp_size 2 --resolution 2048 $RO" ;;
    flux2)  # FLUX.2 [dev] shapes (32B, random weights, tiny encoders): one GPU and a CP=2 rank with loopback peers
      flux2_model
      trainer 600 trainer_flux2.json "--model $MODEL --fake_peers --steps 6" \
        "flux2_1024:1:gpu1.yaml:--resolution 1024 $RO" \
        "flux2_2048:1:gpu1.yaml:--resolution 2048 $RO" \
        "flux2_fake2_2048:1:gpu1.yaml:--cp_size 2 --resolution 2048 $RO" ;;
    flux2_cp)  # needs 2 GPUs of 141 GB: [dev]'s 64 GB of bf16 weights on each
      flux2_model
      trainer 900 trainer_flux2_cp.json "--model $MODEL --steps 6" \
        "flux2_1024:1:gpu1.yaml:--resolution 1024 $RO" \
        "flux2_2048:1:gpu1.yaml:--resolution 2048 $RO" \
        "flux2_cp2_1024:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 $RO" \
        "flux2_cp2_2048:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 $RO"
      run 600 torchrun --nproc_per_node 2 -m benchmarks.bench_diffusers_cp --family flux2 \
        --out "$OUT/diffusers_cp_flux2.json" --resolution 1024 2048 --mode ulysses ;;
    attention)
      run 300 torchrun --nproc_per_node 2 -m benchmarks.bench_attention --tokens 16896 66048 \
        --out "$OUT/attention.json"
      run 300 torchrun --nproc_per_node 2 -m benchmarks.bench_attention --tokens 16896 66048 --compile \
        --out "$OUT/attention_compiled.json" ;;
    memory)
      if [ -n "$DRY" ]; then python3 -m benchmarks.bench_memory --out "$OUT/memory.json" --dry_run; continue; fi
      run 560 python3 -m benchmarks.bench_memory --out "$OUT/memory.json" --budget 420 ;;
    small)
      run 185 python3 -m benchmarks.bench_diffusers_qlora --out "$OUT/diffusers_qlora.json" --gpu_memory_gib 24 12 \
        --resolution 1024 --model_dir "$(mktemp -d)/flux1-dev-shapes-random"
      trainer 360 trainer_small.json "--steps 5 --warmup 2 --timeout 130" \
        "small12_nf4_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto --compile" \
        "small24_nf4_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision nf4 --compile" \
        "small24_fp8_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --offload_blocks auto --compile" ;;
    small_b)
      trainer 470 trainer_small_b.json "--steps 5 --warmup 2 --timeout 130" \
        "small12_nf4:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --gradient_checkpointing all --compile off" \
        "small12_nf4_all_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --gradient_checkpointing all --compile" \
        "small24_bf16_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --offload_blocks auto --compile" \
        "small16_int8_auto:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 16 --base_precision int8 --offload_blocks auto --compile off"
      run 110 python3 -m benchmarks.bench_precision_error --out "$OUT/precision_error.json" ;;
    small_full)  # every component at full size, random weights (python -m flux_cp.tiny --preset ...-full-shapes)
      V="--validation_prompt a_red_circle --num_validation_images 1 --validation_inference_steps 2 --validation_steps 2 --compile off"
      for P in flux1-dev flux2-klein flux2-dev; do
        [ -n "$DRY" ] || python3 -m flux_cp.tiny --preset "$P-full-shapes" --out "/tmp/full-$P" > /dev/null
      done
      trainer 130 trainer_full_flux1.json "--model /tmp/full-flux1-dev --steps 5 --warmup 2 --timeout 125" \
        "full12_flux1_nf4:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto $V"
      trainer 110 trainer_full_klein.json "--model /tmp/full-flux2-klein --steps 5 --warmup 2 --timeout 105" \
        "full12_klein_nf4:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto $V"
      trainer 260 trainer_full_flux2.json "--model /tmp/full-flux2-dev --steps 4 --warmup 2 --timeout 255" \
        "full24_flux2_nf4:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision nf4 --offload_blocks auto $V" ;;
    small_2048)
      trainer 200 trainer_small_2048.json "--fake_peers --steps 5 --warmup 2 --timeout 190" \
        "small24_fp8_fake2_2048:1:gpu1.yaml:--cp_size 2 --resolution 2048 --gradient_checkpointing all --gpu_memory_gib 24 --base_precision fp8 --compile off" ;;
    peers)  # the new peers first: each script writes its rows as it goes
      kohya_env
      run 330 python3 -m benchmarks.bench_kohya --sd_scripts "$SD_SCRIPTS" ${KOHYA_SITE:+--kohya_site "$KOHYA_SITE"} \
        --out "$OUT/kohya.json" --steps 5 --warmup 3 --timeout 105
      run 200 python3 -m benchmarks.bench_diffusers_flux2 --out "$OUT/diffusers_flux2.json" --gpu_memory_gib 24 \
        --steps 4 --warmup 2 --timeout 190
      flux2_model
      trainer 150 trainer_peers_flux2.json "--model $MODEL --steps 6 --warmup 2 --timeout 145" \
        "small24_flux2_nf4_auto:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision nf4 --offload_blocks auto"
      run 170 python3 -m benchmarks.bench_diffusers_qlora --out "$OUT/diffusers_qlora.json" --gpu_memory_gib 24 12 \
        --resolution 1024 --steps 5 --warmup 3 --model_dir "$(mktemp -d)/flux1-dev-shapes-random" ;;
    pairs)  # ours first: a fresh machine measures the speed model's figures at the first run's start (~1 min)
      trainer 250 trainer_readme24.json "--steps 7 --warmup 3 --timeout 240" \
        "readme24:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --gradient_checkpointing --offload_blocks --compile"
      kohya_env
      run 170 python3 -m benchmarks.bench_kohya --sd_scripts "$SD_SCRIPTS" ${KOHYA_SITE:+--kohya_site "$KOHYA_SITE"} \
        --out "$OUT/kohya_24.json" --settings kohya_fp8_24gib --steps 5 --warmup 3 --timeout 150 ;;
    pairs_flux2)
      flux2_model
      trainer 230 trainer_pairs_flux2.json "--model $MODEL --steps 6 --warmup 2 --timeout 220" \
        "small24_flux2_nf4_auto:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision nf4 --offload_blocks auto"
      run 200 python3 -m benchmarks.bench_diffusers_flux2 --out "$OUT/diffusers_flux2.json" --gpu_memory_gib 24 \
        --steps 4 --warmup 2 --timeout 190 ;;
    table)  # small24_fp8_auto_c is README's 24 GB command (bench_trainer adds its --rank 16
            # --mixed_precision bf16 --gradient_checkpointing): give it README's flags if README's command changes
      trainer 580 trainer_table.json "--steps 8 --warmup 3 --timeout 140" \
        "small24_fp8_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --offload_blocks auto --compile" \
        "small24_fp8_auto:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --offload_blocks auto" \
        "small24_bf16_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --offload_blocks --compile" \
        "small12_nf4_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto --compile" ;;
    table_b)
      klein_model
      trainer 100 trainer_table_klein.json "--model $KLEIN --steps 8 --warmup 3 --timeout 95" \
        "small12_klein_nf4_auto:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto"
      flux2_model
      trainer 230 trainer_table_flux2.json "--model $MODEL --steps 8 --warmup 3 --timeout 225" \
        "small48_flux2_fp8_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 48 --base_precision fp8 --offload_blocks auto --compile"
      trainer 170 trainer_table_2048.json "--steps 8 --warmup 3 --timeout 165" \
        "cp1_2048:1:gpu1.yaml:--resolution 2048 --compile" ;;
    picks)
      trainer 290 trainer_picks.json "--steps 7 --warmup 3 --timeout 140" \
        "small12_fp8_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision fp8 --offload_blocks auto --compile" \
        "small12_nf4_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto --compile"
      klein_model
      trainer 100 trainer_picks_klein.json "--model $KLEIN --steps 8 --warmup 3 --timeout 95" \
        "small12_klein_fp8_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision fp8 --offload_blocks auto --compile"
      flux2_model
      trainer 170 trainer_picks_flux2.json "--model $MODEL --steps 6 --warmup 2 --timeout 165" \
        "small24_flux2_fp8_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --offload_blocks auto --compile" ;;
    speed)
      CLASS=cpu
      [ -n "$DRY" ] || CLASS=$(python3 -c 'import torch; from flux_cp.plan.speed import class_of_gpu; print(class_of_gpu(torch.cuda.get_device_name()) or "other")')
      run 280 python3 -m benchmarks.bench_speed_model --gpu_class "$CLASS" --out "$OUT/speed_data/$CLASS.json" \
        --results "$OUT/speed_model.json" --resolutions 1024 --precisions "${SPEED_PRECISIONS:-bf16,fp8,int8,nf4}"
      trainer 230 trainer_speed.json "--steps 6 --warmup 2 --timeout 110" \
        "readme24_fp8:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --base_precision fp8 --offload_blocks auto --max_train_steps 2000 --profile_step 6" \
        "small24_bf16_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 24 --offload_blocks auto --compile"
      run 90 python3 -m benchmarks.bench_speed_model --check "$OUT/trainer_speed.json" \
        --out "$OUT/speed_data/$CLASS.json" --results "$OUT/speed_check.json" ;;
    check)
      run 400 python3 -m pytest -q -x tests/gpu
      run 300 torchrun --nproc_per_node "$N" -m benchmarks.check_gpu --out "$OUT/check_gpu.json" ;;
    *)
      echo "error: unknown set $SET (lora, lora_ro, diffusers, lora4096, full, kontext, host, flux2, flux2_cp, memory,
      attention, small, small_b, small_full, small_2048, peers, table, table_b, picks, speed, check)"
      exit 2 ;;
  esac
done
if [ -z "$DRY" ]; then
  python3 -m benchmarks.render "$OUT" --out "$OUT/results.md" && cat "$OUT/results.md"
fi
