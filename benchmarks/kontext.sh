#!/usr/bin/env bash
# FLUX.1 Kontext-shaped LoRA steps through train_flux_cp.py on 2 GPUs: 1024 and 2048 px pairs (8,704 and 33,280
# tokens with 512 text tokens), one GPU against cp=2 (DDP config), all --compile, bf16, gradient checkpointing,
# LoRA r16 on the attention projections, random FLUX.1-dev-sized weights (no download). Writes
# $OUT/kontext.log and $OUT/kontext.json (median s/step over steps 6-20, after compilation; peak memory).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
SHAPES=/tmp/kontext-dev-shapes
LORA=attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out
COMMON="--pretrained_model_name_or_path $SHAPES --transformer_init random --dataset_name data/tiny_pairs
  --mixed_precision bf16 --gradient_checkpointing --compile --rank 16 --lora_layers $LORA --max_train_steps 20
  --checkpointing_steps 100000 --report_to none --cache_dir /tmp/kontext-enc"
{
  python -m flux_cp.tiny --preset flux1-dev-shapes --kontext --out $SHAPES
  for RES in 1024 2048; do
    timeout 900 accelerate launch --config_file accelerate_configs/gpu1.yaml train_flux_cp.py $COMMON \
      --resolution $RES --cp_size 1 --output_dir /tmp/kontext-$RES-gpu1
    echo "exit kontext-$RES-gpu1: $?"
    timeout 900 accelerate launch --config_file accelerate_configs/ddp_cp2.yaml train_flux_cp.py $COMMON \
      --resolution $RES --cp_size 2 --output_dir /tmp/kontext-$RES-cp2
    echo "exit kontext-$RES-cp2: $?"
  done
} > "$OUT/kontext.log" 2>&1
python - "$OUT/kontext.json" <<'EOF'
import json, statistics, sys
rows = {}
for res in (1024, 2048):
    for run in ("gpu1", "cp2"):
        try:
            m = [json.loads(line) for line in open(f"/tmp/kontext-{res}-{run}/metrics.jsonl")]
        except OSError:
            continue
        rows[f"{res}-{run}"] = {"tokens": 2 * (res // 16) ** 2 + 512, "steps": len(m),
                                "s_per_step": statistics.median(r["s_per_step"] for r in m[5:]),
                                "peak_mem_gib": max(r["peak_mem_gib"] for r in m), "mfu": m[-1].get("mfu")}
json.dump(rows, open(sys.argv[1], "w"), indent=2)
print(json.dumps(rows, indent=2))
EOF
grep -E "^exit|rror" "$OUT/kontext.log" | head
