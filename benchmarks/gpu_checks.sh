#!/usr/bin/env bash
# GPU checks (from the repository root, on a machine with >= 2 GPUs; 4 for the cp=4 and dp2 x cp2 parts):
#  1. bf16 exactness of cp.attention and of a Flux transformer with CP (benchmarks/check_gpu.py)
#  2. the attention-level benchmark, with the Ulysses pipeline depth and a profile (benchmarks/bench_attention.py)
#  3. train_flux_cp.py under accelerate's FSDP2 on the tiny model: LoRA + validation + checkpoint,
#     resume, and full fine-tuning on dp 2 x cp 2
# Full logs and JSON go to $OUT (default ./gpu_out); a summary to stdout.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ echo "gpus: $N"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/env.log"
timeout 200 torchrun --nproc_per_node "$N" benchmarks/check_gpu.py --out "$OUT/check.json" > "$OUT/check.log" 2>&1
echo "check exit $?"; grep -E "^\{" "$OUT/check.log" | cut -c1-220
timeout 240 torchrun --nproc_per_node "$N" benchmarks/bench_attention.py --ulysses_chunks 1 2 4 --profile \
  --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
echo "attention exit $?"; grep -E "^tokens" "$OUT/attention.log" | cut -c1-160
S="--report_to none --max_train_steps 4 --checkpointing_steps 2 --cache_dir /tmp/enc --output_dir /tmp/smoke"
{
  timeout 150 accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py --cp_size 2 $S \
    --overwrite_output_dir --validation_prompt "a red circle" --validation_steps 4 --validation_inference_steps 2; echo "exit lora: $?"
  timeout 150 accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py --cp_size 2 \
    ${S/--max_train_steps 4/--max_train_steps 6} --resume_from_checkpoint latest; echo "exit resume: $?"
  if [ "$N" -ge 4 ]; then
    timeout 150 accelerate launch --config_file accelerate_configs/fsdp2_dp2_cp2.yaml train_flux_cp.py --cp_size 2 \
      --full_finetune --report_to none --max_train_steps 3 --cache_dir /tmp/enc --output_dir /tmp/smoke_full \
      --overwrite_output_dir
    echo "exit full: $?"
  fi
  ls /tmp/smoke /tmp/smoke/validation /tmp/smoke_full /tmp/smoke_full/transformer
  cat /tmp/smoke/metrics.jsonl /tmp/smoke_full/metrics.jsonl
} > "$OUT/smoke.log" 2>&1
grep -E "^exit|^error" "$OUT/smoke.log"
