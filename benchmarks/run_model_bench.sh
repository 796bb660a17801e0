#!/usr/bin/env bash
# Model-level benchmark runs (benchmarks/bench_model.py), one launch per configuration, all on this machine.
# Usage: benchmarks/run_model_bench.sh SET   with SET one of:
#   lora   LoRA r16 at 1024 and 2048 px: ours cp=1 (1 GPU), cp=2 ring and ulysses, cp=4; diffusers' built-in
#          CP (ulysses, ring) on 2 GPUs and ulysses on 4
#   big    4096 px LoRA (cp=1, 2, 4; diffusers ulysses on 4), full fine-tuning with FSDP2 (cp=2 and the dp=2
#          no-CP baseline at 1024/2048, cp=4 at 2048/4096), and ours with --compile at 2048 on 2 GPUs
# Writes $OUT/model_SET.json (all rows) and $OUT/model_SET.log.
set -u
SET=$1; OUT=${OUT:-gpu_out}; mkdir -p "$OUT" /tmp/mb
. benchmarks/gpu_env.sh
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() {  # run NPROC TIMEOUT NAME ARGS...
  local n=$1 t=$2 name=$3; shift 3
  [ "$n" -le "$N" ] || { echo "skip $name: needs $n GPUs"; return; }
  echo "=== $name (np $n): $*"
  timeout "$t" torchrun --nproc_per_node "$n" benchmarks/bench_model.py --out "/tmp/mb/$name.json" "$@" 2>&1 \
    | grep -vE "Warning|warn\(|^\s*$" | tail -25
}
{
if [ "$SET" = lora ]; then
  run 1 120 ours_cp1 --cp 1 --res 1024 2048
  run 2 120 ours_cp2_ulysses --cp 2 --mode ulysses --res 1024 2048
  run 2 120 ours_cp2_ring --cp 2 --mode ring --res 1024 2048
  run 4 120 ours_cp4 --cp 4 --mode ulysses --res 1024 2048
  run 2 120 diffusers_cp2_ulysses --impl diffusers --cp 2 --mode ulysses --backend _native_cudnn --res 1024 2048
  run 2 120 diffusers_cp2_ulysses_flash --impl diffusers --cp 2 --mode ulysses --backend _native_flash --res 1024 2048
  run 2 120 diffusers_cp2_ring --impl diffusers --cp 2 --mode ring --backend _native_cudnn --res 1024 2048
  run 4 120 diffusers_cp4_ulysses --impl diffusers --cp 4 --mode ulysses --backend _native_cudnn --res 1024 2048
else
  run 1 150 ours_cp1_4k --cp 1 --res 4096 --warmup 1 --steps 2
  run 2 110 ours_cp2_4k --cp 2 --mode ulysses --res 4096 --warmup 1 --steps 2
  run 4 80 ours_cp4_4k --cp 4 --mode ulysses --res 4096 --warmup 1 --steps 2
  run 2 90 ours_full_cp2 --cp 2 --mode ulysses --train full --res 1024 2048
  run 2 90 ours_full_dp2 --cp 1 --dp 2 --train full --res 1024 2048
  run 4 100 ours_full_cp4 --cp 4 --mode ulysses --train full --res 2048 4096 --warmup 1 --steps 2
  run 2 150 ours_cp2_compile --cp 2 --mode ulysses --res 2048 --compile --warmup 2 --steps 3
fi
} 2>&1 | tee "$OUT/model_$SET.log"
python3 - "$OUT/model_$SET.json" /tmp/mb/*.json <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[2:]]
out = {"env": runs[0]["env"] if runs else None, "runs": runs}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print("merged", len(runs), "runs into", sys.argv[1])
PY
