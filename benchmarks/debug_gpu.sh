#!/usr/bin/env bash
# Locate a CUDA fault seen with CP + gradient checkpointing on the GPU (kept for the record in NOTES.md).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
B="benchmarks/bench_model.py --res 1024 --layers 2 2 --warmup 1 --steps 1"
for v in "cp1:1::--cp 1" "cp2_ring:2::--cp 2 --mode ring" "cp2_ring_flash:2:flash,efficient,math:--cp 2 --mode ring" \
         "cp2_ring_noreshard:2::--cp 2 --mode ring --no_reshard"; do
  IFS=: read name np kern args <<< "$v"
  echo "=== $name"
  FLUX_CP_KERNELS=$kern CUDA_LAUNCH_BLOCKING=1 timeout 90 torchrun --nproc_per_node $np $B $args --out /tmp/d_$name.json \
    > "$OUT/debug_$name.log" 2>&1; echo "exit $?"
  grep -E "\{'impl'" "$OUT/debug_$name.log" | cut -c1-200
  grep -E "Error|error:" "$OUT/debug_$name.log" | grep -v "ChildFailed\|error_file" | sort | uniq | head -4 | cut -c1-300
done
