#!/usr/bin/env bash
# Prepares .whl/ (git-ignored), the folder a GPU machine without a package index gets beside the checkout, for the
# suite's small-GPU sets (benchmarks/run.sh: small, small_b, small_full, peers, table, table_b). From the repository root:
#   bash benchmarks/carry.sh [SD_SCRIPTS_REPO]
# It downloads wheels for the GPU machine's Python (3.12, x86-64 Linux) and writes:
#   .whl/*.whl         what the trainer and the peers' scripts need beyond that machine's packages (benchmarks/gpu_env.sh
#                      installs them): diffusers 0.42.1 (with importlib_metadata, which it names), datasets 5.2.0 with
#                      dill and multiprocess, torchao 0.16.0, and bitsandbytes 0.50.2 cut to its CUDA 13.0 and CPU
#                      libraries (43 MB -> 3.6 MB)
#   .whl/kohya/*.whl   kohya sd-scripts' pinned dependencies that differ from the machine's (transformers 4.54.1,
#                      diffusers 0.32.1, huggingface_hub 0.34.3, tokenizers 0.21.4, toml, voluptuous, imagesize); the
#                      peers set installs them into a folder of their own, first on the path of kohya's processes only
#   .whl/sd-scripts/   kohya-ss/sd-scripts at $SD_SCRIPTS_COMMIT (default 48d368f), the files its FLUX.1 LoRA
#                      training imports, exported from SD_SCRIPTS_REPO (a clone or bare repository; default: a fresh
#                      clone of https://github.com/kohya-ss/sd-scripts); COMMIT names the commit
# and prints the total size (a device run carries at most 64 MiB with the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=${SD_SCRIPTS_COMMIT:-48d368f}
SRC=${1:-}
PY=${PYTHON:-python3}
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"

# One version of each package: gpu_env.sh installs every top-level wheel, and two versions of one stop the install.
rm -rf .whl/kohya
rm -f .whl/diffusers-*.whl .whl/importlib_metadata-*.whl .whl/datasets-*.whl .whl/dill-*.whl \
  .whl/multiprocess-*.whl .whl/torchao-*.whl .whl/bitsandbytes-*.whl
mkdir -p .whl/kohya
# shellcheck disable=SC2086 # PLATFORM is a list of options
"$PY" -m pip download -q --no-deps $PLATFORM -d .whl diffusers==0.42.1 importlib_metadata==10.2.0 datasets==5.2.0 \
  "dill>=0.3.0,<0.4.2" "multiprocess<0.70.20" torchao==0.16.0 bitsandbytes==0.50.2
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps $PLATFORM -d .whl/kohya transformers==4.54.1 diffusers==0.32.1 \
  huggingface_hub==0.34.3 tokenizers==0.21.4 toml==0.10.2 voluptuous==0.15.2 imagesize==1.4.1

# bitsandbytes ships a library per CUDA and ROCm version; the GPU machine's torch is built for CUDA 13.0.
"$PY" - <<'EOF'
import glob, os, re, zipfile
for path in glob.glob(".whl/bitsandbytes-*.whl"):
    keep = re.compile(r"bitsandbytes/libbitsandbytes_(cuda130|cpu)\.so$")
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith("bitsandbytes/libbitsandbytes_") and not keep.search(item.filename):
                continue
            dst.writestr(item, src.read(item.filename))
    os.replace(tmp, path)
EOF

HAVE=$(cat .whl/sd-scripts/COMMIT 2>/dev/null || true)
if [ -z "$HAVE" ] || [ "${HAVE#"$COMMIT"}" = "$HAVE" ]; then  # not yet exported, or another commit
  if [ -z "$SRC" ]; then
    SRC=$(mktemp -d)/sd-scripts
    git clone -q https://github.com/kohya-ss/sd-scripts "$SRC"
  fi
  rm -rf .whl/sd-scripts && mkdir -p .whl/sd-scripts
  # Only what flux_train_network.py imports (the top-level scripts, library/, networks/) and the license.
  git -C "$SRC" archive "$COMMIT" -- ':(glob)*.py' library networks LICENSE.md requirements.txt |
    tar -x -C .whl/sd-scripts
  git -C "$SRC" rev-parse "$COMMIT^{commit}" > .whl/sd-scripts/COMMIT
fi

du -sh .whl .whl/kohya .whl/sd-scripts
echo "with the checkout: $(( ( $(du -sk .whl | cut -f1) + $(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1) ) / 1024 )) MiB of 64"
