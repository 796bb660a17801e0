"""The launch configs users pick from the README: each loads with accelerate's own loader and says what the
README's table promises (DDP for LoRA, FSDP2 for full fine-tuning, bf16 on GPUs)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_matches_its_name(path: Path):
    config = load_config_from_file(str(path))
    name = path.stem
    if name.startswith("fsdp2_"):
        assert config.distributed_type == DistributedType.FSDP
        assert int(config.fsdp_config["fsdp_version"]) == 2
    if name.startswith("ddp_"):
        assert config.distributed_type == DistributedType.MULTI_GPU
    if name.startswith(("fsdp2_", "ddp_", "gpu")):
        assert config.mixed_precision == "bf16" and not config.use_cpu
    sizes = [int(x) for x in re.findall(r"(?:^|_)(?:dp|cp)(\d+)", name)]
    if sizes and config.num_machines == 1:  # e.g. fsdp2_dp2_cp4: 8 processes
        assert config.num_processes == math.prod(sizes), name


def test_readme_names_only_configs_that_exist():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"accelerate_configs/([\w.]+\.yaml)", readme)) | set(re.findall(r"`(\w+\.yaml)`", readme))
    assert named, "README names no configs"
    missing = sorted(n for n in named if not (ROOT / "accelerate_configs" / n).is_file())
    assert not missing, f"README names configs that do not exist: {missing}"
