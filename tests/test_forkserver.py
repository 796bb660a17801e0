"""tests/forkserver.py keeps its promises: a command it forks ends as it would in a new interpreter (exit code, or death
by the same signal), sees the same arguments, `__main__`, `sys.path[0]`, standard streams, working folder and umask;
signals sent to the client reach the forked process and its children, and killing the client kills them; a command
whose start differs from the server's in what an import may read (an environment variable, the umask) runs in a new
interpreter instead.

The server here preloads nothing and skips its CUDA check (which imports torch): its imports are what make it worth
running, not what it promises, and without them it starts in a moment. Each command says whether it was forked
(the server's own module is among its modules) so that a test cannot pass through the fallback alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.launch import ROOT

FORKSERVER = ROOT / "tests" / "forkserver.py"
FORKED = "import sys; print('forked' if 'forkserver' in sys.modules else 'new', file=sys.stderr)"
SERVER = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("forkserver", sys.argv[1])
server = importlib.util.module_from_spec(spec)
sys.modules["forkserver"] = server
spec.loader.exec_module(server)
server._preload = lambda: None
server._can_fork = lambda: None
server.serve(sys.argv[2], sys.argv[3])
"""
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # the server's and the commands'


@pytest.fixture(scope="module")
def server():
    """(socket path, the server's log) of a fork server for this module's tests."""
    folder = Path(tempfile.mkdtemp(prefix="forkserver_test_"))
    path, log = str(folder / "socket"), folder / "server.log"
    with open(log, "w") as out:
        command = [sys.executable, "-c", SERVER, str(FORKSERVER), path, str(ROOT)]
        proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=out, stderr=out)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield path, log
    proc.stdin.close()  # the server ends when its standard input closes
    proc.wait(timeout=10)


def run(args: list[str], server: tuple | None = None, **kw) -> subprocess.CompletedProcess:
    """`python ARGS` through the fork server's client, or in a new interpreter (`server` None)."""
    prefix = [str(FORKSERVER), server[0]] if server else []
    kw.setdefault("env", ENV)
    return subprocess.run([sys.executable, *prefix, *args], capture_output=True, text=True, timeout=30, **kw)


def how(result: subprocess.CompletedProcess) -> str:
    """'forked' or 'new': how the command ran (the first line its FORKED prefix wrote)."""
    return result.stderr.splitlines()[0]


KILL = "import os, signal; os.kill(os.getpid(), signal.{})"
ENDINGS = ["pass", "import sys; sys.exit(1)", "import sys; sys.exit(3)", "import sys; sys.exit(259)"]
ENDINGS += ["import os; os._exit(5)", "import sys; sys.exit('bye')", "raise ValueError('boom')"]
ENDINGS += ["raise KeyboardInterrupt"]
ENDINGS += [KILL.format(s) for s in ("SIGTERM", "SIGKILL", "SIGUSR1")]


@pytest.mark.parametrize("code", ENDINGS)
def test_a_forked_command_ends_as_in_a_new_interpreter(server, code):
    forked, new = run(["-c", f"{FORKED}; {code}"], server), run(["-c", f"{FORKED}; {code}"])
    assert (how(forked), how(new)) == ("forked", "new")
    assert forked.returncode == new.returncode, (code, forked.returncode, new.returncode)
    # what it wrote on ending, its last line (a traceback's frames differ: the server's are in it)
    assert forked.stderr.splitlines()[1:][-1:] == new.stderr.splitlines()[1:][-1:]


def test_arguments_main_path_streams_and_folder_are_those_of_a_new_interpreter(server, tmp_path):
    script = tmp_path / "script.py"
    show = "import os, sys; print(sys.argv, __name__, sys.path[0], os.getcwd(), input())"
    show += "; print('to stderr', file=sys.stderr)"
    script.write_text(f"{FORKED}\n{show}\n")
    (tmp_path / "shown.py").write_text(f"{FORKED}\n{show}\n")
    for args in (["-c", f"{FORKED}; {show}", "a", "b"], [str(script), "x"], ["-m", "shown", "--y"]):
        forked = run(args, server, cwd=tmp_path, input="a line\n")
        new = run(args, cwd=tmp_path, input="a line\n")
        assert (how(forked), how(new)) == ("forked", "new"), args
        assert forked.returncode == new.returncode == 0, (forked.stderr, new.stderr)
        assert forked.stdout == new.stdout and str(tmp_path) in forked.stdout and "a line" in forked.stdout, args
        assert forked.stderr.splitlines()[1:] == new.stderr.splitlines()[1:] == ["to stderr"]


def test_what_an_import_may_read_differs_so_a_new_interpreter_runs_it(server):
    path, log = server
    show = f"{FORKED}; import os; print(os.environ.get('SOME_SETTING'), os.environ.get('RANK'), oct(os.umask(0)))"
    runtime = run(["-c", show], server, env={**ENV, "RANK": "3"})  # read when used: may differ
    assert (how(runtime), runtime.stdout.split()) == ("forked", ["None", "3", "0o22"])
    other = run(["-c", show], server, env={**ENV, "SOME_SETTING": "1"})
    assert (how(other), other.stdout.split()) == ("new", ["1", "None", "0o22"])
    assert "its SOME_SETTING differ" in log.read_text()
    umask = run(["-c", show], server, umask=0o077)
    assert (how(umask), umask.stdout.split()) == ("new", ["None", "None", "0o77"])
    assert "its umask differ" in log.read_text()


# The forked command starts a child in its process group, and both wait for a signal; the child notes the one it got.
# Each writes its pid under another name and renames it: a pid file is there whole or not at all (a process signalled
# between creating the file and writing to it would leave it empty).
WAITING = """import os, signal, subprocess, sys, time
folder = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
def noted(signum, frame):
    open(os.path.join(sys.argv[1], f"child got {signum}"), "w").close()
    os._exit(0)
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, noted)
with open(os.path.join(sys.argv[1], "child.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(sys.argv[1], "child.tmp"), os.path.join(sys.argv[1], "child"))
time.sleep(60)
''', folder])
while not os.path.exists(os.path.join(folder, "child")):
    time.sleep(0.01)
how = "forked" if "forkserver" in sys.modules else "new"
with open(os.path.join(folder, how + ".tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(folder, how + ".tmp"), os.path.join(folder, how))
time.sleep(60)
"""


def _waiting(server, folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(FORKSERVER), server[0], "-c", WAITING, str(folder)], env=ENV)
    deadline = time.monotonic() + 60
    while not (folder / "forked").exists():
        if proc.poll() is not None or (folder / "new").exists() or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the command did not start forked, with its child, within 60 s")
        time.sleep(0.01)
    return proc


def _soon(check, within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _gone(pid: int) -> bool:
    def ended() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    return _soon(ended)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_client_reach_the_forked_process_and_its_children(server, tmp_path, signum):
    proc = _waiting(server, tmp_path)
    proc.send_signal(signum)
    assert proc.wait(timeout=20) == -signum  # the forked process died of it (SIGINT: KeyboardInterrupt), as the client
    assert _soon((tmp_path / f"child got {int(signum)}").exists)
    assert _gone(int((tmp_path / "forked").read_text())) and _gone(int((tmp_path / "child").read_text()))


def test_killing_the_client_kills_what_it_forked(server, tmp_path):
    proc = _waiting(server, tmp_path)
    proc.kill()
    assert proc.wait(timeout=20) == -signal.SIGKILL
    assert _gone(int((tmp_path / "forked").read_text())) and _gone(int((tmp_path / "child").read_text()))
    assert not list(tmp_path.glob("child got *"))  # SIGKILL: no handler ran
