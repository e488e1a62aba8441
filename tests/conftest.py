"""Fixtures for tests/: the learner's tiny model (test_tba.py builds it), the check that vLLM
runs on the CPU here (``helpers.require_cpu_vllm``), which skips a vLLM test, or fails it where
TBA_REQUIRE_VLLM=1 (CI, .ci/run), and torch's threads left as each test found them."""

import importlib.util

import pytest

from helpers import require_cpu_vllm, torch_threads_kept, vllm_required
from test_tba import tiny_model_dir  # noqa: F401 (a session fixture, shared with test_tba.py)


@pytest.fixture(scope="session")
def cpu_vllm():
    """A test that needs vLLM engines on the CPU (``helpers.needs_cpu_vllm``)."""
    require_cpu_vllm()


@pytest.fixture(scope="session")
def vllm_on_cpu():
    """A test where vLLM is optional (the bench): without vLLM it runs (and fails where vLLM is
    required); with vLLM on another platform than the CPU it skips (fails where required), as
    an engine meant for the CPU would run on GPU 0."""
    if importlib.util.find_spec("vllm") is not None or vllm_required():
        require_cpu_vllm()


@pytest.fixture(autouse=True)
def torch_threads_as_found():
    """Each test leaves torch's threads as it found them (``helpers.torch_threads_kept``)."""
    with torch_threads_kept():
        yield
