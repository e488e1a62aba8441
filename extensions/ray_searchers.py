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

  - ``broadcast`` (the default), the weight group (extensions/weight_group.py and
    weight_rounds.py): a torch process group of its own, the driver rank 0 and each actor a
    rank, gloo or NCCL (``--ray_backend``), formed on a store the driver serves on the group's
    address for the holders of each incarnation's secret alone (extensions/group_store.py).
    Ray carries only control (``GroupBoard``). ``GroupSender`` (a thread of the driver) sends
    each new version from the store itself in buckets; ``GroupWeightSource`` receives it on a
    thread of the actor into a staging copy while the searcher generates, and the searcher
    loads it between generate calls, so no version is ever half-loaded. Every wait has a
    deadline (``--ray_weights_timeout_s``); a round with a member gone, hung or failed is given
    up, the stragglers killed, the group rebuilt with the survivors, and a restarted actor
    joins at the next round with a full copy.
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

Connecting, the token and the loopback cluster are extensions/ray_cluster.py's. Security
(docs/ray.md): ``RAY_AUTH_MODE=token`` keeps out whoever lacks the cluster's token, and a
cluster off loopback without it is refused unless --ray_allow_unauthenticated; neither encrypts
anything, so the cluster needs a private network.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from buffer import Trajectory
from extensions.checks import record_ran
from extensions.ray_cluster import NoRayCluster, connect, is_loopback
from extensions.weight_group import GroupBoard, StoreSnapshot, ask
from extensions.weight_rounds import GroupSender, GroupWeightSource
from plumbing.config import check_bounds, knob, need
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
        2,
        "Ray: generate calls in flight per searcher actor (the backpressure; 2 keeps it busy)",
        at_least=1,
    )
    ray_cpus_per_searcher: float = knob(1.0, "Ray: CPUs each searcher actor asks Ray for", above=0)
    ray_resources: str = knob(
        "",
        "Ray: custom resources each searcher actor asks for, NAME=AMOUNT[,NAME=AMOUNT] (offered "
        "by nodes started with `ray start --resources`, e.g. to keep searchers off the head)",
    )
    ray_allow_unauthenticated: bool = knob(
        False,
        "Ray: accept a cluster off loopback that admits clients without a token (no "
        "RAY_AUTH_MODE=token): whoever reaches its ports then runs code on every node, this one "
        "included; without this flag such a cluster is refused (docs/ray.md, Security)",
    )
    ray_weights: str = knob(
        BROADCAST,
        "Ray: how a published version reaches the searcher actors: broadcast (a weight group of "
        "its own, the driver rank 0: the bytes in buckets straight to every actor, Ray only for "
        "control) or object_store (ray.put once, each node pulls it)",
        choices=(BROADCAST, OBJECT_STORE),
    )
    ray_backend: str = knob(
        "gloo",
        "Ray broadcast: the weight group's backend: gloo (host memory, any network; a CUDA "
        "store is copied to host memory first) or nccl (GPU to GPU: the trainer on a GPU, every "
        "searcher on a GPU; not run on a GPU yet, docs/ray.md)",
        choices=("gloo", "nccl"),
    )
    ray_nccl_any_interface: bool = knob(
        False,
        "Ray broadcast with --ray_backend nccl off loopback: accept that NCCL's own sockets "
        "listen on the interfaces NCCL picks (NCCL_SOCKET_IFNAME), not only the group's "
        "address, with no authentication of their own; without this flag such a group is "
        "refused (docs/ray.md, Security)",
    )
    ray_bucket_mb: int = knob(
        64,
        "Ray broadcast: MiB per bucket, two in flight (the memory NCCL stages through)",
        at_least=1,
    )
    ray_weights_timeout_s: float = knob(
        60.0,
        "Ray broadcast: the deadline of one version's broadcast, the group's rendezvous and "
        "every call to Ray it makes included; a searcher that misses it is killed and "
        "restarted, and the group is rebuilt with the others (less than --timeout_s)",
        above=0,
    )

    def __post_init__(self) -> None:
        check_bounds(self)
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


def _absolute(path: str) -> str:
    """A local directory as an absolute path; a hub name (or empty) as it is."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


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


# ----------------------------------------------------------------------------- driver side


@dataclasses.dataclass
class CallResult:
    """What one call of ``next_batch`` gave: a batch, or the error the call raised."""

    rank: int
    incarnation: str | None = None
    batch: Batch | None = None
    error: BaseException | None = None


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
            allow = self.ray_cfg.ray_allow_unauthenticated
            connect(self.ray_cfg.ray, runtime_env=runtime_env, allow_unauthenticated=allow)
            self.connected_here = True
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
        layout = list(self.store.layout)
        host = ray.util.get_node_ip_address()  # the weight group's address: its store's too
        need(
            self.ray_cfg.ray_weights != BROADCAST
            or self.ray_cfg.ray_backend != "nccl"
            or is_loopback(host)
            or self.ray_cfg.ray_nccl_any_interface,
            f"--ray_backend nccl on {host}: NCCL's own sockets listen on the interfaces NCCL "
            "picks, not only the group's address, and admit whoever connects; pass "
            "--ray_nccl_any_interface to accept that, or use --ray_backend gloo",
        )
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
                host,
                pids=self._pids,
                kill=self._kill_straggler,
                log=self.log,
            )  # started by wait_ready, once the board is up

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
        """Wait until every actor is built (engine and reference model loaded) and the board is
        up, all by one deadline; then start the weight group's sender. The board's process
        starts as the searchers' do (a Ray worker, the job's code, torch): beside a CPU hog
        that took over a minute, past which the sender's first call to it (``CONTROL_S``)
        had failed the run."""
        import ray
        from ray.exceptions import RayError

        refs = {actor.info.remote(): rank for rank, actor in enumerate(self.actors)}
        # Any call to the board answers once its process is up.
        board_ref = (self.board.status if self.sender is not None else self.board.get).remote()
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
        try:
            ask(board_ref, deadline - time.monotonic())  # a board that failed to start raises
        except TimeoutError as exc:
            raise NoRayCluster(
                f"the weights' board on this node not up within {self.cfg.timeout_s}s"
            ) from exc
        if self.sender is not None:
            self.sender.start()

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

    def _actor_records(self, timeout_s: float = 10.0) -> dict[int, dict]:
        """rank -> Ray's record of its actor now (``state``, ``pid``, ``node_id``, ``node_ip``),
        from the GCS in one call, no call into the actor, with ``timeout_s`` as the call's
        gRPC deadline: past it, a TimeoutError (Ray's "Deadline Exceeded" RpcError as one). The
        wait itself ends a second later at most, should Ray's deadline not answer (a wait cut
        first would leave Ray's callback a cancelled future). A private name (the worker's GCS
        client), hence the pinned Ray."""
        import ray
        from ray.core.generated import gcs_pb2
        from ray.exceptions import RpcError

        gcs = ray._private.worker.global_worker.gcs_client
        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        seconds = max(timeout_s, 0.001)  # at least a millisecond: 0 would mean no deadline

        async def table():
            asked = gcs.async_get_all_actor_info(job_id=job, timeout=seconds)
            return await asyncio.wait_for(asked, seconds + 1.0)

        try:
            answer = asyncio.run(table())
        except RpcError as error:
            if "Deadline Exceeded" not in str(error):
                raise
            raise TimeoutError(f"Ray's GCS did not answer within {seconds:g}s") from None
        found = {actor_id.hex(): data for actor_id, data in answer.items()}
        records = {}
        for rank, actor in enumerate(self.actors):
            data = found.get(actor._actor_id.hex())
            if data is not None:
                records[rank] = {
                    "state": gcs_pb2.ActorTableData.ActorState.Name(data.state),
                    "pid": data.pid,
                    "node_id": data.address.node_id.hex(),
                    "node_ip": data.address.ip_address,
                }
        return records

    def _pids(self, timeout_s: float = 10.0) -> dict[int, int]:
        """rank -> the pid of its actor, where Ray runs it now (state ALIVE)."""
        return {
            rank: record["pid"]
            for rank, record in self._actor_records(timeout_s).items()
            if record["state"] == "ALIVE"
        }

    def where_is(self, rank: int) -> str:
        """'searcher R on node IP (NODE_ID)', from Ray's record of its actor ('?' when the GCS
        does not say within seconds)."""
        record = {}
        with contextlib.suppress(TimeoutError):
            record = self._actor_records().get(rank, {})
        node = record.get("node_id", "?")
        return f"searcher {rank} on node {record.get('node_ip', '?')} ({node[:12]})"

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
        try:
            running = self._pids().get(rank)
        except TimeoutError:
            running = info["pid"]  # as far as we know
        if running != info["pid"]:
            self.log(f"{where} {why}; its process is gone, Ray restarts it")
            return
        self.log(f"{where} {why}; killed, Ray restarts it")
        ray.kill(self.actors[rank], no_restart=False)

    def describe(self) -> dict:
        """What ran: each searcher's node, engine and device, and the weight path with its
        seconds per version (the run summary's ``ran``)."""
        records = {}
        with contextlib.suppress(TimeoutError):  # then the actors' own word, from info()
            records = self._actor_records()
        searchers = {}
        for rank in range(len(self.actors)):
            info = self.nodes.get(rank, {})
            record = records.get(rank, {})
            searchers[str(rank)] = {
                "node": record.get("node_ip", info.get("node_ip")),
                "node_id": record.get("node_id", info.get("node_id")),
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
