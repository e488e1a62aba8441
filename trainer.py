"""The trainer, steps 2-5 of tba.py's algorithm, and ``run_tba``, the loop that runs them.

Reading order: ``Trainer`` (2 ``can_step``; 3-4 ``train_step``, ``update``, ``backward``: the TB
loss; 5 ``publish``), ``Intake`` (2: the searchers' batches drained into the buffer on a thread,
and the one wait for data), ``Parts`` (the seam: the classes a run is built from) and
``run_tba``, whose loop is the algorithm in one screen. Sections marked "a learner may skip":
checkpoints, a step's metrics, and the plumbing around the loop (``Run``: start-up in the order
a shared GPU needs, the metrics row, shutdown on any exit with a checkpoint, signals, resume).
The searcher processes themselves are searcher.py's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pickle
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from buffer import ReplayBuffer, Trajectory
from engines import (
    WeightStore,
    load_causal_lm,
    make_weight_store,
    meta_causal_lm,
    pad_token_id,
    peak_memory_gb,
)
from searcher import Searcher, SearcherPool, SearcherSetup
from tba import (
    RunError,
    TBAConfig,
    beta_at,
    group_logprobs,
    group_passes,
    offpolicy_metrics,
    tb_clipped,
    tb_log_z,
    tb_loss,
    wsd_lr_factor,
)

LAG_COUNT_TOP = 4  # metrics count the trajectories of lag 0, 1, 2, 3 and 4 or more


# ----------------------------------------------------------------------------- 2-5. the trainer


class Trainer:
    """The policy, AdamW and its schedule, and the replay buffer, on the trainer's device.

    ``can_step`` is step 2, ``train_step`` steps 3-4 (``update`` and ``backward``: the TB loss),
    ``publish`` step 5. Its other methods are the seams an extension overrides (README,
    "Extensions", says which and who)."""

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        self.cfg = cfg
        self.device = device
        self.pad_id = pad_id
        self.eos_id = eos_id
        # Mixed precision: fp32 weights and moments, compute autocast to `dtype`. Otherwise the
        # weights and AdamW moments are in `dtype` itself (the released run: bf16).
        mixed = cfg.fp32_master_weights and cfg.dtype != "float32"
        self.weights_dtype = torch.float32 if mixed else cfg.torch_dtype()
        self.model = load_causal_lm(cfg.model, self.weights_dtype, device, cfg.trust_remote_code)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        if mixed:
            self.autocast = torch.autocast(device.type, dtype=cfg.torch_dtype())
        else:
            self.autocast = contextlib.nullcontext()
        self.optimizer, self.scheduler = self.make_optimizer()
        self.buffer = ReplayBuffer(cfg.buffer_capacity, cfg.mop_prob, cfg.inv_temp, cfg.seed)
        self.step = 0  # optimizer steps done = the version of the current weights
        # The synchronous baseline is this same trainer on-policy: it publishes every step, and
        # trains only on data of its current weights, from the first batch on (its searchers
        # generate once per version: Searcher.load_newest_weights).
        if cfg.synchronous:
            self.publish_every = 1
            self.max_train_lag = 0
            self.initial_samples = 0
        else:
            self.publish_every = cfg.publish_every
            self.max_train_lag = cfg.max_train_lag
            self.initial_samples = cfg.initial_samples

    def make_optimizer(self):
        """AdamW over the model's parameters, and its warmup-stable-decay schedule."""
        cfg = self.cfg
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        # Update t = 1, 2, ... runs at factor(t), as the released code steps the scheduler first.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self.lr_factor(s + 1))
        return optimizer, scheduler

    def lr_factor(self, update: int) -> float:
        """4. The multiplier of the peak lr at update t = 1, 2, ...: warmup-stable-decay."""
        cfg = self.cfg
        return wsd_lr_factor(update, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps)

    def beta(self) -> float:
        """4. beta at this step: the linear anneal from beta_start to beta_end."""
        cfg = self.cfg
        return beta_at(self.step, cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps)

    # ------------------------------------------------------------------ 2. when to step

    def can_step(self) -> bool:
        """2. Whether a step may run: the initial fill is in, P prompts hold data no older than
        ``oldest_version``, the newest data is at most barrier_lag versions old (the released
        run's barrier), and the step keeps the trajectories trained within replay_ratio of those
        generated."""
        cfg = self.cfg
        oldest = self.oldest_version()
        filled = len(self.buffer) >= max(self.initial_samples, 1)
        enough_prompts = len(self.buffer.by_prompt) >= cfg.prompts_per_step
        young = oldest is None or self.buffer.count_prompts_since(oldest) >= cfg.prompts_per_step
        caught_up = cfg.barrier_lag < 0 or self.buffer.newest_version >= self.step - cfg.barrier_lag
        trained = (self.step + 1) * cfg.trajectories_per_step()
        paced = cfg.replay_ratio == 0 or trained <= cfg.replay_ratio * self.buffer.num_added
        return filled and enough_prompts and young and caught_up and paced

    def oldest_version(self) -> int | None:
        """The oldest version a step may train on: max_train_lag versions behind this one (None:
        no bound)."""
        if self.max_train_lag < 0:
            return None
        return self.step - self.max_train_lag

    # ------------------------------------------------------------------ 3-4. a step

    def train_step(self) -> dict:
        """3-4. One step on P groups of K from the buffer; returns the step's metrics."""
        cfg = self.cfg
        version = self.step  # of the weights this step starts from
        t0 = time.perf_counter()
        drawn, first = self.buffer.num_drawn, self.buffer.num_drawn_first
        groups, is_mop = self.buffer.sample(  # 3. most-on-policy with probability m
            cfg.prompts_per_step, cfg.responses_per_prompt, self.oldest_version()
        )
        t1 = time.perf_counter()
        metrics = self.update(groups)  # 4. the loss, and an AdamW step
        t2 = time.perf_counter()
        new = self.buffer.num_drawn_first - first
        distinct = self.buffer.num_drawn - drawn
        metrics.update(batch_metrics(groups, is_mop, version, new, distinct, t2 - t0))
        metrics["time/sample"] = t1 - t0
        metrics["time/forward_backward"] = t2 - t1
        return metrics

    def update(self, groups: list[list[Trajectory]]) -> dict:
        """4. One AdamW step on the loss of these P groups of K; the step count (the version)
        goes up by one. Returns the loss and optimisation metrics."""
        cfg = self.cfg
        beta = self.beta()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.backward(groups, beta)
        metrics["train/beta"] = beta
        grad_norm = self.grad_norm()
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(
                f"trainer step {self.step}: gradient norm is {grad_norm.item()}"
            )
        if cfg.max_grad_norm > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, grad_norm)
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics["train/grad_norm"] = grad_norm.item()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return metrics

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. The gradient of ``tb_loss`` on the (P, K) batch, accumulated into ``.grad`` over
        ``micro_batches``. log Z is per prompt, so each pass's loss weighted by its share of the
        P groups sums to tb_loss on the whole batch, exactly. Returns the loss's metrics, each a
        sum over the batch divided by a whole-batch count (``offpolicy_metrics`` says which are
        not)."""
        cfg = self.cfg
        items = sum(len(g) for g in groups)
        recorded = all(t.behaviour_logprob is not None for g in groups for t in g)
        if cfg.tb_clip_eps > 0 and not recorded:
            raise ValueError(
                "--tb_clip_eps: a trajectory has no behaviour log-prob (its searcher did not "
                "record Trajectory.behaviour_logprob)"
            )
        loss_sum = 0.0
        log_z_sum = 0.0
        logp_sum = 0.0
        rhos = []  # log pi - log pi_b of each item, when the searchers recorded log pi_b
        clipped = 0
        for chunk in self.micro_batches(groups):
            logp = self.score(chunk)
            ref = torch.tensor([[t.ref_logprob for t in g] for g in chunk], device=self.device)
            reward = torch.tensor([[t.reward for t in g] for g in chunk], device=self.device)
            behaviour = None
            if recorded:
                behaviour = torch.tensor(
                    [[t.behaviour_logprob for t in g] for g in chunk],
                    dtype=torch.float64,  # sums of hundreds of log-probs: fp32 would round them
                    device=self.device,
                )
            loss = tb_loss(logp, ref, reward, beta, behaviour, cfg.tb_clip_eps)
            loss = loss * (len(chunk) / len(groups))
            loss.backward()
            loss_sum += loss.item()
            log_z_sum += tb_log_z(logp, ref, reward, beta).sum().item()
            logp_sum += logp.detach().sum().item()
            # The rest is the off-policy diagnostics' (``offpolicy_metrics``), not the loss's.
            if behaviour is not None:
                rhos.append(logp.detach().double() - behaviour)
            if cfg.tb_clip_eps > 0:
                clipped += int(
                    tb_clipped(logp, ref, reward, beta, behaviour, cfg.tb_clip_eps).sum()
                )
        metrics = {
            "loss/tb": loss_sum,
            "loss/logz_mean": log_z_sum / len(groups),
            "policy/logp_mean": logp_sum / items,
        }
        if rhos:
            metrics.update(offpolicy_metrics(torch.cat(rhos), clipped, items))
        return metrics

    def micro_batches(self, groups: list[list[Trajectory]]) -> Iterator[list[list[Trajectory]]]:
        """The forward passes of a step: micro_batch_size sequences each, in whole groups."""
        for part in group_passes(
            len(groups), self.cfg.responses_per_prompt, self.cfg.micro_batch_size
        ):
            yield groups[part]

    def score(self, groups: list[list[Trajectory]], scorer: Callable = group_logprobs):
        """log pi of the groups' responses with gradients, by the scoring rule the searchers
        used for log p_ref (``TBAConfig.scoring_rule``): ``scorer(model, prompts, responses,
        **rule)``, the (P, K) sums of ``tba.group_logprobs`` unless a loss asks for another view
        of the same rule (per token: ``tba.group_token_logprobs``)."""
        prompts = [group[0].prompt_tokens for group in groups]
        responses = [[t.response_tokens for t in group] for group in groups]
        rule = self.cfg.scoring_rule(self.pad_id, self.eos_id, self.device)
        rule["share_prompt"] = not self.cfg.gradient_checkpointing  # the cache would be dropped
        with self.autocast:
            return scorer(self.model, prompts, responses, **rule)

    def grad_norm(self) -> torch.Tensor:
        """The norm of the whole gradient, a 0-d tensor."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads)

    # ------------------------------------------------------------------ 5. publish

    def publish(self, store: WeightStore) -> float:
        """5. Copy the weights into the store as version ``step``; returns the seconds taken."""
        t0 = time.perf_counter()
        store.publish(self.weights_to_publish(), self.step, self.probe())
        self.buffer.mark_published()  # most-on-policy now means refreshed after this publish
        return time.perf_counter() - t0

    def weights_to_publish(self) -> list[tuple[str, torch.Tensor]]:
        """The named weights the searchers load."""
        return list(self.model.named_parameters())

    def probe(self) -> float:
        """A number computed from the weights that goes out with them, for a check in every
        reader (``engines.WeightStore``'s probe); nothing here."""
        return 0.0

    def whole_model(self) -> torch.nn.Module:
        """The policy, whole: for evaluation and ``save_pretrained``."""
        return self.model

    # ------------------------------------------------------- checkpoints (a learner may skip)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "buffer": self.buffer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.buffer.load_state_dict(state["buffer"])
        self.step = state["step"]
        torch.set_rng_state(state["torch_rng"])

    def save(self, path: Path) -> None:
        """A resumable checkpoint of tensors and plain containers, written atomically (temporary
        file, fsync, rename), so a kill during a save never breaks the latest checkpoint."""
        state = {"trainer": self.state_dict(), "config": dataclasses.asdict(self.cfg)}
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """``weights_only=True``: a checkpoint never unpickles arbitrary code. A file that is
        not a checkpoint of this program, or one of another model, is a RunError naming it."""
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)["trainer"]
        except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, TypeError) as error:
            # torch's own words for an unreadable pickle are about its weights_only default,
            # which would mislead here.
            why = "torch.load cannot read it" if isinstance(error, pickle.UnpicklingError) else ""
            raise RunError(
                f"{path} is not a checkpoint of this program ({why or _first_line(error)}); "
                "move it away, or run without --resume"
            ) from None
        try:
            self.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as error:
            raise RunError(
                f"{path} does not fit this run ({_first_line(error)}): --model and the "
                "extensions' flags must be the checkpoint's, and the code of its version"
            ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n")[0][:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---- what a step trained on: its metrics (a learner may skip) ----


def batch_metrics(
    groups: list[list[Trajectory]],
    is_mop: list[bool],
    version: int,
    new: int,
    distinct: int,
    seconds: float,
) -> dict[str, float]:
    """What a step trained on: the reward, the lags (versions behind ``version``, the weights
    the step started from; 0: generated by them), the most-on-policy share, and of the step's
    ``distinct`` trajectories the ``new`` ones no step had trained on before (a group with fewer
    distinct responses than K repeats some: the buffer keeps one copy of each response); and
    the throughput of the step's ``seconds``."""
    trajectories = [t for group in groups for t in group]
    lags = [version - t.version for t in trajectories]
    lag_counts = collections.Counter(min(lag, LAG_COUNT_TOP) for lag in lags)
    return {
        "reward/mean": statistics.fmean(t.reward for t in trajectories),
        "async/lag_mean": statistics.fmean(lags),
        "async/lag_max": float(max(lags)),
        "async/lag_min": float(min(lags)),
        "async/mop_frac": statistics.fmean(is_mop),
        "async/new_frac": new / distinct,
        "async/distinct_frac": distinct / len(trajectories),
        **{f"async/lag_{lag}": float(lag_counts[lag]) for lag in range(LAG_COUNT_TOP)},
        f"async/lag_{LAG_COUNT_TOP}plus": float(lag_counts[LAG_COUNT_TOP]),
        "throughput/samples_per_s": len(trajectories) / seconds,
        "throughput/tokens_per_s": sum(len(t.response_tokens) for t in trajectories) / seconds,
    }


# ----------------------------------------------------------------------------- 2. the intake


class Intake:
    """2. The searchers' batches drained into the buffer on a thread of its own, so that
    unpickling and adding them overlap the trainer's step (torch releases the GIL while it
    computes; the buffer locks itself), and the trainer's one wait for data (``wait_for``). An
    error the thread meets (SearcherFailed once no restart is left, or any other) ends the
    thread and is raised on the main thread by ``wait_for``."""

    def __init__(self, pool: SearcherPool, buffer: ReplayBuffer, poll_s: float = 0.05):
        self.pool = pool
        self.buffer = buffer
        self.poll_s = poll_s
        self.arrived = threading.Event()  # set when trajectories were added (or on an error)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tba-intake", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                trajectories = self.pool.collect(self.poll_s)
                self.buffer.extend(trajectories)
                if trajectories:
                    self.arrived.set()
        except BaseException as error:  # noqa: BLE001 (raised on the main thread by wait_for)
            self.error = error
            self.arrived.set()

    def start(self) -> None:
        self.thread.start()

    def wait_for(self, trainer: Trainer, timeout_s: float) -> float:
        """2. Wait until ``trainer.can_step()``, at most ``timeout_s`` seconds; returns the
        seconds waited. Raises the thread's error, or a TimeoutError saying what was missing."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        self._raise_error()
        while not trainer.can_step():
            if time.monotonic() > deadline:
                cfg = trainer.cfg
                raise TimeoutError(
                    f"trainer waited {timeout_s}s for data at step {trainer.step}: "
                    f"{len(self.buffer)} trajectories, the newest of version "
                    f"{self.buffer.newest_version} (barrier_lag {cfg.barrier_lag}, "
                    f"max_train_lag {cfg.max_train_lag}, replay_ratio {cfg.replay_ratio})"
                )
            self.arrived.wait(0.2)
            self.arrived.clear()
            self._raise_error()
        return time.perf_counter() - t0

    def _raise_error(self) -> None:
        """Raise the error that ended the thread, if one did."""
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive() and not self.stopping.is_set():
            raise RuntimeError("the intake thread ended without an error")

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread (it finishes the messages in hand, a searcher's restart included)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the intake thread did not stop within {timeout}s")


# ----------------------------------------------------------------------------- the run


@dataclass
class Parts:
    """What ``run_tba`` builds a run from: the seam. An extension swaps a part for its own
    subclass (a ``functools.partial`` binds the extension's config); README, "Extensions"."""

    # Steps 2-5: called as trainer(cfg, device, pad_id, eos_id).
    trainer: Callable[..., Trainer] = Trainer
    # Step 1: called as searcher(setup) in each searcher process, so it must pickle.
    searcher: Callable[[SearcherSetup], Searcher] = Searcher
    # Starts, watches and stops the searcher processes (each runs a ``searcher``); called as
    # SearcherPool is.
    pool: Callable[..., SearcherPool] = SearcherPool


def run_tba(
    cfg: TBAConfig,
    examples: list[dict],
    reward_fn: Callable,
    *,
    parts: Parts | None = None,
    on_step: Callable[[Trainer, dict], None] | None = None,
    show_progress: bool = True,
) -> Trainer:
    """Run TBA: searchers in child processes, the trainer here. Returns the trained Trainer.

    ``examples`` are dicts with ``id`` and ``prompt`` (text) plus what ``reward_fn`` reads.
    ``parts`` are the classes of the run (default: the paper's TB, README "Extensions").
    ``on_step(trainer, metrics)`` runs after every step and may add keys to ``metrics`` (an
    evaluation). Writes output_dir/metrics.jsonl and output_dir/checkpoint.pt (every
    ``checkpoint_every`` steps and on any exit), from which ``cfg.resume`` continues.
    """
    with Run(cfg, parts or Parts(), show_progress) as run:  # on any exit: stop all, checkpoint
        # 1. The searchers start generating; the trainer loads (or resumes) and publishes.
        trainer = run.start(examples, reward_fn)
        while trainer.step < cfg.total_steps:
            t0 = time.perf_counter()
            wait_s = run.intake.wait_for(trainer, cfg.timeout_s)  # 2. data in the buffer

            metrics = trainer.train_step()  # 3-4. sample P x K, the TB loss, an AdamW step

            publish_s = 0.0
            if trainer.step % trainer.publish_every == 0:
                publish_s = trainer.publish(run.store)  # 5. every k steps

            metrics = run.row(metrics, t0, wait_s, publish_s)
            if on_step is not None:
                on_step(trainer, metrics)  # may add keys (an evaluation)
            run.log(metrics)  # metrics.jsonl, the progress bar, the periodic checkpoint
    return trainer


# ---- plumbing: start-up, the metrics row, shutdown, signals, resume (a learner may skip) ----


class Interrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT or SIGTERM; its message says where, and how to resume."""


class Run:
    """Everything around ``run_tba``'s loop: the output files, the weight store, the searcher
    pool, the intake thread and the progress bar. ``start`` brings them up in the order a shared
    GPU needs; leaving the ``with`` block, however it ends, stops every process of the run and,
    once the trainer is loaded, writes a checkpoint. Ctrl-C and SIGTERM end it the same way."""

    def __init__(self, cfg: TBAConfig, parts: Parts, show_progress: bool):
        self.cfg = cfg
        self.parts = parts
        self.show_progress = show_progress
        self.device = torch.device(cfg.trainer_device)
        out_dir = Path(cfg.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_path = out_dir / "checkpoint.pt"
        self.metrics_path = out_dir / "metrics.jsonl"
        self.store = None
        self.pool = None
        self.trainer = None  # set once loaded (and resumed): only then is a checkpoint written
        self.intake = None
        self.bar = None
        self.metrics_file = None
        self.started = 0.0  # when training began: wall_time counts training, not start-up
        self.checkpoint_s = 0.0  # seconds of the latest periodic save, reported in the next row
        self.handlers: dict = {}

    def __enter__(self) -> Run:
        self.handlers = _raise_on_signals()
        return self

    def start(self, examples: list[dict], reward_fn: Callable) -> Trainer:
        """The searchers first, then the trainer: a vLLM engine sizes its KV cache from the GPU
        memory free at its start-up, and may share the trainer's GPU, so the trainer allocates
        nothing but the store (whose layout needs only the policy's names and shapes) before
        every searcher is ready. Then the first publish, which the searchers wait for."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.threads_per_process())
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model, trust_remote_code=cfg.trust_remote_code
        )
        layout = meta_causal_lm(cfg.model, cfg.trust_remote_code)
        self.store = make_weight_store(cfg, layout, self.device)
        self.pool = self.parts.pool(
            cfg, examples, reward_fn, self.store, make=self.parts.searcher, log=tqdm.write
        )
        self.pool.start()
        self.pool.wait_ready()
        self.trainer = _load_trainer(
            self.parts, cfg, self.device, tokenizer, self.ckpt_path, self.metrics_path
        )
        self.trainer.publish(self.store)
        self.intake = Intake(self.pool, self.trainer.buffer)
        self.intake.start()
        self.bar = tqdm(
            total=cfg.total_steps,
            initial=self.trainer.step,
            desc="TBA",
            disable=not self.show_progress,
            dynamic_ncols=True,
        )
        self.metrics_file = open(self.metrics_path, "a")  # noqa: SIM115 (closed in __exit__)
        self.started = time.time()
        return self.trainer

    def row(self, metrics: dict, t0: float, wait_s: float, publish_s: float) -> dict:
        """The step's metrics row: the trainer's, the buffer's, the searchers' and the times."""
        trainer = self.trainer
        row = {"step": trainer.step, "wall_time": time.time() - self.started, **metrics}
        row.update(trainer.buffer.stats(trainer.step))
        row.update(self.pool.metrics())
        row["time/wait"] = wait_s
        row["time/publish"] = publish_s
        row["memory/trainer_peak_gb"] = peak_memory_gb(self.device)
        row["time/step"] = time.perf_counter() - t0
        row["time/checkpoint"] = self.checkpoint_s  # the save after the previous row
        # The whole iteration but the on_step callback (evaluation), with that save: time/step
        # over time/loop is the share of the trainer's loop that trains.
        row["time/loop"] = time.perf_counter() - t0 + self.checkpoint_s
        return row

    def log(self, row: dict) -> None:
        """The row to metrics.jsonl and the bar; then the checkpoint when one is due. After the
        row: a kill between the two leaves the log a row ahead, which --resume cuts back; the
        other order would leave a hole."""
        print(json.dumps(row), file=self.metrics_file, flush=True)
        self.bar.update(1)
        self.bar.set_postfix(progress_fields(row))
        self.checkpoint_s = 0.0
        if self.trainer.step % (self.cfg.checkpoint_every or self.trainer.publish_every) == 0:
            t_save = time.perf_counter()
            self.trainer.save(self.ckpt_path)
            self.checkpoint_s = time.perf_counter() - t_save

    def __exit__(self, kind, error, tb) -> None:
        """Stop the intake and every searcher, then save. It runs to the end: a second Ctrl-C
        (or torchrun's SIGTERM to every rank) must not cut the checkpoint short."""
        for sig in self.handlers:
            signal.signal(sig, signal.SIG_IGN)
        try:
            if self.bar is not None:
                self.bar.close()
            if self.metrics_file is not None:
                self.metrics_file.close()
            if self.intake is not None:
                self.intake.stop()  # then nothing adds to the buffer
            if self.pool is not None:
                self.pool.stop()  # children first: all the run's processes end before the save
            if self.trainer is not None:
                self.trainer.save(self.ckpt_path)
        finally:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)
        if isinstance(error, Interrupted):
            trainer = self.trainer
            where = f"at step {trainer.step}" if trainer is not None else "before training"
            resume = f"; {self.ckpt_path} continues it with --resume" if trainer is not None else ""
            raise Interrupted(f"stopped by {error} {where}{resume}") from None


def progress_fields(metrics: dict) -> dict[str, str]:
    """What the progress bar shows of a step's metrics."""
    shown = {"reward": "reward/mean", "acc": "eval/accuracy", "lag": "async/lag_mean"}
    return {short: f"{metrics[key]:.3g}" for short, key in shown.items() if key in metrics}


def _raise_on_signals() -> dict:
    """Make SIGINT and SIGTERM raise Interrupted in the main thread; returns the old handlers.
    Both are set: a background process inherits SIGINT ignored."""

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}


def _load_trainer(
    parts: Parts,
    cfg: TBAConfig,
    device: torch.device,
    tokenizer,
    ckpt_path: Path,
    metrics_path: Path,
) -> Trainer:
    """The trainer, resumed from ``ckpt_path`` when ``cfg.resume``; metrics.jsonl cut to match."""
    trainer = parts.trainer(cfg, device, pad_token_id(tokenizer), tokenizer.eos_token_id)
    old_rows = []
    if cfg.resume and metrics_path.exists():
        old_rows = metrics_path.read_text().splitlines()
    if cfg.resume and ckpt_path.exists():
        trainer.load(ckpt_path)
        tqdm.write(f"resumed from {ckpt_path} at step {trainer.step}")
    elif cfg.resume:
        tqdm.write(f"--resume: no checkpoint at {ckpt_path}; starting from step 0")
    # A resumed log keeps the rows up to the checkpoint; a new run starts a new log.
    kept = [row for row in old_rows if row.strip() and json.loads(row)["step"] <= trainer.step]
    metrics_path.write_text("".join(row + "\n" for row in kept))
    return trainer
