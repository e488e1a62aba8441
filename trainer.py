"""The trainer (steps 2-5 of tba.py's algorithm) and ``run_tba``, which runs the whole system.

``run_tba`` starts the searcher processes (step 1), waits until each is ready, then loads the
trainer's model, publishes it, and loops here over 2 the queue drained into the replay buffer
(by a thread, ``Intake``) -> 3 sample P groups of K -> 4 the TB loss, AdamW step -> 5 every k
steps publish the weights to the ``WeightStore``. Every wait has a timeout; a failed searcher
is restarted (``max_searcher_restarts`` in all) unless its weights did not arrive; on any exit
every child is stopped and, once the trainer is loaded, a checkpoint written.

Reading order, top to bottom: ``Trainer`` (steps 2-5 as methods), ``Intake`` (step 2's thread),
``run_tba`` (the loop). Extensions plug in through ``Parts``, the classes ``run_tba`` builds a
run from (README, "Extensions"). The sections marked "a learner may skip" hold the off-policy
diagnostics (after the Trainer) and, at the end, the plumbing: the signals and the resume, and
``SearcherPool`` (the searcher processes, their restarts and timeouts).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import os
import pickle
import queue as queue_lib
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tqdm import tqdm
from transformers import AutoTokenizer

from buffer import ReplayBuffer, Trajectory
from searcher import Batch, Failure, Ready, Searcher, SearcherSetup, searcher_main
from tba import (
    RunError,
    TBAConfig,
    WeightStore,
    beta_at,
    group_logprobs,
    group_passes,
    load_causal_lm,
    meta_causal_lm,
    pad_token_id,
    peak_memory_gb,
    tb_clipped,
    tb_log_z,
    tb_loss,
    wsd_lr_factor,
)

LAG_COUNT_TOP = 4  # metrics count the trajectories of lag 0, 1, 2, 3 and 4 or more


# ----------------------------------------------------------------------------- 2-5. the trainer


class Trainer:
    """The policy, AdamW and its schedule, and the replay buffer, on the trainer's device.

    ``ready`` is step 2, ``train_step`` steps 3-4 (``update`` and ``backward``: the TB loss),
    ``publish`` step 5. An extension subclasses it at these methods and at ``micro_batches``,
    ``score``, ``beta``, ``lr_factor``, ``grad_norm``, ``probe``, ``weights_to_publish``,
    ``state_dict``, ``load_state_dict`` and ``whole_model`` (README, "Extensions", says who
    overrides what)."""

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

    def ready(self) -> bool:
        """2. Whether a step may run: the initial fill is in, the newest data at most max_lag
        versions old, P prompts hold data no older than ``oldest_version``, and the step keeps
        the trajectories trained within replay_ratio of those generated; synchronous, only
        P prompts with data of this very version."""
        cfg = self.cfg
        oldest = self.oldest_version()
        young = oldest is None or self.buffer.count_prompts_since(oldest) >= cfg.prompts_per_step
        if cfg.synchronous:
            return young
        filled = len(self.buffer) >= max(cfg.initial_samples, 1)
        enough_prompts = len(self.buffer.groups) >= cfg.prompts_per_step
        # The newest data at most max_lag versions old (the released run's barrier).
        caught_up = cfg.max_lag < 0 or self.buffer.newest_version >= self.step - cfg.max_lag
        trained = (self.step + 1) * cfg.trajectories_per_step()
        paced = cfg.replay_ratio == 0 or trained <= cfg.replay_ratio * self.buffer.num_added
        return filled and enough_prompts and caught_up and young and paced

    def oldest_version(self) -> int | None:
        """The oldest version a step may train on (None: any): this one when synchronous
        (on-policy), else max_train_lag versions behind it when that bound is set."""
        if self.cfg.synchronous:
            return self.step
        if self.cfg.max_train_lag >= 0:
            return self.step - self.cfg.max_train_lag
        return None

    # ------------------------------------------------------------------ 3-4. a step

    def train_step(self) -> dict:
        """3-4. One step on P groups of K from the buffer; returns the step's metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        drawn, first = self.buffer.num_drawn, self.buffer.num_drawn_first
        groups, is_mop = self.buffer.sample(  # 3. most-on-policy with probability m
            cfg.prompts_per_step, cfg.responses_per_prompt, self.oldest_version()
        )
        t1 = time.perf_counter()
        metrics = self.update(groups)  # 4. the loss, and an AdamW step
        t2 = time.perf_counter()

        trajectories = [t for group in groups for t in group]
        distinct = self.buffer.num_drawn - drawn
        # Versions behind the weights this step started from (0: generated by them).
        lags = [self.step - 1 - t.version for t in trajectories]
        lag_counts = collections.Counter(min(lag, LAG_COUNT_TOP) for lag in lags)
        tokens = sum(len(t.response_tokens) for t in trajectories)
        step_s = t2 - t0
        metrics.update(
            {
                "reward/mean": statistics.fmean(t.reward for t in trajectories),
                "async/lag_mean": statistics.fmean(lags),
                "async/lag_max": float(max(lags)),
                "async/lag_min": float(min(lags)),
                "async/mop_frac": statistics.fmean(is_mop),
                # Of the step's distinct trajectories, the share no step had trained on before;
                # and distinct trajectories per drawn one (a group with fewer distinct responses
                # than K repeats some: the buffer keeps one copy of each response).
                "async/new_frac": (self.buffer.num_drawn_first - first) / distinct,
                "async/distinct_frac": distinct / len(trajectories),
                **{f"async/lag_{lag}": float(lag_counts[lag]) for lag in range(LAG_COUNT_TOP)},
                f"async/lag_{LAG_COUNT_TOP}plus": float(lag_counts[LAG_COUNT_TOP]),
                "time/sample": t1 - t0,
                "time/forward_backward": t2 - t1,
                "throughput/samples_per_s": len(trajectories) / step_s,
                "throughput/tokens_per_s": tokens / step_s,
            }
        )
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
        used for log p_ref (temperature, EOS): ``scorer(model, prompts, responses, **rule)``,
        the (P, K) sums of ``tba.group_logprobs`` unless a loss asks for another view of the
        same rule (grpo.py: ``tba.group_token_logprobs``, per token)."""
        cfg = self.cfg
        prompts = [group[0].prompt_tokens for group in groups]
        responses = [[t.response_tokens for t in group] for group in groups]
        rule = dict(
            pad_id=self.pad_id,
            eos_id=self.eos_id,
            temperature=cfg.logprob_temperature(),
            include_eos=cfg.eos_in_logprob,
            share_prompt=not cfg.gradient_checkpointing,
            device=self.device,
        )
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
        reader (``tba.WeightStore``; checks.py's parity probe); nothing here."""
        return 0.0

    def whole_model(self) -> torch.nn.Module:
        """The policy, whole: for evaluation and ``save_pretrained``."""
        return self.model

    # ------------------------------------------------------------------ checkpoints

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


# ---- off-policy diagnostics: how far the policy moved from the samplers (a learner may skip) --


@torch.no_grad()
def offpolicy_metrics(rho: torch.Tensor, clipped: int, items: int) -> dict[str, float]:
    """How far the policy has moved from the behaviour policy on what a step trains, from
    ``rho`` (p, K) = log pi - log pi_b of this process's items (``items`` in the whole batch):
    ``offpolicy/clip_frac`` (share of items tb_loss's trust region took the gradient from),
    ``rho_abs_mean``, ``rho_q10|q50|q90`` and ``ess``, the mean over groups of the effective
    sample size of the importance weights exp(rho) as a share of K, (sum w)^2 / (K sum w^2):
    1 on-policy, 1/K when one item carries all the weight. Each is this process's value times
    its share of the batch, so that data-parallel ranks' values sum to the whole batch's (the
    quantiles to a share-weighted mean of the ranks' quantiles)."""
    share = rho.numel() / items
    quantiles = torch.quantile(
        rho.flatten(), torch.tensor([0.1, 0.5, 0.9], dtype=rho.dtype, device=rho.device)
    )
    w = torch.exp(rho - rho.max(dim=1, keepdim=True).values)  # ess is scale-free: no overflow
    ess = w.sum(dim=1).pow(2) / (w.pow(2).sum(dim=1) * rho.shape[1])
    return {
        "offpolicy/clip_frac": clipped / items,
        "offpolicy/rho_abs_mean": rho.abs().sum().item() / items,
        "offpolicy/rho_q10": quantiles[0].item() * share,
        "offpolicy/rho_q50": quantiles[1].item() * share,
        "offpolicy/rho_q90": quantiles[2].item() * share,
        "offpolicy/ess": ess.mean().item() * share,
    }


# ----------------------------------------------------------------------------- 2. the intake


class Intake:
    """2. The searchers' batches collected into the buffer on a thread of its own, so that
    unpickling and adding them overlap the trainer's step (torch releases the GIL while it
    computes); the buffer locks itself. An error the thread meets (SearcherFailed once no restart
    is left, or any other) ends the thread and is raised on the main thread by ``check()`` and
    ``wait()``, which the trainer's loop calls before every step and while it waits for data."""

    def __init__(self, searchers: SearcherPool, buffer: ReplayBuffer, poll_s: float = 0.05):
        self.searchers = searchers
        self.buffer = buffer
        self.poll_s = poll_s
        self.arrived = threading.Event()  # set when trajectories were added (or on an error)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tba-intake", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                trajectories = self.searchers.collect(self.poll_s)
                self.buffer.extend(trajectories)
                if trajectories:
                    self.arrived.set()
        except BaseException as error:  # noqa: BLE001 (raised on the main thread by check())
            self.error = error
            self.arrived.set()

    def start(self) -> None:
        self.thread.start()

    def check(self) -> None:
        """Raise the error that ended the thread, if one did."""
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive() and not self.stopping.is_set():
            raise RuntimeError("the intake thread ended without an error")

    def wait(self, timeout: float) -> None:
        """Up to ``timeout`` s for trajectories to arrive; raises the thread's error."""
        self.arrived.wait(timeout)
        self.arrived.clear()
        self.check()

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
    """What ``run_tba`` builds a run from. An extension swaps a part for its own subclass (a
    ``functools.partial`` binds the extension's config); README, "Extensions", lists them."""

    # Steps 2-5: called as trainer(cfg, device, pad_id, eos_id).
    trainer: Callable[..., Trainer] = Trainer
    # Step 1: called as searcher(setup) in each searcher process, so it must pickle.
    searcher: Callable[[SearcherSetup], Searcher] = Searcher
    # Starts, watches and stops the searcher processes (each runs a ``searcher``); called as
    # SearcherPool is (a factory: SearcherPool is defined at the end, with the plumbing).
    pool: Callable[..., SearcherPool] = field(default_factory=lambda: SearcherPool)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT or SIGTERM; its message says where, and how to resume."""


def make_weight_store(cfg: TBAConfig, model: torch.nn.Module, device: torch.device) -> WeightStore:
    if cfg.weight_store == "cuda" and device.type != "cuda":
        raise ValueError("--weight_store cuda needs the trainer on a CUDA device")
    on_gpu = cfg.weight_store == "cuda" or (cfg.weight_store == "auto" and device.type == "cuda")
    return WeightStore(
        list(model.named_parameters()), cfg.torch_dtype(), device if on_gpu else torch.device("cpu")
    )


def progress_fields(metrics: dict) -> dict[str, str]:
    """What the progress bar shows of a step's metrics."""
    shown = {"reward": "reward/mean", "acc": "eval/accuracy", "lag": "async/lag_mean"}
    return {short: f"{metrics[key]:.3g}" for short, key in shown.items() if key in metrics}


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
    parts = parts or Parts()
    device = torch.device(cfg.trainer_device)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads_per_process())
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    metrics_path = out_dir / "metrics.jsonl"
    # The searchers start before the trainer allocates anything but the store: a vLLM engine
    # sizes its KV cache from the GPU memory free at its start-up, and may share the trainer's
    # GPU. The store's layout needs only the policy's names and shapes.
    store = make_weight_store(cfg, meta_causal_lm(cfg.model, cfg.trust_remote_code), device)
    searchers = parts.pool(
        cfg,
        examples,
        reward_fn,
        store,
        make=parts.searcher,
        log=tqdm.write,
    )
    trainer = None  # set once loaded (and resumed): only then is a checkpoint written on exit
    intake = None
    bar = None
    handlers = _raise_on_signals()  # Ctrl-C and SIGTERM end the run cleanly, with a checkpoint
    try:
        searchers.start()  # 1. the searchers run from here on, in their own processes
        searchers.wait_ready()
        trainer = _load_trainer(parts, cfg, device, tokenizer, ckpt_path, metrics_path)
        trainer.publish(store)  # the first version: searchers wait for it before generating
        intake = Intake(searchers, trainer.buffer)
        intake.start()
        started = time.time()  # wall_time counts training, not start-up
        bar = tqdm(
            total=cfg.total_steps,
            initial=trainer.step,
            desc="TBA",
            disable=not show_progress,
            dynamic_ncols=True,
        )
        checkpoint_s = 0.0  # seconds of the latest periodic save, reported in the next row
        with open(metrics_path, "a") as metrics_file:
            while trainer.step < cfg.total_steps:
                # 2. The intake thread fills the buffer; wait only when the trainer may not step.
                t0 = time.perf_counter()
                intake.check()
                deadline = time.monotonic() + cfg.timeout_s
                while not trainer.ready():
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"trainer waited {cfg.timeout_s}s for data at step {trainer.step}: "
                            f"{len(trainer.buffer)} trajectories, the newest of version "
                            f"{trainer.buffer.newest_version} (max_lag {cfg.max_lag}, "
                            f"max_train_lag {cfg.max_train_lag}, replay_ratio {cfg.replay_ratio})"
                        )
                    intake.wait(timeout=0.2)
                wait_s = time.perf_counter() - t0

                metrics = trainer.train_step()  # 3-4. sample, TB loss, AdamW step

                publish_s = 0.0
                if cfg.synchronous or trainer.step % cfg.sync_every == 0:
                    publish_s = trainer.publish(store)  # 5. publish every k steps

                metrics = {"step": trainer.step, "wall_time": time.time() - started, **metrics}
                metrics.update(trainer.buffer.stats(trainer.step))
                metrics.update(searchers.metrics())
                metrics["time/wait"] = wait_s
                metrics["time/publish"] = publish_s
                metrics["memory/trainer_peak_gb"] = peak_memory_gb(device)
                metrics["time/step"] = time.perf_counter() - t0
                metrics["time/checkpoint"] = checkpoint_s  # the save after the previous row
                # The whole iteration but the on_step callback (evaluation), with that save:
                # time/step over time/loop is the share of the trainer's loop that trains.
                metrics["time/loop"] = time.perf_counter() - t0 + checkpoint_s
                if on_step is not None:
                    on_step(trainer, metrics)
                print(json.dumps(metrics), file=metrics_file, flush=True)
                bar.update(1)
                bar.set_postfix(progress_fields(metrics))
                # The checkpoint after the step's row: a kill between the two leaves the log a
                # row ahead, which --resume cuts back; the other order would leave a hole.
                checkpoint_s = 0.0
                if trainer.step % (cfg.checkpoint_every or cfg.sync_every) == 0:
                    t_save = time.perf_counter()
                    trainer.save(ckpt_path)
                    checkpoint_s = time.perf_counter() - t_save
    except Interrupted as stop:
        where = f"at step {trainer.step}" if trainer is not None else "before training"
        resume = f"; {ckpt_path} continues it with --resume" if trainer is not None else ""
        raise Interrupted(f"stopped by {stop} {where}{resume}") from None
    finally:
        # Cleanup runs to the end: a second Ctrl-C (or torchrun's SIGTERM to every rank) must
        # not cut the checkpoint short.
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)
        if bar is not None:
            bar.close()
        if intake is not None:
            intake.stop()  # then nothing adds to the buffer
        searchers.stop()  # children first: every process of the run is gone before the save
        if trainer is not None:
            trainer.save(ckpt_path)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return trainer


# ---- plumbing: signals and resume (a learner may skip) ----


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


# ---- 1. plumbing: the searcher processes, their restarts, timeouts and stop (a learner may skip)


class SearcherFailed(RunError):
    """A searcher raised or died, and no restarts are left. The message carries the searcher's
    own traceback, which is where the cause is (a reward that is not a number, a model that does
    not fit): the trainer's side of it says only that the message arrived."""


def prompt_shards(examples: list, num_searchers: int) -> list[list]:
    """Disjoint shards of the prompts, one per searcher: two searchers never generate for the
    same prompt at once."""
    shards = [examples[r::num_searchers] for r in range(num_searchers)]
    if any(not shard for shard in shards):
        raise ValueError(f"{len(examples)} prompts cannot be split over {num_searchers} searchers")
    return shards


def searcher_metrics(arrived: list, latest: dict) -> dict[str, float]:
    """The searchers' side of a step's metrics, for any pool: the mean timings of the batch
    statistics that ``arrived`` since the last step (present only when some did), and what each
    rank last reported (``latest``: rank -> its newest statistics)."""
    out = {}
    if arrived:
        out["time/generate"] = statistics.fmean(s.generate_s for s in arrived)
        out["time/reward"] = statistics.fmean(s.reward_s for s in arrived)
        out["time/reference"] = statistics.fmean(s.reference_s for s in arrived)
        out["time/load"] = statistics.fmean(s.load_s for s in arrived)
    for rank, stats in sorted(latest.items()):
        out[f"searcher{rank}/busy_frac"] = stats.busy_frac
        out[f"searcher{rank}/version"] = float(stats.version)
        out[f"searcher{rank}/peak_mem_gb"] = stats.peak_mem_gb
        for name, value in stats.gauges.items():
            out[f"searcher{rank}/{name}"] = value
    return out


class SearcherPool:
    """Starts, watches, restarts and stops the searcher processes, and collects what they send:
    trajectories for the buffer, and statistics for the metrics. ``collect`` runs on the intake
    thread and ``metrics`` on the main one; a lock keeps them apart."""

    def __init__(
        self,
        cfg: TBAConfig,
        examples: list[dict],
        reward_fn: Callable,
        store: WeightStore,
        make: Callable[[SearcherSetup], Searcher] = Searcher,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.make = make
        self.log = log
        self.ctx = mp.get_context("spawn")
        self.queue = self.ctx.Queue(maxsize=cfg.queue_size)
        self.stop_event = self.ctx.Event()
        shards = prompt_shards(examples, cfg.num_searchers)
        self.setups = [
            SearcherSetup(
                rank=rank,
                cfg=cfg,
                examples=shards[rank],
                reward_fn=reward_fn,
                store=store,
                out_queue=self.queue,
                stop_event=self.stop_event,
            )
            for rank in range(cfg.num_searchers)
        ]
        self.procs: list = [None] * cfg.num_searchers
        self.lock = threading.Lock()
        self.restarts = 0  # all searchers together
        self.last_error: dict[int, str] = {}  # rank -> traceback of its latest Failure
        self.ready: set[int] = set()  # ranks whose running process has sent Ready
        self.arrived: list = []  # BatchStats of the batches since the last metrics()
        self.latest: dict = {}  # rank -> BatchStats of its newest batch

    def start(self, rank: int | None = None) -> None:
        """Start searcher ``rank``, or all of them."""
        ranks = [rank] if rank is not None else range(self.cfg.num_searchers)
        for r in ranks:
            self.ready.discard(r)
            self.procs[r] = self.ctx.Process(
                target=searcher_main, name=f"tba-searcher-{r}", args=(self.setups[r], self.make)
            )
            self.procs[r].start()

    def wait_ready(self) -> None:
        """Wait until every searcher has sent Ready: its engine is built and, with vLLM, its KV
        cache sized from the memory free at that moment, which the trainer has not taken yet."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(self.ready) < self.cfg.num_searchers:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.cfg.num_searchers)) - self.ready)
                raise TimeoutError(
                    f"searcher(s) {missing} not ready (engine and reference model loaded) "
                    f"within {self.cfg.timeout_s}s"
                )
            if self.collect(timeout=0.2):
                raise RuntimeError("a searcher generated before the first publish")

    def collect(self, timeout: float = 0.0) -> list[Trajectory]:
        """The trajectories of every batch waiting (after up to ``timeout`` s for the first
        message); failures restarted or raised (SearcherFailed), readiness and batch statistics
        recorded."""
        messages = self.drain(timeout)  # waits without holding the lock
        with self.lock:
            return self.handle(messages)

    def drain(self, timeout: float = 0.0) -> list[Ready | Batch | Failure]:
        """Every message waiting, after up to ``timeout`` seconds for the first."""
        messages = []
        with contextlib.suppress(queue_lib.Empty):
            if timeout > 0:
                messages.append(self.queue.get(timeout=timeout))
            else:
                messages.append(self.queue.get_nowait())
            while True:
                messages.append(self.queue.get_nowait())
        return messages

    def handle(self, messages: list[Ready | Batch | Failure]) -> list[Trajectory]:
        trajectories = []
        for message in messages:
            if isinstance(message, Failure):
                self.last_error[message.rank] = message.traceback
                why = "raised" if message.restartable else "its weights did not arrive"
                self._failed(message.rank, why, message.restartable)
            elif isinstance(message, Ready):
                self.ready.add(message.rank)
            elif isinstance(message, Batch):
                trajectories += message.trajectories
                self.arrived.append(message.stats)
                self.latest[message.rank] = message.stats
            else:
                raise TypeError(f"SearcherPool: unexpected message {type(message).__name__}")
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._failed(rank, f"exit code {proc.exitcode}")
        return trajectories

    def _failed(self, rank: int, why: str, restartable: bool = True) -> None:
        """A searcher failed: restart it (it loads the newest weights on start) or raise."""
        self.procs[rank].join(timeout=5.0)
        self.procs[rank].kill()  # a no-op when it has exited
        self.procs[rank].join(timeout=5.0)
        error = self.last_error.get(rank, "(no traceback: the process died)")
        limit = self.cfg.max_searcher_restarts
        if not restartable:
            raise SearcherFailed(f"searcher {rank} failed ({why}; not restarted):\n{error}")
        if self.restarts >= limit:
            raise SearcherFailed(
                f"searcher {rank} failed ({why}); {self.restarts} restarts used of {limit}:\n"
                f"{error}"
            )
        self.restarts += 1
        self.log(f"searcher {rank} failed ({why}); restart {self.restarts}/{limit}:\n{error}")
        self.start(rank)

    def metrics(self) -> dict[str, float]:
        """Means of the timings of the batches that arrived since the last call (so present only
        when async/batches_in > 0), and what each searcher last reported."""
        with self.lock:
            arrived, self.arrived = self.arrived, []
            out = {
                "async/batches_in": float(len(arrived)),
                "async/searcher_restarts": float(self.restarts),
            }
            with contextlib.suppress(NotImplementedError):  # qsize is missing on macOS
                out["async/queue_depth"] = float(self.queue.qsize())
            out.update(searcher_metrics(arrived, self.latest))
            return out

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every searcher to stop, drain the queue while they exit, then terminate, then
        kill."""
        self.stop_event.set()
        procs = [p for p in self.procs if p is not None]
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.05)
        for p, end in itertools.product(procs, ("terminate", "kill")):
            if p.is_alive():
                getattr(p, end)()
                p.join(timeout=3.0)
        self.queue.cancel_join_thread()
        self.queue.close()
