"""The lines a finished run gives for loading its weights - in the model card (`README.md` of the output folder) and
at the end of its log (the summary) - run as a user runs them: pasted as they are into a Python process of their
own, the card's from the output folder, the summary's from where the run was launched. They must make an image of
the trained size, say nothing but progress bars, and write nothing outside the output folder."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from PIL import Image

from tests.launch import ROOT, env, python_cmd

# A progress bar as tqdm draws it when its output is not a terminal: `desc: 42%|####  | 5/12 [00:01<00:02, 3.1it/s]`
# (nested bars add the cursor-up escape).
BAR = re.compile(r"^([^|]*: *)?\d+%\|[^|]*\| *\d+/\d+ \[[^\]]*\]$")


def card_code(out: Path, card: str = "README.md") -> str:
    """The Python block of the run's model card."""
    (code,) = re.findall(r"```py\n(.*?)```", (out / card).read_text(), flags=re.S)
    return code


def summary_code(log: str) -> str:
    """The lines the run's log ends with, under `Load the ... with diffusers ...:`, as a user copies them."""
    tail = re.split(r"\nLoad the \w+ with diffusers[^\n]*:\n", log, maxsplit=1)[1]
    block = []
    for line in tail.split("\n"):
        if line and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip("\n") + "\n"


def noise(output: str) -> list[str]:
    """What a process printed besides progress bars."""
    segments = re.split(r"[\r\n]+", output.replace("\x1b[A", ""))
    return [s for s in segments if s.strip() and not BAR.match(s.strip())]


def run(code: str, cwd: Path, fresh: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """`code` as a script of its own, run from `cwd`: forked from the tests' server (tests/forkserver.py, which
    imported the libraries already), or with `fresh` in a new interpreter (which also shows what the libraries print
    while they are imported)."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "snippet.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)] if fresh else python_cmd(str(script))
        return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def check_image(path: Path, size: int) -> None:
    assert path.is_file(), f"the snippet wrote no {path}"
    with Image.open(path) as image:
        image.load()  # a whole, readable PNG
        assert image.format == "PNG" and image.size == (size, size), (image.format, image.size)


def check(out: Path, log: str, size: int, *, fresh: bool = False, card: str = "README.md") -> str:
    """The card's and the summary's lines of the run in `out` whose log is `log`: the same lines, and each run from
    where a user runs it (the card's from the output folder, the summary's from the folder the run was launched
    from: the repository) makes `out/image.png` at `size` x `size` px and prints nothing but progress bars; nothing is
    written into the repository. Returns the lines."""
    code = card_code(out, card)
    assert summary_code(log) == code, (summary_code(log), code)
    for cwd, first in ((out, True), (ROOT, False)):
        image = out / "image.png"
        image.unlink(missing_ok=True)
        result = run(code, cwd, fresh=fresh and first)
        assert result.returncode == 0, f"from {cwd}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        assert not noise(result.stdout + result.stderr), noise(result.stdout + result.stderr)
        check_image(image, size)
    assert not (ROOT / "image.png").exists(), "the lines wrote into the repository"
    return code
