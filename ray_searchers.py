"""Searchers on other machines, as Ray actors: the same ``searcher.Searcher`` loop and engines,
one actor per GPU, placed by Ray on any node of a running Ray cluster; the trainer process (rank
0 under torchrun) is the Ray driver. ``--ray auto`` (or ``--ray HOST:PORT``) turns it on; every
searcher of the run is then an actor. Ray is imported only then: without the flag no process of
the run imports it (this module imports it inside the functions that use it).

    python run_gsm8k.py --ray auto --num_searchers 12 --searcher_devices cuda   # docs/ray.md

Three pieces:

* ``RaySearcherPool`` (the driver, in the trainer process) stands in for ``SearcherPool``
  (``trainer.Parts.pool``), so ``Intake`` and ``run_tba`` use it unchanged. Each
  ``collect`` (the intake thread, every ~50 ms) first notices a newer version in the trainer's
  ``WeightStore`` and ``ray.put``s it once (copied on a CUDA stream of its own, which waits for
  none of the trainer's kernels: ``StoreSnapshot``), then keeps at most ``ray_in_flight``
  ``next_batch`` calls per actor (the backpressure: no actor runs further ahead of the trainer) and
  ``ray.wait``s on them. A batch is the return value of a call.
* ``WeightBoard``, a small actor on the driver's node, holds the newest ``(version, probe,
  [ref])``. Searchers pull from it between generate calls, so an actor that Ray restarts finds
  the newest version with nobody telling it, and every call runs on the actor's main thread (a
  pushed version would need a concurrency group, which moves calls off the main thread: risky
  for vLLM and CUDA). The ref travels inside a list, so Ray hands it over unresolved.
* ``SearcherActor`` builds the run's searcher (``Parts.searcher``: a checked one with
  --parity_check) over a ``RayWeightSource`` (the WeightSource protocol over the board) and runs
  ``Searcher.next_batch`` for each call.

A version is never seen half-written: an object in Ray's object store is immutable once sealed,
and the version and probe travel with its ref. Old versions are freed by reference counting
once the driver and the board have moved on and no actor holds them; every actor on a node maps
the one copy its node pulled.

Faults: an actor whose process or node dies is restarted by Ray (``max_restarts``) on any node
with room; its calls in flight fail with ``ActorUnavailableError`` and are issued again; the
driver counts a restart each time a searcher reports a new incarnation, and fails the run past
``max_searcher_restarts`` (all searchers together, as ``SearcherPool``). A searcher that raises
is killed and restarted the same way; ``WeightsNotLoaded`` stops the run. Actors are not
detached: if the driver dies, Ray ends them (fate sharing).

Security: ``RAY_AUTH_MODE=token`` keeps out whoever lacks the cluster's token; it encrypts
nothing, so the cluster needs a private network (docs/ray.md). ``connect`` turns a refusal for
want of the token into one clear error within a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from cli import run_cli
from engines import WeightsNotLoaded, WeightStore
from searcher import Batch, Searcher, SearcherFailed, SearcherSetup, prompt_shards, searcher_metrics
from tba import RunError, TBAConfig, knob, need
from trainer import Parts

REPO_DIR = Path(__file__).resolve().parent
# What a searcher needs of this directory on another node: the code. Ray's upload honours
# .gitignore too (runs/ and the like).
CODE_EXCLUDES = [".git", "runs", "research", "docs", "*.pt", "*.jsonl", "*.png"]


@dataclass
class RayConfig:
    """Searchers as Ray actors (ray_searchers.py)."""

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

    def __post_init__(self) -> None:
        need(self.ray_in_flight >= 1, f"--ray_in_flight must be >= 1, got {self.ray_in_flight}")
        need(
            self.ray_cpus_per_searcher > 0,
            f"--ray_cpus_per_searcher must be > 0, got {self.ray_cpus_per_searcher}",
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
            "reconstructed": reconstructed,
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
    thread; a lock keeps the two apart), ``stop``. When ``start`` connects, this repository is
    the job's working directory, uploaded to every node (model paths must exist there)."""

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
        on_gpu = cfg.searcher_device_list()[0].startswith("cuda")
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
        here = ray.get_runtime_context().get_node_id()
        self.board = (
            ray.remote(WeightBoard)
            .options(
                num_cpus=0,
                max_restarts=-1,  # empty after a restart: collect sets it again each second
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            )
            .remote()
        )
        layout = list(self.store.layout)
        actor_class = ray.remote(SearcherActor)
        # torch threads: the CPUs each actor asked Ray for (cfg's share of this machine's cores
        # means nothing on another node).
        threads = self.cfg.torch_threads or max(1, int(self.ray_cfg.ray_cpus_per_searcher))
        for setup in self.setups:
            setup.store = RayWeightSource(self.board, layout, self.store.flat.dtype)
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
                    raise SearcherFailed(f"searcher actor {rank} failed to start:\n{exc}") from exc
                self._seen(rank, info["incarnation"])
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

        self._publish_newest()
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
        self.log(f"searcher {rank} is back (restart {self.restarts}/{limit})")
        if self.restarts > limit:
            raise SearcherFailed(f"searcher {rank} restarted; {self.restarts} restarts of {limit}")

    def _call_failed(self, rank: int, error: BaseException) -> None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        limit = self.cfg.max_searcher_restarts
        if isinstance(error, ActorDiedError):  # Ray will not restart it: max_restarts used
            raise SearcherFailed(
                f"searcher {rank} died and Ray will not restart it ({self.restarts} restarts "
                f"used of {limit}):\n{error}"
            )
        if isinstance(error, RayActorError):  # ActorUnavailableError: restarting; issued again
            self.call_errors += 1
            return
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, WeightsNotLoaded):
            raise SearcherFailed(f"searcher {rank}: its weights did not arrive:\n{error}")
        if self.restarts >= limit:
            raise SearcherFailed(
                f"searcher {rank} raised; {self.restarts} restarts used of {limit}:\n{error}"
            )
        self.log(f"searcher {rank} raised; restarting it:\n{error}")
        ray.kill(self.actors[rank], no_restart=False)  # Ray restarts it: a new incarnation

    # --- the main thread

    def metrics(self) -> dict[str, float]:
        """SearcherPool's metrics, plus calls in flight, calls lost to actor deaths and the
        seconds of each ray.put of a version."""
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
            out.update(searcher_metrics(arrived, self.latest))
            return out

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
