# Sourced by benchmarks/run.sh (and benchmarks/archive/equivalence.sh) on a GPU machine: wheels placed in .whl/
# (diffusers, datasets, ... for a machine without a package index) installed into a fresh folder, and NCCL settings.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0): it can take shared GPUs out of service.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export FLUX_CP_HOME=${FLUX_CP_HOME:-$(mktemp -d)}
