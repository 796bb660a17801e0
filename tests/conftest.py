import os

import pytest

# One thread per process (before torch is imported): the tests run tiny tensors on two pytest workers, and the
# processes they launch use one too (tests/launch.py); more threads than cores only spin. Set it to use more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _tiny_flux_home(tmp_path_factory):
    """One tiny Flux per pytest run, shared by the spawned training processes through the environment."""
    if "FLUX_CP_HOME" not in os.environ:
        os.environ["FLUX_CP_HOME"] = str(tmp_path_factory.mktemp("flux_cp_home"))
    yield


@pytest.fixture
def fake_cp_group(monkeypatch):
    """cp.shard's view of a CP group of 2 (which chunk this rank keeps), without a process group."""
    import cp.comm

    state = {"rank": 0}
    group = object()
    real_size, real_rank = cp.comm.group_size, cp.comm.group_rank
    monkeypatch.setattr(cp.comm, "group_size", lambda g: 2 if g is group else real_size(g))
    monkeypatch.setattr(cp.comm, "group_rank", lambda g: state["rank"] if g is group else real_rank(g))
    return group, state
