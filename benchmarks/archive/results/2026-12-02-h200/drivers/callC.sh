#!/usr/bin/env bash
# FLUX.2 [dev] shapes (32B, random weights): bash benchmarks/run.sh's flux2 set, results packed for the way back.
. "$(dirname "$0")/common.sh"
MODEL=/tmp/flux2-dev-shapes; python3 -m flux_cp.tiny --preset flux2-dev-shapes --out $MODEL > /dev/null
RO="--compile_mode reduce-overhead"
timeout 540 python3 -m benchmarks.bench_trainer --out "$OUT/r/flux2.json" --logs "$OUT/r/logs" --model $MODEL \
  --fake_peers --steps 6 --warmup 2 --timeout 260 "flux2_1024:1:gpu1.yaml:--resolution 1024 $RO" \
  "flux2_2048:1:gpu1.yaml:--resolution 2048 $RO" "flux2_fake2_2048:1:gpu1.yaml:--cp_size 2 --resolution 2048 $RO"
python3 -m benchmarks.render "$OUT/r/flux2.json" --out "$OUT/results.md"
grep -h "gradient checkpointing\|MFU and HFU\|error" $OUT/r/logs/*.log | sort | uniq -c | head -20 > "$OUT/r/notes.txt"
pack
