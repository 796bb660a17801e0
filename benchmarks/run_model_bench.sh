#!/usr/bin/env bash
# Model-level benchmark runs (benchmarks/bench_model.py), one launch per configuration, all on this machine.
# Usage: benchmarks/run_model_bench.sh SET   with SET one of:
#   lora     LoRA r16 at 1024 and 2048 px: ours cp=1 (1 GPU); cp=2 ring and Ulysses with the frozen weights
#            replicated (DDP, the ddp_* configs) and sharded (FSDP2); cp=4; diffusers' built-in CP (Ulysses and
#            ring, cuDNN backend) on 2 GPUs and Ulysses on 4
#   compile  the same LoRA steps with every block torch.compile'd: ours cp=1, cp=2 (DDP), cp=4
#   big      4096 px LoRA (cp=1; cp=2 and 4 with DDP; diffusers Ulysses on 2), full fine-tuning with FSDP2
#            (cp=2 and the dp=2 no-CP baseline at 1024/2048, cp=4 at 2048/4096)
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
  run 2 120 ours_cp2_ring_ddp --cp 2 --mode ring --replicate --res 1024 2048
  run 2 120 ours_cp2_ulysses_ddp --cp 2 --mode ulysses --replicate --res 1024 2048
  run 2 120 ours_cp2_ring --cp 2 --mode ring --res 1024 2048
  run 2 120 ours_cp2_ulysses --cp 2 --mode ulysses --res 1024 2048
  run 4 120 ours_cp4_ddp --cp 4 --mode ulysses --replicate --res 1024 2048
  run 2 120 diffusers_cp2_ulysses --impl diffusers --cp 2 --mode ulysses --backend _native_cudnn --res 1024 2048
  run 2 120 diffusers_cp2_ring --impl diffusers --cp 2 --mode ring --backend _native_cudnn --res 1024 2048
  run 4 120 diffusers_cp4_ulysses --impl diffusers --cp 4 --mode ulysses --backend _native_cudnn --res 1024 2048
elif [ "$SET" = compile ]; then
  run 1 240 ours_cp1_compile --cp 1 --compile --res 1024 2048
  run 2 240 ours_cp2_compile_ddp --cp 2 --mode auto --replicate --compile --res 1024 2048
  run 4 240 ours_cp4_compile_ddp --cp 4 --mode ulysses --replicate --compile --res 1024 2048
else
  run 1 200 ours_cp1_4k --cp 1 --res 4096 --warmup 1 --steps 1
  run 2 150 ours_cp2_4k_ddp --cp 2 --mode ulysses --replicate --res 4096 --warmup 1 --steps 2
  run 4 120 ours_cp4_4k_ddp --cp 4 --mode ulysses --replicate --res 4096 --warmup 1 --steps 2
  run 2 150 diffusers_cp2_4k --impl diffusers --cp 2 --mode ulysses --backend _native_cudnn --res 4096 --warmup 1 --steps 2
  run 2 120 ours_full_cp2 --cp 2 --mode ulysses --train full --res 1024 2048
  run 2 120 ours_full_dp2 --cp 1 --dp 2 --train full --res 1024 2048
  run 4 120 ours_full_cp4 --cp 4 --mode ulysses --train full --res 2048 4096 --warmup 1 --steps 2
fi
} 2>&1 | tee "$OUT/model_$SET.log"
python3 - "$OUT/model_$SET.json" /tmp/mb/*.json <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[2:]]
out = {"env": runs[0]["env"] if runs else None, "runs": runs}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print("merged", len(runs), "runs into", sys.argv[1])
PY
