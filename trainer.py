"""The trainer (steps 2-5 of tba.py's algorithm) and ``run_tba``, which runs the whole system.

``run_tba`` starts the searcher processes (step 1), waits until each is ready, then loads the
trainer's model, publishes it, and loops here over 2 the queue drained into the replay buffer
(by a thread, ``Intake``) -> 3 sample P groups of K -> 4 the loss (TB, or the GRPO baseline),
AdamW step -> 5 every k steps publish the weights to the ``WeightStore``. Every wait has a
timeout; a failed searcher is restarted (``max_searcher_restarts`` in all) unless its weights
did not arrive; on any exit every child is joined and, once the trainer is loaded, a checkpoint
written.

With ``--listen`` a gateway process also serves searchers on other nodes, and ``node_main`` is
such a node (``run_gsm8k.py --join``): the last two sections.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import multiprocessing
import os
import queue as queue_lib
import signal
import socket
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import (
    AuthenticationError,
    Client,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers import AutoTokenizer

from buffer import ReplayBuffer, Trajectory
from searcher import (
    HEARTBEAT_S,
    PEER_TIMEOUT_S,
    REMOTE_RANK_BASE,
    SECRET_ENV,
    Batch,
    BatchStats,
    Bye,
    Credit,
    Failure,
    Heartbeat,
    Join,
    ParityProbe,
    Ready,
    SearcherSetup,
    VersionHeader,
    Want,
    Welcome,
    parse_address,
    raw_socket,
    read_secret,
    receive_version,
    searcher_main,
    send_version,
    set_peer_timeouts,
    weights_checksum,
)
from tba import (
    TBAConfig,
    WeightStore,
    beta_at,
    group_logprobs,
    group_token_logprobs,
    grpo_advantages,
    grpo_loss,
    grpo_metrics,
    load_causal_lm,
    meta_causal_lm,
    pad_token_id,
    peak_memory_gb,
    tb_log_z,
    tb_loss,
    wsd_lr_factor,
)


def make_weight_store(cfg: TBAConfig, model: torch.nn.Module, device: torch.device) -> WeightStore:
    if cfg.weight_store == "cuda" and device.type != "cuda":
        raise ValueError("weight_store=cuda needs the trainer on a CUDA device")
    on_gpu = cfg.weight_store == "cuda" or (cfg.weight_store == "auto" and device.type == "cuda")
    return WeightStore(
        list(model.named_parameters()), cfg.torch_dtype(), device if on_gpu else torch.device("cpu")
    )


def padded(rows: list[list[float]], width: int, device: torch.device) -> torch.Tensor:
    """(len(rows), width) fp32, row i = rows[i] from column 0, zeros after."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out.to(device)


# ----------------------------------------------------------------------------- data parallel


class DataParallelFailed(RuntimeError):
    """A collective between the trainer's data-parallel ranks failed: a rank died or timed out."""


@dataclasses.dataclass
class DataParallel:
    """This process's place among the trainer's data-parallel ranks, started by torchrun
    (tba.py, "Data parallel"). Rank 0 runs the single-node system: searchers, replay buffer,
    weight store, metrics, evaluation and checkpoints. Every rank scores its contiguous share of
    each step's P prompt groups; DDP sums the gradients. Each message of rank 0 is one broadcast:
    ``"start"``, a step's groups, or ``None`` (stop). With ``--fsdp`` the weights are sharded, so
    whatever needs them whole is a collective every rank joins, announced by rank 0:
    ``("publish", probe)`` (the parity probe's forward and the gather of the full weights) and
    ``"save"`` (the gather of the full weights and AdamW moments for the checkpoint) and
    ``"gather"`` (a whole copy of the model on rank 0, for evaluation)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float

    @classmethod
    def from_env(cls, trainer_device: str, timeout_s: float) -> DataParallel | None:
        """None without torchrun's WORLD_SIZE > 1; else join (or reuse) the default process
        group: NCCL for CUDA trainer devices, gloo on CPU, every collective bounded by
        ``timeout_s``."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = rank_device(trainer_device, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(dist.get_rank(), world_size, local_rank, device, timeout_s)

    def share(self, count: int) -> range:
        """The indices of this rank's groups among ``count``: contiguous, sizes differ by at
        most one, every rank at least one (``check``)."""
        size, extra = divmod(count, self.world_size)
        start = self.rank * size + min(self.rank, extra)
        return range(start, start + size + (self.rank < extra))

    def check(self, cfg: TBAConfig) -> None:
        """Every rank needs at least one whole group a step."""
        if cfg.prompts_per_step < self.world_size:
            raise ValueError(
                f"data parallel: prompts_per_step ({cfg.prompts_per_step}) must be at least the "
                f"number of ranks ({self.world_size}): a group is never split (log Z is per prompt)"
            )

    def others(self) -> str:
        """The ranks a failure on rank 0 may come from, for its message."""
        if self.world_size == 2:
            return "rank 1"
        return f"one of ranks 1-{self.world_size - 1}"

    def failed(self, what: str, error: Exception) -> DataParallelFailed:
        who = self.others() if self.rank == 0 else "rank 0"
        return DataParallelFailed(
            f"data parallel, rank {self.rank}: {what} failed; {who} died or did not answer "
            f"within {self.timeout_s:g}s (timeout_s): {error}"
        )

    def send(self, message) -> None:
        """Rank 0: hand ``message`` to every other rank."""
        try:
            dist.broadcast_object_list([message], src=0, device=self._object_device())
        except RuntimeError as e:  # gloo raises RuntimeError, NCCL DistError (a subclass)
            raise self.failed("handing out work", e) from e

    def receive(self):
        """Ranks > 0: the next message of rank 0."""
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, device=self._object_device())
        except RuntimeError as e:
            raise self.failed("waiting for work", e) from e
        return box[0]

    def share_object(self, value):
        """Rank 0's ``value`` on every rank."""
        if self.rank == 0:
            self.send(value)
            return value
        return self.receive()

    def close(self) -> None:
        """Leave the process group (the end of a run)."""
        dist.destroy_process_group()

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (fp64)."""
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(total)
        except RuntimeError as e:
            raise self.failed("summing metrics", e) from e
        return total.tolist()

    def check_same(self, trainer: Trainer) -> None:
        """Raise unless every rank starts from the same step and weights (a resumed rank that
        found no checkpoint, on a file system the ranks do not share, would not). Sharded, the
        checksum is of the gathered whole weights, the same on every rank: the step tells."""
        try:
            with torch.no_grad():
                checksum = sum(
                    full_tensor(p).double().sum().item() for p in trainer.model.parameters()
                )
        except RuntimeError as e:
            raise self.failed("gathering the weights", e) from e
        mine = torch.tensor([trainer.step, checksum], dtype=torch.float64, device=self.device)
        low, high = mine.clone(), mine.clone()
        try:
            dist.all_reduce(low, dist.ReduceOp.MIN)
            dist.all_reduce(high, dist.ReduceOp.MAX)
        except RuntimeError as e:
            raise self.failed("comparing the ranks' weights", e) from e
        if not torch.equal(low, high):
            raise DataParallelFailed(
                f"data parallel, rank {self.rank}: the ranks start from different steps or "
                f"weights (step {trainer.step}, weights sum {checksum}; the ranks range over "
                f"{low.tolist()} to {high.tolist()}): output_dir must be one directory that every "
                "rank reads (--resume)"
            )

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (FSDP's DTensor: an all-gather every rank joins), or
    ``tensor`` itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_model(model: torch.nn.Module, dp: DataParallel) -> None:
    """FSDP2 over the data-parallel ranks: each decoder layer (the classes transformers keeps
    whole, ``_no_split_modules``) one unit, gathered for its forward and backward only, then the
    model, whose unit holds the rest (embeddings, final norm, head). Gradients are averaged over
    the ranks, as DDP's are."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"--fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules)"
        )
    mesh = init_device_mesh(dp.device.type, (dp.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def gradient_sync_off(model):
    """FSDP2's ``no_sync``: gradients accumulate unreduced until a backward outside."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def is_collective_error(error: RuntimeError) -> bool:
    """Whether ``error`` is a failed collective: DistError (NCCL, timeouts), or gloo's
    RuntimeError, which names its source file."""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


def rank_device(trainer_device: str, local_rank: int) -> torch.device:
    """The trainer device of the rank with ``local_rank`` on its node: the ``local_rank``-th of
    a comma list; one ``cuda:N``: ``cuda:N + local_rank``; ``cpu``: the CPU."""
    devices = [d.strip() for d in trainer_device.split(",") if d.strip()]
    if len(devices) > 1:
        if local_rank >= len(devices):
            raise ValueError(
                f"trainer_device lists {len(devices)} devices, but local rank is {local_rank}"
            )
        return torch.device(devices[local_rank])
    device = torch.device(devices[0])
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + local_rank)


class GroupScorer(torch.nn.Module):
    """``tba.group_logprobs`` (or ``group_token_logprobs``) of a model as one module call, so
    that DDP, which reduces the gradients of what runs through its forward, covers both model
    calls of a shared-prompt pass."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, prompts, responses, per_token: bool, **rule):
        scorer = group_token_logprobs if per_token else group_logprobs
        return scorer(self.model, prompts, responses, **rule)


# ----------------------------------------------------------------------------- 2-5. the trainer

LAG_COUNT_TOP = 4  # metrics count the trajectories of lag 0, 1, 2, 3 and 4 or more


class Trainer:
    """Model, optimizer, schedules and buffer.

    ``ready`` is step 2, ``train_step`` steps 3-4, ``publish`` step 5."""

    def __init__(
        self,
        cfg: TBAConfig,
        device: torch.device,
        pad_id: int,
        eos_id: int,
        probe: ParityProbe | None = None,
        dp: DataParallel | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.probe = probe
        # Mixed precision: fp32 weights and moments, compute autocast to `dtype`. Otherwise the
        # weights and AdamW moments are in `dtype` itself (the released run: bf16).
        mixed = cfg.fp32_master_weights and cfg.dtype != "float32"
        weights_dtype = torch.float32 if mixed else cfg.torch_dtype()
        self.weights_dtype = weights_dtype
        self.model = load_causal_lm(cfg.model, weights_dtype, device, cfg.trust_remote_code)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        # Data parallel: the forward runs through DDP, which averages the gradients over the
        # ranks at the backward of each step's last pass (``passes`` scales the losses so that
        # the average is the whole batch's gradient); ``self.model`` stays the bare model.
        # With --fsdp, fully_shard instead: each rank keeps a shard of the weights, gradients
        # and moments, and the forward runs through the bare (sharded) model.
        self.dp = dp
        self.ddp = None
        self.sharded = dp is not None and cfg.fsdp
        if self.sharded:
            dp.check(cfg)
            shard_model(self.model, dp)
        elif dp is not None:
            dp.check(cfg)
            self.ddp = DistributedDataParallel(
                GroupScorer(self.model),
                device_ids=[device.index] if device.type == "cuda" else None,
                forward_sync_buffers=False,
            )
        if mixed:
            self.autocast = torch.autocast(device.type, dtype=cfg.torch_dtype())
        else:
            self.autocast = contextlib.nullcontext()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        # Update t = 1, 2, ... runs at factor(t), as the released code steps the scheduler first.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: wsd_lr_factor(
                s + 1, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.decay_shape
            ),
        )
        self.buffer = ReplayBuffer(cfg.buffer_capacity, cfg.mop_prob, cfg.inv_temp, cfg.seed)
        self.step = 0  # optimizer steps done = the version of the current weights
        self.published: dict[int, float] = {}  # version -> weights checksum, with the parity probe

    def ready(self) -> bool:
        """2. Whether a step may run: the initial fill is in and the newest data at most max_lag
        versions old, and with max_train_lag P prompts hold data at most that old; or
        (synchronous) P prompts hold data of this version."""
        cfg = self.cfg
        if cfg.synchronous:
            return self.buffer.count_version(self.step) >= cfg.prompts_per_step
        filled = len(self.buffer) >= max(cfg.initial_samples, 1)
        enough_prompts = len(self.buffer.groups) >= cfg.prompts_per_step
        fresh_enough = cfg.max_lag < 0 or self.buffer.newest_version >= self.step - cfg.max_lag
        if cfg.max_train_lag >= 0:
            young = self.buffer.count_prompts_since(self.step - cfg.max_train_lag)
            fresh_enough = fresh_enough and young >= cfg.prompts_per_step
        return filled and enough_prompts and fresh_enough

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. Accumulate the gradient of the configured loss (``--loss``) on the (P, K) batch
        into ``.grad``; returns the loss's metrics. Data parallel, each rank scores its share
        of the groups (``share``) and the gradient and the metrics are those of the whole batch.
        """
        if self.cfg.loss == "grpo":
            return self.grpo_backward(groups)
        return self.tb_backward(groups, beta)

    def share(self, count: int) -> range:
        """The indices of the groups, of ``count``, that this rank scores: all of them on one
        rank."""
        return self.dp.share(count) if self.dp is not None else range(count)

    def passes(self, groups: list[list[Trajectory]]):
        """(first index, the pass's groups, its weight, sync context) of each forward pass over
        this rank's share. Data parallel, the gradient is reduced only at the backward of the
        last pass (DDP's ``no_sync`` before), and each pass's loss is multiplied by the number of
        ranks, which the average over the ranks divides out (``grad_scale``). Sharded (FSDP),
        every forward and backward gathers weights with all ranks, so every rank runs as many
        passes as the rank with the largest share: a rank with fewer repeats its last pass with
        weight 0 (no gradient, no metrics)."""
        mine = self.share(len(groups))
        per_pass = self.groups_per_pass(len(mine))
        firsts = list(range(mine.start, mine.stop, per_pass))
        weights = [1.0] * len(firsts)
        if self.sharded:
            most = math.ceil(len(groups) / self.dp.world_size)
            extra = math.ceil(most / self.groups_per_pass(most)) - len(firsts)
            firsts += [firsts[-1]] * extra
            weights += [0.0] * extra
        for i, (first, weight) in enumerate(zip(firsts, weights, strict=True)):
            chunk = groups[first : min(first + per_pass, mine.stop)]
            last = i == len(firsts) - 1
            sync = None
            if self.ddp is not None and not last:
                sync = self.ddp.no_sync()
            if self.sharded and not last:
                sync = gradient_sync_off(self.model)
            yield first, chunk, weight, sync or contextlib.nullcontext()

    def grad_scale(self) -> int:
        return self.dp.world_size if self.dp is not None else 1

    def reduce(self, values: list[float]) -> list[float]:
        """Per-rank sums summed over the ranks (as they are on one rank)."""
        return self.dp.sum(values) if self.dp is not None else values

    def groups_per_pass(self, num_groups: int) -> int:
        """Prompt groups per forward pass: micro_batch_size sequences rounded down to whole
        groups (at least one), or all ``num_groups`` in one pass."""
        cfg = self.cfg
        if cfg.micro_batch_size:
            return max(1, cfg.micro_batch_size // cfg.responses_per_prompt)
        return num_groups

    def score(self, groups: list[list[Trajectory]], per_token: bool):
        """log pi of the groups' responses with gradients, by the scoring rule the searchers
        used for log p_ref (temperature, EOS): (P, K) sums, or with ``per_token`` the (B, T)
        token log-probs and their mask (``tba.group_token_logprobs``)."""
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
            if self.ddp is not None:
                return self.ddp(prompts, responses, per_token, **rule)
            scorer = group_token_logprobs if per_token else group_logprobs
            return scorer(self.model, prompts, responses, **rule)

    def tb_backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """tb_loss, in passes of ``groups_per_pass`` (over this rank's share). log Z is per
        prompt, so the passes' losses weighted by their share of the P groups sum to tb_loss on
        the whole batch, exactly, across passes and ranks alike."""
        cfg = self.cfg
        loss_sum = 0.0
        log_z_sum = 0.0
        logp_sum = 0.0
        for _, chunk, weight, sync in self.passes(groups):
            with sync:
                logp = self.score(chunk, per_token=False)
                ref = torch.tensor([[t.ref_logprob for t in g] for g in chunk], device=self.device)
                reward = torch.tensor([[t.reward for t in g] for g in chunk], device=self.device)
                loss = tb_loss(logp, ref, reward, beta, cfg.tb_residual_bound)
                loss = loss * (len(chunk) / len(groups))
                (loss * (weight * self.grad_scale())).backward()
            if not weight:
                continue
            loss_sum += loss.item()
            log_z_sum += tb_log_z(logp, ref, reward, beta).sum().item()
            logp_sum += logp.detach().sum().item()
        loss_sum, log_z_sum, logp_sum = self.reduce([loss_sum, log_z_sum, logp_sum])
        return {
            "loss/tb": loss_sum,
            "loss/logz_mean": log_z_sum / len(groups),
            "policy/logp_mean": logp_sum / sum(len(g) for g in groups),
        }

    def grpo_backward(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        """grpo_loss, in passes of ``groups_per_pass``: advantages from the whole batch's (P, K)
        rewards; each pass's token mean weighted by its share of the batch's scored tokens, so
        the passes sum to grpo_loss on the whole batch (token-level), gradient included. The
        searchers recorded log pi_old and log p_ref per scored token (``tba.scored_tokens``);
        a list that does not match the tokens scored here is an error naming the prompt."""
        cfg = self.cfg
        for t in (t for g in groups for t in g):
            if t.logprobs is None or t.ref_token_logprobs is None:
                raise ValueError(
                    f"--loss grpo: a trajectory of prompt {t.prompt_id!r} has no per-token "
                    "log-probs (made by a searcher, or saved in a checkpoint, under --loss tb)"
                )
        reward = torch.tensor([[t.reward for t in g] for g in groups], device=self.device)
        advantages = grpo_advantages(reward)
        total = sum(len(t.logprobs) for g in groups for t in g)
        keys = ("loss", "clip_frac", "kl", "ratio_mean")
        sums = dict.fromkeys(keys, 0.0)
        logp_sum = 0.0
        for first, chunk, weight, sync in self.passes(groups):
            flat = [t for g in chunk for t in g]
            with sync:
                logp, mask = self.score(chunk, per_token=True)
                for t, n in zip(flat, mask.sum(1).tolist(), strict=True):
                    if len(t.logprobs) != n or len(t.ref_token_logprobs) != n:
                        raise ValueError(
                            f"--loss grpo: prompt {t.prompt_id!r}: {n} scored tokens, but "
                            f"{len(t.logprobs)} behaviour and {len(t.ref_token_logprobs)} "
                            "reference log-probs recorded (the searcher scored by another rule)"
                        )
                old = padded([t.logprobs for t in flat], logp.shape[1], self.device)
                ref = padded([t.ref_token_logprobs for t in flat], logp.shape[1], self.device)
                adv = advantages[first : first + len(chunk)].reshape(-1)
                tokens = int(mask.sum())
                share = tokens / max(total, 1)
                loss = grpo_loss(logp, old, ref, mask, adv, cfg.grpo_clip_eps, cfg.grpo_kl_coef)
                (loss * share * (weight * self.grad_scale())).backward()
            if not weight:
                continue
            sums["loss"] += loss.item() * share
            for key, value in grpo_metrics(logp, old, ref, mask, adv, cfg.grpo_clip_eps).items():
                sums[key] += value.item() * share
            logp_sum += logp.detach().sum().item()
        *reduced, logp_sum = self.reduce([sums[key] for key in keys] + [logp_sum])
        sums = dict(zip(keys, reduced, strict=True))
        return {
            "loss/grpo": sums["loss"],
            "grpo/clip_frac": sums["clip_frac"],
            "grpo/kl": sums["kl"],
            "grpo/ratio_mean": sums["ratio_mean"],
            "policy/logp_mean": logp_sum / sum(len(g) for g in groups),
        }

    def train_step(self) -> dict:
        """3-4. One step on P groups of K from the buffer (most-on-policy with probability m, or
        all of this version when synchronous); returns the step's metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        version = self.step if cfg.synchronous else None
        min_version = self.step - cfg.max_train_lag if cfg.max_train_lag >= 0 else None
        groups, is_mop = self.buffer.sample(
            cfg.prompts_per_step, cfg.responses_per_prompt, version, min_version
        )
        t1 = time.perf_counter()
        if self.dp is not None:
            self.dp.send(groups)  # every rank runs the same update, on its share
        metrics = self.update(groups)
        t2 = time.perf_counter()

        trajectories = [t for group in groups for t in group]
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
        beta = beta_at(
            self.step, cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps, cfg.beta_cut_step
        )
        self.optimizer.zero_grad(set_to_none=True)
        try:
            metrics = self.backward(groups, beta)
        except RuntimeError as e:
            if self.dp is None or not is_collective_error(e):
                raise
            raise self.dp.failed(f"the gradient reduction of step {self.step}", e) from e
        if cfg.loss == "tb":  # GRPO has no beta (its KL weight is grpo_kl_coef)
            metrics["train/beta"] = beta
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(
                f"trainer step {self.step}: gradient norm is {grad_norm.item()}"
            )
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        metrics["train/lr"] = lr
        metrics["train/grad_norm"] = grad_norm.item()
        return metrics

    def publish(self, store: WeightStore) -> float:
        """5. Copy the weights into the store as version ``step``; returns the seconds taken.
        Sharded, every rank joins (``DataParallel``'s ``("publish", probe)``)."""
        t0 = time.perf_counter()
        if self.sharded:
            self.dp.send(("publish", self.probe))
        probe_logp, named = self.weights_to_publish()
        store.publish(named, self.step, probe_logp)
        self.buffer.mark_sync()  # most-on-policy now means refreshed after this publish
        if self.probe is not None:
            self.published[self.step] = weights_checksum(store.views())
        return time.perf_counter() - t0

    def weights_to_publish(self) -> tuple[float, list[tuple[str, torch.Tensor]]]:
        """The parity probe's log-prob and the named weights. Sharded, both are collectives
        every rank runs at once: the probe's forward, then the gather of the full weights, which
        reach rank 0 only (on the CPU; the other ranks get none)."""
        with self.autocast:
            probe_logp = (
                self.probe.logprob(self.model, self.pad_id, self.device) if self.probe else 0.0
            )
        if not self.sharded:
            return probe_logp, list(self.model.named_parameters())
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        try:
            full = get_model_state_dict(self.model, options=options)
        except RuntimeError as e:
            raise self.dp.failed(f"gathering the weights of version {self.step}", e) from e
        if not full:
            return probe_logp, []
        return probe_logp, [(name, full[name]) for name, _ in self.model.named_parameters()]

    def full_model(self) -> torch.nn.Module | None:
        """The policy whole, for evaluation and ``save_pretrained`` on rank 0: ``model`` itself,
        or, sharded, a copy on the trainer device gathered by every rank at once (rank 0 sends
        ``"gather"``); the other ranks get None."""
        if not self.sharded:
            return self.model
        if self.dp.rank == 0:
            self.dp.send("gather")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        try:
            full = get_model_state_dict(self.model, options=options)
        except RuntimeError as e:
            raise self.dp.failed(f"gathering the model of step {self.step}", e) from e
        if self.dp.rank > 0:
            return None
        cpu = torch.device("cpu")
        model = load_causal_lm(self.cfg.model, self.weights_dtype, cpu, self.cfg.trust_remote_code)
        model.load_state_dict(full)
        return model.to(self.device)

    def full_state(self) -> tuple[dict, dict]:
        """The model's and the optimizer's state dicts, whole. Sharded, a gather every rank runs
        at once (``DataParallel``'s ``"save"``): rank 0 gets them on the CPU, keyed by parameter
        name, the others empty dicts."""
        if not self.sharded:
            return self.model.state_dict(), self.optimizer.state_dict()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        try:
            return get_state_dict(self.model, self.optimizer, options=options)
        except RuntimeError as e:
            raise self.dp.failed(f"gathering the state of step {self.step}", e) from e

    def save(self, path: Path) -> None:
        """A resumable checkpoint of tensors and plain containers, written atomically (temporary
        file, fsync, rename), so a kill during a save never breaks the latest checkpoint.
        Sharded, every rank joins the gather (``DataParallel``'s ``"save"``); rank 0 writes."""
        if self.sharded:
            self.dp.send("save")
        model_state, optimizer_state = self.full_state()
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "buffer": self.buffer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save({"trainer": state, "config": dataclasses.asdict(self.cfg)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """``weights_only=True``: a checkpoint never unpickles arbitrary code."""
        state = torch.load(path, map_location=self.device, weights_only=True)["trainer"]
        parts = ("model", "optimizer", "scheduler", "buffer")
        if self.sharded:  # every rank reads the whole checkpoint and keeps its shard
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=StateDictOptions(full_state_dict=True),
            )
            parts = ("scheduler", "buffer")
        for part in parts:
            getattr(self, part).load_state_dict(state[part])
        self.step = state["step"]
        torch.set_rng_state(state["torch_rng"])


# ----------------------------------------------------------------------------- 1. the searchers


class SearcherFailed(RuntimeError):
    """A searcher raised or died, and no restarts are left."""


class SearcherPool:
    """Starts, watches, restarts and stops the searcher processes, and collects what they send:
    trajectories for the buffer, and statistics for the metrics (``metrics``)."""

    def __init__(
        self,
        cfg: TBAConfig,
        examples: list[dict],
        reward_fn: Callable,
        store: WeightStore,
        probe: ParityProbe | None,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.log = log
        self.ctx = mp.get_context("spawn")
        self.queue = self.ctx.Queue(maxsize=cfg.queue_size)
        self.stop_event = self.ctx.Event()
        # Disjoint shards: two searchers never generate for the same prompt at once.
        shards = [examples[r :: cfg.num_searchers] for r in range(cfg.num_searchers)]
        if any(not shard for shard in shards):
            raise ValueError(
                f"{len(examples)} prompts cannot be split over {cfg.num_searchers} searchers"
            )
        self.setups = [
            SearcherSetup(
                rank=rank,
                cfg=cfg,
                examples=shards[rank],
                reward_fn=reward_fn,
                store=store,
                out_queue=self.queue,
                stop_event=self.stop_event,
                probe=probe,
            )
            for rank in range(cfg.num_searchers)
        ]
        self.procs: list = [None] * cfg.num_searchers
        self.restarts = 0  # all searchers together
        self.last_error: dict[int, str] = {}  # rank -> traceback of its latest Failure
        self.ready: set[int] = set()  # ranks whose running process has sent Ready
        self.arrived: list[BatchStats] = []  # of the batches since the last metrics()
        self.latest: dict[int, BatchStats] = {}  # rank -> of its newest batch
        # rank -> the engine's checksum after its newest load: a searcher's version changes only
        # by a load, so this is the checksum of the version its newest batch reports.
        self.checksums: dict[int, float] = {}

    def start(self, rank: int | None = None) -> None:
        """Start searcher ``rank``, or all of them."""
        ranks = [rank] if rank is not None else range(self.cfg.num_searchers)
        for r in ranks:
            self.ready.discard(r)
            self.procs[r] = self.ctx.Process(
                target=searcher_main, name=f"tba-searcher-{r}", args=(self.setups[r],)
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

    def collect(self, timeout: float = 0.0) -> list[Trajectory]:
        """The trajectories of every batch waiting (after up to ``timeout`` s for the first
        message). Also handles failures (restart or raise) and records batch statistics."""
        return self.handle(self.drain(timeout))

    def handle(self, messages: list[Ready | Batch | Failure]) -> list[Trajectory]:
        """``collect``'s work on drained messages: the trajectories; failures restarted or
        raised (SearcherFailed), readiness and batch statistics recorded."""
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
                if message.stats.checksum is not None:
                    self.checksums[message.rank] = message.stats.checksum
            else:
                raise TypeError(f"SearcherPool: unexpected message {type(message).__name__}")
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._failed(rank, f"exit code {proc.exitcode}")
        return trajectories

    def metrics(self) -> dict[str, float]:
        """Means of the timings of the batches that arrived since the last call (so present only
        when async/batches_in > 0), and what each searcher last reported."""
        out = {
            "async/batches_in": float(len(self.arrived)),
            "async/searcher_restarts": float(self.restarts),
        }
        with contextlib.suppress(NotImplementedError):  # qsize is missing on macOS
            out["async/queue_depth"] = float(self.queue.qsize())
        if self.arrived:
            out["time/generate"] = statistics.fmean(s.generate_s for s in self.arrived)
            out["time/reward"] = statistics.fmean(s.reward_s for s in self.arrived)
            out["time/reference"] = statistics.fmean(s.reference_s for s in self.arrived)
            out["time/load"] = statistics.fmean(s.load_s for s in self.arrived)
        self.arrived = []
        for rank, latest in sorted(self.latest.items()):
            out[f"searcher{rank}/busy_frac"] = latest.busy_frac
            out[f"searcher{rank}/version"] = float(latest.version)
            out[f"searcher{rank}/peak_mem_gb"] = latest.peak_mem_gb
            if rank in self.checksums:
                out[f"searcher{rank}/checksum"] = self.checksums[rank]
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


class Intake:
    """2. The searchers' queue drained into the buffer on a thread of its own, so that unpickling
    batches and adding them overlap the trainer's step (torch releases the GIL while it
    computes); the buffer locks itself. While the thread runs it owns the pool: the main thread
    reads the pool's metrics through ``metrics()``, and an error the thread meets (SearcherFailed
    once no restart is left, or any other) ends the thread and is raised on the main thread by
    ``check()`` and ``wait()``, which the trainer's loop calls before every step and while it
    waits for data."""

    def __init__(self, pool: SearcherPool, buffer: ReplayBuffer, poll_s: float = 0.05):
        self.pool = pool
        self.buffer = buffer
        self.poll_s = poll_s
        self.lock = threading.Lock()  # the pool's state: messages handled vs metrics read
        self.arrived = threading.Event()  # set when trajectories were added (or on an error)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tba-intake", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                messages = self.pool.drain(self.poll_s)  # waits without holding the lock
                with self.lock:
                    trajectories = self.pool.handle(messages)
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

    def metrics(self) -> dict[str, float]:
        with self.lock:
            return self.pool.metrics()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread (it finishes the messages in hand, a searcher's restart included); the
        pool is the caller's again."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the intake thread did not stop within {timeout}s")


# ----------------------------------------------------------------------------- the run


def progress_fields(metrics: dict) -> dict[str, str]:
    """What the progress bar shows of a step's metrics."""
    shown = {"reward": "reward/mean", "acc": "eval/accuracy", "lag": "async/lag_mean"}
    return {short: f"{metrics[key]:.3g}" for short, key in shown.items() if key in metrics}


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_tba(
    cfg: TBAConfig,
    examples: list[dict],
    reward_fn: Callable,
    *,
    on_step: Callable[[Trainer, dict], None] | None = None,
    show_progress: bool = True,
) -> Trainer | None:
    """Run TBA: searchers in child processes, the trainer here. Returns the trained Trainer.

    ``examples`` are dicts with ``id`` and ``prompt`` (text) plus what ``reward_fn`` reads.
    ``on_step(trainer, metrics)`` runs after every step and may add keys to ``metrics``. Writes
    output_dir/metrics.jsonl and output_dir/checkpoint.pt (every ``checkpoint_every`` steps and
    on any exit), from which ``cfg.resume`` continues.

    Under torchrun (WORLD_SIZE > 1) this is rank 0 of a data-parallel trainer (``DataParallel``);
    the other ranks run ``follow_rank0`` instead, and return its Trainer (None when rank 0 stopped
    before training). With ``--fsdp`` rank 0's returned Trainer holds the whole trained model,
    gathered on its way out (``gather_on_exit``); ``on_step`` evaluates ``trainer.full_model()``.
    """
    dp = DataParallel.from_env(cfg.trainer_device, cfg.timeout_s)
    device = dp.device if dp is not None else torch.device(cfg.trainer_device)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads_per_process())
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if dp is not None and dp.rank > 0:
        return follow_rank0(cfg, dp, tokenizer)
    probe = None
    if cfg.parity_check:
        probe_prompt = tokenizer(examples[0]["prompt"])["input_ids"]
        probe = ParityProbe.from_prompt(probe_prompt, cfg.parity_tol)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    metrics_path = out_dir / "metrics.jsonl"
    # The searchers start before the trainer allocates anything but the store: a vLLM engine
    # sizes its KV cache from the GPU memory free at its start-up, and may share the trainer's
    # GPU. The store's layout needs only the policy's names and shapes.
    store = make_weight_store(cfg, meta_causal_lm(cfg.model, cfg.trust_remote_code), device)
    pool = SearcherPool(cfg, examples, reward_fn, store, probe, log=tqdm.write)
    gateway = None  # searchers on other nodes feed the same queue (``--listen``)
    if cfg.listen:
        gateway = NodeGateway(cfg, examples, reward_fn, store, pool.queue, probe)
    # Ctrl-C and SIGTERM end the run cleanly. Set both: a background process inherits SIGINT
    # ignored.
    old_handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        old_handlers[sig] = signal.signal(sig, _raise_keyboard_interrupt)
    trainer = None  # set once loaded (and resumed): only then is a checkpoint written on exit
    intake = None
    bar = None
    try:
        pool.start()  # 1. the searchers run from here on, in their own processes
        if gateway is not None:
            gateway.start()
        pool.wait_ready()
        if dp is not None:
            dp.send("start")  # the other ranks load their trainers beside this one
        trainer = _load_trainer(cfg, device, tokenizer, probe, ckpt_path, metrics_path, dp)
        if dp is not None:
            dp.check_same(trainer)
        trainer.publish(store)  # the first version: searchers wait for it before generating
        intake = Intake(pool, trainer.buffer)
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
                            f"max_train_lag {cfg.max_train_lag})"
                        )
                    intake.wait(timeout=0.2)
                wait_s = time.perf_counter() - t0

                metrics = trainer.train_step()  # 3-4. sample, TB loss, AdamW step

                publish_s = 0.0
                if cfg.synchronous or trainer.step % cfg.sync_every == 0:
                    publish_s = trainer.publish(store)  # 5. publish every k steps

                metrics = {"step": trainer.step, "wall_time": time.time() - started, **metrics}
                metrics.update(trainer.buffer.stats(trainer.step))
                metrics.update(intake.metrics())
                metrics.update(gateway.metrics() if gateway is not None else {})
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
    finally:
        if bar is not None:
            bar.close()
        for sig, handler in old_handlers.items():
            # Data parallel: torchrun ends every rank with SIGTERM once one has failed, and
            # SIGKILL 30 s later; the checkpoint is written first.
            signal.signal(sig, signal.SIG_IGN if dp is not None else handler)
        if intake is not None:
            intake.stop()  # then nothing adds to the buffer, and the pool is this thread's
        if gateway is not None:
            gateway.stop()
        pool.stop()  # children first: every process of the run is gone before the save
        if trainer is not None:
            save_on_exit(trainer, ckpt_path)
        if trainer is not None and trainer.sharded:
            gather_on_exit(trainer)
        if dp is not None:
            stop_followers(dp)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
    return trainer


def follow_rank0(cfg: TBAConfig, dp: DataParallel, tokenizer) -> Trainer | None:
    """A data-parallel rank > 0: the same trainer as rank 0's (resumed from the same checkpoint),
    then 4. one update per batch rank 0 hands out, on this rank's share, until rank 0 says stop.
    Searchers, buffer, publishing, metrics and checkpoints are rank 0's."""
    if dp.receive() != "start":  # None: rank 0 stopped before loading its trainer
        return None
    trainer = Trainer(cfg, dp.device, pad_token_id(tokenizer), tokenizer.eos_token_id, dp=dp)
    ckpt_path = Path(cfg.output_dir) / "checkpoint.pt"
    if cfg.resume and ckpt_path.exists():
        trainer.load(ckpt_path)
    dp.check_same(trainer)
    while (message := dp.receive()) is not None:
        if message == "save":
            trainer.full_state()
        elif message == "gather":
            trainer.full_model()
        elif isinstance(message, tuple) and message[0] == "publish":
            trainer.probe = message[1]
            trainer.weights_to_publish()
        else:
            trainer.update(message)
    return trainer


def save_on_exit(trainer: Trainer, path: Path) -> None:
    """Rank 0's checkpoint on its way out. Sharded (--fsdp), it needs every rank; when one has
    died, the last periodic checkpoint stands."""
    try:
        trainer.save(path)
    except DataParallelFailed as e:
        if not trainer.sharded:
            raise
        tqdm.write(f"{e}\n(no checkpoint on exit: the weights are sharded over the ranks)")


def gather_on_exit(trainer: Trainer) -> None:
    """Sharded, the end of rank 0's run: the whole trained model, gathered by every rank,
    becomes rank 0's ``trainer.model`` (unsharded, on the trainer device), for the job's last
    evaluation and ``save_pretrained`` after the ranks part; the trainer does not train after."""
    try:
        model = trainer.full_model()
    except DataParallelFailed as e:
        tqdm.write(f"{e}\n(the trained model stays sharded: it could not be gathered)")
        return
    trainer.model = model
    trainer.sharded = False


def stop_followers(dp: DataParallel) -> None:
    """Rank 0 on its way out: tell the other ranks to stop. A rank that died cannot be told;
    torchrun ends the rest."""
    try:
        dp.send(None)
    except DataParallelFailed as e:
        tqdm.write(f"{e}\n(the other ranks could not be told to stop)")


def _load_trainer(
    cfg: TBAConfig,
    device: torch.device,
    tokenizer,
    probe: ParityProbe | None,
    ckpt_path: Path,
    metrics_path: Path,
    dp: DataParallel | None = None,
) -> Trainer:
    """The trainer, resumed from ``ckpt_path`` when ``cfg.resume``; metrics.jsonl cut to match."""
    trainer = Trainer(cfg, device, pad_token_id(tokenizer), tokenizer.eos_token_id, probe, dp)
    old_rows = []
    if cfg.resume and metrics_path.exists():
        old_rows = metrics_path.read_text().splitlines()
    if cfg.resume and ckpt_path.exists():
        trainer.load(ckpt_path)
        tqdm.write(f"resumed from {ckpt_path} at step {trainer.step}")
    elif cfg.resume:
        tqdm.write(f"--resume: no checkpoint at {ckpt_path}; starting from step 0")
    # A resumed log keeps the rows up to the checkpoint; a fresh run starts a fresh log.
    kept = [row for row in old_rows if row.strip() and json.loads(row)["step"] <= trainer.step]
    metrics_path.write_text("".join(row + "\n" for row in kept))
    return trainer


# ----------------------------------------------------------------------------- searcher nodes
# A node runs its searchers as the trainer does (a NodePool against a node-local WeightStore and
# queue); its main process, the NodeBridge, carries their batches to the trainer and each newest
# version back. On the trainer a NodeGateway process serves every node; it reads the trainer's
# store as a searcher does and feeds the trainer's bounded queue, so the buffer, the staleness
# bounds and the metrics treat remote searchers as local ones. A node is no member of any
# torch.distributed world: its death never stops the trainer (README, "Searchers on other nodes").

NODE_FIELDS = (  # TBAConfig fields a node sets for itself; every other one is the trainer's
    "num_searchers",
    "searcher_devices",
    "torch_threads",
    "engine",
    "vllm_gpu_memory_utilization",
    "vllm_kv_cache_gb",
    "vllm_compile",
    "model",
    "ref_model",
    "secret_file",
    "timeout_s",
)
NODE_SEED_STRIDE = 1000  # node j's searchers draw from seed + 1000 j + 1 + s: no two alike


class NodeError(RuntimeError):
    """A searcher node could not join its trainer, or lost it."""


class RunEnded(Exception):
    """The trainer said goodbye: the run is over, the node exits cleanly."""


def _hang_up(conn) -> None:
    """Shut the connection's socket down, which wakes a thread blocked reading it (a plain
    close from another thread does not)."""
    with contextlib.suppress(OSError), raw_socket(conn) as sock:
        sock.shutdown(socket.SHUT_RDWR)


@dataclasses.dataclass
class GatewaySetup:
    """What the gateway process is started with (pickled once, at spawn)."""

    cfg: TBAConfig
    secret: bytes
    examples: list[dict]
    reward_fn: Callable
    store: WeightStore
    out_queue: Any  # the trainer's bounded trajectory queue (SearcherPool.queue)
    probe: ParityProbe | None
    stop_event: Any
    status: Any  # a queue: "listening", or why not
    connected: Any  # a shared int: nodes connected now


class NodeGateway:
    """The trainer's side of the searcher nodes (``--listen``): starts, watches and stops the
    gateway process. The run stays single-node when ``cfg.listen`` is empty."""

    def __init__(
        self,
        cfg: TBAConfig,
        examples: list[dict],
        reward_fn: Callable,
        store: WeightStore,
        out_queue: Any,
        probe: ParityProbe | None,
    ):
        ctx = mp.get_context("spawn")
        self.setup = GatewaySetup(
            cfg=cfg,
            secret=read_secret(cfg.secret_file),  # no secret: an error before any process starts
            examples=examples,
            reward_fn=reward_fn,
            store=store,
            out_queue=out_queue,
            probe=probe,
            stop_event=ctx.Event(),
            status=ctx.Queue(maxsize=1),
            connected=ctx.Value("i", 0),
        )
        self.proc = ctx.Process(target=gateway_main, name="tba-gateway", args=(self.setup,))

    def start(self) -> None:
        """Start the gateway and wait until it listens; an address it cannot bind is an error."""
        self.proc.start()
        deadline = time.monotonic() + self.setup.cfg.timeout_s
        status = "(no word)"
        while self.proc.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue_lib.Empty):
                status = self.setup.status.get(timeout=0.2)
                break
        if status != "listening":
            raise RuntimeError(f"node gateway: {status}")

    def metrics(self) -> dict[str, float]:
        """Nodes connected now; a dead gateway is an error (its nodes would starve unnoticed)."""
        if not self.proc.is_alive():
            raise RuntimeError(f"the node gateway died (exit code {self.proc.exitcode})")
        return {"nodes/connected": float(self.setup.connected.value)}

    def stop(self, timeout: float = 10.0) -> None:
        """Say goodbye to every node, then end the process (terminate, then kill)."""
        if self.proc.pid is None:
            return  # never started
        self.setup.stop_event.set()
        self.proc.join(timeout=timeout)
        for end in ("terminate", "kill"):
            if self.proc.is_alive():
                getattr(self.proc, end)()
                self.proc.join(timeout=3.0)


@dataclasses.dataclass
class _NodeLink:
    """The gateway's state of one connected node."""

    conn: Any
    node_id: int
    label: str  # for log lines: name, address and id
    pending: collections.deque  # its batches not yet on the trainer's queue
    have: int = -1  # the version it holds
    wants: bool = False  # it will take a newer version
    last_heard: float = 0.0
    last_sent: float = 0.0

    def send(self, message) -> None:
        self.conn.send(message)
        self.last_sent = time.monotonic()


class _Gateway:
    """The gateway process's state: a thread per node, a shared snapshot of the newest version."""

    def __init__(self, setup: GatewaySetup):
        self.setup = setup
        self.closing = threading.Event()
        self.goodbye = Bye("the run ended")  # what each node is told when closing is set
        self.lock = threading.Lock()
        self.names: dict[str, int] = {}  # node name -> the id it joined with first
        self.live: set[int] = set()
        self.snapshot: tuple[int, float, torch.Tensor | None] = (-1, 0.0, None)
        self.threads: list[threading.Thread] = []  # one per connection

    def log(self, msg: str) -> None:
        print(f"gateway: {msg}", flush=True)

    def accept_loop(self, listener) -> None:
        """Accept connections until the listener closes; each is served in its own thread, so
        a peer that stalls its handshake holds up no one."""
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return  # the listener was closed: the run is ending
            host, port = listener.last_accepted
            peer = f"{host}:{port}"
            thread = threading.Thread(target=self.serve, args=(conn, peer), daemon=True)
            thread.start()
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]

    def handshake(self, conn, peer: str) -> Join | None:
        """Both sides prove they hold the secret (HMAC challenge-response) before anything is
        unpickled; then the node's Join. None (logged) when the peer fails or stalls."""
        timer = threading.Timer(PEER_TIMEOUT_S, _hang_up, args=(conn,))
        timer.start()
        try:
            deliver_challenge(conn, self.setup.secret)
            answer_challenge(conn, self.setup.secret)
            join = conn.recv()
        except AuthenticationError:
            self.log(f"refused {peer}: it does not hold the run's secret")
            return None
        except (EOFError, OSError) as exc:
            self.log(f"dropped {peer} during the handshake: {exc!r}")
            return None
        finally:
            timer.cancel()
        if not isinstance(join, Join):
            self.log(f"dropped {peer}: {type(join).__name__} instead of Join")
            return None
        return join

    def register(self, name: str) -> int:
        """A node id: the one this name had, when that node is gone (a restarted node keeps its
        searcher ranks), else a new one."""
        with self.lock:
            node_id = self.names.get(name)
            if node_id is None or node_id in self.live:
                node_id = max([0, *self.live, *self.names.values()]) + 1
                self.names.setdefault(name, node_id)
            self.live.add(node_id)
            self.setup.connected.value = len(self.live)
            return node_id

    def unregister(self, node_id: int) -> None:
        with self.lock:
            self.live.discard(node_id)
            self.setup.connected.value = len(self.live)

    def serve(self, conn, peer: str) -> None:
        """One node from handshake to goodbye; its failure is logged and ends only its link."""
        join = self.handshake(conn, peer)
        if join is None:
            conn.close()
            return
        set_peer_timeouts(conn)
        node_id = self.register(join.name)
        label = f"node {node_id} ({join.name}, {peer})"
        link = _NodeLink(conn, node_id, label, collections.deque())
        self.log(f"{link.label} joined")
        # Read a node's messages as they come, in a thread of their own (``_read_into``).
        inbox = queue_lib.Queue()  # bounded in effect: the node sends batches against credit
        threading.Thread(target=_read_into, args=(conn, inbox), daemon=True).start()
        try:
            link.send(self.welcome(node_id))
            link.last_heard = time.monotonic()
            self.serve_link(link, inbox)
            link.send(self.goodbye)
            _wait_for_hang_up(inbox, HEARTBEAT_S * 2)
        except RunEnded as exc:
            self.log(f"{link.label} left: {exc}")
        except (EOFError, OSError, TimeoutError) as exc:
            self.log(f"{link.label} lost: {exc!r}; the run goes on without it")
        except Exception:  # noqa: BLE001 -- any fault of one node ends its link, not the run
            self.log(f"{link.label} dropped on an error:\n{traceback.format_exc()}")
        finally:
            self.unregister(node_id)
            conn.close()

    def welcome(self, node_id: int) -> Welcome:
        s = self.setup
        layout = [(name, shape) for name, _, shape in s.store.layout]
        return Welcome(
            node_id,
            s.cfg,
            s.examples,
            s.reward_fn,
            s.probe,
            layout,
            s.store.flat.dtype,
            credit=s.cfg.queue_size,
        )

    def serve_link(self, link: _NodeLink, inbox: queue_lib.Queue) -> None:
        """The node's messages in (from ``inbox``), its batches onto the trainer's queue, the
        newest version out, heartbeats both ways; until the run ends."""
        while not self.closing.is_set():
            with contextlib.suppress(queue_lib.Empty):
                message = inbox.get(timeout=0.05)
                if isinstance(message, Exception):
                    raise message
                self.on_message(link, message)
                link.last_heard = time.monotonic()
            self.forward(link)
            self.send_newest(link)
            if time.monotonic() - link.last_sent > HEARTBEAT_S:
                link.send(Heartbeat())
            if time.monotonic() - link.last_heard > PEER_TIMEOUT_S:
                raise TimeoutError(f"no word for {PEER_TIMEOUT_S:.0f}s")

    def on_message(self, link: _NodeLink, message) -> None:
        if isinstance(message, Batch):  # searcher s of node j reports as rank 100 j + s
            message.rank += REMOTE_RANK_BASE * link.node_id
            link.pending.append(message)
        elif isinstance(message, Want):
            link.have = message.have
            link.wants = True
        elif isinstance(message, Failure):
            self.log(f"{link.label}: searcher {message.rank} failed:\n{message.traceback}")
        elif isinstance(message, Bye):
            raise RunEnded(message.reason)
        elif not isinstance(message, Heartbeat):
            raise TypeError(f"unexpected message {type(message).__name__}")

    def forward(self, link: _NodeLink) -> None:
        """The node's batches onto the trainer's bounded queue, a credit back for each: when the
        trainer falls behind, the node's own queue fills and its searchers wait, as local ones."""
        while link.pending:
            try:
                self.setup.out_queue.put(link.pending[0], timeout=0.05)
            except queue_lib.Full:
                return
            link.pending.popleft()
            link.send(Credit(1))

    def send_newest(self, link: _NodeLink) -> None:
        """The newest version, when the node is ready for one and holds an older one: a node
        never queues versions, it skips to the newest (latest wins)."""
        if not link.wants or self.setup.store.version() <= link.have:
            return
        version, probe, flat = self.newest()
        send_version(link.conn, flat, version, probe)
        link.wants = False
        link.last_sent = link.last_heard = time.monotonic()  # it was reading all along

    def newest(self) -> tuple[int, float, torch.Tensor]:
        """A CPU copy of the newest published version, read as a searcher reads (the seqlock:
        copy, then check that no publish overlapped), shared by every node's thread."""
        store = self.setup.store
        with self.lock:
            if store.version() > self.snapshot[0]:
                flat = torch.empty(store.flat.shape, dtype=store.flat.dtype)
                version, probe = store.load_into(lambda views: flat.copy_(store.flat))
                self.snapshot = (version, probe, flat)
            return self.snapshot


def _read_into(conn, inbox: queue_lib.Queue) -> None:
    """Read a node's messages as they come, in a thread of their own: while the gateway sends
    the node a version, the node may be sending batches, and a side that stopped reading could
    leave both blocked on full socket buffers. The error that ends the link goes in last."""
    try:
        while True:
            inbox.put(conn.recv())
    except Exception as exc:  # noqa: BLE001 -- any failure ends this link; serve() logs it
        inbox.put(exc)


def _wait_for_hang_up(inbox: queue_lib.Queue, timeout: float) -> None:
    """After the goodbye, drop what the node still sends until it closes its end (or
    ``timeout`` s). Closing ours first, with the node's messages unread, would reset the
    connection, and a reset can destroy the goodbye before the node reads it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(queue_lib.Empty):
            if isinstance(inbox.get(timeout=0.05), Exception):
                return


def gateway_main(setup: GatewaySetup) -> None:
    """Process entry point: listen on ``cfg.listen`` only, serve nodes until the run ends or
    the trainer process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer owns shutdown
    torch.set_num_threads(1)
    gateway = _Gateway(setup)
    try:
        listener = Listener(parse_address(setup.cfg.listen), family="AF_INET")
    except OSError as exc:
        setup.status.put(f"cannot listen on {setup.cfg.listen}: {exc}")
        raise SystemExit(1) from None
    setup.status.put("listening")
    gateway.log(f"listening on {setup.cfg.listen}")
    threading.Thread(target=gateway.accept_loop, args=(listener,), daemon=True).start()
    parent = multiprocessing.parent_process()
    while not setup.stop_event.is_set() and parent.is_alive():
        time.sleep(0.2)
    if not parent.is_alive():
        gateway.goodbye = Bye("the trainer process is gone", clean=False)
    gateway.closing.set()
    listener.close()
    deadline = time.monotonic() + 5.0
    for thread in list(gateway.threads):  # each says goodbye to its node
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    setup.out_queue.cancel_join_thread()  # never block exit on a queue nobody reads any more


# ----------------------------------------------------------------------------- a searcher node


class NodePool(SearcherPool):
    """A node's searchers: a SearcherPool (start, watch, restart) whose batches go to the bridge
    instead of a buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[Batch] = []

    def drain(self, timeout: float = 0.0) -> list[Ready | Batch | Failure]:
        messages = super().drain(timeout)
        self.batches += [m for m in messages if isinstance(m, Batch)]
        return messages

    def take(self, limit: int) -> list[Batch]:
        """Up to ``limit`` batches; reads the queue (and handles failures) only while fewer are
        held, so that a node the trainer holds back keeps its searchers waiting, not its RAM."""
        if len(self.batches) < max(limit, 1):
            self.collect()
        taken, self.batches = self.batches[:limit], self.batches[limit:]
        return taken


class NodeBridge:
    """The node's end of its link to the trainer: sends the node's batches (within the credit
    the gateway grants) and installs each version it receives in the node's store whole. A
    version lands in ``staging`` first and is published (seqlock) only once complete, so a
    searcher never sees a partial one; a cut transfer leaves the previous version in place."""

    def __init__(self, conn, store: WeightStore, credit: int):
        self.conn = conn
        self.store = store
        self.credit = credit
        self.staging = torch.empty_like(store.flat)
        self.last_heard = self.last_sent = time.monotonic()
        self.send(Want(store.version()))

    def send(self, message) -> None:
        self.conn.send(message)
        self.last_sent = time.monotonic()

    def install(self, header: VersionHeader) -> None:
        """Receive a whole version into staging, then publish it into the node's store."""
        receive_version(self.conn, header, self.staging)
        named = [
            (name, self.staging[offset : offset + math.prod(shape)].view(shape))
            for name, offset, shape in self.store.layout
        ]
        self.store.publish(named, header.version, header.probe)
        self.send(Want(header.version))

    def poll(self, timeout: float) -> None:
        """Handle what the trainer sent (after up to ``timeout`` s), then heartbeat; raises
        RunEnded on its goodbye, NodeError when it has been silent for PEER_TIMEOUT_S."""
        while self.conn.poll(timeout):
            timeout = 0.0
            message = self.conn.recv()
            if isinstance(message, VersionHeader):
                self.install(message)
            elif isinstance(message, Credit):
                self.credit += message.count
            elif isinstance(message, Bye) and message.clean:
                raise RunEnded(message.reason)
            elif isinstance(message, Bye):
                raise NodeError(message.reason)
            elif not isinstance(message, Heartbeat):
                raise TypeError(f"node: unexpected message {type(message).__name__}")
            self.last_heard = time.monotonic()
        if time.monotonic() - self.last_heard > PEER_TIMEOUT_S:
            raise NodeError(f"no word from the trainer for {PEER_TIMEOUT_S:.0f}s")
        if time.monotonic() - self.last_sent > HEARTBEAT_S:
            self.send(Heartbeat())

    def run(self, pool: NodePool) -> None:
        """1d across the link: batches out as credit allows, versions in; until the run ends."""
        while True:
            for batch in pool.take(self.credit):
                self.send(batch)
                self.credit -= 1
            self.poll(0.05)


def connect(address: str, secret: bytes, timeout_s: float) -> Any:
    """An authenticated connection to the trainer's gateway; retried while nothing listens
    there yet (a cluster may start nodes before the trainer), refused loudly on a wrong secret."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(parse_address(address), family="AF_INET", authkey=secret)
        except AuthenticationError:
            raise NodeError(
                f"the trainer at {address} refused this node: its secret ({SECRET_ENV} or "
                "--secret_file) is not the run's"
            ) from None
        except ConnectionRefusedError as exc:
            if time.monotonic() > deadline:
                raise NodeError(f"no trainer at {address} within {timeout_s}s: {exc}") from None
            time.sleep(1.0)


def node_config(welcome: Welcome, overrides: dict) -> TBAConfig:
    """The trainer's config with this node's own fields (NODE_FIELDS) and seeds."""
    unknown = sorted(set(overrides) - set(NODE_FIELDS))
    if unknown:
        raise NodeError(
            f"a node takes its config from the trainer; {unknown} cannot be set on a node "
            f"(these can: {', '.join(NODE_FIELDS)})"
        )
    return dataclasses.replace(
        welcome.cfg,
        **overrides,
        listen="",
        seed=welcome.cfg.seed + NODE_SEED_STRIDE * welcome.node_id,
    )


def node_main(address: str, overrides: dict, log: Callable[[str], None] = print) -> None:
    """A searcher node (``run_gsm8k.py --join HOST:PORT``): join the trainer, run searchers
    against a node-local store and queue, bridge them until the trainer says goodbye or is
    gone (then every process of the node exits)."""
    secret = read_secret(overrides.get("secret_file", ""))
    conn = connect(address, secret, overrides.get("timeout_s", 600.0))
    set_peer_timeouts(conn)
    old_handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        old_handlers[sig] = signal.signal(sig, _raise_keyboard_interrupt)
    pool = None
    try:
        conn.send(Join(socket.gethostname()))
        if not conn.poll(PEER_TIMEOUT_S):
            raise NodeError(f"the trainer at {address} sent no welcome")
        welcome = conn.recv()
        cfg = node_config(welcome, overrides)
        meta = [(name, torch.empty(shape, device="meta")) for name, shape in welcome.layout]
        store = WeightStore(meta, welcome.dtype, torch.device("cpu"))
        log(f"node {welcome.node_id}: joined {address} with {cfg.num_searchers} searcher(s)")
        pool = NodePool(cfg, welcome.examples, welcome.reward_fn, store, welcome.probe, log=log)
        pool.start()
        NodeBridge(conn, store, welcome.credit).run(pool)
    except RunEnded as exc:
        log(f"node: {exc}")
    except (EOFError, OSError) as exc:
        raise NodeError(f"lost the trainer at {address}: {exc!r}") from None
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        conn.close()  # first: the gateway waits for it after its goodbye (_wait_for_hang_up)
        if pool is not None:
            pool.stop()
