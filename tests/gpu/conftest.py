import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them); run with `pytest tests/gpu`")
