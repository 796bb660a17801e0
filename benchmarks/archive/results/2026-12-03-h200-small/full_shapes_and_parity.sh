. benchmarks/gpu_env.sh
python3 -m flux_cp.tiny --preset flux1-dev-full-shapes --out /tmp/full > /dev/null 2>&1
C="--resolution 1024"
timeout 140 python3 -m benchmarks.bench_trainer --model /tmp/full --out $OUT/small_nf4.json --logs $OUT/logs --steps 5 --warmup 2 --timeout 130 "full12_nf4:1:gpu1.yaml:$C --gpu_memory_gib 12 --base_precision nf4 --gradient_checkpointing all" > $OUT/a.log 2>&1
timeout 140 python3 -m benchmarks.bench_trainer --model /tmp/full --out $OUT/small_auto24.json --logs $OUT/logs --steps 5 --warmup 2 --timeout 130 "full24_bf16_auto:1:gpu1.yaml:$C --gpu_memory_gib 24 --offload_blocks auto" > $OUT/b.log 2>&1
(cd .old && timeout 70 python3 -m benchmarks.bench_trainer --out $OUT/parity_before.json --logs $OUT/logs_before --steps 5 --warmup 2 --timeout 65 "cp1_2048:1:gpu1.yaml:--resolution 2048") > $OUT/c.log 2>&1
timeout 70 python3 -m benchmarks.bench_trainer --out $OUT/parity_after.json --logs $OUT/logs_after --steps 5 --warmup 2 --timeout 65 "cp1_2048:1:gpu1.yaml:--resolution 2048" > $OUT/d.log 2>&1
timeout 140 python3 -m benchmarks.bench_trainer --model /tmp/full --out $OUT/small_int8.json --logs $OUT/logs --steps 5 --warmup 2 --timeout 130 "full16_int8_auto:1:gpu1.yaml:$C --gpu_memory_gib 16 --base_precision int8 --offload_blocks auto" > $OUT/e.log 2>&1
grep -h "^| " $OUT/*.log | grep -v "^|---\|^| run" | cut -c1-260
