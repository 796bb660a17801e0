#!/usr/bin/env bash
# --compile under accelerate's FSDP2 (full fine-tuning): the trainer on the tiny model, then the FLUX.1-dev-size
# full fine-tuning step at 2048 px compiled on 2 GPUs. Logs to $OUT/fsdp2_compile.log, rows to $OUT/model_full_compile.json.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
{
  timeout 150 accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py --cp_size 2 \
    --full_finetune --compile --max_train_steps 4 --report_to none --cache_dir /tmp/enc --output_dir /tmp/fsdp2c --overwrite_output_dir
  echo "exit fsdp2_compile_full: $?"
  ls /tmp/fsdp2c /tmp/fsdp2c/transformer
  timeout 150 torchrun --nproc_per_node 2 benchmarks/bench_model.py --cp 2 --mode ulysses --train full --compile \
    --res 2048 --warmup 2 --steps 2 --out "$OUT/model_full_compile.json"
  echo "exit bench_full_compile: $?"
} > "$OUT/fsdp2_compile.log" 2>&1
grep -E "^exit|^\{|rror" "$OUT/fsdp2_compile.log" | cut -c1-300 | head -20
