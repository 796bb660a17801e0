"""Components built from their config with random weights, for benchmarks at full size without downloads
(`--transformer_init random` with a folder written by `python -m flux_cp.tiny --preset ...-full-shapes`): a component
folder that holds a config but no weight files is built on the meta device and its parameters are made one at a
time on the device that fills them fastest (the GPU when there is one), with an integer hash of each element's index
and a seed: the same values on every device, and no CPU-bound normal draw over billions of parameters (a 4.7B T5
fills in a second on a GPU).

Values: every weight of two or more dimensions uniform in +-1/sqrt(fan in) (as torch's default for linear and
convolution layers), one-dimensional weights (norms' scales) 1, biases 0; buffers are the model's own (built for
real: rotary frequencies, position ids, batch-norm statistics)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin")
_CHUNK = 1 << 26  # elements filled at once: bounds the integer temporaries (8 bytes each)
_MASK = (1 << 32) - 1


def has_weight_files(folder: Path | None) -> bool:
    """Whether a component folder holds weight files (safetensors or torch's .bin, sharded or not)."""
    return folder is not None and any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())


def name_seed(name: str, seed: int = 0) -> int:
    """A 31-bit seed of a component's name (and a seed): each component gets its own values in every run."""
    return int.from_bytes(hashlib.sha256(f"{name}\0{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 values in [0, 2^32) (the finalizer of MurmurHash3), exact on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK
    return x ^ (x >> 16)


@torch.no_grad()
def hashed_uniform_(t: torch.Tensor, seed: int, bound: float) -> torch.Tensor:
    """Fill `t` with values uniform in [-bound, bound) from a hash of each element's flat index and `seed`."""
    flat = t.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        idx = torch.arange(start, start + n, device=t.device, dtype=torch.int64)
        h = _hash32((idx * 0x9E3779B1 + seed) & _MASK)
        flat[start : start + n] = ((h.double() / 2**32) * 2 - 1).mul_(bound).to(t.dtype)
    return t


def _fan_in(shape: torch.Size) -> int:
    return shape[1] * math.prod(shape[2:]) if len(shape) > 1 else shape[0]


@torch.no_grad()
def materialize(
    module: torch.nn.Module, dtype: torch.dtype, fill_device: torch.device, home: torch.device, seed: int
) -> torch.nn.Module:
    """Give every parameter of `module` still on the meta device its values (module doc), filled on `fill_device` and
    kept on `home`, in `dtype`; parameters are made one at a time, so `fill_device` needs room for one only. Tied
    parameters stay tied."""
    done: dict[int, torch.nn.Parameter] = {}
    for owner_name, owner in module.named_modules():
        for name, p in list(owner.named_parameters(recurse=False)):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                full = f"{owner_name}.{name}" if owner_name else name
                value = torch.empty(p.shape, dtype=dtype, device=fill_device)
                if p.dim() >= 2:
                    hashed_uniform_(value, name_seed(full, seed), 1 / math.sqrt(_fan_in(p.shape)))
                else:
                    value.fill_(0.0 if name.endswith("bias") else 1.0)
                done[id(p)] = torch.nn.Parameter(value.to(home), requires_grad=p.requires_grad)
            owner._parameters[name] = done[id(p)]
    return module


def build_random(
    cls: type, config, dtype: torch.dtype, home: torch.device, seed: int, fill_device: torch.device | None = None
) -> torch.nn.Module:
    """A diffusers or transformers model of class `cls` built from `config` (a transformers config object, or a
    diffusers config dict) with random weights (module doc), in `dtype` on `home`. `fill_device`: where the values are
    computed (default: the first GPU when there is one, else `home`)."""
    from accelerate import init_empty_weights

    if fill_device is None:
        fill_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else home
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (frequencies, stats) for real
        model = cls.from_config(config) if isinstance(config, dict) else cls._from_config(config)
    if hasattr(model, "tie_weights"):  # transformers ties input and output embeddings where the config says so
        model.tie_weights()
    materialize(model, dtype, fill_device, home, seed)
    for b_owner in model.modules():  # the model's own buffers, kept in their dtype where it is not a float one
        for name, b in list(b_owner.named_buffers(recurse=False)):
            if b is not None:
                b_owner._buffers[name] = b.to(home)
    return model.eval()
