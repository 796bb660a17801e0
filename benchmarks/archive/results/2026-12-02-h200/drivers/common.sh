# Sourced by the one-off GPU driver scripts: environment, wheels, and packing $OUT (at most 8 files come back).
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
mkdir -p "$OUT/r"
pack() { tar -czf "$OUT/logs.tgz" -C "$OUT" r 2>/dev/null; rm -rf "$OUT/r/logs"; }
