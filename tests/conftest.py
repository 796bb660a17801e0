import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _tiny_flux_home(tmp_path_factory):
    """One tiny Flux per test session, shared by the spawned training processes through the environment."""
    if "FLUX_CP_HOME" not in os.environ:
        os.environ["FLUX_CP_HOME"] = str(tmp_path_factory.mktemp("flux_cp_home"))
    yield
