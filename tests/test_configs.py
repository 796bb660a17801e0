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


FSDP_CONFIGS = [p for p in CONFIGS if load_config_from_file(str(p)).distributed_type == DistributedType.FSDP]


@pytest.mark.parametrize("path", FSDP_CONFIGS, ids=lambda p: p.name)
def test_fsdp_configs_wrap_every_block_of_flux1_and_flux2(path: Path):
    """FSDP2 shards block by block: the configs name no block classes, so accelerate wraps the model's own
    `_no_split_modules`, FLUX.1's or FLUX.2's (a FLUX.1 class named here would stop a FLUX.2 run)."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from flux_cp.families import FLUX1, FLUX2
    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
    from flux_cp.families.flux2.tiny import FLUX2_DEV_TRANSFORMER

    fsdp = load_config_from_file(str(path)).fsdp_config
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
        transformer_cls_names_to_wrap=fsdp.get("fsdp_transformer_layer_cls_to_wrap"),
    )  # fmt: skip
    for family, config in ((FLUX1, FLUX1_DEV_TRANSFORMER), (FLUX2, FLUX2_DEV_TRANSFORMER)):
        with torch.device("meta"):
            model = family.transformer_class().from_config(config)
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        assert [m for m in model.modules() if policy(m)] == blocks, family.label
