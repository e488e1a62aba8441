"""Searchers on other machines, as Ray actors: the same ``searcher.Searcher`` loop and engines,
one actor per GPU, placed by Ray on any node of a running Ray cluster; the trainer process (rank
0 under torchrun) is the Ray driver. ``--ray auto`` (or ``--ray HOST:PORT``) turns it on; every
searcher of the run is then an actor. Ray is imported only then: without the flag no process of
the run imports it (this module imports it inside the functions that use it).

    python run_gsm8k.py --ray auto --num_searchers 12 --searcher_devices cuda   # docs/ray.md

The pieces:

* ``RaySearcherPool`` (the driver, in the trainer process) stands in for ``SearcherPool``
  (``trainer.Parts.pool``), so ``Intake`` and ``run_tba`` use it unchanged. Each ``collect``
  (the intake thread, every ~50 ms) keeps at most ``ray_in_flight`` ``next_batch`` calls per
  actor (the backpressure: no actor runs further ahead of the trainer) and ``ray.wait``s on
  them. A batch is the return value of a call.
* ``SearcherActor`` builds the run's searcher (``Parts.searcher``: a checked one with
  --parity_check) over a WeightSource of the weight path, and runs ``Searcher.next_batch`` for
  each call, on the actor's main thread (a call pushed into an actor would need a concurrency
  group, which moves calls off the main thread: risky for vLLM and CUDA).
* The weights, by one of two paths (``--ray_weights``):

  - ``broadcast`` (the default), the weight group: a torch process group of its own, the
    driver rank 0 and each actor a rank, built on a PrefixStore of a TCPStore the driver
    serves (a fresh prefix for each incarnation of the group), gloo or NCCL
    (``--ray_backend``). Ray carries only control: ``GroupBoard``, an async actor on the
    driver's node, holds the group's plan, the version announced and each member's heartbeat.
    ``GroupSender`` (a thread of the driver) sends each new version from the store itself in
    buckets of one size, two in flight (``WeightGroup``); ``GroupWeightSource`` receives it on
    a thread of the actor into a staging copy while the searcher generates, and the searcher
    loads it between generate calls, so no version is ever half-loaded. Every wait has a
    deadline (``--ray_weights_timeout_s``); a round with a member gone, hung or failed is given
    up, the stragglers killed, the group rebuilt with the survivors, and a restarted actor
    joins at the next round with a full copy (``GroupSender`` says how).
  - ``object_store``: each ``collect`` first notices a newer version in the trainer's
    ``WeightStore`` and ``ray.put``s it once (copied on a CUDA stream of its own, which waits
    for none of the trainer's kernels: ``StoreSnapshot``); ``WeightBoard``, a small actor on
    the driver's node, holds the newest ``(version, probe, [ref])`` (the ref inside a list,
    so Ray hands it over unresolved), and each actor's ``RayWeightSource`` pulls it between
    generate calls (once per node: every actor on a node maps the one copy its node pulled).
    An object is immutable once sealed, and the version and probe travel with its ref.

The broadcast path is the one the field's systems take (OpenRLHF, verl's checkpoint engine,
slime, AReaL): on the loopback cluster Ray's object manager moved a version at a third of a
raw gloo transfer's speed (OPERATIONS.md, "Ray", has both measured side by side).

Faults: an actor whose process or node dies is restarted by Ray (``max_restarts``) on any node
with room; its calls in flight fail with ``ActorUnavailableError`` and are issued again; the
driver counts a restart each time a searcher reports a new incarnation, and fails the run past
``max_searcher_restarts`` (all searchers together, as ``SearcherPool``), naming the searcher
and its node. A searcher that raises is killed and restarted the same way; ``WeightsNotLoaded``
stops the run. Actors are not detached: if the driver dies, Ray ends them (fate sharing). What
ran where (each actor's node, engine and device; the weight path and its seconds per version)
goes to the run summary (``checks.record_ran``).

Security: ``RAY_AUTH_MODE=token`` keeps out whoever lacks the cluster's token; it encrypts
nothing, so the cluster needs a private network (docs/ray.md); the weight group's sockets
(the driver's TCPStore, gloo's pairs) carry no authentication at all. ``connect`` turns a
refusal for want of the token into one clear error within a second.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import socket
import statistics
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from buffer import Trajectory
from engines import WeightStore
from extensions.checks import record_ran
from extensions.cli import run_cli
from plumbing.config import RunError, knob, need
from plumbing.metrics import searcher_metrics
from plumbing.processes import SearcherFailed, WeightsNotLoaded, prompt_shards
from searcher import Batch, Searcher, SearcherSetup
from tba import TBAConfig
from trainer import Parts

# How a version reaches the actors (RayConfig.ray_weights).
BROADCAST = "broadcast"
OBJECT_STORE = "object_store"

REPO_DIR = Path(__file__).resolve().parents[1]
# What a searcher needs of this directory on another node: the code. Ray's upload honours
# .gitignore too (runs/ and the like).
CODE_EXCLUDES = [".git", "runs", "research", "docs", "*.pt", "*.jsonl", "*.png"]


@dataclass
class RayConfig:
    """Searchers as Ray actors (extensions/ray_searchers.py)."""

    ray: str = knob(
        "",
        "a running Ray cluster, HOST:PORT or auto (RAY_ADDRESS, or the cluster this machine "
        "runs): every searcher is then a Ray actor, placed by Ray on any node; empty: searcher "
        "processes on this machine",
    )
    ray_in_flight: int = knob(
        2, "Ray: generate calls in flight per searcher actor (the backpressure; 2 keeps it busy)"
    )
    ray_cpus_per_searcher: float = knob(1.0, "Ray: CPUs each searcher actor asks Ray for")
    ray_resources: str = knob(
        "",
        "Ray: custom resources each searcher actor asks for, NAME=AMOUNT[,NAME=AMOUNT] (offered "
        "by nodes started with `ray start --resources`, e.g. to keep searchers off the head)",
    )
    ray_weights: str = knob(
        BROADCAST,
        "Ray: how a published version reaches the searcher actors: broadcast (a weight group of "
        "its own, the driver rank 0: the bytes in buckets straight to every actor, Ray only for "
        "control) or object_store (ray.put once, each node pulls it)",
    )
    ray_backend: str = knob(
        "gloo",
        "Ray broadcast: the weight group's backend: gloo (host memory, any network; a CUDA "
        "store is copied to host memory first) or nccl (GPU to GPU: the trainer on a GPU, every "
        "searcher on a GPU; not run on a GPU yet, docs/ray.md)",
    )
    ray_bucket_mb: int = knob(
        64, "Ray broadcast: MiB per bucket, two in flight (the memory NCCL stages through)"
    )
    ray_weights_timeout_s: float = knob(
        60.0,
        "Ray broadcast: the deadline of one version's broadcast, the group's rendezvous "
        "included; a searcher that misses it is killed and restarted, and the group is rebuilt "
        "with the others (less than --timeout_s)",
    )

    def __post_init__(self) -> None:
        need(self.ray_in_flight >= 1, f"--ray_in_flight must be >= 1, got {self.ray_in_flight}")
        need(
            self.ray_cpus_per_searcher > 0,
            f"--ray_cpus_per_searcher must be > 0, got {self.ray_cpus_per_searcher}",
        )
        need(
            self.ray_weights in (BROADCAST, OBJECT_STORE),
            f"--ray_weights must be {BROADCAST} or {OBJECT_STORE}, got {self.ray_weights!r}",
        )
        need(
            self.ray_backend in ("gloo", "nccl"),
            f"--ray_backend must be gloo or nccl, got {self.ray_backend!r}",
        )
        need(self.ray_bucket_mb >= 1, f"--ray_bucket_mb must be >= 1, got {self.ray_bucket_mb}")
        need(
            self.ray_weights_timeout_s > 0,
            f"--ray_weights_timeout_s must be > 0, got {self.ray_weights_timeout_s}",
        )
        self.resources()  # a malformed list is an error now, not when actors start

    def resources(self) -> dict[str, float]:
        """``ray_resources`` as Ray's ``resources`` argument."""
        out = {}
        for item in filter(None, (part.strip() for part in self.ray_resources.split(","))):
            name, _, amount = item.partition("=")
            try:
                out[name.strip()] = float(amount)
            except ValueError:
                need(False, f"--ray_resources {self.ray_resources!r}: {item!r} is not NAME=AMOUNT")
        return out


def install(parts: Parts, cfg: RayConfig) -> Parts:
    """``parts`` whose searchers are Ray actors when ``cfg.ray`` names a cluster."""
    if not cfg.ray:
        return parts
    return dataclasses.replace(parts, pool=functools.partial(RaySearcherPool, ray_cfg=cfg))


class NoRayCluster(RunError, ConnectionError):
    """Nothing listens at the --ray address (within ``connect``'s wait), or the cluster never
    offers what the searcher actors ask for."""


class RayClusterRefused(RunError, ConnectionError):
    """The Ray cluster is there but refused this process: it runs with token authentication
    (RAY_AUTH_MODE=token) and this process has no token or the wrong one."""


def _absolute(path: str) -> str:
    """A local directory as an absolute path; a hub name (or empty) as it is."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


# ----------------------------------------------------------------------------- connecting


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def connect(address: str, *, runtime_env: dict | None = None, wait_s: float = 60.0) -> None:
    """``ray.init(address)`` that fails clearly. Ray's own retries 20 times a second apart and
    then raises a bare ``ConnectionError("Failed to connect to Ray cluster at ...")``, the reason
    (``InvalidAuthToken``) only in its log lines; here a GCS that refuses our token is a
    ``RayClusterRefused`` within a second, and an address where nothing listens for ``wait_s``
    (a cluster may still be starting) a NoRayCluster that says so."""
    target = _host_port(address) if address not in ("", "auto") else None
    if target is not None:  # first, before Ray reads its token: the cluster may still be starting
        deadline = time.monotonic() + wait_s
        while True:
            try:
                socket.create_connection(target, timeout=5.0).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise NoRayCluster(
                        f"no Ray cluster at {address} within {wait_s:g}s: {exc} (is `ray start "
                        "--head` running there?)"
                    ) from None
                time.sleep(1.0)
    import ray
    from ray._raylet import GcsClient  # ray.init's own client
    from ray.exceptions import AuthenticationError

    if ray.is_initialized():
        return
    if target is not None and target[0] in ("127.0.0.1", "localhost"):
        keep_loopback()
    if target is not None:
        try:
            _ = GcsClient(address=address).cluster_id
        except AuthenticationError as exc:
            raise RayClusterRefused(_refused_text(address, exc)) from None
    try:
        ray.init(address=address or "auto", runtime_env=runtime_env, log_to_driver=True)
    except ConnectionError as exc:
        cause = f"{exc.__cause__!r}"
        if "InvalidAuthToken" in cause or "AuthenticationError" in cause:
            raise RayClusterRefused(_refused_text(address, exc.__cause__)) from None
        raise


def keep_loopback() -> None:
    """Keep a one-machine cluster on 127.0.0.1. ray.init rewrites a loopback address to this
    machine's own IP (services.resolve_ip_for_localhost -> get_node_ip_address), where a
    cluster bound to 127.0.0.1 is not listening: a 20 s hang, then "Failed to connect". The
    switch Ray offers, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, is read once at `import ray`; this
    sets the constant it feeds (read at each call; a private name, hence the pinned Ray) and
    the variable for child processes."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _refused_text(address: str, exc: BaseException | None) -> str:
    mode = os.environ.get("RAY_AUTH_MODE", "(unset)")
    source = (
        "RAY_AUTH_TOKEN"
        if os.environ.get("RAY_AUTH_TOKEN")
        else os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
    )
    said = str(exc).split(". ")[0] if exc else "?"
    return (
        f"the Ray cluster at {address} refused this process: it requires token authentication "
        f"and our token is missing or wrong (RAY_AUTH_MODE={mode}, token from {source}). Run "
        "with RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or in a file named "
        f"by RAY_AUTH_TOKEN_PATH. Ray said: {said}"
    )


# ----------------------------------------------------------------------------- actor side


class WeightBoard:
    """The newest published version: (version, probe, [ref]); -1 before the first."""

    def __init__(self):
        self.newest: tuple[int, float, list] = (-1, 0.0, [])

    def set(self, version: int, probe: float, refs: list) -> None:
        if version > self.newest[0]:
            self.newest = (version, probe, refs)  # the previous ref is dropped here

    def get(self) -> tuple[int, float, list]:
        return self.newest


class RayWeightSource:
    """searcher.WeightSource over a WeightBoard: what an actor's Searcher loads from.

    ``version()`` asks the board at most every ``cache_s`` (a Searcher polls it every 2 ms while
    it waits for the first publish). ``load_into`` fetches the object (pulled to this node's
    object store, then a read-only zero-copy numpy view), hands ``load_fn`` named views of it
    in the store's layout, and drops the view, so the object can be freed later."""

    def __init__(self, board, layout: list, dtype: torch.dtype, cache_s: float = 0.05):
        self.board = board
        self.layout = layout
        self.dtype = dtype
        self.cache_s = cache_s
        self.newest: tuple[int, float, list] = (-1, 0.0, [])
        self.asked = -1e9

    def _ask(self) -> tuple[int, float, list]:
        import ray

        self.newest = ray.get(self.board.get.remote(), timeout=60)
        self.asked = time.monotonic()
        return self.newest

    def version(self) -> int:
        if time.monotonic() - self.asked > self.cache_s:
            self._ask()
        return self.newest[0]

    def load_into(
        self, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> tuple[int, float]:
        import ray

        version, probe, refs = self._ask()
        if version < 0:
            raise RuntimeError("RayWeightSource.load_into before the first publish")
        array = ray.get(refs[0], timeout=600)
        with warnings.catch_warnings():
            # The view is read-only (the object store's memory); load_fn only copies from it.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(array).view(self.dtype)
        views = []
        for name, offset, shape in self.layout:
            numel = int(torch.Size(shape).numel())
            views.append((name, flat[offset : offset + numel].view(shape)))
        load_fn(views)
        del views, flat, array  # unpin the object
        return version, probe


class SearcherActor:
    """One searcher in a Ray actor. Ray builds it again the same way on a restart (the same
    rank, shard and seed), with a new ``incarnation``, by which the driver counts restarts."""

    def __init__(
        self, make: Callable[[SearcherSetup], Searcher], setup: SearcherSetup, threads: int
    ):
        torch.set_num_threads(threads)
        self.incarnation = uuid.uuid4().hex
        if isinstance(setup.store, GroupWeightSource):  # it joins while the models load
            setup.store.start(setup.rank, self.incarnation)
        self.searcher = make(setup)

    def info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():  # it reads the deprecated ctx.actor_id (Ray 2.60)
            warnings.simplefilter("ignore", DeprecationWarning)
            reconstructed = ctx.was_current_actor_reconstructed
        return {
            "rank": self.searcher.rank,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "reconstructed": reconstructed,
            "engine": type(self.searcher.engine).__name__,
            "device": str(self.searcher.device),
        }

    def next_batch(self) -> tuple[str, Batch]:
        """1a-1c once (``Searcher.next_batch``), with this incarnation's id."""
        return self.incarnation, self.searcher.next_batch()


# ----------------------------------------------------------------------------- the weight group
#
# With --ray_weights broadcast (the default) a version travels in a torch process group of its
# own, the weight group: the driver is rank 0, each searcher actor a rank. Ray carries only
# control (``GroupBoard``); the bytes go over the group's sockets (gloo) or GPU links (NCCL).


class WeightGroupError(RuntimeError):
    """An operation of the weight group failed or missed its deadline: a member died, hung,
    or never joined."""


@dataclass(frozen=True)
class GroupPlan:
    """One incarnation of the weight group (``epoch``), formed in the driver's round ``round``:
    where its rendezvous is (the driver's TCPStore) and who is in it, ``members``: (searcher
    rank, incarnation) -> group rank."""

    seq: int
    round: int
    epoch: int
    host: str
    port: int
    members: dict

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
    announcement reaches it within milliseconds, and the poll itself is its heartbeat."""

    def __init__(self):
        import asyncio

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

    def post_plan(self, round: int, epoch: int, host: str, port: int, members: dict) -> None:
        self.seq += 1
        self.plan = GroupPlan(self.seq, round, epoch, host, port, members)
        self._wake()

    def post_announce(self, round: int, epoch: int, version: int, probe: float) -> None:
        self.seq += 1
        self.announce = Announce(self.seq, round, epoch, version, probe)
        self._wake()

    def _wake(self) -> None:
        import asyncio

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
        import asyncio

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


class WeightGroup:
    """One incarnation of the weight group: a torch process group built directly on a
    PrefixStore (``tba_weights/<epoch>/``) of the driver's TCPStore, apart from the default
    group (under torchrun the trainer's data-parallel one). vLLM's ``StatelessProcessGroup``
    would push the bytes through the store, pickled: far too slow for hundreds of MB.

    A version goes as flat buckets of one size, two in flight (``broadcast``): the store's
    flat tensor in slices on the driver, slices of the staging copy on a searcher, so gloo
    copies nothing; NCCL stages host memory through two buffers on the GPU. Every wait has the
    caller's deadline, and the group's own timeout is the same, so an operation left behind
    ends by itself. ``gloo`` binds to ``bind_host`` (the node's address as Ray knows it)."""

    CHECK_S = 0.25  # how often a wait asks ``abandon``

    def __init__(
        self,
        backend: str,
        host: str,
        port: int,
        epoch: int,
        rank: int,
        world: int,
        timeout_s: float,
        bind_host: str,
        server=None,
        abandon: Callable[[], str | None] | None = None,
    ):
        import torch.distributed as dist

        self.backend = backend
        self.epoch = epoch
        self.rank = rank
        self.world = world
        self.abandon = abandon  # -> why the round is to be given up, or None
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = server or dist.TCPStore(host, port, is_master=False, timeout=timeout)
            prefixed = dist.PrefixStore(f"tba_weights/{epoch}/", store)
            if backend == "gloo":
                # Private options (torch 2.13): the only way to bind gloo to one address.
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
                options._threads = 2  # two buckets in flight
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world, options)
                self.device = torch.device("cpu")
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)
                self.device = torch.device("cuda", torch.cuda.current_device())
        except RuntimeError as exc:  # gloo's rendezvous: "Connect timeout", "Socket Timeout"
            raise WeightGroupError(
                f"group {epoch} not formed within {timeout_s:g}s: {_first_line(exc)}"
            ) from None

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
                self._landed(in_flight.popleft(), flat, deadline)
            piece = flat[start : start + bucket_bytes]
            wire = piece
            if through_wires:
                wire = wires[index % 2][: piece.numel()]
                if self.rank == 0:
                    wire.copy_(piece)
            in_flight.append((self.pg.broadcast([wire], options), piece, wire))
        while in_flight:
            self._landed(in_flight.popleft(), flat, deadline)

    def _landed(self, item: tuple, flat: torch.Tensor, deadline: float) -> None:
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
            error = self.abandon() if self.abandon is not None else None
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
        """Let the group go on a thread of its own, waited for up to ``wait_s``: its destructor
        waits for an operation still in flight, which ends by the group's timeout at the
        latest. (gloo's abort() ended nothing sooner here, and once left a survivor waiting
        past its own timeout.) Before a process exits, wait: a group torn down by C++'s static
        destructors after the interpreter can abort the process (OPERATIONS.md)."""
        if self.pg is None:
            return
        held = [self.pg]  # the only reference from here: the thread drops it, not the caller
        self.pg = None
        thread = threading.Thread(target=_let_go, args=(held,), name="tba-group-close", daemon=True)
        thread.start()
        thread.join(wait_s)


def _let_go(held: list) -> None:
    held.pop()  # the group's destructor runs here, on this thread


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n")[0][:300]


class GroupWeightSource:
    """searcher.WeightSource over the weight group, in a searcher actor. ``start`` runs a thread
    of its own that follows the board (plans, announcements) and receives each version into a
    staging copy of the weights while the searcher generates; ``load_into`` hands the engine
    the newest complete version between generate calls, so no version is ever half-loaded.

    ``version()`` is the newest version complete in the staging copy; while the copy is being
    overwritten, the version the engine already holds (nothing newer to load yet). Names,
    shapes and dtypes (``layout``) travel once, with the actor's construction."""

    POLL_S = 1.0  # the longest poll of the board: a receiver's heartbeat

    def __init__(
        self,
        board,
        layout: list,
        dtype: torch.dtype,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
    ):
        self.board = board
        self.layout = layout
        self.dtype = dtype
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.numel = sum(math.prod(shape) for _, _, shape in layout)
        self.thread: threading.Thread | None = None  # the rest is made in start()

    def start(self, rank: int, incarnation: str) -> None:
        """In the actor's process: the staging copy, and the receiver thread."""
        import ray

        ctx = ray.get_runtime_context()
        self.rank = rank
        self.who = dict(
            incarnation=incarnation,
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
        )
        self.staging = self._new_staging()
        self.cond = threading.Condition()  # held while the engine copies from the staging copy
        self.staged: tuple[int, float] | None = None  # (version, probe) complete in staging
        self.held: tuple[int, float] = (-1, 0.0)  # what load_into last handed the engine
        self.group: WeightGroup | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tba-weight-receiver", daemon=True)
        self.thread.start()

    def version(self) -> int:
        if self.error is not None:
            raise RuntimeError(f"searcher {self.rank}: the weight receiver died") from self.error
        staged = self.staged
        return staged[0] if staged is not None else self.held[0]

    def load_into(
        self, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> tuple[int, float]:
        with self.cond:
            # version() saw a complete version that a new receive has begun to overwrite
            # since: wait for that one (rare; one receive at most).
            got = self.cond.wait_for(
                lambda: self.staged is not None or self.error is not None, self.timeout_s
            )
            if not got or self.error is not None:
                raise TimeoutError(f"searcher {self.rank}: no complete version to load")
            flat = self.staging.view(self.dtype)
            views = []
            for name, offset, shape in self.layout:
                views.append((name, flat[offset : offset + math.prod(shape)].view(shape)))
            load_fn(views)
            self.held = self.staged
            return self.held

    def _run(self) -> None:
        import ray

        after = -1
        try:
            while True:
                poll = self.board.poll.remote(self.rank, self.who, after, self.POLL_S)
                command = ray.get(poll, timeout=self.POLL_S + 60)
                if command is None:
                    continue
                after = command.seq
                if isinstance(command, GroupPlan):
                    error = self._join(command)
                elif self.group is not None and self.group.epoch == command.epoch:
                    error = self._receive(command)
                else:
                    continue
                if error is not False:  # False: not a member of this plan
                    self.board.report.remote(
                        self.rank, self.who["incarnation"], command.round, error
                    )
        except BaseException as exc:  # noqa: BLE001 (raised on the searcher's thread)
            self.error = exc
            with self.cond:
                self.cond.notify_all()

    def _join(self, plan: GroupPlan) -> str | bool | None:
        """Leave the old group; join ``plan``'s if it names this incarnation. The error, None
        when joined, False when not a member."""
        if self.group is not None:
            self.group.close()
            self.group = None
        group_rank = plan.members.get((self.rank, self.who["incarnation"]))
        if group_rank is None:
            return False
        try:
            self.group = WeightGroup(
                self.backend,
                plan.host,
                plan.port,
                plan.epoch,
                group_rank,
                plan.world,
                self.timeout_s,
                self.who["node_ip"],
                abandon=functools.partial(self._closed, plan.epoch),
            )
        except WeightGroupError as exc:
            return str(exc)
        return None

    def _receive(self, announce: Announce) -> str | None:
        """The announced version into the staging copy; then, if the driver says its bytes
        were one version (``flag``), it is the newest complete one. The error, or None."""
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            self.staged = None  # waits for a load in progress; from here it is being written
        try:
            self.group.broadcast(self.staging, self.bucket_bytes, deadline)
            if self.group.flag(0.0, deadline) == 1.0:
                with self.cond:
                    self.staged = (announce.version, announce.probe)
                    self.cond.notify_all()
            self.group.flag(1.0, deadline, total=True)  # tell the driver it arrived
        except WeightGroupError as exc:
            self.group.close()
            self.group = None
            # An operation given up may still write into the old copy: receive into a new one.
            with self.cond:
                self.staging = self._new_staging()
            return str(exc)
        return None

    def _new_staging(self) -> torch.Tensor:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        pinned = self.backend == "nccl"  # the GPU buffers' copies to and from it are DMA
        return torch.empty(self.numel * itemsize, dtype=torch.uint8, pin_memory=pinned)

    def _closed(self, epoch: int) -> str | None:
        """The driver gave group ``epoch`` up (WeightGroup's ``abandon``)."""
        import ray

        if ray.get(self.board.is_closed.remote(epoch), timeout=60):
            return "the driver closed the group"
        return None


class GroupSender:
    """The driver's side of the weight group, on a thread of its own: it never waits for the
    trainer, and the intake thread never waits for it. Each round:

    1. Membership: the searchers whose receivers polled the board lately, less those killed as
       stragglers. When it differs from the group's (a searcher restarted, or one is gone),
       a new incarnation of the group is formed: a fresh prefix of the TCPStore, the plan on
       the board, the rendezvous under the deadline.
    2. The newest version the store holds, if the group lacks it (all of it: a searcher
       that just joined gets a full copy): announced on the board, broadcast in buckets from
       the store itself (a CUDA store over gloo: from a host snapshot, ``StoreSnapshot``),
       then a flag saying whether the store's seqlock stayed put meanwhile (else the bytes
       may mix two versions, and the receivers drop them), then a sum that tells the driver
       every member has it. While it waits, the driver asks Ray every quarter second whether
       each member's process is still the one it runs, and gives the round up if not.
    3. On an error, a member gone or the deadline (``timeout_s``): the group is closed on
       the board, and its other members give their part up within a quarter second (they
       ask too); a member that says how its part ended is a survivor, one whose process Ray
       no longer runs is gone (Ray restarts it); one that says nothing by the deadline is a
       straggler, handed to ``kill`` (Ray restarts it, and it joins at a later round).
       ``MAX_FAILED_ROUNDS`` failures in a row stop the run (``error``, raised by the pool).

    "Alive", before a round: polled the board within ``POLL_S`` + 2 s, and its process is the
    one Ray runs for that searcher now (``pids``: searcher rank -> the pid of its live actor,
    from Ray's actor table), so that a rendezvous never waits for a process already dead."""

    MAX_FAILED_ROUNDS = 3
    BOARD_EVERY_S = 0.25  # how often membership is read from the board

    def __init__(
        self,
        store: WeightStore,
        board,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
        host: str,
        pids: Callable[[], dict[int, int]],
        kill: Callable[[int, dict, str], None],
        log: Callable[[str], None] = print,
    ):
        import torch.distributed as dist

        self.store = store
        self.board = board
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host
        self.pids = pids
        self.kill = kill
        self.log = log
        timeout = datetime.timedelta(seconds=timeout_s)
        # Port 0: the OS picks a free one; the plans carry it to the members.
        self.server = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        self.snapshot = StoreSnapshot(store) if store.flat.is_cuda and backend == "gloo" else None
        self.stream = torch.cuda.Stream(store.flat.device) if store.flat.is_cuda else None
        self.epoch = 0
        self.round = 0  # the rounds that did something
        self.sending: int | None = None  # the version of the round under way
        self.group: WeightGroup | None = None
        self.members: dict[int, dict] = {}  # searcher rank -> what the board said, in the group
        self.sent = -1  # the version every member of the group holds
        self.status: dict[int, dict] = {}
        self.status_at = 0.0
        self.checked: dict | None = None  # the status self.running was read for
        self.running: dict[int, int] = {}
        self.killed: set[str] = set()  # incarnations killed as stragglers
        self.failed_rounds = 0  # in a row
        self.rebuilds = 0
        self.seconds: list[float] = []  # per version: announced until every member had it
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tba-weight-sender", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.group is not None:
            self.group.close(wait_s=timeout)

    def _run(self) -> None:
        try:
            if self.stream is not None:  # NCCL and the snapshot: none of the trainer's waits
                torch.cuda.set_device(self.store.flat.device)
            while not self.stopping.is_set():
                self._round()
        except BaseException as exc:  # noqa: BLE001 (raised by the pool's collect)
            self.error = exc

    def _read_board(self, force: bool = False) -> dict[int, dict]:
        import ray

        if force or time.monotonic() - self.status_at > self.BOARD_EVERY_S:
            self.status = ray.get(self.board.status.remote(), timeout=60)
            self.status_at = time.monotonic()
        return self.status

    def _alive(self) -> dict[int, dict]:
        fresh = GroupWeightSource.POLL_S + 2.0
        status = self._read_board()
        if status is not self.checked:  # Ray's view of the processes, with each new status
            self.checked = status
            self.running = self.pids()
        return {
            rank: info
            for rank, info in status.items()
            if info["age"] < fresh
            and info["incarnation"] not in self.killed
            and self.running.get(rank) == info["pid"]
        }

    def _round(self) -> None:
        members = self._alive()
        same = {r: m["incarnation"] for r, m in members.items()} == {
            r: m["incarnation"] for r, m in self.members.items()
        }
        if self.store.version() < 0 or not members or (same and self.store.version() <= self.sent):
            self.stopping.wait(0.002)
            return
        deadline = time.monotonic() + self.timeout_s
        self.round += 1
        try:
            if not same or self.group is None:
                self._form(members)
            with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
                self._send(deadline)
            self.failed_rounds = 0
        except WeightGroupError as exc:
            self._failed(exc, deadline)
        finally:
            self.sending = None

    def _form(self, members: dict[int, dict]) -> None:
        import ray

        if self.group is not None:
            self.group.close()
            self.group = None
        self.epoch += 1
        self.members = members
        self.sent = -1
        ranks = {(r, m["incarnation"]): i + 1 for i, (r, m) in enumerate(sorted(members.items()))}
        ray.get(
            self.board.post_plan.remote(self.round, self.epoch, self.host, self.server.port, ranks),
            timeout=60,
        )
        self.group = WeightGroup(
            self.backend,
            self.host,
            self.server.port,
            self.epoch,
            0,
            1 + len(ranks),
            self.timeout_s,
            self.host,
            server=self.server,
            abandon=self._member_gone,
        )
        self.rebuilds += 1

    def _send(self, deadline: float) -> None:
        header = self.store.header
        seq = header[WeightStore.SEQ].item()
        if seq % 2:
            return  # a publish is under way: the next round sends it
        if self.snapshot is not None:
            read = self.snapshot.read()
            if read is None:
                return
            version, probe, flat = read
        else:
            version = int(header[WeightStore.VERSION].item())
            probe = header[WeightStore.PROBE].item()
            flat = self.store.flat
        t0 = time.perf_counter()
        self.sending = version
        self.board.post_announce.remote(self.round, self.epoch, version, probe)
        self.group.broadcast(flat.view(-1).view(torch.uint8), self.bucket_bytes, deadline)
        whole = self.snapshot is not None or header[WeightStore.SEQ].item() == seq
        self.group.flag(1.0 if whole else 0.0, deadline)
        arrived = self.group.flag(0.0, deadline, total=True)
        if arrived != len(self.members):
            raise WeightGroupError(f"{arrived:g} of {len(self.members)} members confirmed")
        if whole:
            self.sent = version
            self.seconds.append(time.perf_counter() - t0)

    def _member_gone(self) -> str | None:
        """A member whose process Ray no longer runs (WeightGroup's ``abandon``)."""
        running = self.pids()
        gone = [rank for rank, m in self.members.items() if running.get(rank) != m["pid"]]
        return f"the process of searcher(s) {gone} is gone" if gone else None

    def _failed(self, error: WeightGroupError, deadline: float) -> None:
        """Close the group (its members give their part up), sort its members into
        survivors, the gone and stragglers (killed), and say so."""
        import ray

        if self.group is not None:
            self.group.close()
            self.group = None
        ray.get(self.board.post_closed.remote(self.epoch), timeout=60)
        members, self.members = self.members, {}
        epoch = self.epoch
        round = self.round
        failed_at = time.monotonic()
        quiet = dict(members)
        gone = []
        # A survivor's part ends soon after the group closes (its peer's socket is gone), or
        # by the group's own timeout at the latest, and it reports within moments.
        while quiet and time.monotonic() < deadline + 2.0:
            status = self._read_board(force=True)
            running = self.pids()
            for rank in list(quiet):
                now = status.get(rank, quiet[rank])
                if running.get(rank) != quiet[rank]["pid"]:
                    gone.append(rank)  # Ray restarts it
                    del quiet[rank]
                    continue
                reported = now["outcome"] is not None and now["outcome"][0] == round
                restarted = now["incarnation"] != quiet[rank]["incarnation"]
                polled = now["age"] < time.monotonic() - failed_at
                if reported or restarted or polled:
                    del quiet[rank]
            if quiet:
                self.stopping.wait(0.05)
        for rank, info in quiet.items():
            self.killed.add(info["incarnation"])
            self.kill(rank, info, f"missed the weight group's deadline ({error})")
        self.failed_rounds += 1
        survivors = sorted(set(members) - set(quiet) - set(gone))
        self.log(
            f"weight group {epoch} failed ({error}); searchers whose process is gone: "
            f"{sorted(gone)}, killed: {sorted(quiet)}; rebuilding it with {survivors}"
        )
        if self.failed_rounds >= self.MAX_FAILED_ROUNDS:
            raise SearcherFailed(
                f"the weight group failed {self.failed_rounds} rounds in a row; the last: {error}"
            )

    def describe(self) -> dict:
        """The path and its seconds per version (median), for the run summary."""
        out = {
            "path": f"broadcast ({self.backend}, buckets of {self.bucket_bytes >> 20} MiB)",
            "versions_sent": len(self.seconds),
            "group_rebuilds": self.rebuilds,
        }
        if self.seconds:
            out["seconds_per_version"] = statistics.median(self.seconds)
        return out


@contextlib.contextmanager
def _nothing():
    yield


# ----------------------------------------------------------------------------- driver side


@dataclasses.dataclass
class CallResult:
    """What one call of ``next_batch`` gave: a batch, or the error the call raised."""

    rank: int
    incarnation: str | None = None
    batch: Batch | None = None
    error: BaseException | None = None


class StoreSnapshot:
    """One consistent copy of a ``engines.WeightStore`` in this process's host memory, read on the
    intake thread while the trainer computes on the main one, without waiting for it.

    ``WeightStore.load_into`` suits a reader in another process; here it would cost the trainer
    on a GPU. ``flat.cpu()`` on the intake thread runs on the legacy default stream, the
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


class RaySearcherPool:
    """``SearcherPool``'s interface over searcher actors on a Ray cluster (the module docstring
    says how): ``start``, ``wait_ready``, ``collect`` (the intake thread), ``metrics`` (the main
    thread; a lock keeps the two apart), ``stop``; and ``describe``, what ran where. When
    ``start`` connects, this repository is the job's working directory, uploaded to every node
    (model paths must exist there). Weights go by the weight group (``GroupSender``, on a
    thread of its own) or, with --ray_weights object_store, by ``ray.put`` in ``collect``."""

    def __init__(
        self,
        cfg: TBAConfig,
        examples: list[dict],
        reward_fn: Callable,
        store,
        make: Callable[[SearcherSetup], Searcher] = Searcher,
        log: Callable[[str], None] = print,
        *,
        ray_cfg: RayConfig,
    ):
        self.cfg = cfg
        self.store = store
        self.make = make
        self.log = log
        self.ray_cfg = ray_cfg
        need(
            ray_cfg.ray_weights != BROADCAST or ray_cfg.ray_weights_timeout_s < cfg.timeout_s,
            f"--ray_weights_timeout_s {ray_cfg.ray_weights_timeout_s:g} must be less than "
            f"--timeout_s {cfg.timeout_s:g}: a broken weight group is rebuilt before the run's "
            "own waits give up",
        )
        on_gpu = cfg.searcher_device_list()[0].startswith("cuda")
        need(
            ray_cfg.ray_weights != BROADCAST or ray_cfg.ray_backend != "nccl" or on_gpu,
            "--ray_backend nccl needs the searchers on GPUs (--searcher_devices cuda)",
        )
        self.num_gpus = 1.0 if on_gpu else 0.0
        # Each actor sees its own GPU as cuda:0 (Ray sets CUDA_VISIBLE_DEVICES), or the CPU; it
        # runs in Ray's copy of this directory, so a local model path goes as an absolute one
        # (which must exist on every node: a hub name is downloaded by each).
        actor_cfg = dataclasses.replace(
            cfg,
            searcher_devices="cuda:0" if on_gpu else "cpu",
            model=_absolute(cfg.model),
            ref_model=_absolute(cfg.ref_model),
        )
        shards = prompt_shards(examples, cfg.num_searchers)
        self.setups = [
            SearcherSetup(
                rank=rank,
                cfg=actor_cfg,
                examples=shards[rank],
                reward_fn=reward_fn,
                store=None,  # a RayWeightSource, made in start() when the board exists
                out_queue=None,  # batches are the calls' return values
                stop_event=None,  # the driver ends the actor
            )
            for rank in range(cfg.num_searchers)
        ]
        self.lock = threading.Lock()
        self.connected_here = False
        self.board = None
        self.sender: GroupSender | None = None
        self.broadcast_seen = 0  # of sender.seconds, already in a metrics row
        self.nodes: dict[int, dict] = {}  # rank -> info() of its newest incarnation seen
        self.actors: list = []
        self.pending: dict = {}  # ObjectRef of a next_batch call -> rank
        self.incarnations: dict[int, str] = {}  # rank -> the newest incarnation seen
        self.ready_ranks: set[int] = set()
        self.restarts = 0  # all searchers together, as SearcherPool counts them
        self.call_errors = 0  # calls lost to an actor's death (issued again)
        self.put_version = -1
        self.put_ref = None
        self.put_probe = 0.0
        self.put_s: list[float] = []
        self.put_all: list[float] = []  # every put's seconds, for describe()
        self.put_count = 0
        self.snapshot: StoreSnapshot | None = None  # made on the intake thread, where it reads
        self.board_set_at = 0.0
        self.arrived: list = []  # BatchStats since the last metrics()
        self.latest: dict = {}  # rank -> BatchStats of its newest batch

    # --- start-up

    def start(self) -> None:
        """Connect (unless connected), place the board on this node, start the actors."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            runtime_env = {"working_dir": str(REPO_DIR), "excludes": CODE_EXCLUDES}
            connect(self.ray_cfg.ray, runtime_env=runtime_env)
            self.connected_here = True
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
        layout = list(self.store.layout)
        if self.ray_cfg.ray_weights == BROADCAST:
            # The board's state is the group's: if it dies, the sender's next call raises.
            self.board = (
                ray.remote(GroupBoard).options(num_cpus=0, scheduling_strategy=here).remote()
            )
            bucket = self.ray_cfg.ray_bucket_mb << 20
            self.sender = GroupSender(
                self.store,
                self.board,
                self.ray_cfg.ray_backend,
                bucket,
                self.ray_cfg.ray_weights_timeout_s,
                ray.util.get_node_ip_address(),
                pids=self._pids,
                kill=self._kill_straggler,
                log=self.log,
            )
            self.sender.start()

            def source():
                return GroupWeightSource(
                    self.board,
                    layout,
                    self.store.flat.dtype,
                    self.ray_cfg.ray_backend,
                    bucket,
                    self.ray_cfg.ray_weights_timeout_s,
                )
        else:
            self.board = (
                ray.remote(WeightBoard)
                .options(
                    num_cpus=0,
                    max_restarts=-1,  # empty after a restart: collect sets it again each second
                    scheduling_strategy=here,
                )
                .remote()
            )

            def source():
                return RayWeightSource(self.board, layout, self.store.flat.dtype)

        actor_class = ray.remote(SearcherActor)
        # torch threads: the CPUs each actor asked Ray for (cfg's share of this machine's cores
        # means nothing on another node).
        threads = self.cfg.torch_threads or max(1, int(self.ray_cfg.ray_cpus_per_searcher))
        for setup in self.setups:
            setup.store = source()
            actor = actor_class.options(
                num_cpus=self.ray_cfg.ray_cpus_per_searcher,
                num_gpus=self.num_gpus,
                resources=self.ray_cfg.resources(),
                max_restarts=self.cfg.max_searcher_restarts,
                max_task_retries=0,  # a lost call raises; collect issues it again
            ).remote(self.make, setup, threads)
            self.actors.append(actor)

    def wait_ready(self) -> None:
        """Wait until every actor is built (engine and reference model loaded)."""
        import ray
        from ray.exceptions import RayError

        refs = {actor.info.remote(): rank for rank, actor in enumerate(self.actors)}
        deadline = time.monotonic() + self.cfg.timeout_s
        while refs:
            left = deadline - time.monotonic()
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, left))
            for ref in done:
                rank = refs.pop(ref)
                try:
                    info = ray.get(ref)
                except RayError as exc:
                    raise SearcherFailed(f"{self.where_is(rank)} failed to start:\n{exc}") from exc
                self._seen(rank, info["incarnation"])
                self.nodes[rank] = info
                self.ready_ranks.add(rank)
            if refs and time.monotonic() > deadline:
                raise NoRayCluster(
                    f"searcher actor(s) {sorted(refs.values())} not ready within "
                    f"{self.cfg.timeout_s}s: does the cluster have a node with "
                    f"{self.num_gpus:g} GPU(s) and {self.ray_cfg.ray_cpus_per_searcher:g} "
                    "CPU(s) free for each? (`ray status`)"
                )

    # --- the intake thread

    def collect(self, timeout: float = 0.0) -> list[Trajectory]:
        """The trajectories of the calls that finished (after up to ``timeout`` s for the
        first), with a newer version put first and every actor topped up with calls; restarts
        counted, failures raised (SearcherFailed)."""
        results = self._drain(timeout)  # waits without holding the lock
        with self.lock:
            return self._handle(results)

    def _drain(self, timeout: float) -> list[CallResult]:
        import ray
        from ray.exceptions import RayError

        if self.sender is None:
            self._publish_newest()
        elif self.sender.error is not None:
            error = self.sender.error
            if isinstance(error, SearcherFailed):
                raise error
            raise SearcherFailed(f"the weight group's sender failed: {error!r}") from error
        busy = dict.fromkeys(range(len(self.actors)), 0)
        for rank in self.pending.values():
            busy[rank] += 1
        for rank, count in busy.items():
            for _ in range(self.ray_cfg.ray_in_flight - count):
                self.pending[self.actors[rank].next_batch.remote()] = rank
        done, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        if done:
            done, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        results = []
        for ref in done:
            rank = self.pending.pop(ref)
            try:
                incarnation, batch = ray.get(ref)
                results.append(CallResult(rank, incarnation=incarnation, batch=batch))
            except RayError as exc:
                results.append(CallResult(rank, error=exc))
        return results

    def _handle(self, results: list[CallResult]) -> list[Trajectory]:
        trajectories: list[Trajectory] = []
        for result in results:
            if result.error is not None:
                self._call_failed(result.rank, result.error)
                continue
            self._seen(result.rank, result.incarnation)
            stats = result.batch.stats
            trajectories += result.batch.trajectories
            self.arrived.append(stats)
            self.latest[result.rank] = stats
        return trajectories

    def _publish_newest(self) -> None:
        """ray.put the store's newest version once, and tell the board (again every second:
        a restarted board has forgotten it)."""
        import ray

        if self.store.version() > self.put_version:
            t0 = time.perf_counter()
            if self.snapshot is None:
                self.snapshot = StoreSnapshot(self.store)
            read = self.snapshot.read()
            if read is not None:  # else a publish overlapped: the next collect reads again
                version, probe, flat = read
                ref = ray.put(flat.view(torch.uint8).numpy())  # bf16: as bytes
                self.put_s.append(time.perf_counter() - t0)
                self.put_all.append(self.put_s[-1])
                self.put_count += 1
                self.put_version, self.put_probe, self.put_ref = version, probe, ref
                self.board_set_at = 0.0
        if self.put_ref is not None and time.monotonic() - self.board_set_at > 1.0:
            self.board.set.remote(self.put_version, self.put_probe, [self.put_ref])
            self.board_set_at = time.monotonic()

    def _seen(self, rank: int, incarnation: str) -> None:
        """Count a restart when ``rank`` reports a new incarnation."""
        known = self.incarnations.get(rank)
        self.incarnations[rank] = incarnation
        if known is None or known == incarnation:
            return
        self.restarts += 1
        limit = self.cfg.max_searcher_restarts
        self.log(f"{self.where_is(rank)} is back (restart {self.restarts}/{limit})")
        if self.restarts > limit:
            raise SearcherFailed(
                f"{self.where_is(rank)} restarted; {self.restarts} restarts of {limit}"
            )

    def _call_failed(self, rank: int, error: BaseException) -> None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        limit = self.cfg.max_searcher_restarts
        if isinstance(error, ActorDiedError):  # Ray will not restart it: max_restarts used
            raise SearcherFailed(
                f"{self.where_is(rank)} died and Ray will not restart it ({self.restarts} restarts "
                f"used of {limit}):\n{error}"
            )
        if isinstance(error, RayActorError):  # ActorUnavailableError: restarting; issued again
            self.call_errors += 1
            return
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, WeightsNotLoaded):
            raise SearcherFailed(f"{self.where_is(rank)}: its weights did not arrive:\n{error}")
        if self.restarts >= limit:
            raise SearcherFailed(
                f"{self.where_is(rank)} raised; {self.restarts} restarts used of {limit}:\n{error}"
            )
        self.log(f"{self.where_is(rank)} raised; restarting it:\n{error}")
        ray.kill(self.actors[rank], no_restart=False)  # Ray restarts it: a new incarnation

    # --- the main thread

    def metrics(self) -> dict[str, float]:
        """SearcherPool's metrics, plus calls in flight, calls lost to actor deaths, and the
        seconds of each version's broadcast (announced until every member had it) and the
        weight group's rebuilds, or of each ray.put of a version."""
        with self.lock:
            arrived, self.arrived = self.arrived, []
            put_s, self.put_s = self.put_s, []
            out = {
                "async/batches_in": float(len(arrived)),
                "async/searcher_restarts": float(self.restarts),
                "async/in_flight": float(len(self.pending)),
                "async/searcher_call_errors": float(self.call_errors),
            }
            if put_s:
                out["time/ray_put"] = statistics.fmean(put_s)
            if self.sender is not None:
                sent = self.sender.seconds[self.broadcast_seen :]
                self.broadcast_seen += len(sent)
                if sent:
                    out["time/ray_broadcast"] = statistics.fmean(sent)
                out["async/weight_group_rebuilds"] = float(self.sender.rebuilds)
                out["async/weight_group_size"] = float(len(self.sender.members))
            out.update(searcher_metrics(arrived, self.latest))
            return out

    def _actor_records(self) -> dict[int, dict]:
        """rank -> Ray's record of its actor now (state, pid, node), from the GCS: no call
        into the actor. A private name (ray._private.state), hence the pinned Ray."""
        from ray._private.state import state

        records = {}
        for rank, actor in enumerate(self.actors):
            records[rank] = state.actor_table(actor._actor_id.hex()) or {}
        return records

    def _pids(self) -> dict[int, int]:
        """rank -> the pid of its actor, where Ray runs it now (state ALIVE)."""
        return {
            rank: record["Pid"]
            for rank, record in self._actor_records().items()
            if record.get("State") == "ALIVE"
        }

    def where_is(self, rank: int) -> str:
        """'searcher R on node IP (NODE_ID)', from Ray's record of its actor."""
        address = self._actor_records().get(rank, {}).get("Address", {})
        node = address.get("NodeID", "?")
        return f"searcher {rank} on node {address.get('IPAddress', '?')} ({node[:12]})"

    def _kill_straggler(self, rank: int, info: dict, why: str) -> None:
        """The weight group's straggler: kill its process if Ray still runs that one (a
        process already gone is Ray's to restart), counted as a restart when it is back; with
        no restart left, stop the run (SearcherFailed, raised by ``collect``)."""
        import ray

        where = f"searcher {rank} on node {info['node_ip']} ({info['node_id'][:12]})"
        limit = self.cfg.max_searcher_restarts
        if self.restarts >= limit:
            raise SearcherFailed(
                f"{where} {why}; no restart left ({self.restarts} used of {limit})"
            )
        if self._pids().get(rank) != info["pid"]:
            self.log(f"{where} {why}; its process is gone, Ray restarts it")
            return
        self.log(f"{where} {why}; killed, Ray restarts it")
        ray.kill(self.actors[rank], no_restart=False)

    def describe(self) -> dict:
        """What ran: each searcher's node, engine and device, and the weight path with its
        seconds per version (the run summary's ``ran``)."""
        records = self._actor_records()
        searchers = {}
        for rank in range(len(self.actors)):
            info = self.nodes.get(rank, {})
            address = records.get(rank, {}).get("Address", {})
            searchers[str(rank)] = {
                "node": address.get("IPAddress", info.get("node_ip")),
                "node_id": address.get("NodeID", info.get("node_id")),
                "engine": info.get("engine"),
                "device": info.get("device"),
                "ray_actor": True,
            }
        if self.sender is not None:
            weights = self.sender.describe()
        else:
            weights = {"path": "Ray object store (ray.put, a pull per node)"}
            weights["versions_sent"] = self.put_count
            if self.put_all:
                weights["put_seconds_per_version"] = statistics.median(self.put_all)
        return {"searchers": searchers, "weights": weights}

    def where(self, timeout: float = 30.0) -> dict[int, dict]:
        """rank -> info() of each actor now (pid, node, incarnation): for tests and logs."""
        import ray
        from ray.exceptions import GetTimeoutError

        refs = [actor.info.remote() for actor in self.actors]
        with contextlib.suppress(GetTimeoutError):
            return dict(enumerate(ray.get(refs, timeout=timeout)))
        return {}

    def stop(self, timeout: float = 10.0) -> None:
        """Kill the actors and the board (no restart) and drop the version; disconnect if
        ``start`` connected. Actors die with the driver anyway (they are not detached)."""
        import ray
        from ray.exceptions import RayError

        if not ray.is_initialized():
            return
        if self.sender is not None:
            self.sender.stop(timeout)
        with contextlib.suppress(RayError):
            record_ran(self.cfg.output_dir, self.describe())
        for actor in [*self.actors, self.board]:
            if actor is not None:
                with contextlib.suppress(RayError):
                    ray.kill(actor, no_restart=True)
        self.pending.clear()
        self.put_ref = None
        if self.connected_here:
            ray.shutdown()


# ----------------------------------------------------------------------------- one machine


def local_cluster(
    workers: int, cpus: int, token_file: str, gpus: int = 0, port: int = 6390
) -> None:
    """A Ray cluster of a head and ``workers`` worker nodes on this machine, every address
    127.0.0.1 (the head at ``port``), token authentication on (the token written to
    ``token_file``, mode 600), until Ctrl-C or SIGTERM; prints the address. Each worker node
    offers a ``searcher`` resource per CPU, so ``--ray_resources searcher=1`` puts searchers
    on the worker nodes, not beside the trainer. Why not ``ray start`` twice: its worker start
    rewrites a loopback address to the machine's own IP, and the switch that stops that makes
    it refuse to start a worker node (``keep_loopback``). Drivers need RAY_AUTH_MODE=token and
    RAY_AUTH_TOKEN_PATH=``token_file``."""
    import secrets
    import signal

    from ray._raylet import AuthenticationTokenLoader, Config
    from ray.cluster_utils import Cluster

    keep_loopback()  # its processes inherit the switch
    path = Path(token_file)
    if not path.exists():
        path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path.resolve()))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    # Ray read the mode and token when it was imported: read them again, or this process's own
    # client (the Cluster's) is refused by the GCS it just started.
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    node = dict(num_cpus=cpus, num_gpus=gpus, node_ip_address="127.0.0.1")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(node, gcs_server_port=port, include_dashboard=False, no_monitor=True),
    )
    for _ in range(workers):
        cluster.add_node(**node, resources={"searcher": cpus})
    cluster.wait_for_nodes()
    print(f"Ray cluster of {workers + 1} nodes at {cluster.address} (token: {path})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        cluster.shutdown()
        print("Ray cluster stopped", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=local_cluster.__doc__.split(". ")[0])
    parser.add_argument("--workers", type=int, default=1, help="worker nodes beside the head")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs per node")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    parser.add_argument("--port", type=int, default=6390, help="the head's port on 127.0.0.1")
    parser.add_argument("--token_file", default="/tmp/tba_ray_token")

    def main(argv: list[str]) -> None:
        args = parser.parse_args(argv)
        local_cluster(args.workers, args.cpus, args.token_file, args.gpus, args.port)

    sys.exit(run_cli(main))
