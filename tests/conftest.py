"""Fixtures for tests/: the learner's tiny model (test_tba.py builds it), the check that vLLM
runs on the CPU here (``helpers.require_cpu_vllm``), which skips a vLLM test, or fails it where
TBA_REQUIRE_VLLM=1 (CI, .ci/run), and torch's threads left as each test found them."""

import importlib.util
import os

# One torch (OpenMP) thread per process unless the caller sets another count: the README's
# command runs two pytest workers on two cores, and each test's searchers and trainers beside
# them, so a second thread per process finds no free core and spins in OpenMP's barrier. Set
# before the first import of torch (test_tba below), so spawned children inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
