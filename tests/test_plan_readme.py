"""`--plan` and the README agree: the flags of each of the GPU table's fastest lines for one GPU (FLUX.1 [dev] at 24
and 12 GB, FLUX.2 [dev] at 24 GB, FLUX.2 [klein] 4B at 12 GB; 1024 px) are those of the command `--plan` recommends
for one GPU of that size at 1024 px with the figures of the GPU class that measured the line (an H100's; the class of
the table's other lines where a line is not measured), the launch config included. FLUX.2 has no built-in config:
its lines are planned on the full-size shapes folders of `python -m flux_cp.tiny`."""

from __future__ import annotations

import shlex

import pytest

from benchmarks import gpu_table
from flux_cp.config.parser import parse_config
from flux_cp.plan import recommend
from flux_cp.plan.report import print_plan

MODEL = "black-forest-labs/FLUX.1-dev"
# (model, GiB) -> the line's start and the model --plan plans (a hub id known offline, or a flux_cp.tiny preset)
LINES = {
    ("FLUX.1 [dev]", 24): ("| 1 x 24 GB | FLUX.1 [dev], 1024 px (fastest) |", MODEL),
    ("FLUX.1 [dev]", 12): ("| 1 x 12 GB | FLUX.1 [dev], 1024 px (fastest) |", MODEL),
    ("FLUX.2 [dev]", 24): ("| 1 x 24 GB | FLUX.2 [dev], 1024 px (fastest) |", "flux2-dev-shapes"),
    ("FLUX.2 [klein] 4B", 12): ("| 1 x 12 GB | FLUX.2 [klein] 4B, 1024 px (fastest) |", "flux2-klein-shapes"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """What --plan is given for each line's model: the hub id, or the shapes folder built from its preset."""
    from flux_cp.tiny import main as tiny

    found = {MODEL: MODEL}
    for _, model in LINES.values():
        if model not in found:
            out = tmp_path_factory.mktemp("models") / model
            assert tiny(["--preset", model, "--out", str(out)]) == 0
            found[model] = str(out)
    return found


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)


def readme_command(key: tuple[str, int] = ("FLUX.1 [dev]", 24)) -> list[str]:
    """The README table's fastest line for `key` as one command: the table's common command with its config, model,
    resolution and the line's flags (its data set left out: --plan reads none)."""
    line, _ = LINES[key]
    (row,) = [r for r in gpu_table.current_block(gpu_table.README.read_text()).splitlines() if r.startswith(line)]
    flags = row[len(line) :].split("|")[0].strip().strip("`")
    assert "H100" in row or "not measured" in row, row  # the GPU class whose figures --plan is given below
    common = gpu_table.COMMON.replace("\\\n", " ").replace("CONFIG", "gpu1.yaml").replace("MODEL", MODEL)
    common = common.replace("--dataset_name DATA ", "").replace("PX", "1024").replace("FLAGS", flags)
    return shlex.split(common)


def plan_command(capsys, gib: int = 24, model: str = MODEL) -> list[str]:
    argv = ["--plan", "--pretrained_model_name_or_path", model, "--resolution", "1024", "--gpu_memory_gib", str(gib)]
    argv += ["--gpu_class", "h100", "--host_memory_gib", "128"]
    print_plan(parse_config(argv), argv)
    out = capsys.readouterr().out
    assert f"recommended for 1 GPU of {gib} GiB" in out, out
    (line,) = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("accelerate launch")]
    return shlex.split(line)


def settings(command: list[str]) -> dict[str, object]:
    """The launch config and the values of the flags the recommendation sets, as the trainer parses them."""
    flags = command[command.index("train_flux_cp.py") + 1 :]
    cfg = parse_config(flags)
    values = {"config_file": command[command.index("--config_file") + 1]}
    for section in cfg.sections():
        for name in recommend.SET:
            if hasattr(section, name):
                values[name] = getattr(section, name)
    assert set(values) == {"config_file", *recommend.SET}
    return values


@pytest.mark.parametrize("key", sorted(LINES))
def test_the_readme_s_fastest_line_is_the_command_plan_recommends(capsys, models, key):
    readme, plan = readme_command(key), plan_command(capsys, key[1], models[LINES[key][1]])
    assert settings(readme) == settings(plan), f"README: {shlex.join(readme)}\n--plan:  {shlex.join(plan)}"


def test_the_comparison_sees_a_line_that_is_not_the_recommendation(capsys):
    plan = plan_command(capsys)
    other = [a for a in plan if a not in ("--base_precision", "fp8")]  # the bf16 base: exact, not the fastest
    assert settings(other) != settings(plan)
