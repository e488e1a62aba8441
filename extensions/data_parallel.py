"""A data-parallel trainer on torch.distributed: DDP, or FSDP2 with --fsdp, under torchrun.

    torchrun --standalone --nproc-per-node 4 run_gsm8k.py --trainer_device cuda:0 \
        --num_searchers 4 --searcher_devices cuda:4,cuda:5,cuda:6,cuda:7

Rank 0 runs the single-node system (searchers, replay buffer, weight store, metrics, evaluation,
checkpoints). Every step it hands each rank a contiguous share of the P prompt groups, whole
(log Z is per prompt); each rank scores its share with the loss weighted by that share of the
batch, and the gradients are summed over the ranks (DDP with a summing communication hook, FSDP2
with a divide factor of 1), so a step equals one rank's step on the whole batch. One publish per
version, by rank 0. The backend is NCCL for CUDA and gloo for the CPU; every collective waits at
most --timeout_s, but rank 0's first message, which the other ranks wait for while rank 0
starts up (a warm start, an evaluation, the searchers' engines): --startup_timeout_s.

How rank 0 drives the others: each ``Trainer`` method that every rank must run (an update, a
checkpoint load, and, sharded, whatever needs the whole weights: the weights to publish, the
probe, a checkpoint's state, a whole copy for evaluation) first sends its name and arguments to
the other ranks (``on_every_rank``), which call the same method (``follow``), so the collectives
inside line up. Sharded, every forward and backward gathers layers with every rank, so each
rank runs as many passes as the rank with the largest share; a rank with fewer makes up the
difference with passes that carry no gradient (``DataParallelTrainer.micro_batches``).

How a run ends, in this order on every rank (OPERATIONS.md, "Shutting down", has every launch
path): rank 0's ``run_tba`` stops its intake thread and its searchers and writes the checkpoint;
``finish`` gathers the whole model (sharded) and tells the other ranks to stop; each rank's
trainer lets go of the group (``DataParallelTrainer.release``); ``Ranks.close`` destroys the
group and waits until its backend's threads have ended; only then does the process exit. A
backend still alive at exit is torn down by C++ static destructors after the interpreter, the
one-in-seven abort this order prevents (``Ranks.close`` says how it stayed alive).

The extension: ``DataParallelConfig``, ``Ranks`` (this process among the trainer's ranks),
``DataParallelTrainer`` (installed by ``install``), ``follow`` (the loop of ranks > 0) and
``finish`` (rank 0's end of a run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers import AutoTokenizer

from buffer import StoredTrajectory, Trajectory
from plumbing.checkpoint import buffer_state, load_buffer_state
from plumbing.config import knob
from plumbing.logprobs import group_passes
from plumbing.models import load_causal_lm, pad_token_id
from tba import TBAConfig, group_logprobs
from trainer import Parts, Trainer


@dataclass
class DataParallelConfig:
    """The data-parallel trainer's knobs (extensions/data_parallel.py; under torchrun only)."""

    startup_timeout_s: float = knob(
        3600.0,
        "under torchrun, the longest wait of ranks > 0 for rank 0 to start training (its warm "
        "start, the evaluation before training, the searchers' engines); after that every wait "
        "is --timeout_s, which tells a dead rank",
    )
    fsdp: bool = knob(
        False,
        "under torchrun, shard the trainer's weights, gradients and AdamW moments over the ranks "
        "(FSDP2 fully_shard per decoder layer, then the model) instead of replicating them (DDP): "
        "for a policy that does not fit one GPU",
    )


class RanksFailed(RuntimeError):
    """A collective between the trainer's data-parallel ranks failed: a rank died or timed out."""


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Ranks:
    """This process's place among the trainer's data-parallel ranks, and the messages of rank 0
    to the others (one broadcast each)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float
    # Rank 0's first message (the start of training, or the stop of a run that failed before)
    # goes over a gloo group of its own whose collectives wait up to ``startup_timeout_s``:
    # the wait a start-up needs is not the one that tells a dead rank. None: the default group.
    startup: Any = None
    startup_timeout_s: float = 0.0
    started: bool = False  # rank 0's first message sent (rank 0) or received (the others)

    @classmethod
    def from_env(
        cls, trainer_device: str, timeout_s: float, startup_timeout_s: float | None = None
    ) -> Ranks:
        """Join (or reuse) torchrun's default process group: NCCL for CUDA trainer devices, gloo
        on CPU, every collective bounded by ``timeout_s``. A group that exists already must be
        torchrun's whole world (a RuntimeError otherwise: never train alone unawares)."""
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = rank_device(trainer_device, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        elif dist.get_world_size() != world_size():
            # An in-process vLLM engine built before the ranks joined leaves a one-process
            # default group (vllm 0.33.0 distributed/parallel_state.py,
            # init_distributed_environment): reused, every rank would train alone.
            raise RuntimeError(
                f"data parallel: this process already belongs to a process group of "
                f"{dist.get_world_size()} process(es), not torchrun's {world_size()} (was a "
                "vLLM engine built in this process before the ranks joined? build it in a "
                "process of its own, as evaluate.EngineProcess does)"
            )
        startup_timeout_s = startup_timeout_s or timeout_s
        startup = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=startup_timeout_s)
        )  # every rank at once, here
        return cls(
            dist.get_rank(),
            dist.get_world_size(),
            local_rank,
            device,
            timeout_s,
            startup,
            startup_timeout_s,
        )

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

    def failed(self, what: str, error: Exception, starting: bool = False) -> RanksFailed:
        if self.rank > 0:
            who = "rank 0"
        elif self.world_size == 2:
            who = "rank 1"
        else:
            who = f"one of ranks 1-{self.world_size - 1}"
        wait = (
            f"{self.startup_timeout_s:g}s (--startup_timeout_s)"
            if starting
            else f"{self.timeout_s:g}s (--timeout_s)"
        )
        return RanksFailed(
            f"data parallel, rank {self.rank}: {what} failed; {who} died or did not answer "
            f"within {wait}: {error}"
        )

    def send(self, message) -> None:
        """Rank 0: hand ``message`` to every other rank (the first over the start-up group)."""
        starting, self.started = not self.started, True
        try:
            self._broadcast([message], starting)
        except RuntimeError as e:  # gloo raises RuntimeError, NCCL DistError (a subclass)
            raise self.failed("handing out work", e, starting) from e

    def receive(self):
        """Ranks > 0: the next message of rank 0 (the first over the start-up group)."""
        starting, self.started = not self.started, True
        box = [None]
        try:
            self._broadcast(box, starting)
        except RuntimeError as e:
            raise self.failed("waiting for work", e, starting) from e
        return box[0]

    def _broadcast(self, box: list, starting: bool) -> None:
        if starting and self.startup is not None:
            dist.broadcast_object_list(box, src=0, group=self.startup)  # gloo: CPU tensors
        else:
            dist.broadcast_object_list(box, src=0, device=self._object_device())

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (fp64)."""
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(total)
        except RuntimeError as e:
            raise self.failed("summing metrics", e) from e
        return total.tolist()

    def check_same(self, trainer: Trainer) -> None:
        """Raise unless every rank holds the same step and weights (a resumed rank that found
        another checkpoint, on a file system the ranks do not share, would not). Sharded, the
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
            raise RanksFailed(
                f"data parallel, rank {self.rank}: the ranks hold different steps or weights "
                f"(step {trainer.step}, weights sum {checksum}; the ranks range over "
                f"{low.tolist()} to {high.tolist()}): output_dir must be one directory that every "
                "rank reads (--resume)"
            )

    def close(self) -> None:
        """Leave the process group, and end its backend's threads now (the end of a run).

        ``destroy_process_group`` unregisters the group, but its backend (gloo: an I/O thread and
        two workers) lives while anything holds it. Under FSDP2 something always does: DTensor
        caches its sharding decisions in a C++ table for the life of the process, whose keys
        hold the device mesh, which holds the group. The backend then outlived the interpreter
        and was destroyed by C++ static destructors at exit, racing the library teardown: rank
        1 aborted there in about one finished run in seven ("terminate called without an active
        exception", torchrun exits 1). The meshes' groups dropped (``release_meshes``), DDP's
        wrapper let go (``DataParallelTrainer.release``; a rank > 0's trainer is dropped once
        ``follow`` returns) and garbage collected, the threads end here, while the process is
        whole."""
        dist.destroy_process_group()  # every group, the start-up group too
        self.startup = None
        release_meshes()
        gc.collect()

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


def release_meshes() -> None:
    """Make every device mesh still alive drop the process groups it holds (``Ranks.close``).
    DTensor keeps meshes in caches for the life of the process (a C++ table of its sharding
    decisions, the redistribution planner, the mesh topology), and each mesh keeps its groups
    by name; a destroyed group is of no use to a mesh, and no cache then holds a backend."""
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()


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


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (FSDP's DTensor: an all-gather every rank joins), or
    ``tensor`` itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def is_collective_error(error: RuntimeError) -> bool:
    """Whether ``error`` is a failed collective: DistError (NCCL, timeouts), or gloo's
    RuntimeError, which names its source file."""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


def shard_model(model: torch.nn.Module, ranks: Ranks) -> None:
    """FSDP2 over the ranks: each decoder layer (the classes transformers keeps whole,
    ``_no_split_modules``) one unit, gathered for its forward and backward only, then the model,
    whose unit holds the rest (embeddings, final norm, head). Gradients are summed over the
    ranks (a divide factor of 1), as the losses' shares of the batch ask."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"--fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules)"
        )
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain SUM, which gloo supports too (a divide factor alone is NCCL's PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def sum_gradients(state, bucket):
    """DDP's communication hook that sums the ranks' gradients (a dist.GradBucket's), where
    DDP's own averages them: each rank's loss is already its share of the whole batch's. No
    annotations: DDP checks the hook's, and this module's are strings (future annotations)."""
    reduced = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return reduced.then(lambda fut: fut.value()[0])


class GroupScorer(torch.nn.Module):
    """A scorer of ``Trainer.score`` (``tba.group_logprobs``, or ``group_token_logprobs``) of a
    model as one module call, so that DDP, which reduces the gradients of what runs through its
    forward, covers both model calls of a shared-prompt pass."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, prompts, responses, scorer: Callable, **rule):
        return scorer(self.model, prompts, responses, **rule)


def through_ddp(ddp: DistributedDataParallel, scorer: Callable, model, prompts, responses, **rule):
    """``scorer`` called as ``Trainer.score`` calls it, run through ``ddp`` (a GroupScorer of
    ``model``)."""
    return ddp(prompts, responses, scorer, **rule)


# ----------------------------------------------------------------------------- the trainer


def on_every_rank(sharded_only: bool = False):
    """A Trainer method that every rank runs at once: on rank 0 it first sends its name and
    arguments to the other ranks (``follow`` calls the same method there). ``sharded_only``:
    only with --fsdp, where it needs the whole weights; otherwise it runs on rank 0 alone."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args):
            if self.ranks.rank == 0 and (self.sharded or not sharded_only):
                self.ranks.send((method.__name__, args))
            return method(self, *args)

        return run

    return wrap


class DataParallelTrainer(Trainer):
    """A trainer whose every step is spread over the ranks (``install`` sets ``ranks`` and
    ``sharded``); rank 0's copy is the one ``run_tba`` drives."""

    ranks: Ranks
    sharded: bool

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        self.ranks.check(cfg)
        if self.ranks.rank == 0:
            self.ranks.send(("start", cfg))  # the other ranks build their trainers beside this
        super().__init__(cfg, device, pad_id, eos_id)
        self.ddp = None
        if self.sharded:
            shard_model(self.model, self.ranks)
            if self.previous is not None:  # the trust region's second anchor, sharded alike
                shard_model(self.previous, self.ranks)
            self.optimizer, self.scheduler = self.make_optimizer()  # over the shards
        else:
            self.ddp = DistributedDataParallel(
                GroupScorer(self.model),
                device_ids=[device.index] if device.type == "cuda" else None,
                forward_sync_buffers=False,
            )
            self.ddp.register_comm_hook(None, sum_gradients)
        self.ranks.check_same(self)

    @on_every_rank()
    def update(self, groups: list[list[Trajectory]]) -> dict:
        try:
            return super().update(groups)
        except RuntimeError as e:
            if not is_collective_error(e):
                raise
            raise self.ranks.failed(f"the gradient reduction of step {self.step}", e) from e

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """The loss's backward on this rank's share; each metric is a sum over the batch over a
        whole-batch count (``Trainer.backward``), so the ranks' values sum to the batch's."""
        metrics = super().backward(groups, beta)
        names = sorted(metrics)
        return dict(zip(names, self.ranks.sum([metrics[n] for n in names]), strict=True))

    def micro_batches(self, groups: list[list[Trajectory]]):
        """This rank's share in passes; the gradient is reduced at the backward of the last
        pass only (``gradient_sync``). Sharded, passes that carry no gradient bring this rank
        to as many as the rank with the largest share."""
        mine = self.ranks.share(len(groups))
        size, per_pass = self.cfg.responses_per_prompt, self.cfg.micro_batch_size
        chunks = [
            groups[mine.start + part.start : mine.start + part.stop]
            for part in group_passes(len(mine), size, per_pass)
        ]
        total = len(chunks)
        if self.sharded:
            most = math.ceil(len(groups) / self.ranks.world_size)
            total = len(group_passes(most, size, per_pass))
        for i, chunk in enumerate(chunks):
            with self.gradient_sync(last=i == total - 1):
                yield chunk  # the caller's forward and backward run inside the context
        for i in range(len(chunks), total):
            with self.gradient_sync(last=i == total - 1):
                logp = self.score(chunks[-1])
                (logp.sum() * 0.0).backward()  # the collectives, no gradient

    def gradient_sync(self, last: bool):
        """No gradient reduction before the last backward of a step (DDP's ``no_sync``,
        FSDP2's ``set_requires_gradient_sync``)."""
        if last:
            return contextlib.nullcontext()
        if self.sharded:
            return _gradient_sync_off(self.model)
        return self.ddp.no_sync()

    def score(self, groups: list[list[Trajectory]], scorer: Callable = group_logprobs, model=None):
        """Replicated, through DDP (``through_ddp``; ``model``, without gradient, locally);
        sharded, as one rank scores."""
        if self.ddp is not None and model is None:
            scorer = functools.partial(through_ddp, self.ddp, scorer)
        return super().score(groups, scorer, model)

    def grad_norm(self) -> torch.Tensor:
        return full_tensor(super().grad_norm())

    @on_every_rank(sharded_only=True)
    def probe(self) -> float:
        return super().probe()

    @on_every_rank(sharded_only=True)
    def weights_to_publish(self) -> list[tuple[str, torch.Tensor]]:
        """Sharded, the full weights gathered to rank 0 (the other ranks get none): on its
        trainer device, one all-gather per weight, where the weight store is on that device
        too (``engines.make_weight_store``); to its CPU where the store is in shared memory
        (``--weight_store shared_memory`` on a GPU). Gathering to the CPU for a store on the
        GPU made every publish a round trip through host memory. Every rank takes the same
        branch: it depends on the config and the device type alone."""
        if not self.sharded:
            return super().weights_to_publish()
        if self.device.type == "cuda" and self.cfg.weight_store == "shared_memory":
            full = self._gather(get_model_state_dict, f"the weights of version {self.step}")
            return [(n, full[n]) for n, _ in self.model.named_parameters()] if full else []
        whole = []
        try:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    tensor = full_tensor(param)  # every rank joins; rank 0 keeps it
                    if self.ranks.rank == 0:
                        whole.append((name, tensor))
        except RuntimeError as e:
            raise self.ranks.failed(f"gathering the weights of version {self.step}", e) from e
        return whole

    @on_every_rank(sharded_only=True)
    def whole_model(self) -> torch.nn.Module | None:
        """Sharded, a whole copy on the trainer device, gathered by every rank (rank 0 gets it,
        the others None)."""
        if not self.sharded:
            return super().whole_model()
        full = self._gather(get_model_state_dict, f"the model of step {self.step}")
        if self.ranks.rank > 0:
            return None
        cfg = self.cfg
        model = load_causal_lm(
            cfg.model, self.weights_dtype, torch.device("cpu"), cfg.trust_remote_code
        )
        model.load_state_dict(full)
        return model.to(self.device)

    @on_every_rank(sharded_only=True)
    def state_dict(self) -> dict:
        """Sharded, the weights and AdamW moments gathered whole to rank 0's CPU, keyed by
        parameter name (the other ranks get empty dicts)."""
        if not self.sharded:
            return super().state_dict()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        try:
            model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        except RuntimeError as e:
            raise self.ranks.failed(f"gathering the state of step {self.step}", e) from e
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "buffer": buffer_state(self.buffer),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Sharded, every rank reads the whole checkpoint and keeps its shard."""
        if not self.sharded:
            return super().load_state_dict(state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        load_buffer_state(self.buffer, state["buffer"], StoredTrajectory)
        self.step = state["step"]
        torch.set_rng_state(state["torch_rng"])

    @on_every_rank()
    def load(self, path) -> None:
        """Every rank reads the checkpoint (so ``output_dir`` must be on a file system they
        share), then the ranks check that they hold the same step and weights."""
        try:
            super().load(path)
        except FileNotFoundError:
            raise RanksFailed(
                f"data parallel, rank {self.ranks.rank}: no checkpoint at {path}, which rank 0 "
                "resumes from: output_dir must be one directory that every rank reads"
            ) from None
        self.ranks.check_same(self)

    def save(self, path) -> None:
        """Sharded, a checkpoint needs every rank: when one has died, the last periodic
        checkpoint stands (the next collective raises the failure)."""
        try:
            super().save(path)
        except RanksFailed as e:
            if not self.sharded:
                raise
            tqdm.write(f"{e}\n(no checkpoint: the weights are sharded over the ranks)")

    def release(self) -> None:
        """The run has ended: let go of DDP's wrapper, whose reducer holds the process group, so
        that ``Ranks.close`` ends the group's threads. The trainer trains no more."""
        self.ddp = None

    def _gather(self, fetch, what: str) -> dict:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        try:
            return fetch(self.model, options=options)
        except RuntimeError as e:
            raise self.ranks.failed(f"gathering {what}", e) from e


@contextlib.contextmanager
def _gradient_sync_off(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ----------------------------------------------------------------------------- the run


def install(parts: Parts, cfg: DataParallelConfig, ranks: Ranks) -> Parts:
    """``parts`` with its trainer spread over ``ranks`` (install this last: it must see every
    method the other extensions override)."""
    trainer = type(
        f"DataParallel{parts.trainer.__name__}",
        (DataParallelTrainer, parts.trainer),
        {"ranks": ranks, "sharded": cfg.fsdp},
    )
    return dataclasses.replace(parts, trainer=trainer)


def follow(ranks: Ranks, trainer_for: Callable[[TBAConfig], type[Trainer]]) -> Trainer | None:
    """A rank > 0: the trainer rank 0 builds (``trainer_for(rank 0's config)``: the class the same
    flags make there), then every method rank 0 calls on every rank, until rank 0 says stop.
    Returns the trainer (None when rank 0 stopped before training)."""
    message = ranks.receive()
    if message is None:
        return None
    _, cfg = message
    trainer_class = trainer_for(cfg)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads_per_process())
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    trainer = trainer_class(cfg, ranks.device, pad_token_id(tokenizer), tokenizer.eos_token_id)
    while (message := ranks.receive()) is not None:
        name, args = message
        getattr(trainer, name)(*args)
    trainer.release()
    return trainer


def finish(ranks: Ranks, trainer: Trainer | None) -> None:
    """Rank 0 at the end of its run: sharded, the whole trained model gathered into
    ``trainer.model`` (for the job's last evaluation and ``save_pretrained``); then the other
    ranks told to stop (a rank that died cannot be told; torchrun ends the rest); then the
    trainer lets go of the process group (``release``), which ``Ranks.close`` destroys next."""
    try:
        if trainer is not None and trainer.sharded:
            trainer.model = trainer.whole_model()
            trainer.sharded = False  # the trainer trains no more
        ranks.send(None)
    except RanksFailed as e:
        tqdm.write(f"{e}\n(the other ranks could not be told to stop)")
    if trainer is not None:
        trainer.release()
