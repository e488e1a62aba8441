"""Searchers as Ray actors (extensions/ray_searchers.py) on a multi-node Ray cluster that this
module starts on one machine: ``ray.cluster_utils.Cluster`` with a head and three worker raylets,
every address 127.0.0.1, token authentication on (RAY_AUTH_MODE=token). Batches reach the driver
with their version tags and the parity check, at most ray_in_flight calls per actor, the weights by
the weight group or the object store; the weight group itself, outside Ray, with a member killed
mid-broadcast and one hung past the deadline; an actor killed mid-broadcast (the others go on,
it comes back with a full copy) and one hung past the deadline (killed; with no restart left,
the run stops naming it and its node); a node removed mid-broadcast (its actor comes back on a
node with room and loads the newest version); the main job with --ray whose driver is
SIGKILLed (its actors die, and --resume continues, saying what ran where); a client without
the cluster's token refused with a clear error. The module's teardown fails if any process of
the cluster is left.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# Before `import ray`: read once at import. Without it ray.init("127.0.0.1:port") rewrites the
# address to the machine's own IP (services.resolve_ip_for_localhost), which leaves loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil
import ray
import torch

import test_tba
from engines import WeightStore
from extensions import ray_searchers
from extensions.checks import CheckedSearcher, ParityProbe, weights_checksum
from helpers import REPO, start_cli_run, time_limit
from plumbing.models import load_causal_lm, pad_token_id
from plumbing.processes import SearcherFailed
from rewards import gsm8k_reward
from test_tba import tiny_examples

pytestmark = pytest.mark.slow  # a Ray cluster of four raylets on this machine, for the module

LOOPBACK = "127.0.0.1"
WORKERS = 3  # worker raylets, one searcher slot each: two searchers and a spare node
FAST_HEALTH = {  # a node that dies without saying so is declared dead in ~3 s, not ~15 s
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


def cluster_procs(temp_dir: str) -> list:
    """Live processes of the cluster whose RAY_TMPDIR is ``temp_dir``: named on the command
    line, or Ray's own programs (ray::... workers and agents, the ray package's scripts) that
    inherited it or hold one of its log files open (the agents)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = proc.cmdline()
            ours = cmdline and (
                cmdline[0].startswith("ray::") or any("site-packages/ray/" in c for c in cmdline)
            )
            if temp_dir in " ".join(cmdline) or (
                ours
                and (
                    proc.environ().get("RAY_TMPDIR", "").startswith(temp_dir)
                    or any(f.path.startswith(temp_dir) for f in proc.open_files())
                )
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def actor_pids(temp_dir: str) -> set[int]:
    """Processes of searcher actors (Ray titles them ray::SearcherActor...)."""
    pids = set()
    for proc in cluster_procs(temp_dir):
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.cmdline() and proc.cmdline()[0].startswith("ray::SearcherActor"):
                pids.add(proc.pid)
    return pids


class RayTestCluster:
    """The module's cluster and what the tests need of it."""

    def __init__(self, temp_dir: str, token: str):
        from ray.cluster_utils import Cluster

        self.temp_dir = temp_dir
        self.token = token
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                num_cpus=1,
                node_ip_address=LOOPBACK,
                include_dashboard=False,
                no_monitor=True,
                object_store_memory=100 << 20,
                _system_config=FAST_HEALTH,
            ),
        )
        self.workers = [self.add_worker() for _ in range(WORKERS)]
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def add_worker(self):
        return self.cluster.add_node(
            num_cpus=1,
            node_ip_address=LOOPBACK,
            resources={"searcher": 1},
            object_store_memory=100 << 20,
        )

    def node(self, node_id: str):
        return next(n for n in self.workers if n.node_id == node_id)

    def child_env(self, **extra) -> dict:
        """The environment of a driver in a child process: this one's, token included."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, PYTHONPATH=str(REPO))
        env.update(extra)
        return {k: v for k, v in env.items() if v is not None}


TEMP_PREFIX = "/tmp/rts"


def sweep_orphaned_agents() -> list[str]:
    """Kill the Ray agents an earlier run of this module left behind when it was SIGKILLed (a
    CI timeout): the kernel ends the raylets with their owner (PR_SET_PDEATHSIG), but in Ray
    2.60 each raylet's DashboardAgent and RuntimeEnvAgent log "the parent is dead" and stay,
    orphaned (parent pid 1), ignoring SIGTERM. Only ours: their logs are under TEMP_PREFIX."""
    killed = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            cmdline = proc.cmdline()
            if (
                proc.ppid() == 1
                and cmdline
                and cmdline[0] in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
                and any(f.path.startswith(TEMP_PREFIX) for f in proc.open_files())
            ):
                proc.kill()
                killed.append(f"{proc.pid} {cmdline[0]}")
    return killed


@pytest.fixture(scope="module")
def cluster():
    """Head + 3 worker raylets on 127.0.0.1 with token auth; this process is a driver. On
    teardown every process of the cluster must be gone."""
    swept = sweep_orphaned_agents()
    if swept:
        print(f"killed Ray agents orphaned by an earlier run: {swept}")
    temp_dir = tempfile.mkdtemp(prefix=Path(TEMP_PREFIX).name, dir="/tmp")  # short: sockets
    token = secrets.token_hex(32)
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    # RAY_TMPDIR, not temp_dir=: Cluster writes its address file under the default temp root,
    # where other users' `ray.init()` would find it.
    os.environ.update(RAY_TMPDIR=temp_dir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # this process reads the auth mode and token anew
    AuthenticationTokenLoader.instance().reset_cache()
    ray_searchers.keep_loopback()  # in case ray was imported before this module set the switch
    started = time.monotonic()
    test_cluster = RayTestCluster(temp_dir, token)
    ray_searchers.connect(test_cluster.address)
    print(f"cluster of {1 + WORKERS} raylets up in {time.monotonic() - started:.1f}s")
    try:
        yield test_cluster
    finally:
        ray.shutdown()
        test_cluster.cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        deadline = time.monotonic() + 30
        while (left := cluster_procs(temp_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        names = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in left]
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        assert not names, f"processes of the test's Ray cluster left behind: {names}"
        shutil.rmtree(temp_dir, ignore_errors=True)


def tiny_cfg(model_dir: str, out: Path, **overrides):
    """test_tba.py's tiny_cfg, with restarts to spare and time for an actor's start (Python,
    torch, transformers, the models) on 2 busy cores."""
    values = dict(timeout_s=240, max_searcher_restarts=2)
    values.update(overrides)
    return test_tba.tiny_cfg(model_dir, out, **values)


class Publisher:
    """The trainer's side of the weights, without a trainer: the tiny policy, its store, and
    the parity probe published with each version."""

    def __init__(self, cfg, examples):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.pad_id = pad_token_id(tokenizer)
        self.model = load_causal_lm(cfg.model, torch.float32, torch.device("cpu"), False)
        self.named = list(self.model.named_parameters())
        self.store = WeightStore(self.named, torch.float32, torch.device("cpu"))
        prompt = tokenizer(examples[0]["prompt"])["input_ids"]
        self.probe = ParityProbe.from_prompt(prompt, 1e-4)
        self.checksums: dict[int, float] = {}

    def publish(self, version: int) -> None:
        with torch.no_grad():
            if version:
                for _, p in self.named:
                    p.add_(torch.randn_like(p) * 0.01)  # a new version differs everywhere
            logp = self.probe.logprob(self.model, self.pad_id, torch.device("cpu"))
        self.store.publish(self.named, version, logp)
        self.checksums[version] = weights_checksum(self.store.views())


def make_pool(cluster, cfg, examples, publisher, in_flight: int = 2, log=print, **ray_flags):
    """Searchers checked as a run with --parity_check checks them, on the worker raylets."""
    ray_cfg = ray_searchers.RayConfig(
        ray=cluster.address, ray_in_flight=in_flight, ray_resources="searcher=1", **ray_flags
    )
    return ray_searchers.RaySearcherPool(
        cfg,
        examples,
        gsm8k_reward,
        publisher.store,
        make=functools.partial(CheckedSearcher, parity=publisher.probe),
        log=log,
        ray_cfg=ray_cfg,
    )


def nodes(pool) -> dict[int, str]:
    """rank -> the node its actor runs on now."""
    return {rank: info["node_id"] for rank, info in pool.where().items()}


def collect_until(pool, done, timeout: float, seen: list | None = None) -> list:
    """collect() every 50 ms, as the intake thread does, until ``done(trajectories so far)``;
    checks the backpressure bound on every round."""
    got = [] if seen is None else seen
    deadline = time.monotonic() + timeout
    while not done(got):
        assert time.monotonic() < deadline, f"not done within {timeout}s ({len(got)} in)"
        got += pool.collect(timeout=0.05)
        assert len(pool.pending) <= pool.ray_cfg.ray_in_flight * len(pool.actors)
    return got


GROUP_BYTES = 64 << 20  # more than loopback's socket buffers hold: a frozen member stalls it
GROUP_BUCKET = 1 << 20


def group_member(port: int, incarnations: list[tuple[int, int, int]], deadline_s: float, out):
    """A weight group member outside Ray: each (epoch, rank, world) in turn, it joins, receives
    a version into its staging copy and confirms; it says how each ended on ``out``."""
    torch.set_num_threads(1)
    staging = torch.zeros(GROUP_BYTES, dtype=torch.uint8)
    out.put((0, "started", os.getpid()))
    for epoch, rank, world in incarnations:
        try:
            group = ray_searchers.WeightGroup(
                "gloo", LOOPBACK, port, epoch, rank, world, deadline_s, LOOPBACK
            )
            out.put((epoch, "joined", os.getpid()))
            deadline = time.monotonic() + deadline_s
            group.broadcast(staging, GROUP_BUCKET, deadline)
            whole = group.flag(0.0, deadline)
            group.flag(1.0, deadline, total=True)
            out.put((epoch, "received", (whole, staging.double().sum().item())))
        except ray_searchers.WeightGroupError as error:
            out.put((epoch, "failed", str(error)))


def test_weight_group_member_killed_or_hung_mid_broadcast():
    """The weight group alone (gloo on loopback, two member processes, 64 MiB in buckets of 1
    MiB, two in flight): a member frozen and then SIGKILLed mid-broadcast fails the driver's
    broadcast within a second, not at the deadline; the group rebuilt with the survivor (a new
    epoch, the same TCPStore) delivers a whole copy; a member frozen and left so fails it at
    the deadline: never a hang."""
    import datetime

    import torch.distributed as dist

    deadline_s = 20.0
    server = dist.TCPStore(
        LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    plans = {"a": [(1, 1, 3)], "b": [(1, 2, 3), (2, 1, 2), (3, 1, 2)]}
    members = {
        name: ctx.Process(target=group_member, args=(server.port, plan, deadline_s, out))
        for name, plan in plans.items()
    }
    payload = torch.randint(0, 255, (GROUP_BYTES,), dtype=torch.uint8)

    def group(epoch: int, world: int, deadline: float):
        return ray_searchers.WeightGroup(
            "gloo", LOOPBACK, server.port, epoch, 0, world, deadline_s, LOOPBACK, server=server
        )

    def said(epoch: int, what: str, count: int = 1, timeout: float = 60) -> list:
        found = []
        while len(found) < count:
            got_epoch, kind, detail = out.get(timeout=timeout)
            assert (got_epoch, kind) == (epoch, what), (got_epoch, kind, detail)
            found.append(detail)
        return found

    with time_limit(200):
        for member in members.values():
            member.start()
        try:
            said(0, "started", 2, timeout=100)  # imported: the rendezvous waits for no import
            first = group(1, 3, deadline_s)
            pids = said(1, "joined", 2)
            frozen = members["a"].pid
            assert frozen in pids
            os.kill(frozen, signal.SIGSTOP)
            threading.Timer(0.5, os.kill, (frozen, signal.SIGKILL)).start()
            t0 = time.monotonic()
            with pytest.raises(ray_searchers.WeightGroupError):
                deadline = t0 + deadline_s
                first.broadcast(payload, GROUP_BUCKET, deadline)
                first.flag(1.0, deadline)
                first.flag(0.0, deadline, total=True)
            failed_s = time.monotonic() - t0
            assert 0.4 < failed_s < 5.0, failed_s  # the kill, not the deadline
            first.close()
            assert said(1, "failed")  # the survivor's part ended too, and it says so

            second = group(2, 2, deadline_s)
            said(2, "joined")
            deadline = time.monotonic() + deadline_s
            second.broadcast(payload, GROUP_BUCKET, deadline)
            second.flag(1.0, deadline)
            assert second.flag(0.0, deadline, total=True) == 1.0
            ((whole, checksum),) = said(2, "received")
            assert whole == 1.0 and checksum == payload.double().sum().item()
            second.close()

            hung_deadline_s = 2.0
            third = ray_searchers.WeightGroup(
                "gloo", LOOPBACK, server.port, 3, 0, 2, hung_deadline_s, LOOPBACK, server=server
            )
            said(3, "joined")
            os.kill(members["b"].pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(ray_searchers.WeightGroupError):
                deadline = t0 + hung_deadline_s
                third.broadcast(payload, GROUP_BUCKET, deadline)
                third.flag(1.0, deadline)
                third.flag(0.0, deadline, total=True)
            assert time.monotonic() - t0 < hung_deadline_s + 1.0
            third.close()
            print(f"killed mid-broadcast: failed in {failed_s:.2f}s; hung: at the deadline")
        finally:
            for member in members.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.pid, signal.SIGKILL)
                member.join(timeout=10)


def held_open(pool, version: int, hold_s: float = 0.5) -> list:
    """collect() until the weight group's round of ``version`` has been under way for
    ``hold_s`` (a member frozen: it cannot finish), and what arrived meanwhile."""
    got = collect_until(pool, lambda _: pool.sender.sending == version, 60, seen=[])
    until = time.monotonic() + hold_s
    got = collect_until(pool, lambda _: time.monotonic() > until, 60, seen=got)
    assert pool.sender.sending == version and pool.sender.sent < version
    return got


def delivered(rank: int, version: int):
    """collect_until's test: searcher ``rank`` (its shard: prompt ids of its parity, two
    searchers) delivered a batch of ``version`` or newer."""
    return lambda got: any(t.version >= version and t.prompt_id % 2 == rank for t in got)


@pytest.mark.parametrize("weights", ["broadcast", "object_store"])
def test_batches_carry_versions_checksums_and_backpressure(
    cluster, tiny_model_dir, tmp_path, weights
):
    """Two actors on worker raylets: nothing before the first publish; then batches tagged with
    version 0, then version 1 once published; each load passes the parity probe and the
    engines' checksums equal the trainer's; never more than in_flight calls per actor. The
    weights by the weight group (one incarnation, both actors in it) or the object store."""
    with time_limit(400):
        examples = tiny_examples()
        cfg = tiny_cfg(tiny_model_dir, tmp_path)
        publisher = Publisher(cfg, examples)
        pool = make_pool(cluster, cfg, examples, publisher, in_flight=2, ray_weights=weights)
        try:
            pool.start()
            pool.wait_ready()
            head = ray.get_runtime_context().get_node_id()
            assert head not in nodes(pool).values()  # placed on the worker raylets
            assert pool.collect(timeout=0.5) == []  # they wait for the first publish
            publisher.publish(0)
            got = collect_until(pool, lambda t: len({x.prompt_id for x in t}) >= 4, 240)
            assert {t.version for t in got} == {0}
            publisher.publish(1)
            metrics: dict = {}

            def both_at_1(_):
                metrics.update(pool.metrics())
                return all(metrics.get(f"searcher{r}/version") == 1.0 for r in range(2))

            got = collect_until(pool, both_at_1, 180)
            assert max(t.version for t in got) == 1
            for rank in range(2):
                assert metrics[f"searcher{rank}/checksum"] == pytest.approx(
                    publisher.checksums[1], rel=1e-9
                )
            assert metrics["async/searcher_restarts"] == 0
            if weights == "broadcast":
                assert metrics["async/weight_group_rebuilds"] == 1.0
                assert metrics["async/weight_group_size"] == 2.0
                assert "time/ray_broadcast" in metrics or pool.sender.seconds
            else:
                assert pool.sender is None and "time/ray_put" in metrics
        finally:
            pool.stop()
        ran = json.loads((tmp_path / "ran.json").read_text())
        assert weights.replace("_", " ") in ran["weights"]["path"].lower()
        assert ran["weights"]["versions_sent"] >= 2
        assert {s["engine"] for s in ran["searchers"].values()} == {"HFEngine"}


def test_actor_killed_or_hung_mid_broadcast(cluster, tiny_model_dir, tmp_path):
    """Two searchers on the weight group. Searcher 0 is frozen (SIGSTOP) before version 1, so
    that version's broadcast cannot finish, and SIGKILLed while it is under way: the group is
    rebuilt without it, searcher 1 goes on, and searcher 0 comes back (a restart, counted)
    with a full copy of version 1. Then searcher 1 is frozen before version 2 and left so:
    past the group's deadline it is a straggler, and with no restart left the run stops with
    an error naming it and its node. Every load passed the parity check."""
    logged: list[str] = []
    with time_limit(400):
        examples = tiny_examples()
        cfg = tiny_cfg(tiny_model_dir, tmp_path, max_searcher_restarts=1)
        publisher = Publisher(cfg, examples)
        pool = make_pool(
            cluster, cfg, examples, publisher, log=logged.append, ray_weights_timeout_s=3.0
        )
        try:
            pool.start()
            pool.wait_ready()
            publisher.publish(0)
            collect_until(pool, lambda t: delivered(0, 0)(t) and delivered(1, 0)(t), 180)
            pids = pool._pids()
            os.kill(pids[0], signal.SIGSTOP)
            publisher.publish(1)
            got = held_open(pool, 1)
            killed_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError):  # unless the deadline came first
                os.kill(pids[0], signal.SIGKILL)
            got = collect_until(pool, delivered(0, 1), 120, seen=got)
            back_s = time.monotonic() - killed_at
            metrics = pool.metrics()
            assert metrics["async/searcher_restarts"] == 1
            assert metrics["searcher0/checksum"] == pytest.approx(publisher.checksums[1], rel=1e-9)
            assert any(t.prompt_id % 2 == 1 for t in got)  # searcher 1 went on meanwhile
            assert any("gone: [0], killed: []; rebuilding it with [1]" in x for x in logged), logged
            # Formed with both, without searcher 0, with both again (at least).
            assert pool.sender.rebuilds >= 3
            print(f"searcher 0 back with version 1 {back_s:.1f}s after its SIGKILL")

            frozen_at = time.monotonic()
            os.kill(pool._pids()[1], signal.SIGSTOP)
            publisher.publish(2)
            held_open(pool, 2)
            with pytest.raises(SearcherFailed, match=r"searcher 1 on node 127\.0\.0\.1") as failed:
                collect_until(pool, lambda _: False, 60, seen=[])
            stopped_s = time.monotonic() - frozen_at
            print(f"stopped {stopped_s:.1f}s after searcher 1 froze")
            assert "missed the weight group's deadline" in str(failed.value)
            assert "no restart left (1 used of 1)" in str(failed.value)
            assert stopped_s < 3.0 + 2.0 + 3.0  # the deadline, the survivors' reports, slack
        finally:
            pool.stop()


def test_driver_killed_leaves_nothing_and_resume_continues(cluster, tiny_model_dir, tmp_path):
    """The main job with --ray (its searchers are Ray actors, the job is the driver), SIGKILLed
    mid-run: its actors die with it (fate sharing), and a second run with --resume continues
    from the checkpoint through the same intake."""
    out = tmp_path / "run"
    flags = ["--ray", cluster.address, "--ray_resources", "searcher=1", "--num_searchers", "2"]
    flags += ["--searcher_devices", "cpu", "--checkpoint_every", "2", "--timeout_s", "240"]
    metrics_path = out / "metrics.jsonl"
    with time_limit(600):
        child = start_cli_run(tiny_model_dir, out, *flags, "--total_steps", "400")
        try:
            deadline = time.monotonic() + 180
            while not (
                metrics_path.exists()
                and len(metrics_path.read_text().splitlines()) >= 4
                and (out / "checkpoint.pt").exists()
            ):
                assert child.poll() is None, child.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "no checkpointed steps within 180s"
                time.sleep(0.2)
            pids = actor_pids(cluster.temp_dir)
            assert len(pids) == 2, pids
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            killed_at = time.monotonic()
            while actor_pids(cluster.temp_dir) & pids:
                assert time.monotonic() - killed_at < 20, "actors outlived their driver"
                time.sleep(0.1)
            print(f"actors gone {time.monotonic() - killed_at:.2f}s after the driver's SIGKILL")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        ckpt_step = torch.load(out / "checkpoint.pt", weights_only=True)["trainer"]["step"]
        resumed = start_cli_run(
            tiny_model_dir, out, *flags, "--total_steps", str(ckpt_step + 4), "--resume"
        )
        output, _ = resumed.communicate(timeout=180)
        assert resumed.returncode == 0, output[-3000:]
        steps = [json.loads(line)["step"] for line in metrics_path.read_text().splitlines()]
        assert steps == list(range(1, ckpt_step + 5)), steps  # resumed, no gap, no repeat
        last = json.loads(metrics_path.read_text().splitlines()[-1])
        assert last["async/searcher_restarts"] == 0 and "async/lag_mean" in last
        assert last["searcher0/version"] >= ckpt_step  # the resumed run's actors load its weights
        # What ran, in results.json and the printed summary: the trainer here, its searchers
        # Ray actors on the worker raylets, the weights by the weight group.
        ran = json.loads((out / "results.json").read_text())["summary"]["ran"]
        assert ran["trainer"]["ranks"] == 1
        assert {s["node"] for s in ran["searchers"].values()} == {LOOPBACK}
        assert all(s["ray_actor"] for s in ran["searchers"].values())
        assert ran["weights"]["path"].startswith("broadcast (gloo")
        assert ran["weights"]["seconds_per_version"] > 0
        assert "searchers (Ray actors): 0 HFEngine on cpu at 127.0.0.1" in output
        assert "weights: broadcast (gloo" in output


def test_client_without_token_is_refused(cluster):
    """A driver without the cluster's token, or with a wrong one, is refused within seconds by
    ray_searchers.connect, saying why (Ray's own ray.init takes 20 s to raise a bare
    ConnectionError)."""
    script = "import sys; from extensions import ray_searchers; ray_searchers.connect(sys.argv[1])"
    with time_limit(90):
        for extra in (
            dict(RAY_AUTH_MODE=None, RAY_AUTH_TOKEN=None),
            dict(RAY_AUTH_TOKEN=secrets.token_hex(32)),
        ):
            t0 = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-c", script, cluster.address],
                env=cluster.child_env(**extra),
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode != 0
            assert "RayClusterRefused" in done.stderr, done.stderr[-2000:]
            assert "requires token authentication" in done.stderr
            assert time.monotonic() - t0 < 15


def test_node_removed_mid_broadcast_actor_comes_back_elsewhere(cluster, tiny_model_dir, tmp_path):
    """Remove the node of searcher 0 mid-broadcast (its actor frozen first, so the broadcast of
    version 1 cannot finish; a frozen process cannot exit with its node, so it is killed with
    it): searcher 1 keeps delivering, searcher 0 comes back on the spare node (restart counted)
    and its first batch there is of the newest version, loaded whole (checksum, parity).
    Last in the module: it leaves the cluster a node short (a node is added back)."""
    with time_limit(400):
        examples = tiny_examples()
        cfg = tiny_cfg(tiny_model_dir, tmp_path)
        publisher = Publisher(cfg, examples)
        pool = make_pool(cluster, cfg, examples, publisher)
        try:
            pool.start()
            pool.wait_ready()
            publisher.publish(0)
            collect_until(pool, lambda t: delivered(0, 0)(t) and delivered(1, 0)(t), 180)
            node_id = nodes(pool)[0]
            before = pool.incarnations[0]
            pid = pool._pids()[0]
            os.kill(pid, signal.SIGSTOP)
            publisher.publish(1)
            got = held_open(pool, 1)
            cluster.cluster.remove_node(cluster.node(node_id), allow_graceful=False)
            cluster.workers = [n for n in cluster.workers if n.node_id != node_id]
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            got = collect_until(pool, lambda t: pool.incarnations[0] != before, 180, seen=got)
            got = collect_until(pool, delivered(0, 1), 60, seen=got)
            # While searcher 0 was away, searcher 1 (the odd prompt ids) kept delivering.
            assert any(t.prompt_id % 2 == 1 for t in got)
            back = pool.where()[0]
            assert back["node_id"] != node_id and back["reconstructed"]
            metrics = pool.metrics()
            assert metrics["async/searcher_restarts"] == 1
            assert metrics["searcher0/version"] == 1.0
            assert metrics["searcher0/checksum"] == pytest.approx(publisher.checksums[1], rel=1e-9)
        finally:
            pool.stop()
            cluster.workers.append(cluster.add_worker())


def test_prime_searchers_reset_their_reference_from_the_board(cluster, tiny_model_dir, tmp_path):
    """TBA′'s searcher as a Ray actor (tba_prime.configure binds its settings into the factory
    that travels to it, over the checked searcher): with the reference reset every 2 steps,
    batches of version 0 carry the initial reference's version, 0, and once version 2 is on the
    board the actor copies it into its reference, so its batches carry version 2 and a log
    p_ref equal to their log pi_b (the same weights, the same rule)."""
    from extensions import checks, tba_prime
    from trainer import Parts

    with time_limit(400):
        examples = tiny_examples()
        cfg = tiny_cfg(tiny_model_dir, tmp_path, num_searchers=1)  # one actor is enough here
        publisher = Publisher(cfg, examples)
        prime = tba_prime.PrimeConfig(ref_reset_every=2)
        parts = checks.install(tba_prime.install(Parts(), prime), publisher.probe)
        make = tba_prime.configure(parts, prime).searcher
        ray_cfg = ray_searchers.RayConfig(ray=cluster.address, ray_resources="searcher=1")
        pool = ray_searchers.RaySearcherPool(
            cfg, examples, gsm8k_reward, publisher.store, make=make, ray_cfg=ray_cfg
        )
        try:
            pool.start()
            pool.wait_ready()
            publisher.publish(0)
            got = collect_until(pool, lambda t: len(t) >= 8, 240)
            assert {(t.version, t.ref_version) for t in got} == {(0, 0)}
            publisher.publish(2)
            got = collect_until(pool, lambda t: any(x.version == 2 for x in t), 180)
            fresh = [t for t in got if t.version == 2]
            assert fresh and {t.ref_version for t in fresh} == {2}
            for t in fresh:
                assert t.ref_logprob == pytest.approx(t.behaviour_logprob, abs=1e-3)
        finally:
            pool.stop()
