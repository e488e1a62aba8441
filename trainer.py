"""The trainer, the weight store, and the launcher that runs searchers beside the trainer.

Steps 2-5 of tba.py's algorithm run here, in the main process:

    drain the queue into the replay buffer (never blocking) -> sample P groups of K -> recompute
    log pi with gradients -> tb_loss -> clip, AdamW, LR schedule -> every k steps publish weights

Process layout (``run_tba``): a spawn context starts S non-daemon searcher processes
(searcher.py); trajectories come back through one bounded multiprocessing queue; weights go out
through a ``WeightStore`` of shared tensors. Every wait has a timeout; a searcher that raises or
dies is reported with its traceback or exit code, restarted up to ``max_searcher_restarts``
times with the newest weights, and then the run fails loudly. On any exit all children are
stopped and joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue as queue_lib
import signal
import time
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from buffer import ReplayBuffer, Trajectory
from searcher import load_causal_lm, pad_token_id, searcher_main, weights_checksum
from tba import (TBAConfig, beta_at, group_logprobs, pad_sequences, peak_memory_gb,
                 sequence_logprobs, tb_log_z, tb_loss, wsd_lr_factor)


class SearcherFailed(RuntimeError):
    """A searcher raised or died, and no restarts are left."""


# ----------------------------------------------------------------------------- weight store

class WeightStore:
    """The trainer's parameters mirrored into one flat shared tensor, plus a version counter.

    Storage is a CUDA tensor on the trainer's GPU (shared with searchers by CUDA IPC when they
    unpickle it) or shared-memory CPU tensor. A publish is a device copy; nothing is pickled per
    sync. A seqlock makes reads consistent without ever blocking the writer: the writer makes
    ``seq`` odd, copies, then makes it even; a reader retries when ``seq`` was odd or changed.
    """

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 device: torch.device):
        self.layout, offset = [], 0
        for name, p in named_params:
            self.layout.append((name, offset, tuple(p.shape)))
            offset += p.numel()
        self.flat = torch.empty(offset, dtype=dtype, device=device)
        if device.type == "cpu":
            self.flat.share_memory_()
        self.header = torch.zeros(3, dtype=torch.float64).share_memory_()  # seq, version, probe
        self.header[1] = -1

    def views(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, self.flat[off:off + math.prod(shape)].view(shape))
                for name, off, shape in self.layout]

    def version(self) -> int:
        return int(self.header[1].item())

    @torch.no_grad()
    def publish(self, named_params: list[tuple[str, torch.Tensor]], version: int,
                probe_logp: float = 0.0) -> None:
        seq = self.header[0].item()
        self.header[0] = seq + 1  # odd: writing
        for (name, view), (pname, p) in zip(self.views(), named_params):
            if name != pname:
                raise RuntimeError(f"WeightStore.publish: parameter {pname} where {name} expected")
            view.copy_(p.detach())
        if self.flat.is_cuda:
            torch.cuda.synchronize(self.flat.device)  # bytes land before readers may look
        self.header[2] = probe_logp
        self.header[1] = version
        self.header[0] = seq + 2  # even: stable

    def load_into(self, load_fn: Callable, timeout_s: float = 60.0) -> tuple[int, float]:
        """Call ``load_fn(views)`` on a consistent version; returns (version, probe log-prob)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seq = self.header[0].item()
            if seq % 2 == 0:
                version, probe = int(self.header[1].item()), self.header[2].item()
                load_fn(self.views())
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    # Our copies (on our device's stream, reading the store's device) must be
                    # finished before seq is re-checked, or a torn read could pass the check.
                    torch.cuda.synchronize()
                    if self.flat.is_cuda:
                        torch.cuda.synchronize(self.flat.device)
                if self.header[0].item() == seq:
                    return version, probe
            time.sleep(0.001)
        raise TimeoutError(f"WeightStore: no consistent read within {timeout_s}s")


def make_weight_store(cfg: TBAConfig, model: torch.nn.Module, device: torch.device) -> WeightStore:
    kind = cfg.weight_store
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "shared_memory"
    if kind == "cuda" and device.type != "cuda":
        raise ValueError("weight_store=cuda needs the trainer on a CUDA device")
    store_device = device if kind == "cuda" else torch.device("cpu")
    return WeightStore(list(model.named_parameters()), cfg.torch_dtype(), store_device)


# ----------------------------------------------------------------------------- the trainer

class Trainer:
    """Model, optimizer, schedule and replay buffer; ``train_step`` is steps 3-4 of TBA."""

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int,
                 probe: tuple[list[int], list[int]] | None = None):
        self.cfg, self.device, self.pad_id, self.eos_id, self.probe = cfg, device, pad_id, eos_id, probe
        # Released run: weights and AdamW moments in bf16, no autocast. fp32_master_weights: fp32
        # weights and moments, computing in `dtype` under autocast on CUDA (mixed precision).
        mixed = cfg.fp32_master_weights and cfg.dtype != "float32"
        self.model = load_causal_lm(cfg.model, torch.float32 if mixed else cfg.torch_dtype(), device,
                                    cfg.trust_remote_code)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.autocast = (torch.autocast(device.type, dtype=cfg.torch_dtype()) if mixed
                         else contextlib.nullcontext())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        # The released code steps its scheduler before each update, so update t (1-based) runs
        # at the factor of t: LambdaLR's counter s starts at 0, hence s + 1.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: wsd_lr_factor(s + 1, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps))
        self.buffer = ReplayBuffer(cfg.buffer_capacity, cfg.mop_prob, cfg.inv_temp, cfg.seed)
        self.step = 0  # optimizer steps done = the version of the current weights
        self.published: dict[int, float | None] = {}  # version -> checksum (parity tests)

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    @torch.no_grad()
    def probe_logprob(self) -> float:
        if self.probe is None:
            return 0.0
        ids, attn, resp = pad_sequences([self.probe[0]], [self.probe[1]], self.pad_id, self.device)
        with self.autocast:
            return sequence_logprobs(self.model, ids, attn, resp).item()

    def publish(self, store: WeightStore) -> float:
        t0 = time.perf_counter()
        probe = self.probe_logprob() if self.cfg.parity_check else 0.0
        store.publish(self.named_params(), self.step, probe)
        self.buffer.mark_sync()  # most-on-policy now means refreshed after this publish
        if self.cfg.parity_check:
            self.published[self.step] = weights_checksum(store.views())
        return time.perf_counter() - t0

    def sample(self) -> tuple[list[list[Trajectory]], list[bool]]:
        cfg = self.cfg
        if cfg.synchronous:
            groups = self.buffer.sample_version(cfg.prompts_per_step, cfg.group_size, self.step)
            return groups, [True] * len(groups)
        return self.buffer.sample(cfg.prompts_per_step, cfg.group_size)

    def ready(self) -> bool:
        """Whether a step can run: the initial fill is in and the newest data is at most max_lag
        versions old (async), or P prompts hold data of this version (synchronous)."""
        cfg = self.cfg
        if cfg.synchronous:
            return self.buffer.count_version(self.step) >= cfg.prompts_per_step
        return (len(self.buffer) >= max(cfg.initial_samples, 1)
                and len(self.buffer.groups) >= cfg.prompts_per_step
                and (cfg.max_lag < 0 or self.buffer.newest_version >= self.step - cfg.max_lag))

    def backward(self, groups: list[list[Trajectory]], beta: float) -> tuple[float, list[float], float]:
        """Accumulate the gradient of tb_loss on the (P, K) batch ``groups`` into ``.grad``, in
        forward/backward passes of micro_batch_size sequences rounded down to whole prompt groups.
        log Z^ is per prompt, so the passes' losses weighted by their share of the P groups sum
        to tb_loss on the whole batch, exactly. Returns (loss, log Z^ per prompt, mean log pi)."""
        cfg = self.cfg
        per_pass = max(1, cfg.micro_batch_size // cfg.group_size) if cfg.micro_batch_size else len(groups)
        loss_sum, log_z, logp_sum = 0.0, [], 0.0
        for first in range(0, len(groups), per_pass):
            chunk = groups[first:first + per_pass]
            with self.autocast:
                logp = group_logprobs(
                    self.model, [g[0].prompt_tokens for g in chunk],
                    [[t.response_tokens for t in g] for g in chunk], pad_id=self.pad_id,
                    eos_id=self.eos_id, temperature=cfg.logprob_temperature(),
                    include_eos=cfg.eos_in_logprob, share_prompt=not cfg.gradient_checkpointing,
                    device=self.device)
            ref = torch.tensor([[t.ref_logprob for t in g] for g in chunk], device=self.device)
            reward = torch.tensor([[t.reward for t in g] for g in chunk], device=self.device)
            loss = tb_loss(logp, ref, reward, beta) * (len(chunk) / len(groups))
            loss.backward()
            loss_sum += loss.item()
            log_z += tb_log_z(logp, ref, reward, beta).tolist()
            logp_sum += logp.detach().sum().item()
        return loss_sum, log_z, logp_sum / sum(len(g) for g in groups)

    def train_step(self) -> dict:
        """One TBA step on P groups of K; returns the step's metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        groups, is_mop = self.sample()
        beta = beta_at(self.step, cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps)
        t1 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss, log_z, logp_mean = self.backward(groups, beta)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, grad_norm)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"trainer step {self.step}: gradient norm is {grad_norm.item()}")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        t2 = time.perf_counter()
        trajs = [t for g in groups for t in g]
        lags = [self.step - 1 - t.version for t in trajs]
        tokens = sum(len(t.response_tokens) for t in trajs)
        return {
            "loss/tb": loss, "loss/logz_mean": sum(log_z) / len(log_z), "policy/logp_mean": logp_mean,
            "reward/mean": sum(t.reward for t in trajs) / len(trajs),
            "train/beta": beta, "train/lr": lr, "train/grad_norm": grad_norm.item(),
            "async/lag_mean": sum(lags) / len(lags), "async/lag_max": float(max(lags)),
            "async/lag_min": float(min(lags)),
            "async/mop_frac": sum(is_mop) / len(is_mop),
            "time/sample": t1 - t0, "time/forward_backward": t2 - t1,
            "throughput/samples_per_s": len(trajs) / (t2 - t0),
            "throughput/tokens_per_s": tokens / (t2 - t0),
        }

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step,
                "buffer": self.buffer.state_dict(), "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.buffer.load_state_dict(state["buffer"])
        torch.set_rng_state(state["torch_rng"])


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(trainer: Trainer, cfg: TBAConfig, path: Path) -> None:
    """Atomic: write a temporary file, fsync, then rename over the old checkpoint, so a kill
    during a save never leaves a broken latest checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"trainer": trainer.state_dict(), "config": dataclasses.asdict(cfg)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: torch.device) -> dict:
    """Tensors and plain containers only: ``weights_only=True`` never unpickles arbitrary code."""
    return torch.load(path, map_location=device, weights_only=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric rows past ``step`` (written after the checkpoint a resume starts from)."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(row + "\n" for row in rows))


# ----------------------------------------------------------------------------- searcher pool

class SearcherPool:
    """Starts, watches, restarts and stops the searcher processes."""

    def __init__(self, cfg: TBAConfig, examples: list[dict], reward_fn: Callable,
                 store: WeightStore, probe, log: Callable[[str], None] = print):
        self.cfg, self.reward_fn, self.store, self.probe, self.log = cfg, reward_fn, store, probe, log
        self.ctx = mp.get_context("spawn")
        self.queue = self.ctx.Queue(maxsize=cfg.queue_size)
        self.stop_event = self.ctx.Event()
        self.shards = [examples[r::cfg.num_searchers] for r in range(cfg.num_searchers)]
        if any(not shard for shard in self.shards):
            raise ValueError(f"{len(examples)} prompts cannot be split over {cfg.num_searchers} searchers")
        self.procs: list = [None] * cfg.num_searchers
        self.restarts = 0
        self.last_error: dict[int, str] = {}
        self.first_ready_at: float | None = None  # time.time() when a searcher could first generate

    def start(self, rank: int | None = None) -> None:
        for r in ([rank] if rank is not None else range(self.cfg.num_searchers)):
            proc = self.ctx.Process(
                target=searcher_main, name=f"tba-searcher-{r}", daemon=False,
                args=(r, self.cfg, self.shards[r], self.reward_fn, self.store, self.queue,
                      self.stop_event, self.probe))
            proc.start()
            self.procs[r] = proc

    def _failed(self, rank: int, why: str) -> None:
        """A searcher failed: restart it (newest weights load on start) or raise."""
        proc = self.procs[rank]
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
        if self.restarts >= self.cfg.max_searcher_restarts:
            raise SearcherFailed(f"searcher {rank} failed ({why}); "
                                 f"{self.restarts} restarts used of {self.cfg.max_searcher_restarts}:\n"
                                 f"{self.last_error.get(rank, '(no traceback: the process died)')}")
        self.restarts += 1
        self.log(f"searcher {rank} failed ({why}); restart {self.restarts}/"
                 f"{self.cfg.max_searcher_restarts}:\n{self.last_error.get(rank, '')}")
        self.start(rank)

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc is not None and not proc.is_alive():
                self._failed(rank, f"exit code {proc.exitcode}")

    def poll(self, timeout: float = 0.0) -> list[tuple]:
        """Every message waiting (after up to ``timeout`` s for the first); errors handled."""
        messages = []
        try:
            messages.append(self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait())
            while True:
                messages.append(self.queue.get_nowait())
        except queue_lib.Empty:
            pass
        batches = []
        for msg in messages:
            if msg[0] == "error":
                self.last_error[msg[1]] = msg[2]
                self._failed(msg[1], "raised")
            elif msg[0] == "ready":
                self.first_ready_at = self.first_ready_at or msg[2]
            else:
                batches.append(msg)
        self.check_alive()
        return batches

    def depth(self) -> int:
        try:
            return self.queue.qsize()
        except NotImplementedError:  # macOS
            return -1

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every searcher to stop, drain the queue while they exit, then terminate/kill."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        while any(p is not None and p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            with contextlib.suppress(queue_lib.Empty):
                while True:
                    self.queue.get_nowait()
            time.sleep(0.05)
        for p in self.procs:
            if p is not None and p.is_alive():
                p.terminate()
                p.join(timeout=3.0)
            if p is not None and p.is_alive():
                p.kill()
                p.join(timeout=3.0)
        self.queue.cancel_join_thread()
        self.queue.close()


class SearcherStats:
    """What the searchers report, as metrics: per-step means of the timings of the batches that
    arrived during the step (so present only when ``async/batches_in`` > 0), and per searcher
    its busy fraction, the version it holds, its peak memory and weight checksum."""

    def __init__(self):
        self.arrived: list[dict] = []  # batch stats since the last step_metrics()
        self.latest: dict[int, dict] = {}  # rank -> stats of its newest batch
        self.busy_wall: dict[int, list[float]] = {}  # rank -> [busy seconds, wall seconds]

    def add(self, rank: int, stats: dict) -> None:
        self.arrived.append(stats)
        self.latest[rank] = stats
        busy, wall = self.busy_wall.get(rank, [0.0, 0.0])
        self.busy_wall[rank] = [busy + stats["busy_s"], wall + stats["wall_s"]]

    def step_metrics(self) -> dict[str, float]:
        out = {"async/batches_in": float(len(self.arrived))}
        if self.arrived:
            for key in ("generate", "reward", "reference", "load"):
                out[f"time/{key}"] = sum(s[f"{key}_s"] for s in self.arrived) / len(self.arrived)
        self.arrived = []
        for rank, (busy, wall) in sorted(self.busy_wall.items()):
            latest = self.latest[rank]
            out[f"searcher{rank}/busy_frac"] = busy / wall if wall > 0 else 0.0
            out[f"searcher{rank}/version"] = float(latest["version"])
            out[f"searcher{rank}/peak_mem_gb"] = latest["peak_mem_gb"]
            if latest.get("checksum") is not None:
                out[f"searcher{rank}/checksum"] = latest["checksum"]
        return out


# ----------------------------------------------------------------------------- the launcher

def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_tba(cfg: TBAConfig, examples: list[dict], reward_fn: Callable, *,
            on_step: Callable[[Trainer, dict], None] | None = None,
            show_progress: bool = True) -> Trainer:
    """Run TBA: searchers in child processes, the trainer here. Returns the trained Trainer.

    ``examples`` are dicts with ``id`` and ``prompt`` (text) plus what ``reward_fn`` reads.
    ``on_step(trainer, metrics)`` runs after every step (e.g. evaluation) and may add keys to
    ``metrics``. Writes ``output_dir/metrics.jsonl`` and ``output_dir/checkpoint.pt`` (every
    ``checkpoint_every`` steps and on every exit: the end, an error, Ctrl-C or SIGTERM);
    ``cfg.resume`` continues from that checkpoint.
    """
    from transformers import AutoTokenizer

    device = torch.device(cfg.trainer_device)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads_per_process())
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    pad_id = pad_token_id(tokenizer)
    first = examples[0]
    probe = (tokenizer(first["prompt"])["input_ids"],
             tokenizer(first.get("answer", " 0"), add_special_tokens=False)["input_ids"][:64]
             + [tokenizer.eos_token_id])
    trainer = Trainer(cfg, device, pad_id, tokenizer.eos_token_id, probe)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, metrics_path = out_dir / "checkpoint.pt", out_dir / "metrics.jsonl"
    if cfg.resume and ckpt_path.exists():
        trainer.load_state_dict(load_checkpoint(ckpt_path, device)["trainer"])
        truncate_metrics(metrics_path, trainer.step)
        tqdm.write(f"resumed from {ckpt_path} at step {trainer.step}")
    elif cfg.resume:
        tqdm.write(f"--resume: no checkpoint at {ckpt_path}; starting from step 0")
    elif metrics_path.exists():
        metrics_path.unlink()  # a fresh run starts a fresh log
    ckpt_every = cfg.checkpoint_every or cfg.sync_every
    store = make_weight_store(cfg, trainer.model, device)
    trainer.publish(store)  # the current weights, before any searcher starts
    pool = SearcherPool(cfg, examples, reward_fn, store, probe, log=tqdm.write)
    stats = SearcherStats()
    # Ctrl-C and SIGTERM both end the run cleanly (checkpoint, children joined). SIGINT is set
    # explicitly too: a process started in the background of a script inherits it ignored.
    old_handlers = {sig: signal.signal(sig, _raise_keyboard_interrupt)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    bar = tqdm(total=cfg.total_steps, initial=trainer.step, desc="TBA", disable=not show_progress,
               dynamic_ncols=True)
    try:
        pool.start()  # step 1 runs in the searcher processes from here on

        def ingest(batches) -> None:
            for _, rank, trajs, batch_stats in batches:
                trainer.buffer.extend(trajs)
                stats.add(rank, batch_stats)

        with open(metrics_path, "a") as metrics_file:
            while trainer.step < cfg.total_steps:
                # 2. Drain the queue into the buffer. Wait only for the initial fill, for data
                #    no staler than max_lag, or (synchronous) for this version's data.
                t0 = time.perf_counter()
                ingest(pool.poll())
                deadline = time.monotonic() + cfg.timeout_s
                while not trainer.ready():
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"trainer waited {cfg.timeout_s}s for data at step {trainer.step}: "
                            f"buffer holds {len(trainer.buffer)} trajectories, newest of version "
                            f"{trainer.buffer.newest_version}")
                    ingest(pool.poll(timeout=0.2))
                wait_s = time.perf_counter() - t0
                # 3-4. Sample P groups of K, recompute log pi, TB loss, AdamW step.
                metrics = trainer.train_step()
                # 5. Publish the weights every k steps (every step when synchronous).
                publish_s = 0.0
                if cfg.synchronous or trainer.step % cfg.sync_every == 0:
                    publish_s = trainer.publish(store)
                # Seconds since the first searcher was ready to generate: process start-up
                # (imports, model loading) is not training time, the initial fill is.
                metrics = {"step": trainer.step,
                           "wall_time": time.time() - (pool.first_ready_at or time.time()),
                           **metrics, **trainer.buffer.stats(trainer.step), **stats.step_metrics(),
                           "time/wait": wait_s, "time/publish": publish_s,
                           "async/queue_depth": float(pool.depth()),
                           "async/searcher_restarts": float(pool.restarts),
                           "memory/trainer_peak_gb": peak_memory_gb(device),
                           "time/step": time.perf_counter() - t0}
                if on_step is not None:
                    on_step(trainer, metrics)
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                if trainer.step % ckpt_every == 0:
                    save_checkpoint(trainer, cfg, ckpt_path)
                bar.update(1)
                bar.set_postfix({short: f"{metrics[k]:.3g}" for short, k in
                                 (("reward", "reward/mean"), ("acc", "eval/accuracy"),
                                  ("lag", "async/lag_mean"), ("beta", "train/beta"))
                                 if k in metrics})
    finally:
        bar.close()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        pool.stop()  # children first: every process of the run is gone before the save
        save_checkpoint(trainer, cfg, ckpt_path)
    return trainer
