import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _tiny_flux_home(tmp_path_factory):
    """One tiny Flux per pytest run, shared by the spawned training processes through the environment."""
    if "FLUX_CP_HOME" not in os.environ:
        os.environ["FLUX_CP_HOME"] = str(tmp_path_factory.mktemp("flux_cp_home"))
    yield


def pytest_collection_modifyitems(config, items):
    """Tier marks: `e2e` is set by the test files that launch train_flux_cp.py; `distributed` here, on the
    tests of every module that spawns gloo process groups through tests/distributed.py."""
    spawner = sys.modules.get("tests.distributed")
    for item in items:
        module = getattr(item, "module", None)
        if spawner is not None and any(v is spawner for v in vars(module).values()):
            item.add_marker(pytest.mark.distributed)
