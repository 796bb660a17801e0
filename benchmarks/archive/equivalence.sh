#!/usr/bin/env bash
# Loss equivalence at FLUX.1-dev size: the same run with and without CP, through train_flux_cp.py.
#   Task A: dp=2 x cp=1 on 2 GPUs.   Task B: dp=2 x cp=CP on 2*CP GPUs (CP=2 on a 4-GPU machine, 4 on 8).
# FLUX.1-dev transformer config with seeded random weights (no download), tiny matching encoders, the
# bundled data set at 1024 px, LoRA r16, bf16, --deterministic, one seed checkpoint written by A, read by B.
# Usage, from the repository root: OUT=DIR bash benchmarks/archive/equivalence.sh [CP] [STEPS];
# metrics go to $OUT/equivalence_{A,B}.jsonl.
set -euo pipefail
CP=${1:-2}; STEPS=${2:-200}; OUT=${OUT:?set OUT to the results folder}; mkdir -p "$OUT"
case $CP in 2) CFG=fsdp2_dp2_cp2.yaml;; 4) CFG=fsdp2_dp2_cp4.yaml;; *) echo "error: CP must be 2 or 4"; exit 2;; esac
. benchmarks/gpu_env.sh
TMP=$(mktemp -d)
python3 -m flux_cp.tiny --preset flux1-dev-shapes --out "$TMP/flux1-dev-shapes" > /dev/null
COMMON="--pretrained_model_name_or_path $TMP/flux1-dev-shapes --transformer_init random --resolution 1024
  --rank 16 --mixed_precision bf16 --deterministic --seed 0 --seed_checkpoint $TMP/seed_lora.safetensors
  --train_batch_size 1 --max_train_steps $STEPS --learning_rate 1e-4 --report_to none --checkpointing_steps 100000
  --cache_dir $TMP/cache"
# shellcheck disable=SC2086 # COMMON is a list of flags
timeout "${TASK_TIMEOUT:-330}" accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py \
  $COMMON --cp_size 1 --output_dir "$TMP/A" > "$OUT/equivalence_A.log" 2>&1 || echo "task A exit $?"
# shellcheck disable=SC2086
timeout "${TASK_TIMEOUT:-330}" accelerate launch --config_file "accelerate_configs/$CFG" train_flux_cp.py \
  $COMMON --cp_size "$CP" --output_dir "$TMP/B" > "$OUT/equivalence_B.log" 2>&1 || echo "task B exit $?"
cp "$TMP/A/metrics.jsonl" "$OUT/equivalence_A.jsonl" || true
cp "$TMP/B/metrics.jsonl" "$OUT/equivalence_B.jsonl" || true
tail -3 "$OUT/equivalence_A.log" "$OUT/equivalence_B.log" | cut -c1-300
