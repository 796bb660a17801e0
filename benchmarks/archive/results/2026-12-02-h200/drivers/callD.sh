#!/usr/bin/env bash
# FP8 (torchao float8, rowwise) against bf16: the fp8 set's runs (bf16 at 2048 px is auto.json's cp1_2048_ro of the
# same sitting), then the fp8_quality pair: 200 steps at 512 px, bf16 and fp8 from the same seed, data and noise.
. "$(dirname "$0")/common.sh"
MODEL=/tmp/flux1-dev-shapes; [ -d $MODEL ] || python3 -m flux_cp.tiny --preset flux1-dev-shapes --out $MODEL > /dev/null
RO="--compile_mode reduce-overhead"
timeout 300 python3 -m benchmarks.bench_trainer --out "$OUT/r/fp8.json" --logs "$OUT/r/logs" --model $MODEL --steps 6 \
  --warmup 2 --timeout 150 "bf16_1024:1:gpu1.yaml:--resolution 1024 $RO" \
  "fp8_rowwise_1024:1:gpu1.yaml:--resolution 1024 $RO --fp8 rowwise" \
  "fp8_rowwise_2048:1:gpu1.yaml:--resolution 2048 $RO --fp8 rowwise"
Q="--pretrained_model_name_or_path $MODEL --transformer_init random --mixed_precision bf16 --rank 16 --resolution 512 $RO \
  --gradient_checkpointing --max_train_steps 200 --checkpointing_steps 100000 --report_to none --seed 0"
for V in bf16 fp8_rowwise; do
  F=""; [ "$V" = bf16 ] || F="--fp8 rowwise"
  timeout 110 accelerate launch --config_file accelerate_configs/gpu1.yaml train_flux_cp.py $Q $F \
    --output_dir "$OUT/q/$V" --encodings_dir "$OUT/q/cache" > "$OUT/r/quality_$V.log" 2>&1
  cp "$OUT/q/$V/metrics.jsonl" "$OUT/r/metrics_$V.jsonl" 2>/dev/null
done
timeout 60 python3 -m benchmarks.fp8_quality "$OUT/q/bf16" "$OUT/q/fp8_rowwise" --out "$OUT/r/fp8_quality.json" \
  --plot "$OUT/fp8_quality.png" > "$OUT/r/fp8_quality.txt" 2>&1
python3 -m benchmarks.render "$OUT/r/fp8.json" "$OUT/r/fp8_quality.json" --out "$OUT/results.md"
rm -rf "$OUT/q"
pack
