#!/usr/bin/env bash
# The whole GPU benchmark in one command, on a machine with 2-4 (or 8) H200s, from the repository root:
#   bash benchmarks/run.sh [results-folder-name]
# Runs the bf16 checks and the attention benchmark; the model-level sets (LoRA at 1024/2048 px, eager and
# compiled, DDP and FSDP2; 4096 px; full fine-tuning eager and compiled); the trainer on GPUs through the DDP
# config; the CP-on/off loss equivalence (4+ GPUs); then renders docs/benchmarks.md, docs/equivalence.md and
# their plots from benchmarks/results/<name>/. Needs about 45 minutes of GPU time.
set -u
NAME=${1:-$(date +%F)-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')}
export OUT=benchmarks/results/$NAME
mkdir -p "$OUT"
bash benchmarks/gpu_checks.sh
bash benchmarks/run_model_bench.sh lora
bash benchmarks/run_model_bench.sh compile
bash benchmarks/run_model_bench.sh big
bash benchmarks/fsdp2_compile_check.sh
bash benchmarks/trainer_smoke.sh
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$N" -ge 8 ]; then bash benchmarks/equivalence.sh 4 200; elif [ "$N" -ge 4 ]; then bash benchmarks/equivalence.sh 2 200; fi
python3 benchmarks/report.py "$OUT"  # add earlier folders (e.g. a 4-GPU run) as further arguments
