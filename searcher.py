"""Searchers: step 1 of tba.py's algorithm, each in its own process.

A searcher owns a generation engine (engines.py: the policy at some version), the frozen
reference model, a shard of the prompts and a seed. ``Searcher.run`` loops over 1a load the
newest weights (between generate calls) -> 1b generate N responses per prompt, with their
behaviour log-probs -> 1c rewards and reference log-probs -> 1d put the trajectories on the
queue.

Reading order: the messages a searcher sends (``Batch``, with its ``BatchStats``) and what its
process is started with (``SearcherSetup``); the searcher; then its processes
(``searcher_main`` in each child, ``SearcherPool`` in the trainer: spawned processes writing to
one bounded queue). Their supervision -- readiness, failures, restarts within a limit, stopping
-- is plumbing/processes.py's.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import numbers
import queue as queue_lib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from buffer import Trajectory
from engines import WeightStore, make_engine
from plumbing.logprobs import group_passes
from plumbing.metrics import peak_memory_gb, searcher_metrics
from plumbing.models import load_causal_lm, pad_token_id
from plumbing.processes import ProcessPool, Ready, prompt_shards, run_reporting_failures
from tba import TBAConfig, group_token_logprobs, scored_tokens

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
    # Values an extension adds to a batch's stats about its searcher, logged as searcherN/<name>.
    gauges: dict[str, float] = field(default_factory=dict)


@dataclass
class Batch:
    """1d. One generate call's trajectories, and what the searcher measured."""

    rank: int
    trajectories: list[Trajectory]
    stats: BatchStats


class WeightSource(Protocol):
    """1a. The published weights, as a searcher reads them (engines.WeightStore is one)."""

    def version(self) -> int:
        """The newest published version (-1 before the first publish)."""

    def load_into(
        self, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> tuple[int, float]:
        """``load_fn`` on the (name, tensor) pairs of one consistent version; returns the version
        and the probe value published with it (engines.WeightStore)."""


@dataclass
class SearcherSetup:
    """1. What searcher process ``rank`` is started with (pickled once, at spawn)."""

    rank: int
    cfg: TBAConfig
    examples: list[dict]  # this searcher's shard of the prompts
    reward_fn: Callable  # see rewards.py for the plug-in contract
    store: WeightSource
    out_queue: Any  # the bounded queue: Batch messages, and plumbing.processes' Ready and Failure
    stop_event: Any  # a multiprocessing Event: set when the run ends


# ----------------------------------------------------------------------------- 1. the searcher


class Searcher:
    """1. One searcher's state and loop; ``searcher_main`` runs it in a child process. Its methods
    are the seams an extension overrides (docs/extensions.md)."""

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
        self.published_probe = 0.0  # the number published with them (engines.WeightStore's probe)
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
        measured; None when the run ended while it waited for weights. A pool that drives its
        searchers itself, rather than through ``run``, calls this for each batch."""
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
        Without a stop event (a searcher its pool drives), its driver ends it."""
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
        include_eos = self.cfg.eos_in_logprob
        behaviour = [
            [
                lp[: len(scored_tokens(y, self.eos_id, include_eos))]
                for y, lp in zip(ys, lps, strict=True)
            ]
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
            responses = outputs[part]
            token_logp, _ = self.reference_token_logprobs(prompts[part], responses)
            sums += token_logp.sum(dim=1).view(len(responses), len(responses[0])).tolist()
        return sums

    def reference_token_logprobs(
        self, prompts: list[list[int]], responses: list[list[list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """1c. log p_ref per scored token of one pass's responses, and the mask, by the rule
        the trainer scores log pi with (``TBAConfig.scoring_rule``)."""
        rule = self.cfg.scoring_rule(self.pad_id, self.eos_id, self.device)
        return group_token_logprobs(self.ref, prompts, responses, **rule)

    def put(self, message) -> None:
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


# ----------------------------------------------------------------------------- 1. the processes


def searcher_main(setup: SearcherSetup, make: Callable[[SearcherSetup], Searcher]) -> None:
    """1. A searcher process: ``make(setup)`` (Searcher, or an extension's subclass) runs until the
    run ends; an error goes to the trainer as a ``Failure`` (plumbing.processes), then exit 1."""
    torch.set_num_threads(setup.cfg.threads_per_process())
    run_reporting_failures(setup.rank, setup.out_queue, lambda: make(setup).run())


class SearcherPool(ProcessPool):
    """The S searcher processes, spawned, each with its shard of the prompts, all writing to one
    bounded queue, which the trainer's intake drains (``collect``: Ready and Failure messages,
    restarts within max_searcher_restarts, and ``stop`` are plumbing.processes.ProcessPool's)."""

    def __init__(
        self,
        cfg: TBAConfig,
        examples: list[dict],
        reward_fn: Callable,
        store: WeightStore,
        make: Callable[[SearcherSetup], Searcher] = Searcher,
        log: Callable[[str], None] = print,
    ):
        """1. One process a searcher, each given its setup and its ``make``."""
        ctx = mp.get_context("spawn")  # CUDA and vLLM need fresh processes, not forks
        queue = ctx.Queue(maxsize=cfg.queue_size)  # bounded: a slow trainer slows the searchers
        stop_event = ctx.Event()
        self.setups = [
            SearcherSetup(rank, cfg, shard, reward_fn, store, queue, stop_event)
            for rank, shard in enumerate(prompt_shards(examples, cfg.num_searchers))
        ]
        targets = [functools.partial(searcher_main, setup, make) for setup in self.setups]
        super().__init__(
            ctx, queue, stop_event, targets, cfg.max_searcher_restarts, cfg.timeout_s, log
        )
        self.arrived: list[BatchStats] = []  # of the batches since the last metrics()
        self.latest: dict[int, BatchStats] = {}  # rank -> of its newest batch

    def receive(self, batch: Batch) -> list[Trajectory]:
        """2. A batch from the queue: its trajectories for the buffer, its statistics for the
        metrics."""
        self.arrived.append(batch.stats)
        self.latest[batch.rank] = batch.stats
        return batch.trajectories

    def metrics(self) -> dict[str, float]:
        """The timings of the batches that arrived since the last call (so present only when
        async/batches_in > 0), and what each searcher last reported."""
        with self.lock:
            arrived, self.arrived = self.arrived, []
            return {**self.process_metrics(len(arrived)), **searcher_metrics(arrived, self.latest)}
