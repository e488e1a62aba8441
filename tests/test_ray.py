"""Searchers as Ray actors (ray_searchers.py) on a multi-node Ray cluster that this module starts
on one machine: ``ray.cluster_utils.Cluster`` with a head and three worker raylets, every address
127.0.0.1, token authentication on (RAY_AUTH_MODE=token). Batches reach the driver with their
version tags and the parity check, at most ray_in_flight calls per actor; an actor killed
(restarted, counted); a node removed mid-run (its actor comes back on a node with room and loads
the newest version); the main job with --ray whose driver is SIGKILLed (its actors die, and
--resume continues); a client without the cluster's token refused with a clear error. The
module's teardown fails if any process of the cluster is left.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
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

import ray_searchers
import test_tba
from checks import CheckedSearcher, ParityProbe, weights_checksum
from engines import WeightStore, load_causal_lm, pad_token_id
from helpers import REPO, start_cli_run, time_limit
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


def make_pool(cluster, cfg, examples, publisher, in_flight: int = 2):
    """Searchers checked as a run with --parity_check checks them, on the worker raylets."""
    ray_cfg = ray_searchers.RayConfig(
        ray=cluster.address, ray_in_flight=in_flight, ray_resources="searcher=1"
    )
    return ray_searchers.RaySearcherPool(
        cfg,
        examples,
        gsm8k_reward,
        publisher.store,
        make=functools.partial(CheckedSearcher, parity=publisher.probe),
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


def test_batches_carry_versions_checksums_and_backpressure(cluster, tiny_model_dir, tmp_path):
    """Two actors on worker raylets: nothing before the first publish; then batches tagged with
    version 0, then version 1 once published; each load passes the parity probe and the
    engines' checksums equal the trainer's; never more than in_flight calls per actor."""
    with time_limit(400):
        examples = tiny_examples()
        cfg = tiny_cfg(tiny_model_dir, tmp_path)
        publisher = Publisher(cfg, examples)
        pool = make_pool(cluster, cfg, examples, publisher, in_flight=2)
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
        finally:
            pool.stop()


def test_killed_actor_restarts_counted_loads_newest(cluster, tiny_model_dir, tmp_path):
    """SIGKILL a searcher actor's process: Ray restarts it, the driver counts one restart, the
    new incarnation's first batch is of the newest version, and calls lost are re-issued."""
    with time_limit(400):
        examples = tiny_examples()
        cfg = tiny_cfg(tiny_model_dir, tmp_path, num_searchers=1)
        publisher = Publisher(cfg, examples)
        pool = make_pool(cluster, cfg, examples, publisher)
        try:
            pool.start()
            pool.wait_ready()
            publisher.publish(0)
            collect_until(pool, lambda t: len(t) > 0, 180)
            before = pool.incarnations[0]
            os.kill(pool.where()[0]["pid"], signal.SIGKILL)
            publisher.publish(1)
            collect_until(pool, lambda t: pool.incarnations[0] != before, 180)
            assert pool.latest[0].version == 1  # the restarted actor's first batch: the newest
            metrics = pool.metrics()
            assert metrics["async/searcher_restarts"] == 1
            assert metrics["async/searcher_call_errors"] >= 1
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


def test_client_without_token_is_refused(cluster):
    """A driver without the cluster's token, or with a wrong one, is refused within seconds by
    ray_searchers.connect, saying why (Ray's own ray.init takes 20 s to raise a bare
    ConnectionError)."""
    script = "import sys, ray_searchers; ray_searchers.connect(sys.argv[1])"
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


def test_node_removed_actor_comes_back_elsewhere(cluster, tiny_model_dir, tmp_path):
    """Remove the node of searcher 0 mid-run: searcher 1 keeps delivering, searcher 0 comes back
    on the spare node (restart counted) and its first batch there is of the newest version.
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
            collect_until(pool, lambda t: {x.prompt_id for x in t} and len(pool.latest) == 2, 180)
            node_id = nodes(pool)[0]
            before = pool.incarnations[0]
            cluster.cluster.remove_node(cluster.node(node_id), allow_graceful=False)
            cluster.workers = [n for n in cluster.workers if n.node_id != node_id]
            publisher.publish(1)
            got = collect_until(pool, lambda t: pool.incarnations[0] != before, 180, seen=[])
            # While searcher 0 was away, searcher 1 (the odd prompt ids) kept delivering.
            assert any(t.prompt_id % 2 == 1 for t in got)
            assert any(t.version == 1 and t.prompt_id % 2 == 0 for t in got)
            back = pool.where()[0]
            assert back["node_id"] != node_id and back["reconstructed"]
            metrics = pool.metrics()
            assert metrics["async/searcher_restarts"] == 1
            assert metrics["searcher0/version"] == 1.0
        finally:
            pool.stop()
            cluster.workers.append(cluster.add_worker())
