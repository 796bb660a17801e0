"""Start the Python programs the tests launch (train_flux_cp.py, `accelerate launch` and its workers) by forking them
from a server that imported torch, diffusers, transformers, peft, accelerate and flux-cp once, instead of a new
interpreter importing them for each process: ~7 s of CPU per process, most of a tiny run's cost on 2 cores.

    python tests/forkserver.py SOCKET train_flux_cp.py ARGS...   # as `python train_flux_cp.py ARGS...`
    python tests/forkserver.py SOCKET -m accelerate.commands.launch ARGS...   # or -c CODE ARGS...

This file, run as above, is the client: a bare interpreter (the standard library only) that sends its arguments,
environment, working folder, umask and standard streams to the server listening on SOCKET. The server forks a process
that takes them on and runs the command as `python` would (`__main__`, `sys.argv`, `sys.path[0]`, exit status), in
a process group of its own. The client waits for it, passes on the signals it gets (a launcher stopping its workers
signals their process groups) and exits as it did: its exit code, or killed by the same signal. When the client is
killed, the forked process is killed too.

Where there is no server (not started, or on a machine with CUDA, which a forked process must not inherit), or the
command's start differs from the server's in what a module may read when it is imported (an environment variable
other than the launcher's, flux-cp's and the trackers', the umask, a relative PYTHONPATH from another folder), the
client runs the command in a new interpreter instead (exec): the result never depends on the server, only the time
does.

What a forked process does not repeat is the interpreter's start (the imports, and what libraries print while they
are imported, which goes to the server's log) and its teardown: it ends as multiprocessing's forked processes do
(threads joined, atexit handlers run, streams flushed, then os._exit). A test of either starts its own interpreter.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import struct
import sys

# Variables read when they are used, not when a module is imported: they may differ between the server and a
# command it forks (the forked process gets the command's environment as it is).
RUNTIME_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE"
    r"|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|TORCH_NCCL_ASYNC_ERROR_HANDLING|ACCELERATE_\w+|FSDP_\w+"
    r"|FLUX_CP_\w+|WANDB_\w+|NETRC|HF_TOKEN|HUGGING_FACE_HUB_TOKEN|PYTEST_\w+|TESTS_FORKSERVER|PATH|_|OLDPWD|PWD"
    r"|CUDA_VISIBLE_DEVICES)"  # read when CUDA starts, which a server never lets a forked process inherit
)
# What the server imports before it forks anything: the trainer's modules and what a run imports of the libraries.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.run", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._inductor",
    "torch._inductor.compile_fx", "prodigyopt",
    "accelerate", "accelerate.commands.config", "accelerate.utils", "accelerate.utils.launch",
    "diffusers", "diffusers.models.transformers", "diffusers.pipelines.flux", "diffusers.pipelines.flux2", "peft",
    "transformers", "transformers.models.clip", "transformers.models.t5", "transformers.models.qwen3",
    "transformers.models.mistral3", "safetensors.torch", "PIL.Image", "tqdm.auto", "huggingface_hub", "xxhash",
    "matplotlib", "matplotlib.pyplot",
]  # fmt: skip
PACKAGES = ["cp", "flux_cp"]  # every module of these
DIFFUSERS_NAMES = ["FluxTransformer2DModel", "Flux2Transformer2DModel", "AutoencoderKL", "AutoencoderKLFlux2",
                   "FlowMatchEulerDiscreteScheduler", "FluxPipeline", "FluxKontextPipeline", "Flux2Pipeline",
                   "Flux2KleinPipeline"]  # fmt: skip
TRANSFORMERS_NAMES = ["CLIPTextModel", "CLIPTokenizer", "T5EncoderModel", "T5TokenizerFast", "Qwen3ForCausalLM",
                      "Mistral3ForConditionalGeneration", "Qwen2TokenizerFast", "PreTrainedTokenizerFast",
                      "AutoTokenizer"]  # fmt: skip
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!Q")
_STATUS = struct.Struct("!ci")  # b"S" + pid (started), b"X" + exit code or -signal (ended), b"N" + 0 (not here)
_UMASK_AT_START = 0o022  # the server's, when it imported the modules


# --- client --------------------------------------------------------------------------------------------------------


def _exec(command: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *command])


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def client(path: str, command: list[str]) -> None:
    """Run `command` (python's arguments) forked by the server at `path`, or exec it; never returns."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        umask = os.umask(0)
        os.umask(umask)
        body = json.dumps({"argv": command, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask}).encode()
        socket.send_fds(conn, [_HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        reply = _recv_exact(conn, _STATUS.size)
    except OSError:
        reply = b""
    if len(reply) < _STATUS.size or _STATUS.unpack(reply)[0] != b"S":
        _exec(command)  # no server, or not one for this environment: a new interpreter

    def relay(signum, frame):  # to the forked process group, which the launcher cannot see
        try:
            conn.sendall(struct.pack("!i", signum))
        except OSError:  # it has ended: its status is on the way
            pass

    for s in RELAYED:
        signal.signal(s, relay)
    reply = _recv_exact(conn, _STATUS.size)
    for s in RELAYED:
        signal.signal(s, signal.SIG_DFL)
    if len(reply) < _STATUS.size:
        sys.stderr.write("tests/forkserver.py: the forked process's supervisor ended without its status\n")
        os._exit(1)
    _, status = _STATUS.unpack(reply)
    if status < 0:  # killed by a signal: so is this process
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        os._exit(128 - status)
    os._exit(status)


# --- server --------------------------------------------------------------------------------------------------------


def _preload() -> None:
    import importlib
    import pkgutil

    for name in PRELOAD:
        if name == "matplotlib.pyplot":
            importlib.import_module("matplotlib").use("Agg")  # as flux_cp.outputs.metrics does before its plot
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for package in PACKAGES:
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, f"{package}."):
            importlib.import_module(info.name)
    diffusers, transformers = importlib.import_module("diffusers"), importlib.import_module("transformers")
    for name in DIFFUSERS_NAMES:
        getattr(diffusers, name, None)
    for name in TRANSFORMERS_NAMES:
        getattr(transformers, name, None)
    try:  # transformers' table of checkpoint renamings, built at the first model load (~700 regular expressions)
        importlib.import_module("transformers.conversion_mapping").get_checkpoint_conversion_mapping("t5")
    except (ImportError, AttributeError):
        pass


def _can_fork() -> str | None:
    """Why forking is not safe in this process, or None."""
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        return "CUDA is available: a forked process must not inherit it"
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        return f"the server has {threads} threads after its imports: a fork would copy only one"
    return None


def _foreign(env: dict[str, str], server_env: dict[str, str], added: dict[str, str]) -> list[str]:
    """Variables of `env` that differ from the server's and may have been read while a module was imported (those
    the server's imports set may be unset or hold that value: a process the server forked passes them on)."""
    keys = set(env) | set(server_env)
    return sorted(k for k in keys if env.get(k) != server_env.get(k) and not RUNTIME_VARIABLES.fullmatch(k)
                  and not (k in added and env.get(k) == added[k]))  # fmt: skip


def _plain(argv: list[str], env: dict[str, str]) -> list[str] | None:
    """`argv` without a `-u` that PYTHONUNBUFFERED makes no different (a launcher's workers get `python -u`), when it
    is a form this server runs: `-c CODE ...`, `-m MODULE ...` or `SCRIPT ...`; else None."""
    if argv[:1] == ["-u"] and env.get("PYTHONUNBUFFERED"):
        argv = argv[1:]
    if not argv or (argv[0].startswith("-") and (argv[0] not in ("-c", "-m") or len(argv) < 2)):
        return None
    return argv


def _run(argv: list[str]) -> int:
    """What `python ARGV` does after its start, in this process: the exit code."""
    import builtins
    import runpy
    import traceback
    import types

    argv = _plain(argv, os.environ)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            saved, sys.modules["__main__"] = sys.modules["__main__"], main
            try:
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            finally:
                sys.modules["__main__"] = saved
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            sys.modules.pop(argv[1], None)  # `python -m` runs it as __main__ only
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1


def _end(code: int) -> None:
    """End as a forked multiprocessing process does: threads joined, atexit handlers run, streams flushed."""
    import atexit
    import threading

    try:
        threading._shutdown()
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _supervise(conn: socket.socket, server_env: dict[str, str], added: dict[str, str]) -> None:
    """One command: check its environment (against the server's at its start; `added`: what its imports set, as
    they would in a new interpreter), fork the process that runs it, relay signals, report its status."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (size,) = _HEADER.unpack(header + _recv_exact(conn, _HEADER.size - len(header)))
    request = json.loads(_recv_exact(conn, size))
    foreign = _foreign(request["env"], server_env, added)
    if request["umask"] != _UMASK_AT_START:  # read when a module is imported too (flux_cp.files)
        foreign.append("umask")
    relative = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and not os.path.isabs(p)]
    if relative and request["cwd"] != os.getcwd():
        foreign.append("the folder a relative PYTHONPATH starts from")
    if _plain(request["argv"], request["env"]) is None:
        foreign.append("interpreter options")
    if foreign or len(fds) != 3:
        print(f"forkserver: not forking {request['argv'][:2]}: its {', '.join(foreign)} differ", file=sys.stderr)
        conn.sendall(_STATUS.pack(b"N", 0))
        return
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update({**added, **request["env"]})
        if "numpy" in sys.modules:  # a new interpreter's global NumPy generator is seeded anew
            sys.modules["numpy"].random.seed()
        _end(_run(request["argv"]))
    try:
        os.setpgid(pid, pid)  # as the child does: a signal relayed before it ran that is not lost
    except OSError:  # it has run it already
        pass
    for fd in fds:
        os.close(fd)
    import select

    pidfd = os.pidfd_open(pid)
    try:
        conn.sendall(_STATUS.pack(b"S", pid))
        while True:
            ready, _, _ = select.select([conn, pidfd], [], [])
            if pidfd in ready:
                break
            data = _recv_exact(conn, 4)
            if len(data) < 4:  # the client was killed: so is what it ran
                raise ConnectionResetError
            try:
                os.killpg(pid, struct.unpack("!i", data)[0])
            except ProcessLookupError:
                pass
    except OSError:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        return
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(_STATUS.pack(b"X", os.waitstatus_to_exitcode(status)))
    except OSError:  # the client is gone
        pass


def serve(path: str, root: str) -> None:
    """Listen on `path` (clients wait in its queue while the imports run), import, then fork a supervisor per client
    until standard input closes (the test session that started the server ended)."""
    import select

    global _UMASK_AT_START
    _UMASK_AT_START = os.umask(0o022)
    os.umask(_UMASK_AT_START)
    sys.path[0] = root  # modules resolve as for a script in the repository root
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    server_env = dict(os.environ)
    _preload()
    added = {k: v for k, v in os.environ.items() if k not in server_env}
    gc.collect()
    gc.freeze()  # the imported objects: never collected, so a forced collection in a forked process skips them
    why = _can_fork()
    if why:
        print(f"forkserver: not serving: {why}", file=sys.stderr)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
        while True:  # reap the supervisors that ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return
        if listener in ready:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                try:
                    _supervise(conn, server_env, added)
                finally:
                    os._exit(0)
            conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        client(sys.argv[1], sys.argv[2:])
