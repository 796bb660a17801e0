"""A model folder's configs are checked before anything is built from them (flux_cp.families.model_config): sizes are
positive integers within generous bounds, the family's rules across keys and components hold, and the weight files'
headers agree with the configs; each problem is one line naming the file and the key. Every released and built model
passes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from flux_cp.config.training import ModelConfig
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1, FLUX2, FLUX2_KLEIN
from flux_cp.families.components import transformer_config, with_class_defaults
from flux_cp.families.model_config import check_model, safetensors_shapes
from tests.launch import env, launch_cmd

MODEL = ModelConfig()


def _check(family, folder: Path, model: ModelConfig = MODEL) -> None:
    check_model(family, str(folder), transformer_config(str(folder), family.transformer_class(), None, None), model)


def _copy(family, tmp_path: Path, edits: dict[str, dict]) -> Path:
    """A copy of the family's tiny folder with `edits` (component -> keys) made to its config files."""
    folder = Path(shutil.copytree(family.embedded_default(pairs=False), tmp_path / "model"))
    for component, keys in edits.items():
        path = folder / component / "config.json"
        config = json.loads(path.read_text())
        for key, value in keys.items():  # a dotted key is nested
            *outer, last = key.split(".")
            inner = config
            for part in outer:
                inner = inner[part]
            inner[last] = value
        path.write_text(json.dumps(config))
    return folder


def test_every_released_and_built_model_passes(tmp_path):
    from flux_cp.families.flux1 import tiny as tiny1
    from flux_cp.families.flux2 import tiny as tiny2

    for family in (FLUX1, FLUX2, FLUX2_KLEIN):
        for known in family.known:  # a hub id's built-in config, nothing of it on this machine
            config = with_class_defaults(dict(known.transformer), family.transformer_class())
            check_model(family, known.model_id, config, MODEL)
    _check(FLUX1, Path(FLUX1.embedded_default(pairs=True)))
    for family in (FLUX2, FLUX2_KLEIN):
        _check(family, Path(family.embedded_default(pairs=False)))
    built = [
        (FLUX1, Path(FLUX1.embedded_default(pairs=False))),
        (FLUX1, tiny1.write_flux1_dev_shapes(tmp_path / "a")),
        (FLUX1, tiny1.write_flux1_dev_full_shapes(tmp_path / "b")),
        (FLUX2, tiny2.write_flux2_shapes(tmp_path / "c")),
        (FLUX2, tiny2.write_flux2_full_shapes(tmp_path / "d")),
        (FLUX2_KLEIN, tiny2.write_flux2_full_shapes(tmp_path / "e", klein=True)),
    ]
    for family, folder in built:
        _check(family, folder)


HOSTILE = [
    (FLUX1, "transformer", {"num_layers": 100_000_000}, "num_layers is 100000000; it must be an integer from 0 to 200"),
    (FLUX1, "transformer", {"num_single_layers": 2**40}, "num_single_layers is 1099511627776; it must be an integer"),
    (FLUX1, "transformer", {"num_attention_heads": -4}, "num_attention_heads is -4; it must be an integer from 1"),
    (FLUX1, "transformer", {"in_channels": -64}, "in_channels is -64; it must be an integer from 1"),
    (FLUX1, "transformer", {"attention_head_dim": 0}, "attention_head_dim is 0; it must be an integer from 1"),
    (FLUX1, "transformer", {"num_layers": "2"}, 'num_layers is "2"; it must be an integer'),
    (FLUX1, "transformer", {"num_layers": 2.0}, "num_layers is 2.0; it must be an integer"),
    (
        FLUX1,
        "transformer",
        {"axes_dims_rope": [4, 6, -6]},
        "axes_dims_rope is [4, 6, -6]; it must be an integer from 1 to 1280 (each of its values)",
    ),
    (FLUX1, "vae", {"latent_channels": -4}, "vae/config.json: latent_channels is -4"),
    (
        FLUX1,
        "vae",
        {"block_out_channels": [8, 16]},
        "vae/config.json: down_block_types lists 4 blocks and block_out_channels 2 channel counts",
    ),
    (FLUX1, "text_encoder", {"num_hidden_layers": 100_000_000}, "text_encoder/config.json: num_hidden_layers is"),
    (FLUX1, "text_encoder_2", {"d_model": None, "num_heads": True}, "text_encoder_2/config.json: num_heads is true"),
    (
        FLUX1,
        "transformer",
        {"axes_dims_rope": [4, 6, 4]},
        "axes_dims_rope [4, 6, 4] adds up to 14, not attention_head_dim 16",
    ),
    (FLUX1, "transformer", {"out_channels": 8}, "out_channels is 8, not in_channels 16"),
    (FLUX1, "text_encoder_2", {"d_model": 64}, "joint_attention_dim is 32, not the T5 encoder's d_model"),
    (FLUX1, "transformer", {"num_layers": 3}, "num_layers is 3, and the weight files hold 2 (transformer_blocks.N)"),
    (
        FLUX1,
        "transformer",
        {"num_attention_heads": 8, "axes_dims_rope": [8, 4, 4]},
        "x_embedder.weight is [64, 16] in the weight files, [128, 16] for this config",
    ),
    (FLUX1, "text_encoder", {"num_hidden_layers": 3}, "num_hidden_layers is 3, and the weight files hold 2"),
    (FLUX2, "transformer", {"mlp_ratio": -1}, "mlp_ratio is -1; it must be a number from 0 to 40"),
    (FLUX2, "text_encoder", {"text_config.hidden_size": 0}, "text_encoder/config.json: text_config.hidden_size is 0"),
    (
        FLUX2,
        "text_encoder",
        {"text_config.hidden_size": 32},
        "joint_attention_dim is 48, not 3 x the text encoder's hidden_size",
    ),
    (FLUX2_KLEIN, "vae", {"latent_channels": 8}, "in_channels is 16, not 4 x the VAE's latent_channels"),
    (
        FLUX2_KLEIN,
        "text_encoder",
        {"vocab_size": 100},
        "model.embed_tokens.weight is [261, 16] in the weight files, [100, 16] for this config",
    ),
]


@pytest.mark.parametrize(
    "family, component, edits, message", HOSTILE, ids=[f"{h[0].name}-{h[3][:40]}" for h in HOSTILE]
)
def test_a_config_of_impossible_or_foreign_sizes_is_refused_naming_its_file_and_key(
    tmp_path, family, component, edits, message
):
    folder = _copy(family, tmp_path, {component: edits})
    with pytest.raises(UsageError) as e:
        _check(family, folder)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(folder / component) in str(e.value) or "transformer/config.json" in str(e.value), str(e.value)


def test_weight_files_that_are_not_whole_are_named(tmp_path):
    folder = _copy(FLUX1, tmp_path, {})
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(UsageError, match=f"^{weights} is not a whole safetensors file .*: download or copy it again$"):
        _check(FLUX1, folder)
    weights.write_bytes(b"\xff" * 8 + b"{}")  # a header length no file holds
    with pytest.raises(UsageError, match="with no header of a readable size"):
        _check(FLUX1, folder)
    weights.write_bytes(whole)
    shapes = safetensors_shapes(weights)
    assert shapes["x_embedder.weight"] == (64, 16)
    # a sharded checkpoint: its index names its files, each inside the folder
    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    for weight_map, message in (
        ({"x": "../vae/diffusion_pytorch_model.safetensors"}, "not a file of its folder"),
        ({"x": "diffusion_pytorch_model-00002-of-00002.safetensors"}, "which .* does not hold"),
        ([], "has no 'weight_map'"),
    ):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(UsageError, match=message):
            _check(FLUX1, folder)
    index.write_text(json.dumps({"weight_map": dict.fromkeys(shapes, weights.name)}))
    _check(FLUX1, folder)
    # with --transformer_init random the transformer's weights are not read: only its config counts
    index.write_text("{}")
    _check(FLUX1, folder, ModelConfig(transformer_init="random"))


@pytest.mark.e2e
@pytest.mark.parametrize(
    "edits, plan",
    [({"num_layers": 100_000_000}, False), ({"num_single_layers": 2**40}, True)],
    ids=["train", "plan"],
)
def test_the_trainer_and_the_plan_refuse_a_huge_model_config_at_once(tmp_path, edits, plan):
    """Such a config built for hours at full CPU with no output: now one line, in seconds (a hang fails the test at
    its timeout rather than blocking the suite)."""
    folder = _copy(FLUX1, tmp_path, {"transformer": edits})
    args = [
        "--pretrained_model_name_or_path",
        str(folder),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--max_train_steps",
        "1",
        *(["--plan"] if plan else []),
    ]
    r = subprocess.run(launch_cmd(1, *args), env=env(), capture_output=True, text=True, timeout=180)
    key = next(iter(edits))
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: {folder}/transformer/config.json: {key} is {edits[key]}; it must be an integer" in r.stderr
    assert "Traceback" not in r.stderr
