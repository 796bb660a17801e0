"""The README's CPU demos, run as the README gives them: the log says the demo's settings, the loss falls by the
figures the README states (every loss figure in the README is one of these runs'), the model card's snippet renders
the trained LoRA at the trained size on this CPU machine, resuming the finished demo does nothing, and a step count
extends it."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from flux_cp import tiny
from flux_cp.outputs.summary import loss_change
from tests import snippets
from tests.launch import ROOT, in_process, ok, train

pytestmark = pytest.mark.e2e

README = (ROOT / "README.md").read_text()
# Each demo by a line of its command in the README; the figure the README states after that command is its own.
DEMO, KONTEXT = "--cp_size 2 --output_dir output/tiny\n", "--dataset_name data/tiny_pairs --cp_size 2"
FLUX2, KLEIN = "--output_dir output/tiny-flux2\n", "--output_dir output/tiny-flux2-klein\n"
# A loss figure as the README and the run's summary write it: "1.162 to 0.966 (-17%" or "1.162 -> 0.966 (-17%".
FIGURE = re.compile(r"(\d\.\d{3}) (?:to|->) (\d\.\d{3}) \(([-+]\d+%)")


def _commands(marker: str) -> list[list[str]]:
    """The commands of the README's code block that holds `marker` (its lines indented by four spaces)."""
    at = README.index(marker)
    start = README.rindex("\n\n", 0, at) + 2
    block = README[start : README.index("\n\n", at)]
    assert all(line.startswith("    ") for line in block.splitlines()), block
    return [shlex.split(c) for c in block.replace("\\\n", " ").splitlines()]


def _run(marker: str, tmp: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's commands for a demo, with its `output/` folders in `tmp` and the test's encoding cache: the tiny
    model built as given (`python -m flux_cp.tiny`'s main with the command's arguments, in this process: a new
    interpreter would add seconds of imports), the training launched as given (the CPU config's 2 processes)."""
    result = None
    for command in _commands(marker):
        command = [str(tmp / a[len("output/") :]) if a.startswith("output/") else a for a in command]
        if command[:3] == ["python", "-m", "flux_cp.tiny"]:
            with contextlib.redirect_stdout(io.StringIO()):
                assert tiny.main(command[3:]) == 0, command
            continue
        assert command[:4] == ["accelerate", "launch", "--config_file", "accelerate_configs/cpu_cp2.yaml"], command
        flags = command[command.index("train_flux_cp.py") + 1 :]
        result = ok(train(2, *flags, "--encodings_dir", str(tmp / "cache")))
    return Path(flags[flags.index("--output_dir") + 1]), result


def _figures(out: Path) -> tuple[str, str, str]:
    first, last, _ = loss_change(out / "metrics.jsonl")
    return f"{first:.3f}", f"{last:.3f}", f"{(last - first) / first:+.0%}"


def _stated_after(marker: str) -> tuple[str, str, str]:
    """The first loss figure the README states after the command holding `marker`."""
    return FIGURE.search(README, README.index(marker)).groups()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    out, result = _run(DEMO, tmp)
    return tmp, out, result


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """The README's other CPU demos: FLUX.1 Kontext, FLUX.2 [dev] and [klein] (output folder, launch)."""
    return {marker: _run(marker, tmp_path_factory.mktemp("demo")) for marker in (KONTEXT, FLUX2, KLEIN)}


def test_the_demo_says_its_settings_and_its_loss_falls_as_the_readme_says(demo):
    _, out, result = demo
    assert (
        "flux-cp: the demo's settings: 200 steps at learning rate 0.001, 4 samples per step, validation images of 2 "
        "prompts before and after training" in result.stderr
    )
    assert _stated_after(DEMO) == _figures(out)
    (done,) = [line for line in result.stderr.splitlines() if line.startswith("done: ")]
    assert done.replace(str(out), "output/tiny") in README, done  # the summary the README shows
    listed = re.findall(r"`output/tiny/([^`]+)`", README[README.index("## The demo") :])  # what it says it writes
    assert {"pytorch_lora_weights.safetensors", "README.md", "metrics.jsonl", "checkpoint-200/"} <= set(listed)
    for name in listed:
        assert (out / name).exists(), name


def test_the_other_demos_losses_fall_as_the_readme_says(others):
    for marker, (out, _) in others.items():
        assert _stated_after(marker) == _figures(out), marker


def test_every_loss_figure_in_the_readme_is_one_of_these_runs(demo, others):
    runs = {_figures(out) for out in (demo[1], *(out for out, _ in others.values()))}
    stated = set(FIGURE.findall(README))
    assert stated == runs, f"the README states {stated - runs}; these runs give {runs - stated}"


@contextlib.contextmanager
def _one_thread():
    """torch on one thread in this process while it runs what a user would run in a process of their own (as the
    launched trainers do): on a machine the test workers share, more threads spend the time waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_the_demo_s_lines_render_its_lora_pasted_from_its_card_or_its_log_as_the_readme_shows_them(demo):
    """The lines that load the demo's LoRA, from its model card (in a new interpreter, from the output folder) and
    from its log (from the repository, where it was launched): an image of 64 px in the output folder, and no library
    notice. The README shows them as the run prints them."""
    _, out, result = demo
    code = snippets.check(out, result.stderr, 64, fresh=True)
    shown = README[README.index("    Load the LoRA with diffusers (also in the model card") :].split("\n", 1)[1]
    shown = textwrap.dedent(shown[: shown.index("\n\n## ")]).strip("\n") + "\n"
    assert shown == code.replace(repr(str(out)), repr("/path/to/flux-cp/output/tiny")), shown


def test_the_other_demos_lines_render_their_weights_pasted_from_the_card_or_the_log(others):
    """FLUX.1 Kontext (the bundled pair's reference beside the LoRA), FLUX.2 [dev] text-to-image and [klein] editing
    one reference: each demo's lines make an image of its trained size, from its card and from its log."""
    for marker, (out, result) in others.items():
        code = snippets.check(out, result.stderr, 64)
        assert ("reference.png" in code) == (marker != FLUX2), marker
        assert "load_lora_weights(folder" in code, marker


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_resuming_the_finished_demo_says_so_and_changes_nothing(demo):
    tmp, out, _ = demo
    before = _files(out)
    code, stderr = in_process(["--output_dir", str(out), "--encodings_dir", str(tmp / "cache"),
                               "--resume_from_checkpoint", "latest"])  # fmt: skip
    assert code == 0 and f"flux-cp: {out} already finished: checkpoint-200 is its last step (200 steps)" in stderr
    assert "steps:" not in stderr and "done:" not in stderr
    assert _files(out) == before


def test_a_step_count_extends_the_demo_with_its_settings(demo, tmp_path, caplog):
    """The README's way to train the demo further: its checkpoint's batch, learning rate and prompts, the steps
    given; resumed on one process (another layout of the same global batch)."""
    tmp, out, _ = demo
    assert "--resume_from_checkpoint latest --max_train_steps 300" in README
    more = tmp_path / "tiny"
    shutil.copytree(out, more)
    with caplog.at_level(logging.INFO, logger="flux_cp"), _one_thread():
        code, stderr = in_process(["--output_dir", str(more), "--encodings_dir", str(tmp / "cache"),
                                   "--resume_from_checkpoint", "latest", "--max_train_steps", "202",
                                   "--validation_inference_steps", "2"])  # fmt: skip
    assert code == 0, stderr[-3000:]
    checkpoint, log = more / "checkpoint-200", caplog.text
    assert f"the demo's settings, as the run of {checkpoint} had them: 202 steps at learning rate 0.001" in log
    assert f"resumed from {checkpoint} at step 200" in log and "done: 202 steps" in log
    assert (more / "checkpoint-202").is_dir() and (more / "validation" / "step-000202.png").is_file()
