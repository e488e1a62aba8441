"""The data-parallel trainer (extensions/data_parallel.py) on CPU: gloo on loopback, torchrun."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from buffer import Trajectory
from extensions import data_parallel, grpo
from extensions.data_parallel import DataParallelConfig, Ranks, full_tensor, rank_device
from extensions.grpo import GRPOConfig
from extensions.tiny import cpu_config
from helpers import REPO, free_port, proc_stats, small_tiny_job, time_limit, wait_for_rows
from tba import TBAConfig, scored_tokens
from test_tba import read_metrics
from trainer import Parts, Trainer


def dp_batch(prompts: int, seed: int) -> list[list[Trajectory]]:
    """``prompts`` groups of 3 random responses (some cut, some ending in EOS 1), with reference
    sums and per-token behaviour and reference log-probs of the tokens scored (EOS not)."""
    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        group = []
        for _ in range(3):
            response = [rng.randrange(4, 60) for _ in range(rng.randint(1, 6))]
            response += [1] * (rng.random() < 0.5)
            n = len(scored_tokens(response, 1, include_eos=False))
            t = Trajectory(p, [5, 6, 7 + p], response, float(rng.random() < 0.5), -5.0, 0)
            t.token_logprobs = {
                "behaviour": [-rng.uniform(1, 5) for _ in range(n)],
                "reference": [-rng.uniform(1, 5) for _ in range(n)],
            }
            t.ref_logprob = sum(t.token_logprobs["reference"])
            group.append(t)
        groups.append(group)
    return groups


# (loss, P, micro_batch_size): P odd gives the ranks 2 and 1 groups; passes of 1 group make rank
# 0 accumulate over two passes (DDP's no_sync) before its reducing one.
DP_CASES = [("tb", 3, 3), ("grpo", 3, 3), ("tb", 4, 0)]


class Lockstep(data_parallel.Ranks):
    """Ranks whose rank 0 sends nothing: every rank calls each trainer method itself, in step,
    so a test can read every rank's results (the messages by which rank 0 drives the others in
    a run are tested end to end, under torchrun, below)."""

    def send(self, message) -> None:
        pass


def dp_trainer(
    model_dir: str, loss: str, prompts: int, micro: int, dp=None, fsdp: bool = False
) -> Trainer:
    """One rank's trainer of ``loss`` (tb or grpo); data-parallel over ``dp`` when given."""
    cfg = cpu_config(
        model_dir,
        max_grad_norm=0.5,  # the clipping runs on sharded gradients too
        num_generations=3,
        responses_per_prompt=3,
        prompts_per_step=prompts,
        micro_batch_size=micro,
        lr=1e-2,
        warmup_steps=0,
        beta_start=0.05,
        beta_end=0.05,
    )
    parts = grpo.install(Parts(), GRPOConfig(loss=loss))
    if dp is not None:
        parts = data_parallel.install(parts, DataParallelConfig(fsdp=fsdp), dp)
    return parts.trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)


def dp_results(model_dir: str, dp=None, fsdp: bool = False) -> list[dict]:
    """Per case of DP_CASES: backward's metrics and gradients on the batch, then the weights
    after 3 updates on it (whole: sharded ones gathered), and with ``fsdp`` the weights rank 0
    would publish."""
    results = []
    for loss, prompts, micro in DP_CASES:
        groups = dp_batch(prompts, seed=prompts)
        trainer = dp_trainer(model_dir, loss, prompts, micro, dp, fsdp)
        metrics = trainer.backward(groups, 0.05)
        grads = [full_tensor(p.grad).clone() for p in trainer.model.parameters()]
        for _ in range(3):
            trainer.update(groups)
        weights = [full_tensor(p.detach()).clone() for p in trainer.model.parameters()]
        result = {"metrics": metrics, "grads": grads, "weights": weights}
        if fsdp:
            result["published"] = [w.clone() for _, w in trainer.weights_to_publish()]
        if fsdp or dp is None:
            path = Path(model_dir) / f"resume-{1 if dp is None else 2}-{loss}-{prompts}.pt"
            result["resumed"] = resumed_weights(trainer, path, groups, dp)
        results.append(result)
    return results


def resumed_weights(trainer: Trainer, path: Path, groups, dp=None) -> list[torch.Tensor]:
    """The weights after one more update by a trainer loaded from ``trainer``'s checkpoint at
    ``path``. Sharded, rank 0 writes it with every rank's gather (``state_dict``), and every
    rank reads it."""
    if dp is None or dp.rank == 0:
        trainer.save(path)
    else:
        trainer.state_dict()
    if dp is not None:
        dp.sum([0.0])  # every rank past the save
    resumed = type(trainer)(trainer.cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    resumed.load(path)
    assert resumed.step == trainer.step
    resumed.update(groups)
    return [full_tensor(p.detach()).clone() for p in resumed.model.parameters()]


def join_together(rank: int, world: int, port: int, started) -> None:
    """torchrun's environment for ``rank``, once every rank has started (``started``, a
    Barrier): the group's rendezvous waits ``timeout_s`` at most, and on a loaded machine one
    spawned process can take many seconds longer than another to import torch."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    started.wait(timeout=RANK_START_S)


# Seconds a spawned rank may take to start (imports included): a hang, not an honest start.
RANK_START_S = 300


def _dp_rank(
    rank: int, world: int, port: int, model_dir: str, out_queue, started, fsdp: bool = False
) -> None:
    join_together(rank, world, port, started)
    torch.set_num_threads(1)
    dp = Lockstep.from_env("cpu", timeout_s=60)
    out_queue.put((rank, pickle.dumps(dp_results(model_dir, dp, fsdp))))  # tensors by value
    dp.close()
    out_queue.put((rank, backend_threads()))


def _startup_rank(rank: int, port: int, out_queue, started) -> None:
    """Rank 0 starts for twice --timeout_s, sends its first message, then goes silent for twice
    --timeout_s; rank 1 reports what each of its two waits got."""
    join_together(rank, 2, port, started)
    ranks = Ranks.from_env("cpu", timeout_s=2.0, startup_timeout_s=60.0)
    got = []
    if rank == 0:
        time.sleep(4.0)  # the warm start, the evaluation before training, the engines
        try:  # reported, not raised: the test ends at once when rank 1 stopped waiting
            ranks.send("start")
        except data_parallel.RanksFailed as error:
            got.append(str(error))
        time.sleep(4.0)  # then nothing: to rank 1, a dead rank 0
    else:
        for _ in range(2):
            try:
                got.append(ranks.receive())
            except data_parallel.RanksFailed as error:
                got.append(str(error))
    ranks.close()
    out_queue.put((rank, got))


def backend_threads() -> list[str]:
    """The names of this process's threads that belong to a gloo process group (its I/O loop and
    its workers), read from /proc."""
    names = [
        Path(f"/proc/self/task/{task}/comm").read_text().strip()
        for task in os.listdir("/proc/self/task")
    ]
    return sorted(name for name in names if "gloo" in name)


def test_rank_device_maps_local_ranks_to_devices():
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda:0", 2) == torch.device("cuda:2")
    assert rank_device("cuda:4", 1) == torch.device("cuda:5")
    assert rank_device("cuda:3,cuda:1", 1) == torch.device("cuda:1")
    with pytest.raises(ValueError, match="lists 2 devices, but local rank is 2"):
        rank_device("cuda:3,cuda:1", 2)


def test_data_parallel_shares_are_whole_contiguous_groups():
    for count, world in itertools.product(range(2, 9), range(1, 5)):
        if count < world:
            continue
        shares = [Ranks(r, world, r, torch.device("cpu"), 1.0).share(count) for r in range(world)]
        assert [i for share in shares for i in share] == list(range(count))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1 and min(map(len, shares)) >= 1
    with pytest.raises(ValueError, match=r"prompts_per_step \(1\) must be at least"):
        Ranks(0, 2, 0, torch.device("cpu"), 1.0).check(TBAConfig(prompts_per_step=1))


@pytest.mark.slow
def test_ranks_wait_for_rank_0_to_start_longer_than_for_a_dead_rank():
    """Ranks > 0 wait for rank 0's first message up to --startup_timeout_s (rank 0 evaluates
    and starts its engines meanwhile), and for every later one up to --timeout_s, which tells
    a dead rank. With one wait for both, rank 1 failed at --timeout_s while rank 0 started."""
    with time_limit(RANK_START_S + 60):
        ctx = multiprocessing.get_context("spawn")
        out_queue, started = ctx.Queue(), ctx.Barrier(2)
        port = free_port()
        procs = [
            ctx.Process(target=_startup_rank, args=(r, port, out_queue, started)) for r in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            got = dict(out_queue.get(timeout=RANK_START_S + 30) for _ in procs)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                proc.kill()
    first, second = got[1]
    assert first == "start"
    assert "rank 0 died or did not answer within 2s (--timeout_s)" in second


def test_a_process_group_of_another_size_is_refused(tmp_path, monkeypatch):
    """A default group that is not torchrun's whole world (the one-process group an in-process
    vLLM engine leaves when built before the ranks join) is an error, never a rank training
    alone."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(RuntimeError, match=r"a process group of 1 process.*torchrun's 2"):
            Ranks.from_env("cpu", timeout_s=5.0)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_data_parallel_ranks_equal_one_rank(tiny_model_dir, fsdp):
    """2 ranks (gloo on loopback, spawned) give the loss, the metrics and the gradient of 1
    rank on the same batch, for TB and GRPO, with P = 3 split 2 + 1 and P = 4 split 2 + 2, and
    the same weights after 3 AdamW steps, on both ranks; replicated (DDP) or sharded (FSDP2,
    gradients and weights gathered; rank 0 publishes the whole weights, rank 1 none, and a
    checkpoint round trip, AdamW moments included, gives the 4th step of 1 rank's round trip).
    Once a rank has closed its group, none of the group's threads is left in it: a backend
    alive at exit is torn down after the interpreter, where FSDP's rank 1 used to abort."""
    # A hang: the slower (FSDP) took over 120 s at a load of 19 on two cores, DDP 66 s at 10.
    with time_limit(RANK_START_S + 300):
        want = dp_results(tiny_model_dir)
        ctx = multiprocessing.get_context("spawn")
        out_queue, started = ctx.Queue(), ctx.Barrier(2)
        port = free_port()
        procs = [
            ctx.Process(
                target=_dp_rank, args=(r, 2, port, tiny_model_dir, out_queue, started, fsdp)
            )
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            got = {
                rank: pickle.loads(data)
                for rank, data in (out_queue.get(timeout=RANK_START_S + 240) for _ in procs)
            }
            left = dict(out_queue.get(timeout=30) for _ in procs)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                proc.kill()
    assert left == {0: [], 1: []}, f"process-group threads alive after close: {left}"
    first = list(dp_trainer(tiny_model_dir, "tb", 3, 3).model.parameters())
    for case, want_case in enumerate(want):
        moved = max(
            (w - p).abs().max().item() for w, p in zip(want_case["weights"], first, strict=True)
        )
        assert moved > 1e-3, f"{DP_CASES[case]}: 3 steps did not move the weights"
        for rank in (0, 1):
            mine = got[rank][case]
            for key, value in want_case["metrics"].items():
                assert mine["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            for a, b in zip(mine["grads"], want_case["grads"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert_same_steps(mine["weights"], want_case["weights"], first)
        if fsdp:
            for rank in (0, 1):
                assert_same_steps(got[rank][case]["resumed"], want_case["resumed"], first)
            assert got[1][case]["published"] == []
            assert_same_steps(got[0][case]["published"], want_case["weights"], first)


def assert_same_steps(got: list, want: list, start: list) -> None:
    """Weights after AdamW steps agree, tensor by tensor, to 0.1% of how far they moved from
    ``start``. Not element by element: AdamW divides each gradient by its own running size, so an
    element whose gradient differs by rounding (two ranks sum in another order than one) can
    move by a visibly different amount (seen on one x86-64 CPU and not on another: 2.4e-5 of a
    0.03 move, 4e-5 of its tensor's move). A rank whose share went missing moves every tensor
    by a different amount, tens of percent."""
    for a, b, s in zip(got, want, start, strict=True):
        assert (a - b).norm() <= 1e-3 * (b - s).norm() + 1e-7, (a - b).abs().max()


def start_dp_run(model_dir: str, out: Path, *extra: str) -> subprocess.Popen:
    """The tiny main job under torchrun with 2 data-parallel ranks (gloo on loopback) in its own
    session; its output goes to out/run.log."""
    out.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *small_tiny_job(model_dir, out, prompts_per_step=3),  # 3 groups: a 2 + 1 split
        "--eval_test_size",
        "4",
        "--eval_subset",
        "4",
        "--timeout_s",
        "60",
        *extra,
    ]
    with open(out / "run.log", "a") as log:
        return subprocess.Popen(
            args, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )


def data_parallel_rank(pid: int) -> int | None:
    """torchrun's RANK of a process of the main job (not of its searchers), else None."""
    with contextlib.suppress(OSError):
        if "run_gsm8k.py" in Path(f"/proc/{pid}/cmdline").read_text():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks = [int(e.split(b"=")[1]) for e in env if e.startswith(b"RANK=")]
            return ranks[0] if ranks else None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, zombies aside."""
    children = collections.defaultdict(list)
    for child, fields, _ in proc_stats():
        if fields[0] != "Z":
            children[int(fields[1])].append(child)
    found, todo = [], [pid]
    while todo:
        below = children[todo.pop()]
        found += below
        todo += below
    return sorted(found)


def living(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (not zombies)."""
    alive = {pid for pid, fields, _ in proc_stats() if fields[0] != "Z"}
    return [pid for pid in pids if pid in alive]


@pytest.mark.slow
def test_killed_data_parallel_rank_stops_the_run_with_a_checkpoint_and_resume_continues(
    tiny_model_dir, tmp_path
):
    """SIGKILL of rank 1 of 2: rank 0 writes its checkpoint and fails naming rank 1, every
    process of the run exits, and --resume on 2 ranks continues from the checkpoint."""
    # Hangs: this test took 141 s at a load of 10 on two cores; the run's --timeout_s is 60.
    with time_limit(450):
        proc = start_dp_run(tiny_model_dir, tmp_path, "--total_steps", "100000")
        run = []
        try:
            wait_for_rows(tmp_path, 3, proc, timeout=240)
            run = descendants(proc.pid)  # torchrun starts each rank in a session of its own
            (rank1,) = [p for p in run if data_parallel_rank(p) == 1]
            os.kill(rank1, signal.SIGKILL)
            # rank 0 fails within --timeout_s; torchrun's SIGKILL of the rest comes 30 s after
            # its SIGTERM
            proc.wait(timeout=120)
            deadline = time.monotonic() + 30
            while living(run) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert living(run) == [], "a process of the run outlived the failure"
        finally:
            for pid in living([*run, *descendants(proc.pid), proc.pid]):
                os.kill(pid, signal.SIGKILL)
        log = (tmp_path / "run.log").read_text()
        assert proc.returncode != 0
        assert "data parallel, rank 0" in log and "rank 1 died" in log, log[-3000:]
        step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["step"]
        assert step >= 3

        proc = start_dp_run(tiny_model_dir, tmp_path, "--total_steps", str(step + 2), "--resume")
        try:
            assert proc.wait(timeout=240) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 3))
        assert json.loads((tmp_path / "results.json").read_text())["steps"] == step + 2


@pytest.mark.slow
def test_sharded_data_parallel_run_publishes_evaluates_and_saves(tiny_model_dir, tmp_path):
    """The main job on 2 ranks with --fsdp: every gather rank 0 needs (publish with the parity
    probe, evaluation, checkpoint, the final model) is joined by rank 1, the searchers load
    weights that pass the parity check, and the run ends cleanly."""
    with time_limit(240):  # a hang: 73 s at a load of 10 on two cores
        proc = start_dp_run(
            tiny_model_dir,
            tmp_path,
            "--fsdp",
            "--total_steps",
            "4",
            "--publish_every",
            "2",
            "--eval_every",
            "2",
            "--parity_check",
            "--parity_tol",
            "1e-4",
        )
        try:
            assert proc.wait(timeout=230) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [("eval/accuracy" in r) for r in rows] == [False, True, False, True]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 4
    assert "parity checked after every load" in results["summary"]["weights"]
    trainer = results["summary"]["ran"]["trainer"]  # what ran: two gloo ranks, sharded
    assert (trainer["ranks"], trainer["backend"], trainer["sharded"]) == (2, "gloo", True)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]
    assert state["step"] == 4
    assert "model.embed_tokens.weight" in state["model"]
    assert (tmp_path / "final" / "config.json").exists()
