#!/usr/bin/env bash
# train_flux_cp.py on GPUs with the tiny model, through the DDP config that LoRA users are pointed to:
# --compile, CP validation, a checkpoint, then a resume that must continue from it. Log to $OUT/trainer.log.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
S="--cp_size 2 --report_to none --cache_dir /tmp/enc --output_dir /tmp/ddp_smoke --checkpointing_steps 3"
{
  timeout 240 accelerate launch --config_file accelerate_configs/ddp_cp2.yaml train_flux_cp.py $S --compile --overwrite_output_dir \
    --max_train_steps 6 --validation_prompt "a red circle" --validation_steps 6 --validation_inference_steps 2
  echo "exit ddp_compile: $?"
  timeout 150 accelerate launch --config_file accelerate_configs/ddp_cp2.yaml train_flux_cp.py $S \
    --max_train_steps 9 --resume_from_checkpoint latest
  echo "exit ddp_resume: $?"
  ls /tmp/ddp_smoke /tmp/ddp_smoke/validation
  cat /tmp/ddp_smoke/metrics.jsonl
} > "$OUT/trainer.log" 2>&1
grep -E "^exit|rror" "$OUT/trainer.log" | head
