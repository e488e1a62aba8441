"""Fixtures for tests/: the learner's tiny model (test_tba.py builds it), and the check that
vLLM runs on the CPU here (``helpers.require_cpu_vllm``), which skips a vLLM test, or fails it
where TBA_REQUIRE_VLLM=1 (CI, .ci/run)."""

import importlib.util

import pytest

from helpers import require_cpu_vllm, vllm_required
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


# With `-n 2 --dist loadfile` a worker takes a whole file, the next when it is near the end of
# its own. pytest-xdist hands out the files with the most tests first, which left the slowest
# files (vLLM's, few tests each minutes long) for the end, and one worker idle while the other
# ran them. Handed out slowest first (measured per file, OPERATIONS.md "Tests"), the two
# workers end within a file's time of each other. A file not named here goes after these.
SLOWEST_FIRST = (
    "tests/test_vllm.py",
    "tests/test_system.py",
    "tests/test_ray.py",
    "tests/test_bench.py",
    "tests/test_prime.py",
    "tests/test_data_parallel.py",
    "tests/test_report.py",
    "tests/test_walkthrough.py",
    "tests/test_checks.py",
    "tests/test_errors.py",
    "tests/test_grpo.py",
    "tests/test_gpu_check.py",
    "test_tba.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's; keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """Every file's tests in their own order, the files in SLOWEST_FIRST's (a stable sort)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
