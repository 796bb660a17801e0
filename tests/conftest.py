import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _tiny_flux_home(tmp_path_factory):
    """One tiny Flux per pytest run, shared by the spawned training processes through the environment."""
    if "FLUX_CP_HOME" not in os.environ:
        os.environ["FLUX_CP_HOME"] = str(tmp_path_factory.mktemp("flux_cp_home"))
    yield
