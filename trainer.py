"""The trainer, steps 2-5 of tba.py's algorithm, and ``run_tba``, the loop that runs them.

Reading order: ``Intake`` (2: the searchers' batches drained into the buffer on a thread, and
the one wait for data), ``Trainer`` (2 ``can_step``; 3-4 ``train_step``, ``update``,
``backward``: the TB loss; 5 ``publish``), ``Parts`` (the seam: the classes a run is built
from) and ``run_tba``: the system built (weight store, searcher processes, trainer, intake) and
the algorithm's loop, in one screen. Around the loop (output directory, signals, resume,
checkpoints, the metrics row, shutdown): plumbing/run.py."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from buffer import ReplayBuffer, StoredTrajectory, Trajectory
from engines import WeightStore, make_weight_store
from plumbing.checkpoint import Checkpointed, buffer_state, load_buffer_state
from plumbing.logprobs import group_passes
from plumbing.metrics import batch_metrics, offpolicy_metrics
from plumbing.models import load_causal_lm, meta_causal_lm, special_token_ids
from plumbing.run import Run
from searcher import Searcher, SearcherPool, SearcherSetup
from tba import TBAConfig, beta_at, group_logprobs, tb_clipped, tb_log_z, tb_loss, wsd_lr_factor

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
        ended = not self.thread.is_alive()  # first: the thread sets its error, then ends
        if self.error is not None:
            raise self.error
        if ended and not self.stopping.is_set():
            raise RuntimeError("the intake thread ended without an error")

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread (it finishes the messages in hand, a searcher's restart included)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the intake thread did not stop within {timeout}s")


# ----------------------------------------------------------------------------- 2-5. the trainer


class Trainer(Checkpointed):
    """The policy, AdamW and its schedule, and the replay buffer, on the trainer's device.

    ``can_step`` is step 2, ``train_step`` steps 3-4 (``update`` and ``backward``: the TB loss),
    ``publish`` step 5. Its other methods are the seams an extension overrides
    (docs/extensions.md says which and who)."""

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        """2-5. The policy in training, its optimizer and the replay buffer, at version 0."""
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
        compute = torch.autocast(device.type, dtype=cfg.torch_dtype()) if mixed else None
        self.autocast = compute or contextlib.nullcontext()
        self.optimizer, self.scheduler = self.make_optimizer()
        self.previous = copy.deepcopy(self.model).requires_grad_(False) if cfg.tb_clip_eps else None
        self.buffer = ReplayBuffer(cfg.buffer_capacity, cfg.mop_prob, cfg.inv_temp, cfg.seed)
        self.step = 0  # optimizer steps done = the version of the current weights
        # The synchronous baseline is this trainer on-policy: it publishes every step and trains
        # only on its current weights' data (searchers generate once per version: searcher.py).
        sync = cfg.synchronous
        self.publish_every = 1 if sync else cfg.publish_every
        self.max_train_lag = 0 if sync else cfg.max_train_lag
        self.initial_samples = 0 if sync else cfg.initial_samples

    def make_optimizer(self):
        """4. AdamW over the model's parameters, and its warmup-stable-decay schedule."""
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
        """2-3. The oldest version a step may train on: max_train_lag versions behind this one
        (None: no bound)."""
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
            raise FloatingPointError(f"step {self.step}: the gradient norm is {grad_norm.item()}")
        if cfg.max_grad_norm > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, grad_norm)
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        metrics["train/grad_norm"] = grad_norm.item()
        if self.previous is not None:  # these weights: the next step's second anchor
            self.previous.load_state_dict(self.model.state_dict())
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return metrics

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. The gradient of ``tb_loss`` on the (P, K) batch, accumulated into ``.grad`` over
        ``micro_batches``. log Z is per prompt, so each pass's loss weighted by its share of the
        P groups sums to tb_loss on the whole batch, exactly. Returns the loss's metrics, each a
        batch sum / a whole-batch count (``offpolicy_metrics`` says which are not)."""
        eps = self.cfg.tb_clip_eps
        recorded = all(t.behaviour_logprob is not None for g in groups for t in g)
        if eps > 0 and not recorded:
            raise ValueError("--tb_clip_eps: a trajectory's searcher recorded no log pi_b")
        sums = {"loss/tb": 0.0, "loss/logz_mean": 0.0, "policy/logp_mean": 0.0}
        rhos = []  # log pi - log pi_b of each item, when the searchers recorded log pi_b
        clipped = 0
        for chunk in self.micro_batches(groups):
            logp = self.score(chunk)
            ref = item_tensor(chunk, "ref_logprob", self.device)
            reward = item_tensor(chunk, "reward", self.device)
            behaviour = item_tensor(chunk, "behaviour_logprob", self.device) if recorded else None
            lags = self.step - item_tensor(chunk, "version", self.device)  # versions behind
            with torch.no_grad():  # log pi of the weights one update old: the second anchor
                prox = None if self.previous is None else self.score(chunk, model=self.previous)
            region = (behaviour, eps, lags, prox)  # the trust region's (tba.tb_loss)
            loss = tb_loss(logp, ref, reward, beta, *region) * (len(chunk) / len(groups))
            loss.backward()
            # The rest is the metrics': the loss, log Z, and how far the policy has moved.
            sums["loss/tb"] += loss.item()
            sums["loss/logz_mean"] += tb_log_z(logp, ref, reward, beta).sum().item()
            sums["policy/logp_mean"] += logp.detach().sum().item()
            if recorded:
                rhos.append(logp.detach().double() - behaviour)
            if eps > 0:
                clipped += int(tb_clipped(logp, ref, reward, beta, *region).sum())
        items = sum(len(g) for g in groups)
        metrics = {**sums, "loss/logz_mean": sums["loss/logz_mean"] / len(groups)}
        metrics["policy/logp_mean"] /= items
        if rhos:
            metrics.update(offpolicy_metrics(torch.cat(rhos), clipped, items))
        return metrics

    def micro_batches(self, groups: list[list[Trajectory]]) -> Iterator[list[list[Trajectory]]]:
        """4. The forward passes of a step: micro_batch_size sequences each, in whole groups."""
        cfg = self.cfg
        for part in group_passes(len(groups), cfg.responses_per_prompt, cfg.micro_batch_size):
            yield groups[part]

    def score(self, groups: list[list[Trajectory]], scorer: Callable = group_logprobs, model=None):
        """4. log pi of the groups' responses with gradients, by the scoring rule the searchers
        used for log p_ref (``TBAConfig.scoring_rule``): ``scorer(model, prompts, responses,
        **rule)``, the (P, K) sums of ``tba.group_logprobs`` unless a loss asks for another view
        of the same rule (per token: ``tba.group_token_logprobs``); ``model``: the policy's."""
        prompts = [group[0].prompt_tokens for group in groups]
        responses = [[t.response_tokens for t in group] for group in groups]
        rule = self.cfg.scoring_rule(self.pad_id, self.eos_id, self.device)
        rule["share_prompt"] = not self.cfg.gradient_checkpointing  # the cache would be dropped
        with self.autocast:
            return scorer(self.model if model is None else model, prompts, responses, **rule)

    def grad_norm(self) -> torch.Tensor:
        """4. The norm of the whole gradient, a 0-d tensor."""
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
        """5. The named weights the searchers load."""
        return list(self.model.named_parameters())

    def probe(self) -> float:
        """A number computed from the weights that goes out with them, for a check in every
        reader (``engines.WeightStore``'s probe); nothing here."""
        return 0.0

    def whole_model(self) -> torch.nn.Module:
        """The policy, whole: for evaluation and ``save_pretrained``."""
        return self.model

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Everything a resumed run needs (``save`` and ``load``: plumbing/checkpoint.py)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "buffer": buffer_state(self.buffer),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        load_buffer_state(self.buffer, state["buffer"], StoredTrajectory)
        self.step = state["step"]
        torch.set_rng_state(state["torch_rng"])
        if self.previous is not None:  # as at a run's start: the first update's anchor is itself
            self.previous.load_state_dict(self.model.state_dict())


def item_tensor(groups: list[list[Trajectory]], name: str, device: torch.device) -> torch.Tensor:
    """4. The field ``name`` of each item of the groups, as a (P, K) tensor: fp64 for the
    behaviour log-probs (sums over hundreds of tokens), the default dtype for the rest."""
    dtype = torch.float64 if name == "behaviour_logprob" else None
    return torch.tensor([[getattr(t, name) for t in g] for g in groups], dtype=dtype, device=device)


# ----------------------------------------------------------------------------- the run


@dataclass
class Parts:
    """What ``run_tba`` builds a run from: the seam. An extension swaps a part for its own
    subclass (a ``functools.partial`` binds the extension's config); docs/extensions.md."""

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
    """1-5. Run TBA: searchers in child processes, the trainer here; returns the trained Trainer.
    ``examples`` are dicts with ``id`` and ``prompt`` (text) plus what ``reward_fn`` reads;
    ``parts`` the run's classes (default: the paper's TB); ``on_step(trainer, metrics)`` runs
    after every step and may add keys (an evaluation). Writes output_dir/metrics.jsonl and
    checkpoint.pt (every ``checkpoint_every`` steps and on any exit; ``cfg.resume`` goes on)."""
    parts = parts or Parts()
    with Run(cfg, show_progress) as run:  # on any exit: stop what it stops, then a checkpoint
        # 1. The searchers start first (a vLLM engine sizes its KV cache from the GPU memory free
        # at its start), then the trainer loads and publishes the version they wait for.
        layout = meta_causal_lm(cfg.model, cfg.trust_remote_code)  # names and shapes only
        store = make_weight_store(cfg, layout, run.device)  # shared tensors
        pool = run.stops(parts.pool(cfg, examples, reward_fn, store, parts.searcher, run.say))
        pool.start()
        pool.wait_ready()
        pad_id, eos_id = special_token_ids(cfg.model, cfg.trust_remote_code)
        trainer = run.resume(parts.trainer(cfg, run.device, pad_id, eos_id))
        trainer.publish(store)
        intake = run.stops(Intake(pool, trainer.buffer))
        intake.start()
        while trainer.step < cfg.total_steps:
            t0 = time.perf_counter()
            wait_s = intake.wait_for(trainer, cfg.timeout_s)  # 2. data in the buffer

            metrics = trainer.train_step()  # 3-4. sample P x K, the TB loss, an AdamW step

            publish_s = 0.0
            if trainer.step % trainer.publish_every == 0:
                publish_s = trainer.publish(store)  # 5. every k steps

            metrics = run.row(metrics, pool, t0, wait_s, publish_s)
            if on_step is not None:
                on_step(trainer, metrics)  # may add keys (an evaluation)
            run.log(metrics)  # metrics.jsonl, the progress bar, the periodic checkpoint
    return trainer
