#!/usr/bin/env bash
# The GPU benchmark, one entry point. From the repository root, on a machine with 2 H200s (or more):
#   bash benchmarks/run.sh RESULTS_DIR SET [SET ...]
# Sets:
#   check      pytest tests/gpu: bf16 CP attention (eager and compiled) against one GPU, the trainer on GPUs
#   lora       train_flux_cp.py, LoRA r16 on the default --lora_layers, --compile, 1024 and 2048 px: one GPU (two
#              runs side by side, one per GPU) against cp=2 (DDP config)
#   lora_attn  the same with LoRA on the attention projections only
#   kontext    lora_attn on FLUX.1 Kontext-shaped pairs (data/tiny_pairs: target + reference, 8,704 and 33,280
#              tokens at 1024 and 2048 px)
#   anchor     diffusers' built-in CP (Ulysses, ring; cuDNN) with its blocks compiled, 1024 and 2048 px
#              (ANCHOR=path/to/anchor_bench.py, skipped when unset; ANCHOR_MODES="ulysses ring" by default)
#   lora_ro    the lora set with --compile_mode reduce-overhead (each block's forward and backward a CUDA graph)
#   variants   cp=2 at 2048 px, each choice of the compiled step against the default of the lora set: no reordering
#              of the exchanges (FLUX_CP_OVERLAP=none), Inductor's overlap scheduler (FLUX_CP_OVERLAP=scheduler),
#              the attention recomputed in the backward (--recompute_attention), the gradients of q, k and v sent
#              back as one exchange (FLUX_CP_GRAD_EXCHANGE=joint, profiled at step 5), compute moved beside the
#              exchanges by Inductor's estimates (FLUX_CP_OVERLAP=compute, profiled), and both together
#   overlap    the 2048 px lora_ro pair against cp=2 with FLUX_CP_OVERLAP=compute, alone and with
#              FLUX_CP_GRAD_EXCHANGE=joint, and the compute choice under --compile profiled at step 5
#   fill       the 2048 px lora_ro pair against cp=2 with FLUX_CP_OVERLAP=fill (flux_cp/overlap.py), and fill under
#              --compile profiled at step 5
#   priority   the 2048 px lora_ro pair against cp=2 with NCCL's streams at high priority (TORCH_NCCL_HIGH_PRIORITY=1),
#              alone and with FLUX_CP_OVERLAP=fill
#   lora_attn_ro  the 2048 px lora_ro pair with LoRA on the attention projections only (the layers diffusers'
#              built-in CP trains in the anchor set), and cp=2 with FLUX_CP_SM_CARVEOUT for each of CARVEOUT (if set)
#   carveout   the 2048 px lora_ro pair against cp=2 with the matrix products launched beside an exchange leaving
#              SMs free for it (FLUX_CP_SM_CARVEOUT, each of CARVEOUT="8 16"); with CARVE_CTAS="8 16" also each
#              carveout with NCCL's kernels that wide (NCCL_MAX_CTAS, NCCL_MAX_P2P_NCHANNELS); with
#              CARVE_PROFILE=N, carveout N under --compile profiled at step 5 (rank 0's trace beside the logs);
#              NO_PAIR=1 skips the pair and CARVEOUT (to split the set over two calls)
#   first      the 2048 px lora_ro pair against cp=2 with FLUX_CP_EXCHANGE_FIRST=1 (each exchange kernel dispatched
#              before the compute launched behind it), alone and with each SM carveout of CARVEOUT (if set);
#              NO_PAIR=1 skips the pair
#   attention_first  benchmarks/bench_attention.py, 16,896 and 66,048 tokens, Ulysses in ATTENTION_CHUNKS (default
#              "1 2 4") head chunks (compiled: the pipeline of cp/ulysses.py), with FLUX_CP_EXCHANGE_FIRST=0 and =1;
#              compiled only unless ATTENTION_COMPILE is set ("": eager; '"" --compile': both)
#   profile    one step of the 2048 px one-GPU and cp=2 lora runs under --profile_step (GPU time by kernel kind,
#              how much of the communication overlapped compute; rank 0's trace in logs.tgz), and
#              benchmarks/probe_layouts.py (which q/k/v layouts cuDNN's attention takes, and at what speed)
#   chunks     the 2048 px lora_ro pair, and cp=2 with the Ulysses heads in CHUNKS chunks (default "2 4"; each
#              chunk exchanged and attended on its own, FLUX_CP_ULYSSES_CHUNKS; with FLUX_CP_EXCHANGE_FIRST=1 set
#              for the whole set, the pipeline as it is meant to run)
#   host       one GPU is enough: the 2048 px CUDA-graph one-GPU run against cp=2's rank 0 with loopback peers, each
#              exchange one local copy (benchmarks/fake_peers.py): what a CP rank spends besides communication, host time included
#   host_profile  the same pair under --compile, profiled at step 5 (where the GPU waits for the host)
#   full       full fine-tuning at 2048 px alone (FSDP2, cp=2; the last run of the big set)
#   ring       cp=2 at 2048 px with --cp_mode ring
#   lora4096   4096 px LoRA alone: one GPU against cp=2
#   big        4096 px LoRA (one GPU against cp=2) and full fine-tuning at 2048 px (FSDP2, cp=2; weights-only
#              checkpoints, so that the trainer's disk check passes on a 128 GB disk - no checkpoint is written)
#   attention  benchmarks/bench_attention.py, eager and compiled, 16,896 and 66,048 tokens (ATTENTION_COMPILE=--compile:
#              compiled only; ATTENTION_CHUNKS="1 2": the Ulysses head chunks to measure, default 1)
#   check_model  benchmarks/check_gpu.py: bf16 attention and a 4-block Flux model with CP against fp32 and bf16
#   equivalence  benchmarks/equivalence.sh: losses with and without CP over 200 steps (4 or 8 GPUs)
# Results (JSON, logs) go to RESULTS_DIR; benchmarks/report.py renders docs/benchmarks.md from such folders.
set -euo pipefail
OUT=$1; shift
mkdir -p "$OUT"
TMP=$(mktemp -d)
mkdir -p "$TMP/logs"
export FLUX_CP_HOME=$TMP/home
. benchmarks/gpu_env.sh
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/env.txt"
python3 -c 'import torch, diffusers; print("torch", torch.__version__, "diffusers", diffusers.__version__)' >> "$OUT/env.txt"
echo "gpus: $N" >> "$OUT/env.txt"

ATTN=attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out
trainer() {  # trainer SECONDS RUN...
  local t=$1; shift
  timeout "$t" python3 benchmarks/bench_trainer.py --out "$OUT/trainer.json" --logs "$TMP/logs" --parallel "$@" \
    || echo "bench_trainer exit $?"
}

ro_pair_and_carveouts() {  # SUFFIX FLAGS CARVEOUTS: the 2048 px CUDA-graph pair, then cp=2 with each SM carveout
  local ro="--resolution 2048 --compile_mode reduce-overhead $2"
  trainer 300 "cp1_2048_ro$1:1:gpu1.yaml:$ro" "cp2_2048_ro$1:2:ddp_cp2.yaml:--cp_size 2 $ro"
  for n in $3; do
    FLUX_CP_SM_CARVEOUT=$n trainer 200 "cp2_2048_ro${1}_carve$n:2:ddp_cp2.yaml:--cp_size 2 $ro"
  done
}

for SET in "$@"; do
  echo "=== $SET $(date +%T)"
  case $SET in
    check)
      timeout 300 python3 -m pytest -q -x tests/gpu 2>&1 | tail -15 || echo "check exit $?" ;;
    check_attention)
      timeout 200 python3 -m pytest -q -x -s tests/gpu -k bf16 2>&1 | grep -E "^\{|passed|failed|Error" \
        || echo "check exit $?" ;;
    lora)
      trainer ${LORA_S:-560} \
        "cp1_2048:1:gpu1.yaml:--resolution 2048 --compile" \
        "cp1_1024:1:gpu1.yaml:--resolution 1024 --compile" \
        "cp2_2048:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile" \
        "cp2_1024:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 --compile" ;;
    lora_attn)
      trainer 560 \
        "cp1_2048_attn:1:gpu1.yaml:--resolution 2048 --compile --lora_layers $ATTN" \
        "cp1_1024_attn:1:gpu1.yaml:--resolution 1024 --compile --lora_layers $ATTN" \
        "cp2_2048_attn:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --lora_layers $ATTN" \
        "cp2_1024_attn:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 --compile --lora_layers $ATTN" ;;
    kontext)
      python3 -m flux_cp.tiny --preset flux1-dev-shapes --kontext --out "$TMP/kontext-shapes" > /dev/null
      K="--compile --lora_layers $ATTN --dataset_name data/tiny_pairs"
      trainer 900 --model "$TMP/kontext-shapes" \
        "cp1_2048_kontext:1:gpu1.yaml:--resolution 2048 $K" \
        "cp1_1024_kontext:1:gpu1.yaml:--resolution 1024 $K" \
        "cp2_2048_kontext:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 $K" \
        "cp2_1024_kontext:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 $K" ;;
    lora_ro)
      RO="--compile_mode reduce-overhead"
      trainer ${LORA_S:-560} \
        "cp1_2048_ro:1:gpu1.yaml:--resolution 2048 $RO" \
        "cp1_1024_ro:1:gpu1.yaml:--resolution 1024 $RO" \
        "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 $RO" \
        "cp2_1024_ro:2:ddp_cp2.yaml:--cp_size 2 --resolution 1024 $RO" ;;
    variants)
      FLUX_CP_OVERLAP=none trainer 200 "cp2_2048_nooverlap:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile"
      trainer 200 "cp2_2048_recompute:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --recompute_attention"
      FLUX_CP_OVERLAP=scheduler trainer 200 \
        "cp2_2048_scheduler:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile"
      FLUX_CP_GRAD_EXCHANGE=joint trainer 200 \
        "cp2_2048_joint:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --profile_step 5"
      FLUX_CP_OVERLAP=compute trainer 200 \
        "cp2_2048_compute:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --profile_step 5"
      FLUX_CP_OVERLAP=compute FLUX_CP_GRAD_EXCHANGE=joint trainer 200 \
        "cp2_2048_compute_joint:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --profile_step 5" ;;
    overlap)
      RO="--resolution 2048 --compile_mode reduce-overhead"
      trainer 300 "cp1_2048_ro:1:gpu1.yaml:$RO" "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 $RO"
      FLUX_CP_OVERLAP=compute trainer 200 "cp2_2048_ro_compute:2:ddp_cp2.yaml:--cp_size 2 $RO"
      FLUX_CP_OVERLAP=compute FLUX_CP_GRAD_EXCHANGE=joint trainer 200 \
        "cp2_2048_ro_compute_joint:2:ddp_cp2.yaml:--cp_size 2 $RO"
      FLUX_CP_OVERLAP=compute trainer 200 \
        "cp2_2048_compute:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --profile_step 5" ;;
    fill)
      RO="--resolution 2048 --compile_mode reduce-overhead"
      trainer 300 "cp1_2048_ro:1:gpu1.yaml:$RO" "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 $RO"
      FLUX_CP_OVERLAP=fill trainer 200 "cp2_2048_ro_fill:2:ddp_cp2.yaml:--cp_size 2 $RO"
      FLUX_CP_OVERLAP=fill trainer 200 \
        "cp2_2048_fill:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --profile_step 5"
      # what the pass did (or that it kept Inductor's order), from the main rank's log
      grep -h "FLUX_CP_OVERLAP=fill" "$TMP"/logs/*fill* | sort | uniq -c || echo "fill: the pass logged nothing" ;;
    priority)
      RO="--resolution 2048 --compile_mode reduce-overhead"
      trainer 300 "cp1_2048_ro:1:gpu1.yaml:$RO" "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 $RO"
      TORCH_NCCL_HIGH_PRIORITY=1 trainer 200 "cp2_2048_ro_high:2:ddp_cp2.yaml:--cp_size 2 $RO"
      TORCH_NCCL_HIGH_PRIORITY=1 FLUX_CP_OVERLAP=fill trainer 200 "cp2_2048_ro_high_fill:2:ddp_cp2.yaml:--cp_size 2 $RO" ;;
    lora_attn_ro)
      ro_pair_and_carveouts _attn "--lora_layers $ATTN" "${CARVEOUT:-}" ;;
    carveout)
      if [ -z "${NO_PAIR:-}" ]; then
        ro_pair_and_carveouts "" "" "${CARVEOUT-8 16}"
      fi
      for n in ${CARVE_CTAS:-}; do  # NCCL's kernels no wider than the SMs left free
        FLUX_CP_SM_CARVEOUT=$n NCCL_MAX_CTAS=$n NCCL_MAX_P2P_NCHANNELS=$n trainer 200 \
          "cp2_2048_ro_carve${n}_ctas$n:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile_mode reduce-overhead"
      done
      if [ -n "${CARVE_PROFILE:-}" ]; then
        FLUX_CP_SM_CARVEOUT=$CARVE_PROFILE trainer 200 \
          "cp2_2048_carve$CARVE_PROFILE:2:ddp_cp2.yaml:--cp_size 2 --resolution 2048 --compile --profile_step 5"
      fi ;;
    first)
      RO="--resolution 2048 --compile_mode reduce-overhead"
      if [ -z "${NO_PAIR:-}" ]; then
        trainer 300 "cp1_2048_ro:1:gpu1.yaml:$RO" "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 $RO"
      fi
      FLUX_CP_EXCHANGE_FIRST=1 trainer 200 "cp2_2048_ro_first:2:ddp_cp2.yaml:--cp_size 2 $RO"
      for n in ${CARVEOUT:-}; do
        FLUX_CP_EXCHANGE_FIRST=1 FLUX_CP_SM_CARVEOUT=$n trainer 200 "cp2_2048_ro_first_carve$n:2:ddp_cp2.yaml:--cp_size 2 $RO"
      done ;;
    attention_first)
      for f in 0 1; do
        for c in ${ATTENTION_COMPILE---compile}; do
          FLUX_CP_EXCHANGE_FIRST=$f timeout 250 torchrun --nproc_per_node 2 benchmarks/bench_attention.py $c \
            --tokens 16896 66048 --ulysses_chunks ${ATTENTION_CHUNKS:-1 2 4} \
            --out "$OUT/attention_first$f${c:+_compiled}.json" 2>&1 | grep -E "^tokens" || echo "attention_first $f exit $?"
        done
      done ;;
    profile)
      P="--resolution 2048 --compile --profile_step 5"
      trainer 300 "cp1_2048_profile:1:gpu1.yaml:$P" "cp2_2048_profile:2:ddp_cp2.yaml:--cp_size 2 $P"
      python3 benchmarks/probe_layouts.py --out "$OUT/layouts.jsonl" --tokens 16896 --heads 12 24 || echo "layouts exit $?" ;;
    chunks)
      RO="--resolution 2048 --compile_mode reduce-overhead"
      trainer 300 "cp1_2048_ro:1:gpu1.yaml:$RO" "cp2_2048_ro:2:ddp_cp2.yaml:--cp_size 2 $RO"
      for c in ${CHUNKS:-2 4}; do
        FLUX_CP_ULYSSES_CHUNKS=$c trainer 200 "cp2_2048_ro_chunks$c:2:ddp_cp2.yaml:--cp_size 2 $RO"
      done ;;
    host)
      RO="--resolution 2048 --compile_mode reduce-overhead"
      trainer 400 --fake_peers "cp1_2048_ro:1:gpu1.yaml:$RO" "fake2_2048_ro:1:gpu1.yaml:--cp_size 2 $RO" ;;
    host_profile)
      P="--resolution 2048 --compile --profile_step 5"
      trainer 300 --fake_peers "cp1_2048_profile:1:gpu1.yaml:$P" "fake2_2048_profile:1:gpu1.yaml:--cp_size 2 $P" ;;
    full)
      trainer 400 "cp2_2048_full:2:fsdp2_cp2.yaml:--cp_size 2 --resolution 2048 --compile --full_finetune --checkpoint_weights_only" ;;
    ring)
      trainer 300 "cp2_2048_ring:2:ddp_cp2.yaml:--cp_size 2 --cp_mode ring --resolution 2048 --compile" ;;
    lora4096)
      trainer 560 "cp1_4096:1:gpu1.yaml:--resolution 4096 --compile" "cp2_4096:2:ddp_cp2.yaml:--cp_size 2 --resolution 4096 --compile" ;;
    big)
      trainer 560 \
        "cp1_4096:1:gpu1.yaml:--resolution 4096 --compile" \
        "cp2_4096:2:ddp_cp2.yaml:--cp_size 2 --resolution 4096 --compile" \
        "cp2_2048_full:2:fsdp2_cp2.yaml:--cp_size 2 --resolution 2048 --compile --full_finetune --checkpoint_weights_only" ;;
    anchor)
      if [ -n "${ANCHOR:-}" ]; then
        for mode in ${ANCHOR_MODES:-ulysses ring}; do
          COMPILE=1 RES=1024,2048 OUT=$TMP timeout 200 torchrun --nproc_per_node 2 "$ANCHOR" model "$mode" \
            > "$TMP/logs/anchor_$mode.log" 2>&1 || echo "anchor $mode exit $?"
        done
        cp "$TMP/anchors.jsonl" "$OUT/anchors.jsonl" && grep -h '"kind": "model"' "$OUT/anchors.jsonl" || true
      fi ;;
    attention)
      for c in ${ATTENTION_COMPILE-"" --compile}; do
        timeout 200 torchrun --nproc_per_node 2 benchmarks/bench_attention.py --tokens 16896 66048 $c \
          --ulysses_chunks ${ATTENTION_CHUNKS:-1} --out "$OUT/attention${c:+_compiled}.json" 2>&1 | grep -E "^tokens" \
          || echo "attention $c exit $?"
      done ;;
    check_model)
      timeout 200 torchrun --nproc_per_node "$N" benchmarks/check_gpu.py --out "$OUT/check.json" \
        > "$TMP/logs/check_model.log" 2>&1 || echo "check_model exit $?"
      grep -E "^\{" "$TMP/logs/check_model.log" | cut -c1-220 || true ;;
    equivalence)
      if [ "$N" -ge 8 ]; then OUT=$OUT bash benchmarks/equivalence.sh 4 200
      elif [ "$N" -ge 4 ]; then OUT=$OUT bash benchmarks/equivalence.sh 2 200
      else echo "equivalence: needs 4 or 8 GPUs, skipped"; fi ;;
    *) echo "error: unknown set $SET (check, check_attention, check_model, lora, lora_attn, kontext, anchor, lora_ro, variants, overlap, fill, priority, lora_attn_ro, carveout, first, attention_first, profile, host, host_profile, chunks, full, ring, lora4096, big, attention, equivalence)"; exit 2 ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$TMP" logs
[ -f "$OUT/trainer.json" ] && python3 - "$OUT/trainer.json" <<'PY' || true
import json, sys
sys.path.insert(0, "benchmarks")
from bench_trainer import table
table(json.load(open(sys.argv[1]))["runs"])
PY
