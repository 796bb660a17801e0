#!/usr/bin/env bash
# Parity: the step time of this code against the code before the restructuring (ff7068d), FLUX.1-dev shapes, one H200,
# 2048 px, CUDA graphs, every block checkpointed (the old default of --gradient_checkpointing), 8 steps (3 warm-up).
. "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/r/gpu.txt"
python3 -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)" >> "$OUT/r/gpu.txt"
MODEL=/tmp/flux1-dev-shapes; python3 -m flux_cp.tiny --preset flux1-dev-shapes --out $MODEL > /dev/null
RO="--compile_mode reduce-overhead"
timeout 250 python3 -m benchmarks.bench_trainer --out "$OUT/r/parity_new.json" --logs "$OUT/r/logs" --model $MODEL \
  --timeout 240 "new_cp1_2048_ro_all:1:gpu1.yaml:--resolution 2048 $RO --gradient_checkpointing all"
(cd .ref && PYTHONPATH=$PWD timeout 250 python3 benchmarks/bench_trainer.py --out "$OUT/r/parity_old.json" \
  --model $MODEL --timeout 240 "old_cp1_2048_ro:1:gpu1.yaml:--resolution 2048 $RO") > "$OUT/r/parity_old.log" 2>&1
python3 -m benchmarks.render "$OUT/r/parity_new.json" --out "$OUT/results.md"
python3 - "$OUT/r/parity_old.json" >> "$OUT/results.md" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("runs", d if isinstance(d, list) else []):
    print({k: r.get(k) for k in ("name", "s_per_step", "peak_mem_gib", "mfu", "error")})
PY
pack
