# The rows measured again once quantized linears compute in the autocast dtype (flux_cp/precision.py), from the
# repository root on one GPU: bash benchmarks/archive/results/2026-12-03-h200-small-c/rows.sh RESULTS_DIR
set -u
OUT=$1
. benchmarks/gpu_env.sh
mkdir -p "$OUT/logs"
python3 -m flux_cp.tiny --preset flux1-dev-full-shapes --out /tmp/full-flux1-dev > /dev/null
V="--validation_prompt a_red_circle --num_validation_images 1 --validation_inference_steps 2 --validation_steps 2"
B="python3 -m benchmarks.bench_trainer --logs $OUT/logs --steps 5 --warmup 2"
timeout 120 $B --out "$OUT/trainer_full_flux1.json" --model /tmp/full-flux1-dev --timeout 115 \
  "full12_flux1_nf4:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto $V"
timeout 125 $B --out "$OUT/trainer_small12_nf4_c.json" --timeout 120 \
  "small12_nf4_auto_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto --compile"
timeout 85 $B --out "$OUT/trainer_small16_int8.json" --timeout 80 \
  "small16_int8_auto:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 16 --base_precision int8 --offload_blocks auto"
# What the last sitting ran instead (its time was short): one row, compiled, without validation:
#   python3 -m benchmarks.bench_trainer --logs $OUT/logs --steps 5 --warmup 2 --out "$OUT/trainer_full_flux1_c.json" \
#     --model /tmp/full-flux1-dev --timeout 160 \
#     "full12_flux1_nf4_c:1:gpu1.yaml:--resolution 1024 --gpu_memory_gib 12 --base_precision nf4 --offload_blocks auto --compile"
