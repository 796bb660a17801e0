#!/usr/bin/env bash
# Parity (the old code's run) and the default --gradient_checkpointing (auto) at 2048 px: one GPU and a cp=2 rank with
# loopback peers, FLUX.1-dev shapes, CUDA graphs.
. "$(dirname "$0")/common.sh"
MODEL=/tmp/flux1-dev-shapes; [ -d $MODEL ] || python3 -m flux_cp.tiny --preset flux1-dev-shapes --out $MODEL > /dev/null
RO="--compile_mode reduce-overhead"
(cd .ref && PYTHONPATH=$PWD:$PYTHONPATH timeout 250 python3 benchmarks/bench_trainer.py --out "$OUT/r/parity_old.json" \
  --model $MODEL --timeout 240 "old_cp1_2048_ro:1:gpu1.yaml:--resolution 2048 $RO") > "$OUT/r/parity_old.log" 2>&1
timeout 330 python3 -m benchmarks.bench_trainer --out "$OUT/r/auto.json" --logs "$OUT/r/logs" --model $MODEL \
  --fake_peers --timeout 200 "cp1_2048_ro:1:gpu1.yaml:--resolution 2048 $RO" \
  "fake2_2048_ro:1:gpu1.yaml:--cp_size 2 --resolution 2048 $RO"
python3 -m benchmarks.render "$OUT/r/auto.json" --out "$OUT/results.md"
python3 - "$OUT/r/parity_old.json" >> "$OUT/results.md" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("runs", d if isinstance(d, list) else []):
    print({k: r.get(k) for k in ("name", "s_per_step", "peak_mem_gib", "mfu", "loss_step1", "error")})
PY
pack
