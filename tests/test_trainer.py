"""The trainer's components: bounds on age, micro-batches, dtypes, the weight store, the searcher
pool and the intake thread."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import random
import signal
import sys
import time
import types

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
)

from buffer import ReplayBuffer, Trajectory
from engines import HFEngine, WeightStore
from extensions.tiny import cpu_config
from helpers import time_limit
from plumbing.models import meta_causal_lm
from plumbing.processes import Failure, Ready, SearcherFailed, prompt_shards
from searcher import Searcher, SearcherPool, SearcherSetup
from tba import TBAConfig, group_logprobs, tb_loss
from test_tba import digit_reward, tiny_examples, traj
from trainer import Intake, Trainer


def test_prompt_shards_are_disjoint_and_cover_every_prompt():
    shards = prompt_shards(list(range(10)), 3)
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    with pytest.raises(ValueError, match="2 prompts cannot be split over 3 searchers"):
        prompt_shards([0, 1], 3)


def test_trainer_with_max_train_lag_waits_for_young_data_and_counts_lags(tiny_model_dir):
    """max_train_lag 1: the trainer is not ready until P prompts hold data at most one version
    old, and then trains on nothing older; the per-lag counts cover the whole batch."""
    cfg = cpu_config(
        tiny_model_dir,
        num_generations=2,
        responses_per_prompt=2,
        prompts_per_step=2,
        initial_samples=4,
        publish_every=1,
        barrier_lag=1,
        max_train_lag=1,
        mop_prob=0.5,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    trainer.step = 5
    for pid in range(4):
        for tokens in ([10, 1], [11, 1]):
            trainer.buffer.add(traj(pid, tokens, version=1))  # four versions old
    trainer.buffer.add(traj(0, [12, 1], version=4))
    assert not trainer.can_step()  # one young prompt, P = 2
    trainer.buffer.add(traj(1, [12, 1], version=5))
    assert trainer.can_step()
    metrics = trainer.train_step()
    assert metrics["async/lag_max"] <= 1
    counts = [metrics[f"async/lag_{lag}"] for lag in range(4)] + [metrics["async/lag_4plus"]]
    assert sum(counts) == cfg.prompts_per_step * cfg.responses_per_prompt
    assert counts[2:] == [0.0, 0.0, 0.0]


def test_replay_ratio_holds_the_trainer_until_enough_was_generated(tiny_model_dir):
    """replay_ratio r: the step that brings the trajectories trained to (s + 1) P K runs only
    once r times the trajectories generated (duplicates included: the searchers' work, not what
    the buffer keeps) reaches that; 0: no bound. P K = 4 here."""
    cfg = cpu_config(
        tiny_model_dir,
        num_generations=2,
        responses_per_prompt=2,
        prompts_per_step=2,
        initial_samples=0,
        publish_every=1,
        barrier_lag=-1,
        replay_ratio=1.0,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    buffer = trainer.buffer
    for pid, tokens in ((0, [10, 1]), (1, [11, 1]), (1, [11, 1])):  # the last a duplicate
        buffer.add(traj(pid, tokens))
    assert (len(buffer), buffer.num_added) == (2, 3) and not trainer.can_step()  # 3 < 4
    buffer.add(traj(0, [12, 1]))
    assert trainer.can_step()  # 4 generated, 4 to train
    trainer.train_step()
    for j in range(3):
        buffer.add(traj(1, [20 + j, 1], version=1))
        assert not trainer.can_step(), f"{buffer.num_added} generated, 8 to train"
    buffer.add(traj(1, [23, 1], version=1))
    assert trainer.can_step()
    trainer.cfg = dataclasses.replace(cfg, replay_ratio=0.5)  # 8 to train needs 16 generated
    assert not trainer.can_step()
    trainer.cfg = dataclasses.replace(cfg, replay_ratio=0.0)
    assert trainer.can_step()


def test_micro_batches_leave_loss_and_gradient_unchanged(tiny_model_dir):
    """Trainer.backward in passes of 1, 2 or all 4 prompt groups (micro_batch_size 3, 7 -> 6,
    12, 0) gives tb_loss on the whole (P, K) batch and its gradient, as one forward would."""
    rng = random.Random(0)
    groups = [
        [
            Trajectory(
                p,
                [5, 6, 7 + p],
                [rng.randrange(4, 60) for _ in range(rng.randint(1, 6))] + [1],
                float(rng.random() < 0.5),
                -rng.uniform(5, 20),
                0,
            )
            for _ in range(3)
        ]
        for p in range(4)
    ]
    cfg = dict(num_generations=3, responses_per_prompt=3, prompts_per_step=4)
    trainer = Trainer(cpu_config(tiny_model_dir, **cfg), torch.device("cpu"), pad_id=0, eos_id=1)
    flat = [t for g in groups for t in g]
    logp = group_logprobs(
        trainer.model,
        [g[0].prompt_tokens for g in groups],
        [[t.response_tokens for t in g] for g in groups],
        pad_id=0,
        eos_id=1,
        logprob_temperature=0.7,
        include_eos=False,
        share_prompt=False,
    )
    want_loss = tb_loss(
        logp,
        torch.tensor([t.ref_logprob for t in flat]).view(4, 3),
        torch.tensor([t.reward for t in flat]).view(4, 3),
        0.05,
    )
    want_grads = torch.autograd.grad(want_loss, list(trainer.model.parameters()))
    for size in (3, 7, 12, 0):
        trainer.cfg = cpu_config(tiny_model_dir, **cfg, micro_batch_size=size)
        trainer.model.zero_grad(set_to_none=True)
        metrics = trainer.backward(groups, 0.05)
        assert metrics["loss/tb"] == pytest.approx(want_loss.item(), rel=1e-5)
        assert "loss/grpo" not in metrics
        for want, p in zip(want_grads, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fp32_master", [False, True])
def test_trainer_weights_and_adamw_moments_dtype(tiny_model_dir, fp32_master):
    """Released run: bf16 weights and bf16 AdamW moments; --fp32_master_weights: fp32 both,
    bf16 compute under autocast."""
    cfg = TBAConfig(
        model=tiny_model_dir,
        dtype="bfloat16",
        fp32_master_weights=fp32_master,
        trainer_device="cpu",
        searcher_devices="cpu",
        num_searchers=1,
        num_generations=2,
        responses_per_prompt=2,
        prompts_per_step=2,
        searcher_batch_prompts=2,
        initial_samples=1,
        lr=1e-2,
        warmup_steps=0,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    for pid in range(2):
        for j in range(2):
            trainer.buffer.add(Trajectory(pid, [5, 6], [7 + j, 8, 1], float(j), -3.0, 0))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    want = torch.float32 if fp32_master else torch.bfloat16
    assert all(p.dtype == want for p in trainer.model.parameters())
    moments = [
        st[key] for st in trainer.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")
    ]
    assert moments and all(m.dtype == want for m in moments)
    assert any(
        not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True)
    )
    assert math.isfinite(metrics["loss/tb"]) and metrics["train/grad_norm"] > 0


def test_weight_store_laid_out_from_the_meta_model_takes_the_trainers_weights(tiny_model_dir):
    """run_tba lays the store out before the trainer loads its model (searchers start first):
    the meta model lists the same names and shapes, in the order the trainer publishes."""
    store = WeightStore(
        list(meta_causal_lm(tiny_model_dir, False).named_parameters()),
        torch.float32,
        torch.device("cpu"),
    )
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    store.publish(list(trainer_model.named_parameters()), version=0)
    loaded = {}
    store.load_into(lambda named: loaded.update({n: t.clone() for n, t in named}))
    assert loaded.keys() == dict(trainer_model.named_parameters()).keys()
    for name, param in trainer_model.named_parameters():
        assert torch.equal(loaded[name], param.detach()), name


def test_pool_waits_for_every_searcher_to_be_ready_and_names_the_late_one(tiny_model_dir):
    cfg = cpu_config(tiny_model_dir, num_searchers=2, timeout_s=0.5)
    pool = SearcherPool(cfg, tiny_examples(), digit_reward, store=None)
    pool.procs = [types.SimpleNamespace(is_alive=lambda: True)] * 2  # started, still loading
    pool.queue.put(Ready(rank=0, unix_time=time.time()))
    try:
        with pytest.raises(TimeoutError, match=r"searcher\(s\) \[1\] not ready"):
            pool.wait_ready()
        assert pool.ready_ranks == {0}
    finally:
        pool.queue.cancel_join_thread()
        pool.queue.close()


class ScriptedPool:
    """SearcherPool's side of the intake (``collect``) replaying a script: batches of
    trajectories, then an exception, as SearcherPool.collect raises SearcherFailed."""

    def __init__(self, script: list):
        self.script = script

    def collect(self, timeout: float) -> list[Trajectory]:
        time.sleep(min(timeout, 0.001))
        message = self.script.pop(0) if self.script else []
        if isinstance(message, BaseException):
            raise message
        return message


def test_intake_thread_adds_while_the_trainer_samples_and_raises_failures_on_the_main_thread():
    """The intake thread fills the buffer while this thread samples it (no torn state), and a
    searcher failure it meets is raised here, where run_tba's loop calls wait_for()."""
    batches = [[traj(b % 500, [b, j], version=b // 500) for j in range(8)] for b in range(1000)]
    failure = SearcherFailed("searcher 1 failed (raised); 2 restarts used of 2")
    buffer = ReplayBuffer(capacity=10, mop_prob=0.5, seed=0)
    intake = Intake(ScriptedPool([*batches, failure]), buffer, poll_s=0.01)
    sampler = types.SimpleNamespace(can_step=lambda: len(buffer.by_prompt) >= 4)  # a trainer
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads' adds and draws finely
    with time_limit(60), contextlib.ExitStack() as stack:  # a hang: 8 s at a load of 10
        stack.callback(sys.setswitchinterval, switch)
        intake.start()
        draws = 0
        with pytest.raises(SearcherFailed, match="2 restarts used of 2"):
            while True:
                intake.wait_for(sampler, timeout_s=10)
                groups, _ = buffer.sample(4, 3)
                assert all(len({t.prompt_id for t in g}) == 1 for g in groups)
                draws += 1
        intake.stop()
    assert draws > 0 and not intake.thread.is_alive()
    assert buffer.num_added == 1000 * 8 and len(buffer) == 500 * 10  # every batch in, some evicted


def test_pool_does_not_restart_a_searcher_whose_weights_did_not_arrive(tiny_model_dir):
    """A failed parity check or a refused weight load would fail again after a restart (the
    same load, the same way): the run stops at once, though restarts are left."""
    cfg = cpu_config(tiny_model_dir, max_searcher_restarts=3)
    pool = SearcherPool(cfg, tiny_examples(), digit_reward, store=None)
    exited = types.SimpleNamespace(
        is_alive=lambda: False, join=lambda timeout: None, kill=lambda: None
    )
    pool.procs = [exited]
    pool.queue.put(Failure(0, "WeightsNotLoaded: parity check failed", restartable=False))
    try:
        with pytest.raises(SearcherFailed, match="not restarted"), time_limit(10):
            pool.collect(timeout=5.0)
        assert pool.restarts == 0
    finally:
        pool.queue.cancel_join_thread()
        pool.queue.close()


@pytest.mark.parametrize(
    "exitcode, restarted", [(-signal.SIGTERM, False), (-signal.SIGKILL, True), (1, True)]
)
def test_pool_restarts_a_dead_searcher_unless_sigterm_ended_it(tiny_model_dir, exitcode, restarted):
    """A searcher that died (killed, or exited) is restarted; one that SIGTERM ended is not:
    torchrun and job schedulers send it to the whole process group, so the run is ending, and
    a restart only gives it a starting searcher to wait for (plumbing.processes.exit_cause)."""
    cfg = cpu_config(tiny_model_dir, max_searcher_restarts=3)
    pool = SearcherPool(cfg, tiny_examples(), digit_reward, store=None)
    dead = types.SimpleNamespace(
        is_alive=lambda: False, join=lambda timeout: None, kill=lambda: None, exitcode=exitcode
    )
    pool.procs = [dead]
    started = []
    pool.start = started.append  # the restart, without a process
    try:
        with time_limit(10):
            if restarted:
                pool.collect()
            else:
                with pytest.raises(SearcherFailed, match=r"stopped by SIGTERM.*not restarted"):
                    pool.collect()
        assert (pool.restarts, started) == ((1, [0]) if restarted else (0, []))
    finally:
        pool.queue.cancel_join_thread()
        pool.queue.close()


def _cuda_reader(store, out_queue):
    target = {}
    version, _ = store.load_into(lambda named: target.update({n: t.clone() for n, t in named}))
    # numpy arrays pickle by value: a torch tensor would be passed as a file descriptor that
    # this process, exiting right after, could no longer hand over
    out_queue.put((version, {n: t.float().cpu().numpy() for n, t in target.items()}))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: CUDA-IPC weight store "
    "and the transformers engine on CUDA (run on a GPU box to exercise them)",
)
@pytest.mark.slow
def test_cuda_ipc_weight_store_and_hf_engine(tiny_model_dir):

    model = torch.nn.Linear(64, 32).cuda()
    store = WeightStore(list(model.named_parameters()), torch.bfloat16, torch.device("cuda:0"))
    store.publish(list(model.named_parameters()), version=3)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_cuda_reader, args=(store, q))
    proc.start()
    version, got = q.get(timeout=120)
    proc.join(timeout=30)
    assert version == 3 and proc.exitcode == 0
    assert torch.equal(
        torch.from_numpy(got["weight"]), model.weight.detach().to(torch.bfloat16).float().cpu()
    )

    cfg = TBAConfig(
        model=tiny_model_dir,
        dtype="float32",
        num_searchers=1,
        searcher_devices="cuda:0",
        max_new_tokens=8,
        num_generations=2,
        responses_per_prompt=2,
    )
    engine = HFEngine(cfg, torch.device("cuda:0"), eos_id=1, pad_id=0)
    outs = engine.generate([[5, 6, 7], [8, 9]], n=2)
    assert len(outs) == 2 and all(len(o) == 2 for o in outs)
    assert all(len(tokens) <= 8 for o in outs for tokens in o)


def test_store_snapshot_reads_one_version_or_none():
    """ray_searchers.StoreSnapshot (the Ray driver's read of the store, on the intake thread):
    the newest version with its probe, or None while a publish is under way."""
    from extensions.ray_searchers import StoreSnapshot

    weights = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4))]
    store = WeightStore(weights, torch.float32, torch.device("cpu"))
    store.publish(weights, version=5, probe=-1.5)
    snapshot = StoreSnapshot(store)
    version, probe, flat = snapshot.read()
    assert (version, probe) == (5, -1.5)
    assert torch.equal(flat, torch.cat([w.flatten() for _, w in weights]))
    store.header[WeightStore.SEQ] += 1  # a publish under way
    assert snapshot.read() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_store_snapshot_does_not_wait_for_the_trainers_kernels():
    """On a GPU the Ray driver's read of the CUDA store, on another thread, ends while the
    trainer's queued kernels still run: its copy runs on a stream of its own. A read by
    ``flat.cpu()`` and ``WeightStore.load_into`` waited for them (the default stream, then the
    whole device)."""
    import threading

    from extensions.ray_searchers import StoreSnapshot

    weights = [("w", torch.randn(1 << 22, device="cuda"))]
    store = WeightStore(weights, torch.bfloat16, torch.device("cuda:0"))
    store.publish(weights, version=2)
    snapshot = StoreSnapshot(store)
    snapshot.read()  # warm: the stream and the pinned buffer exist
    got = {}

    def read():
        t0 = time.perf_counter()
        got["read"] = snapshot.read()
        got["s"] = time.perf_counter() - t0

    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(3e9))  # the trainer's step: ~1-2 s of queued GPU work
    end.record()
    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=30)
    end.synchronize()
    queued_s = start.elapsed_time(end) / 1000
    version, _, flat = got["read"]
    assert version == 2 and torch.equal(flat, weights[0][1].to(torch.bfloat16).cpu())
    assert got["s"] < queued_s / 2, (got["s"], queued_s)


def test_trust_region_on_policy_then_stale(tiny_model_dir):
    """A searcher's trajectories carry log pi_b, the engine's log-prob of what it sampled by the
    trainer's scoring rule: trained at once, rho = log pi - log pi_b is ~0, nothing is clipped
    and the group ESS is 1. After three AdamW steps the same batch is stale: rho moves, the
    clip drops some items, and micro-batches change neither the gradient nor the count."""
    cfg = cpu_config(
        tiny_model_dir,
        num_generations=4,
        responses_per_prompt=4,
        prompts_per_step=4,
        searcher_batch_prompts=4,
        max_new_tokens=8,
        eos_in_logprob=True,
        tb_clip_eps=0.3,
        lr=3e-2,
        max_grad_norm=0.0,
    )
    setup = SearcherSetup(0, cfg, tiny_examples(), digit_reward, None, None, None)
    torch.manual_seed(0)
    searcher = Searcher(setup)  # its engine loads the model the trainer starts from
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=searcher.pad_id, eos_id=searcher.eos_id)
    trajectories, _ = searcher.search_once()
    groups = [trajectories[i : i + 4] for i in range(0, len(trajectories), 4)]
    assert all(t.behaviour_logprob is not None for t in trajectories)
    fresh = trainer.backward(groups, 0.05)
    assert fresh["offpolicy/rho_abs_mean"] < 1e-4
    assert fresh["offpolicy/clip_frac"] == 0.0
    assert fresh["offpolicy/ess"] == pytest.approx(1.0, abs=1e-6)
    for _ in range(3):
        trainer.update(groups)
    stale = {}
    grads = {}
    for size in (0, 4):
        trainer.cfg = dataclasses.replace(cfg, micro_batch_size=size)
        trainer.model.zero_grad(set_to_none=True)
        stale[size] = trainer.backward(groups, 0.05)
        grads[size] = [p.grad.clone() for p in trainer.model.parameters()]
    assert stale[0]["offpolicy/rho_abs_mean"] > 0.3
    assert 0 < stale[0]["offpolicy/clip_frac"] < 1
    assert stale[4]["offpolicy/clip_frac"] == stale[0]["offpolicy/clip_frac"]
    assert stale[4]["loss/tb"] == pytest.approx(stale[0]["loss/tb"], rel=1e-5)
    for a, b in zip(grads[0], grads[4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
