"""The Ray extension's weight group (``--ray_weights broadcast``): a torch process group of its
own, the driver rank 0 and each searcher actor a rank, that carries each published version from
the trainer's weight store into every actor; Ray carries only its control. This file holds the
group itself and its control; extensions/weight_rounds.py its two sides.

* ``GroupBoard``, an async actor on the driver's node, holds the group's plan (``GroupPlan``:
  who is in it, where it meets, its secret), the version announced (``Announce``) and each
  member's heartbeat.
* ``WeightGroup`` is one incarnation of the group, formed on the driver's ``StoreServer``
  (extensions/group_store.py: the group's address only, and only for the holders of that
  incarnation's secret); it sends a version as flat buckets, two in flight.
* ``GroupSender`` (a thread of the driver) forms the group, sends each new version, and gives a
  failed round up; ``GroupWeightSource`` (in each actor) receives a version into a staging copy
  while the searcher generates, and hands the engine only a complete one
  (extensions/weight_rounds.py).
* ``StoreSnapshot`` reads one consistent copy of a CUDA store into host memory without waiting
  for the trainer (the gloo path and ``--ray_weights object_store``).

Every wait has the round's deadline (``--ray_weights_timeout_s``), the calls to Ray's GCS and to
the board included; a round that fails is given up and the group rebuilt (``GroupSender``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines import WeightStore
from extensions.group_store import GroupStore


class WeightGroupError(RuntimeError):
    """An operation of the weight group failed or missed its deadline: a member died, hung,
    or never joined."""


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n")[0][:300]


# The bound of a call to the board or to Ray's GCS outside a round (membership, a receiver's
# poll), where no deadline runs: a slow answer only delays the next round. Inside a round every
# call ends by the round's deadline.
CONTROL_S = 60.0


def ask(call, timeout_s: float):
    """``ray.get`` of an actor call, ended by ``timeout_s`` (GetTimeoutError, a TimeoutError)."""
    import ray

    return ray.get(call, timeout=max(timeout_s, 0.001))


# ----------------------------------------------------------------------------- control


@dataclass(frozen=True)
class GroupPlan:
    """One incarnation of the weight group (``epoch``), formed in the driver's round ``round``:
    where its rendezvous is (the driver's StoreServer), the secret that admits its members
    there (never printed), and who is in it, ``members``: (searcher rank, incarnation) -> group
    rank."""

    seq: int
    round: int
    epoch: int
    host: str
    port: int
    members: dict
    secret: str = dataclasses.field(repr=False)

    @property
    def world(self) -> int:
        return 1 + len(self.members)


@dataclass(frozen=True)
class Announce:
    """Version ``version`` (published with ``probe``) is broadcast in group ``epoch`` now, in the
    driver's round ``round``."""

    seq: int
    round: int
    epoch: int
    version: int
    probe: float


class GroupBoard:
    """The weight group's control, an async actor on the driver's node: the newest plan, the
    newest announced version, and what each searcher told it (its heartbeat, its node, how its
    latest part in the group ended). A receiver long-polls it (``poll``): a plan or an
    announcement reaches it within milliseconds, and the poll itself is its heartbeat. Only
    Ray's clients reach it (the cluster's token), so the plan's secret travels only there."""

    def __init__(self):
        self.seq = 0
        self.plan: GroupPlan | None = None
        self.announce: Announce | None = None
        self.posted = asyncio.Event()
        self.members: dict[int, dict] = {}  # searcher rank -> what it last said, and when
        self.closed = 0  # the newest epoch the driver gave up

    def post_closed(self, epoch: int) -> None:
        self.closed = max(self.closed, epoch)

    def is_closed(self, epoch: int) -> bool:
        return epoch <= self.closed

    def post_plan(
        self, round: int, epoch: int, host: str, port: int, secret: str, members: dict
    ) -> None:
        self.seq += 1
        self.plan = GroupPlan(self.seq, round, epoch, host, port, members, secret)
        self._wake()

    def post_announce(self, round: int, epoch: int, version: int, probe: float) -> None:
        self.seq += 1
        self.announce = Announce(self.seq, round, epoch, version, probe)
        self._wake()

    def _wake(self) -> None:
        self.posted.set()
        self.posted = asyncio.Event()

    def _next(self, after: int) -> GroupPlan | Announce | None:
        """A newer plan first (it supersedes what was announced in an older group); else the
        newest announcement, if it is for the current group."""
        if self.plan is not None and self.plan.seq > after:
            return self.plan
        announce = self.announce
        if announce is not None and announce.seq > after and announce.epoch == self.plan.epoch:
            return announce
        return None

    async def poll(self, rank: int, who: dict, after: int, wait_s: float):
        self._seen(rank, who)
        posted = self.posted
        if self._next(after) is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(posted.wait(), wait_s)
        self._seen(rank, who)
        return self._next(after)

    def _seen(self, rank: int, who: dict) -> None:
        known = self.members.get(rank, {})
        outcome = known.get("outcome") if known.get("incarnation") == who["incarnation"] else None
        self.members[rank] = dict(who, seen=time.monotonic(), outcome=outcome)

    def report(self, rank: int, incarnation: str, round: int, error: str | None) -> None:
        """How searcher ``rank``'s part in the driver's round ``round`` ended (None: well)."""
        known = self.members.get(rank)
        if known is not None and known["incarnation"] == incarnation:
            known["outcome"] = (round, error)
            known["seen"] = time.monotonic()

    def status(self) -> dict[int, dict]:
        """searcher rank -> what it last said, with ``age``: seconds since it last did."""
        now = time.monotonic()
        return {rank: dict(info, age=now - info["seen"]) for rank, info in self.members.items()}


# ----------------------------------------------------------------------------- the group


class WeightGroup:
    """One incarnation of the weight group: a torch process group built directly on a
    ``GroupStore`` (the driver's StoreServer, this incarnation's ``secret``), apart from the
    default group (under torchrun the trainer's data-parallel one). vLLM's
    ``StatelessProcessGroup`` would push the bytes through the store, pickled: far too slow for
    hundreds of MB.

    It is formed on a thread of its own, waited for in ``CHECK_S`` slices until ``deadline``
    and given up as soon as ``abandon`` says why (the driver closed the group, a member's
    process is gone, the sender stops); the store's client is then closed, which ends the
    abandoned rendezvous too. A version goes as flat buckets of one size, two in flight
    (``broadcast``): the store's flat tensor in slices on the driver, slices of the staging copy
    on a searcher, so gloo copies nothing; NCCL stages host memory through two buffers on the
    GPU. Every wait has the caller's deadline. gloo's own timeout is the same, so an operation
    left behind ends by itself; gloo binds to ``bind_host`` (the node's address as Ray knows
    it). NCCL's is ``NCCL_TIMEOUT_FACTOR`` times longer, since its watchdog kills the process
    (the trainer's, on the driver) when an operation outlives it: a group given up is aborted
    (``close``) long before (docs/ray.md, "Hang safety")."""

    CHECK_S = 0.25  # how often a wait asks ``abandon``
    NCCL_TIMEOUT_FACTOR = 4

    def __init__(
        self,
        backend: str,
        host: str,
        port: int,
        secret: str,
        epoch: int,
        rank: int,
        world: int,
        timeout_s: float,
        bind_host: str,
        abandon: Callable[[float], str | None] | None = None,
        deadline: float | None = None,
    ):
        self.backend = backend
        self.epoch = epoch
        self.rank = rank
        self.world = world
        self.abandon = abandon  # (the deadline) -> why the round is to be given up, or None
        self.pg = None
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = None
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        built: dict = {}
        done = threading.Event()
        lock = threading.Lock()

        def build() -> None:
            try:
                store = GroupStore(host, port, secret, timeout)
                with lock:
                    built["store"] = store
                    if built.get("abandoned"):
                        store.close()
                        return
                pg = self._process_group(store, rank, world, timeout, bind_host)
            except (RuntimeError, OSError) as exc:  # gloo: "Connect timeout"; the store's
                built["error"] = exc
                done.set()
                return
            with lock:
                if built.get("abandoned"):
                    _let_go([pg], abort=backend == "nccl")  # its destructor runs here
                    return
                built["pg"] = pg
            done.set()

        threading.Thread(target=build, name="tba-group-form", daemon=True).start()
        while not done.wait(min(self.CHECK_S, max(deadline - time.monotonic(), 0.0))):
            why = "the deadline passed" if time.monotonic() > deadline else None
            why = why or (abandon(deadline) if abandon is not None else None)
            if why:
                with lock:
                    built["abandoned"] = True
                    if built.get("store") is not None:
                        built["store"].close()  # the rendezvous it serves fails now
                raise WeightGroupError(f"group {epoch} not formed: {why}")
        if "error" in built:
            if built.get("store") is not None:
                built["store"].close()
            raise WeightGroupError(
                f"group {epoch} not formed within {timeout_s:g}s: {_first_line(built['error'])}"
            )
        self.store = built["store"]
        self.pg = built["pg"]

    def _process_group(self, store, rank: int, world: int, timeout, bind_host: str):
        import torch.distributed as dist

        if self.backend == "gloo":
            # Private options (torch 2.13): the only way to bind gloo to one address.
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            options._threads = 2  # two buckets in flight
            return dist.ProcessGroupGloo(store, rank, world, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout * self.NCCL_TIMEOUT_FACTOR
        pg = dist.ProcessGroupNCCL(store, rank, world, options)
        # The communicator now, on this thread under the formation's deadline, not at the first
        # broadcast (NCCL's blocking init has no timeout of its own).
        pg.eager_connect_single_device(self.device)
        return pg

    def broadcast(self, flat: torch.Tensor, bucket_bytes: int, deadline: float) -> None:
        """Rank 0's ``flat`` (bytes, uint8) into every other rank's ``flat``, in buckets."""
        import torch.distributed as dist

        through_wires = flat.device != self.device  # NCCL, host memory: two GPU buffers
        wires = []
        if through_wires:
            size = min(bucket_bytes, flat.numel())
            wires = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        options = dist.BroadcastOptions()
        options.rootRank = 0
        in_flight: collections.deque = collections.deque()
        for index, start in enumerate(range(0, flat.numel(), bucket_bytes)):
            if len(in_flight) == 2:
                self._landed(in_flight.popleft(), deadline)
            piece = flat[start : start + bucket_bytes]
            wire = piece
            if through_wires:
                wire = wires[index % 2][: piece.numel()]
                if self.rank == 0:
                    wire.copy_(piece)
            in_flight.append((self.pg.broadcast([wire], options), piece, wire))
        while in_flight:
            self._landed(in_flight.popleft(), deadline)

    def _landed(self, item: tuple, deadline: float) -> None:
        work, piece, wire = item
        self.wait(work, deadline)
        if wire is not piece and self.rank > 0:
            piece.copy_(wire)  # before the buffer takes the bucket after next

    def flag(self, value: float, deadline: float, total: bool = False) -> float:
        """Rank 0's ``value`` to every rank, or (``total``) the sum of every rank's."""
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        if total:
            work = self.pg.allreduce([tensor], dist.AllreduceOptions())
        else:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            work = self.pg.broadcast([tensor], options)
        self.wait(work, deadline)
        return tensor.item()

    def wait(self, work, deadline: float) -> None:
        """Wait for ``work`` until ``deadline`` (time.monotonic), asking ``abandon`` every
        ``CHECK_S``: its error, the deadline passed, or the round abandoned (a member's process
        gone, the group closed by the driver) as a WeightGroupError. A peer's death does not
        always fail gloo's operations at once (a blocked send waits for its timeout), hence
        the check."""
        while True:
            now = time.monotonic()
            if now > deadline:
                error = "the deadline passed"
                break
            try:
                if self._waited(work, min(self.CHECK_S, deadline - now)):
                    return
            except RuntimeError as exc:  # gloo: a peer's socket closed, or its own timeout
                error = _first_line(exc)
                break
            error = self.abandon(deadline) if self.abandon is not None else None
            if error:
                break
        raise WeightGroupError(f"group {self.epoch}, rank {self.rank}: {error}")

    def _waited(self, work, seconds: float) -> bool:
        """True once ``work`` is done within ``seconds`` (its error raised), False if not yet.
        gloo's wait(timeout) blocks (a timed-out wait leaves the operation as it was); NCCL's
        does not bound the CPU's wait, so it is polled."""
        if self.backend == "gloo":
            try:
                work.wait(datetime.timedelta(seconds=max(seconds, 0.001)))
                return True
            except RuntimeError:
                if not work.is_completed():
                    return False
            work.wait()  # done meanwhile, or failed: its own outcome (raises its error)
            return True
        until = time.monotonic() + seconds
        while not work.is_completed() and time.monotonic() < until:
            time.sleep(0.001)
        if work.is_completed():
            work.wait()  # raises the operation's error
            return True
        return False

    def close(self, wait_s: float = 0.0) -> None:
        """Let the group go on a thread of its own, waited for up to ``wait_s``: gloo's
        destructor waits for an operation still in flight, which ends by the group's timeout at
        the latest (gloo's abort() ended nothing sooner here, and once left a survivor waiting
        past its own timeout). NCCL's group is aborted first, there, so that no operation
        meets its watchdog. Before a process exits, wait: a group torn down by C++'s static
        destructors after the interpreter can abort the process (OPERATIONS.md)."""
        if self.store is not None:
            self.store.close()
        if self.pg is None:
            return
        held = [self.pg]  # the only reference from here: the thread drops it, not the caller
        self.pg = None
        abort = self.backend == "nccl"
        thread = threading.Thread(
            target=_let_go, args=(held, abort), name="tba-group-close", daemon=True
        )
        thread.start()
        thread.join(wait_s)


def _let_go(held: list, abort: bool = False) -> None:
    if abort:
        held[0].abort()
    held.pop()  # the group's destructor runs here, on this thread


class StoreSnapshot:
    """One consistent copy of a ``engines.WeightStore`` in this process's host memory, read on a
    thread of the driver while the trainer computes on the main one, without waiting for it.

    ``WeightStore.load_into`` suits a reader in another process; here it would cost the trainer
    on a GPU. ``flat.cpu()`` on another thread runs on the legacy default stream, the
    trainer's, so it waits for every kernel the trainer has queued and holds back the ones it
    queues next for the whole copy from pageable memory; and ``load_into`` then synchronises
    the whole device. Here the copy runs on a stream of its own (torch's streams are
    non-blocking: no implicit order with the default stream) into pinned memory, and only that
    stream is waited for. The store's seqlock (``engines.WeightStore``) makes it consistent: a
    publish makes its bytes land before it makes ``seq`` even again, so a copy started on an
    even ``seq`` and ended with ``seq`` unchanged holds one version."""

    def __init__(self, store: WeightStore):
        self.store = store
        self.stream = torch.cuda.Stream(store.flat.device) if store.flat.is_cuda else None
        pinned = store.flat.is_cuda  # a pinned target: the copy is a DMA the stream runs
        self.host = torch.empty(store.flat.shape, dtype=store.flat.dtype, pin_memory=pinned)

    def read(self) -> tuple[int, float, torch.Tensor] | None:
        """(version, probe, the flat weights in host memory), or None when a publish was under
        way or overlapped the copy. The tensor is reused by the next read: copy it first (a
        ``ray.put`` does)."""
        header = self.store.header
        seq = header[WeightStore.SEQ].item()
        if seq % 2:
            return None
        version = int(header[WeightStore.VERSION].item())
        probe = header[WeightStore.PROBE].item()
        if self.stream is None:
            self.host.copy_(self.store.flat)  # shared CPU memory
        else:
            with torch.cuda.stream(self.stream):
                self.host.copy_(self.store.flat, non_blocking=True)
            self.stream.synchronize()
        if header[WeightStore.SEQ].item() != seq:
            return None
        return version, probe, self.host
