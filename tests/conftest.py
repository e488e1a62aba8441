"""Fixtures for tests/: the learner's tiny model (test_tba.py builds it) and the vLLM models."""

from test_tba import tiny_model_dir  # noqa: F401 (a session fixture, shared with test_tba.py)
