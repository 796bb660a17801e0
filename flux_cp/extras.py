"""The optional packages behind some flags (pyproject's extras): which package each `--base_precision` and each
optional optimizer needs, the oldest version accepted, whether it is installed, and the pip line that installs it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

from flux_cp.errors import UsageError

# The package of each quantized --base_precision and the oldest version accepted: peft's LoRA layers for torchao need
# 0.16; bitsandbytes 0.50 is the one tested (and the `optim` extra's floor).
PACKAGES = {"fp8": ("torchao", "0.16"), "int8": ("torchao", "0.16"), "nf4": ("bitsandbytes", "0.50")}
INSTALL = "pip install -e .[quant]"
# The packages behind --optimizer prodigy and --use_8bit_adam (the `optim` extra).
OPTIMIZER_PACKAGES = {"prodigy": "prodigyopt", "adamw8bit": "bitsandbytes"}
OPTIMIZER_INSTALL = "pip install -e .[optim]"


def check_installed(precision: str) -> None:
    """The package behind `precision` is installed, at a version it was tested with (pip's command when not)."""
    if precision not in PACKAGES:
        return
    package, oldest = PACKAGES[precision]
    found = version(package)
    if found is None:
        raise UsageError(
            f"--base_precision {precision} needs the {package} package: {INSTALL} (or pip install "
            f"'{package}>={oldest}')",
            agreed=True,
        )
    if older(found, oldest):
        raise UsageError(
            f"--base_precision {precision} needs {package} >= {oldest} (found {found}): pip install -U "
            f"'{package}>={oldest}' (or {INSTALL})",
            agreed=True,
        )


def version(package: str) -> str | None:
    """The installed version; None when not importable, "" when importable without a version (a source tree)."""
    if package in sys.modules and sys.modules[package] is None:  # blocked (tests: as if not installed)
        return None
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def older(found: str, oldest: str) -> bool:
    from packaging.version import Version

    return bool(found) and Version(found) < Version(oldest)


def installed(module: str) -> bool:
    """Whether `module` can be imported (imported already, or found; a module blocked in sys.modules is not)."""
    if module in sys.modules:  # imported already, or blocked (None)
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None
