"""Searchers: step 1 of tba.py's algorithm, each in its own process.

A searcher owns a generation engine (engines.py: the policy at some version), the frozen
reference model, a shard of the prompts and a seed. ``Searcher.run`` loops over 1a load the
newest weights (between generate calls) -> 1b generate N responses per prompt -> 1c rewards
and reference log-probs -> 1d put the trajectories on the queue.

Reading order: the messages between the processes (``SearcherSetup``, what a searcher process
is started with; the queue messages ``Ready``, ``Batch`` and ``Failure``), which both sides
import; then the searcher. The last section, a learner may skip, is the plumbing of the
searcher processes, from both sides: a process's entry point (``searcher_main``) and the pool
that starts, watches, restarts and stops them for the trainer (``SearcherPool``). It lives here,
beside what it runs, so that the whole protocol between the two sides is one file and
trainer.py holds only the algorithm's side.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import numbers
import queue as queue_lib
import random
import signal
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from buffer import Trajectory
from engines import (
    WeightsNotLoaded,
    WeightStore,
    load_causal_lm,
    make_engine,
    pad_token_id,
    peak_memory_gb,
)
from tba import RunError, TBAConfig, group_passes, group_token_logprobs, scored_tokens

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


class WeightSource(Protocol):
    """The published weights, as a searcher reads them (engines.WeightStore is one)."""

    def version(self) -> int:
        """The newest published version (-1 before the first publish)."""

    def load_into(
        self, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> tuple[int, float]:
        """``load_fn`` on the (name, tensor) pairs of one consistent version; returns the version
        and the probe value published with it (engines.WeightStore)."""


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
    """One searcher's state and loop; ``searcher_main`` runs it in a child process. Its methods
    are the seams an extension overrides (README, "Extensions")."""

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


# ---- plumbing: the searcher processes, from both sides (a learner may skip) ----


# A searcher process: its entry point, signals and failures.


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


# The trainer's side: the processes started, watched, restarted within limits, and stopped.


class SearcherFailed(RunError):
    """A searcher raised or died, and no restarts are left. The message carries the searcher's
    own traceback, which is where the cause is (a reward that is not a number, a model that does
    not fit): the trainer's side of it says only that the message arrived."""


def prompt_shards(examples: list, num_searchers: int) -> list[list]:
    """Disjoint shards of the prompts, one per searcher: two searchers never generate for the
    same prompt at once."""
    shards = [examples[r::num_searchers] for r in range(num_searchers)]
    if any(not shard for shard in shards):
        raise ValueError(f"{len(examples)} prompts cannot be split over {num_searchers} searchers")
    return shards


def searcher_metrics(arrived: list, latest: dict) -> dict[str, float]:
    """The searchers' side of a step's metrics, for any pool: the mean timings of the batch
    statistics that ``arrived`` since the last step (present only when some did), and what each
    rank last reported (``latest``: rank -> its newest statistics)."""
    out = {}
    if arrived:
        out["time/generate"] = statistics.fmean(s.generate_s for s in arrived)
        out["time/reward"] = statistics.fmean(s.reward_s for s in arrived)
        out["time/reference"] = statistics.fmean(s.reference_s for s in arrived)
        out["time/load"] = statistics.fmean(s.load_s for s in arrived)
    for rank, stats in sorted(latest.items()):
        out[f"searcher{rank}/busy_frac"] = stats.busy_frac
        out[f"searcher{rank}/version"] = float(stats.version)
        out[f"searcher{rank}/peak_mem_gb"] = stats.peak_mem_gb
        for name, value in stats.gauges.items():
            out[f"searcher{rank}/{name}"] = value
    return out


class SearcherPool:
    """Starts, watches, restarts and stops the searcher processes, and collects what they send:
    trajectories for the buffer, and statistics for the metrics. ``collect`` runs on the intake
    thread and ``metrics`` on the main one; a lock keeps them apart."""

    def __init__(
        self,
        cfg: TBAConfig,
        examples: list[dict],
        reward_fn: Callable,
        store: WeightStore,
        make: Callable[[SearcherSetup], Searcher] = Searcher,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.make = make
        self.log = log
        self.ctx = mp.get_context("spawn")
        self.queue = self.ctx.Queue(maxsize=cfg.queue_size)
        self.stop_event = self.ctx.Event()
        shards = prompt_shards(examples, cfg.num_searchers)
        self.setups = [
            SearcherSetup(
                rank=rank,
                cfg=cfg,
                examples=shards[rank],
                reward_fn=reward_fn,
                store=store,
                out_queue=self.queue,
                stop_event=self.stop_event,
            )
            for rank in range(cfg.num_searchers)
        ]
        self.procs: list = [None] * cfg.num_searchers
        self.lock = threading.Lock()
        self.restarts = 0  # all searchers together
        self.last_error: dict[int, str] = {}  # rank -> traceback of its latest Failure
        self.ready_ranks: set[int] = set()  # ranks whose running process has sent Ready
        self.arrived: list = []  # BatchStats of the batches since the last metrics()
        self.latest: dict = {}  # rank -> BatchStats of its newest batch

    def start(self, rank: int | None = None) -> None:
        """Start searcher ``rank``, or all of them."""
        ranks = [rank] if rank is not None else range(self.cfg.num_searchers)
        for r in ranks:
            self.ready_ranks.discard(r)
            self.procs[r] = self.ctx.Process(
                target=searcher_main, name=f"tba-searcher-{r}", args=(self.setups[r], self.make)
            )
            self.procs[r].start()

    def wait_ready(self) -> None:
        """Wait until every searcher has sent Ready: its engine is built and, with vLLM, its KV
        cache sized from the memory free at that moment, which the trainer has not taken yet."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(self.ready_ranks) < self.cfg.num_searchers:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.cfg.num_searchers)) - self.ready_ranks)
                raise TimeoutError(
                    f"searcher(s) {missing} not ready (engine and reference model loaded) "
                    f"within {self.cfg.timeout_s}s"
                )
            if self.collect(timeout=0.2):
                raise RuntimeError("a searcher generated before the first publish")

    def collect(self, timeout: float = 0.0) -> list[Trajectory]:
        """The trajectories of every batch waiting (after up to ``timeout`` s for the first
        message); failures restarted or raised (SearcherFailed), readiness and batch statistics
        recorded."""
        messages = self.drain(timeout)  # waits without holding the lock
        with self.lock:
            return self.handle(messages)

    def drain(self, timeout: float = 0.0) -> list[Ready | Batch | Failure]:
        """Every message waiting, after up to ``timeout`` seconds for the first."""
        messages = []
        with contextlib.suppress(queue_lib.Empty):
            if timeout > 0:
                messages.append(self.queue.get(timeout=timeout))
            else:
                messages.append(self.queue.get_nowait())
            while True:
                messages.append(self.queue.get_nowait())
        return messages

    def handle(self, messages: list[Ready | Batch | Failure]) -> list[Trajectory]:
        trajectories = []
        for message in messages:
            if isinstance(message, Failure):
                self.last_error[message.rank] = message.traceback
                why = "raised" if message.restartable else "its weights did not arrive"
                self._failed(message.rank, why, message.restartable)
            elif isinstance(message, Ready):
                self.ready_ranks.add(message.rank)
            elif isinstance(message, Batch):
                trajectories += message.trajectories
                self.arrived.append(message.stats)
                self.latest[message.rank] = message.stats
            else:
                raise TypeError(f"SearcherPool: unexpected message {type(message).__name__}")
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._failed(rank, f"exit code {proc.exitcode}")
        return trajectories

    def _failed(self, rank: int, why: str, restartable: bool = True) -> None:
        """A searcher failed: restart it (it loads the newest weights on start) or raise."""
        self.procs[rank].join(timeout=5.0)
        self.procs[rank].kill()  # a no-op when it has exited
        self.procs[rank].join(timeout=5.0)
        error = self.last_error.get(rank, "(no traceback: the process died)")
        limit = self.cfg.max_searcher_restarts
        if not restartable:
            raise SearcherFailed(f"searcher {rank} failed ({why}; not restarted):\n{error}")
        if self.restarts >= limit:
            raise SearcherFailed(
                f"searcher {rank} failed ({why}); {self.restarts} restarts used of {limit}:\n"
                f"{error}"
            )
        self.restarts += 1
        self.log(f"searcher {rank} failed ({why}); restart {self.restarts}/{limit}:\n{error}")
        self.start(rank)

    def metrics(self) -> dict[str, float]:
        """Means of the timings of the batches that arrived since the last call (so present only
        when async/batches_in > 0), and what each searcher last reported."""
        with self.lock:
            arrived, self.arrived = self.arrived, []
            out = {
                "async/batches_in": float(len(arrived)),
                "async/searcher_restarts": float(self.restarts),
            }
            with contextlib.suppress(NotImplementedError):  # qsize is missing on macOS
                out["async/queue_depth"] = float(self.queue.qsize())
            out.update(searcher_metrics(arrived, self.latest))
            return out

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every searcher to stop, drain the queue while they exit, then terminate, then
        kill."""
        self.stop_event.set()
        procs = [p for p in self.procs if p is not None]
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.05)
        for p, end in itertools.product(procs, ("terminate", "kill")):
            if p.is_alive():
                getattr(p, end)()
                p.join(timeout=3.0)
        self.queue.cancel_join_thread()
        self.queue.close()
