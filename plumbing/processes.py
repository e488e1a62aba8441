"""The searcher processes' supervision (a learner may skip): what a child process does when it
fails, and ``ProcessPool``, which starts the children, waits until each is ready, notices a
failure or a death, restarts within a limit, and stops them all. searcher.SearcherPool is this
pool over the searcher processes; what its children send besides ``Ready`` and ``Failure`` (the
batches) goes to its ``receive``.
"""

from __future__ import annotations

import contextlib
import itertools
import queue as queue_lib
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from plumbing.config import RunError


@dataclass
class Ready:
    """The child is set up (a searcher: its engine and reference model loaded, a vLLM engine
    with its KV cache sized): the trainer may allocate its own memory."""

    rank: int
    unix_time: float


@dataclass
class Failure:
    """The child raised; it exits with code 1 after sending this."""

    rank: int
    traceback: str
    restartable: bool = True  # False for WeightsNotLoaded: a restart would fail the same way


class WeightsNotLoaded(RuntimeError):
    """Published weights did not arrive intact in an engine. A restart would load them the same
    way, so a searcher that raises this stops the run instead of being restarted."""


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


def run_reporting_failures(rank: int, out_queue, body: Callable[[], None]) -> None:
    """A child's body: ``body()``, with Ctrl-C left to the trainer (it reaches the whole process
    group; the trainer owns shutdown) and any exception sent to the trainer as a ``Failure``,
    then exit 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        body()
    except BaseException as exc:  # noqa: BLE001 -- report all (KeyboardInterrupt too), exit 1
        text = traceback.format_exc()
        print(f"searcher {rank} failed:\n{text}", flush=True)
        failure = Failure(rank, text, restartable=not isinstance(exc, WeightsNotLoaded))
        try:  # exiting then flushes this message to the trainer, which keeps reading
            out_queue.put(failure, timeout=5.0)
        except queue_lib.Full:
            print(f"searcher {rank}: queue full, the trainer will see exit code 1", flush=True)
        raise SystemExit(1) from None
    # Do not block process exit on flushing the queue's feeder thread when nobody reads it
    # (the classic multiprocessing exit hang); the trainer has stopped reading by now.
    out_queue.cancel_join_thread()


def exit_cause(exitcode: int | None) -> tuple[str, bool]:
    """Why a child ended, and whether a restart may help. SIGTERM is an order to stop, not a
    fault: torchrun sends it to a rank's whole process group when another rank dies, as job
    schedulers do, so the trainer has it too and is ending, and a restart would only give the
    ending run a starting searcher to wait for (OPERATIONS.md, "Shutting down")."""
    if exitcode == -signal.SIGTERM:
        return "stopped by SIGTERM, an order to stop the run", False
    return f"exit code {exitcode}", True


class ProcessPool:
    """Child processes ``targets[rank]`` (picklable callables, run in ``ctx``'s processes) that
    write to one bounded ``queue``; ``stop_event`` asks them to end. ``collect`` runs on the
    trainer's intake thread and ``metrics`` on the main one; ``lock`` keeps them apart.
    A subclass's ``receive(message)`` turns every message but Ready and Failure into
    trajectories."""

    def __init__(
        self,
        ctx,
        queue,
        stop_event,
        targets: list[Callable[[], None]],
        max_restarts: int,
        timeout_s: float,
        log: Callable[[str], None] = print,
    ):
        self.ctx = ctx
        self.queue = queue
        self.stop_event = stop_event
        self.targets = targets
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self.log = log
        self.procs: list = [None] * len(targets)
        self.lock = threading.Lock()
        self.restarts = 0  # all children together
        self.last_error: dict[int, str] = {}  # rank -> traceback of its latest Failure
        self.ready_ranks: set[int] = set()  # ranks whose running process has sent Ready

    def receive(self, message) -> list:
        raise NotImplementedError

    def start(self, rank: int | None = None) -> None:
        """Start child ``rank``, or all of them."""
        for r in [rank] if rank is not None else range(len(self.targets)):
            self.ready_ranks.discard(r)
            self.procs[r] = self.ctx.Process(target=self.targets[r], name=f"tba-searcher-{r}")
            self.procs[r].start()

    def wait_ready(self) -> None:
        """Wait until every child has sent Ready: a searcher's engine is built and, with vLLM,
        its KV cache sized from the memory free at that moment, which the trainer has not taken
        yet."""
        deadline = time.monotonic() + self.timeout_s
        while len(self.ready_ranks) < len(self.targets):
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self.targets))) - self.ready_ranks)
                raise TimeoutError(
                    f"searcher(s) {missing} not ready (engine and reference model loaded) "
                    f"within {self.timeout_s}s"
                )
            if self.collect(timeout=0.2):
                raise RuntimeError("a searcher generated before the first publish")

    def collect(self, timeout: float = 0.0) -> list:
        """The trajectories of every message waiting (after up to ``timeout`` s for the first);
        failures restarted or raised (SearcherFailed), readiness recorded."""
        messages = self.drain(timeout)  # waits without holding the lock
        with self.lock:
            trajectories = []
            for message in messages:
                if isinstance(message, Failure):
                    self.last_error[message.rank] = message.traceback
                    why = "raised" if message.restartable else "its weights did not arrive"
                    self._failed(message.rank, why, message.restartable)
                elif isinstance(message, Ready):
                    self.ready_ranks.add(message.rank)
                else:
                    trajectories += self.receive(message)
            for rank, proc in enumerate(self.procs):
                if not proc.is_alive():
                    self._failed(rank, *exit_cause(proc.exitcode))
            return trajectories

    def drain(self, timeout: float = 0.0) -> list:
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

    def _failed(self, rank: int, why: str, restartable: bool = True) -> None:
        """A child failed: restart it (a searcher loads the newest weights on start) or raise."""
        self.procs[rank].join(timeout=5.0)
        self.procs[rank].kill()  # a no-op when it has exited
        self.procs[rank].join(timeout=5.0)
        error = self.last_error.get(rank, "(no traceback: the process died)")
        limit = self.max_restarts
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

    def process_metrics(self, batches_in: int) -> dict[str, float]:
        """The pool's side of a step's metrics (call holding ``lock``)."""
        out = {
            "async/batches_in": float(batches_in),
            "async/searcher_restarts": float(self.restarts),
        }
        with contextlib.suppress(NotImplementedError):  # qsize is missing on macOS
            out["async/queue_depth"] = float(self.queue.qsize())
        return out

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every child to stop, drain the queue while they exit, then terminate, then
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
