"""What every job shares (run_gsm8k.py, jobs/run_tldr.py, jobs/run_redteam.py): its command line,
built from the configs of the core, of the job and of the extensions; the ``trainer.Parts`` its
flags ask for (GRPO, the off-policy corrections, the checks, searchers as Ray actors); torchrun's
ranks (a data-parallel trainer); the tracker every metrics row also goes to (extensions/report.py);
and where the processes go on the GPUs a machine has, with which memory shares (``gpu_placement``),
and why ``--preset auto`` found none (``auto_preset``).

    configs = launch.parse(args, preset_values, EvalConfig)  # one config per component
    ranks = launch.torchrun(configs)   # ranks > 0 train under rank 0 in here, then return
    with launch.extensions(configs, ranks, on_step) as (cfg, parts, on_step):
        trainer = run_tba(cfg, examples, reward_fn, parts=parts, on_step=on_step)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from engines import wants_vllm
from extensions import checks, data_parallel, grpo, offpolicy, ray_searchers, report, tba_prime
from extensions.cli import config_argparser, configs_from_args
from plumbing.config import ConfigError, RunError
from tba import TBAConfig
from trainer import Parts, Trainer

# The extensions every job offers, by the config that switches them on.
EXTENSION_CONFIGS = (
    grpo.GRPOConfig,
    offpolicy.OffPolicyConfig,
    tba_prime.PrimeConfig,
    checks.ChecksConfig,
    data_parallel.DataParallelConfig,
    ray_searchers.RayConfig,
    report.ReportConfig,
)


@dataclass
class Configs:
    """A job's configs: the core's, the extensions', and the job's own (``task``, in the order
    the job named them)."""

    tba: TBAConfig
    grpo: grpo.GRPOConfig
    offpolicy: offpolicy.OffPolicyConfig
    prime: tba_prime.PrimeConfig
    checks: checks.ChecksConfig
    data_parallel: data_parallel.DataParallelConfig
    ray: ray_searchers.RayConfig
    report: report.ReportConfig
    task: list


def argparser(description: str, presets: list[str], *task_configs: type) -> argparse.ArgumentParser:
    """The job's flags: ``--preset``, then every field of TBAConfig, of ``task_configs`` and of
    the extensions' configs."""
    parser = config_argparser(description, TBAConfig, *task_configs, *EXTENSION_CONFIGS)
    parser.add_argument(
        "--preset",
        choices=presets,
        default=presets[0],
        help="base values that explicit flags override (auto: paper with CUDA GPUs, else tiny)",
    )
    return parser


def parse(args: argparse.Namespace, base: dict, *task_configs: type) -> Configs:
    """The configs of ``args`` over the preset ``base``; a bad value is a ConfigError."""
    tba, *rest = configs_from_args(args, base, TBAConfig, *EXTENSION_CONFIGS, *task_configs)
    grpo_cfg, offpolicy_cfg, prime_cfg, checks_cfg, dp_cfg, ray_cfg, report_cfg, *task = rest
    offpolicy.check(offpolicy_cfg, grpo_cfg.loss, tba.tb_clip_eps)  # before any model loads
    return Configs(
        tba, grpo_cfg, offpolicy_cfg, prime_cfg, checks_cfg, dp_cfg, ray_cfg, report_cfg, task
    )


def config_dict(configs: Configs) -> dict:
    """Every field of every config, for results.json."""
    values = {}
    for config in (
        configs.tba,
        configs.grpo,
        configs.offpolicy,
        configs.prime,
        configs.checks,
        configs.data_parallel,
        configs.ray,
        configs.report,
        *configs.task,
    ):
        values.update(dataclasses.asdict(config))
    return values


def parts(configs: Configs) -> Parts:
    """The parts of a run (trainer.Parts): TB, or what the extensions' flags ask for, and what
    a job's own config installs (its ``install(parts)``: jobs/run_tldr.py's schedules)."""
    chosen = Parts()
    for task in configs.task:
        if hasattr(task, "install"):
            chosen = task.install(chosen)
    chosen = grpo.install(chosen, configs.grpo)
    chosen = offpolicy.install(chosen, configs.offpolicy)
    chosen = tba_prime.install(chosen, configs.prime)  # over the loss the flags chose
    probe = parity_probe(configs)
    if probe is not None:
        chosen = checks.install(chosen, probe)
    chosen = tba_prime.configure(chosen, configs.prime)  # once the searcher is wrapped
    return ray_searchers.install(chosen, configs.ray)  # Ray itself is imported only if asked


def parity_probe(configs: Configs) -> checks.ParityProbe | None:
    """With --parity_check, the probe of ``checks.PROBE_TEXT`` in the policy's tokens; its
    floor ``--parity_abs_tol`` in bf16 and fp16 (fp32 engines agree to ~1e-5: none there)."""
    if not configs.checks.parity_check:
        return None
    cfg = configs.tba
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    tokens = tokenizer(checks.PROBE_TEXT)["input_ids"]
    floor = configs.checks.parity_abs_tol if cfg.dtype != "float32" else 0.0
    return checks.ParityProbe.from_prompt(tokens, configs.checks.parity_tol, floor)


def torchrun(configs: Configs) -> data_parallel.Ranks | None:
    """None without torchrun. Under torchrun, this process's rank among the trainer's: rank 0
    goes on with the job; a rank > 0 trains its share of every step rank 0 hands out, in here,
    until rank 0's run ends, and then the job should return (``rank > 0``)."""
    if data_parallel.world_size() <= 1:
        return None
    check_devices(configs)  # on every rank, before any joins: each refuses alike
    cfg = configs.tba
    ranks = data_parallel.Ranks.from_env(
        cfg.trainer_device, cfg.timeout_s, configs.data_parallel.startup_timeout_s
    )
    if ranks.rank > 0:

        def trainer_for(rank0_cfg: TBAConfig) -> type[Trainer]:
            chosen = parts(dataclasses.replace(configs, tba=rank0_cfg))
            return data_parallel.install(chosen, configs.data_parallel, ranks).trainer

        data_parallel.follow(ranks, trainer_for)
        ranks.close()
    return ranks


@contextlib.contextmanager
def extensions(
    configs: Configs,
    ranks: data_parallel.Ranks | None,
    on_step: Callable[[Trainer, dict], None] | None = None,
) -> Iterator[tuple[TBAConfig, Parts, Callable[[Trainer, dict], None]]]:
    """What the flags ask for beyond the core, around a job's call of ``trainer.run_tba``:
    yields its ``cfg`` (under torchrun, on this rank's device), its ``parts`` (``parts``, and
    the data-parallel trainer under torchrun) and an ``on_step`` that runs the job's, then sends
    the row to the tracker of --report_to. On leaving, under torchrun: the whole trained model
    gathered into the trainer, and the other ranks told to stop (``data_parallel.finish``)."""
    cfg = configs.tba
    chosen = parts(configs)
    if ranks is not None:
        cfg = dataclasses.replace(cfg, trainer_device=str(ranks.device))
        chosen = data_parallel.install(chosen, configs.data_parallel, ranks)
    built = []  # the trainer run_tba builds: data_parallel.finish gathers its model
    build = chosen.trainer

    def trainer(*args) -> Trainer:
        built.append(build(*args))
        return built[-1]

    reporter = report.Reporter(configs.report, cfg.output_dir, config_dict(configs))

    def step(trainer: Trainer, metrics: dict) -> None:
        if on_step is not None:
            on_step(trainer, metrics)
        reporter.log(metrics)  # after the job's evaluation, whose keys go with the row

    failed = True
    checks.record_ran(cfg.output_dir, ran_here(configs, ranks))
    try:
        yield cfg, dataclasses.replace(chosen, trainer=trainer), step
        failed = False
    finally:
        try:
            if ranks is not None:
                data_parallel.finish(ranks, None if failed else built[-1])
        finally:
            reporter.close(failed=failed)
    if ranks is not None:
        ranks.close()


def ran_here(configs: Configs, ranks: data_parallel.Ranks | None) -> dict:
    """What this job runs from here (checks.record_ran): the trainer's data-parallel ranks and
    their backend, and, unless they are Ray actors (ray_searchers records those), the searcher
    processes on this machine and the weight store they load from."""
    import torch
    import torch.distributed as dist

    cfg = configs.tba
    device = str(ranks.device) if ranks is not None else cfg.trainer_device
    trainer = {"ranks": 1, "backend": None, "device": device, "node": socket.gethostname()}
    if ranks is not None:
        trainer.update(
            ranks=ranks.world_size,
            backend=dist.get_backend(),
            sharded=configs.data_parallel.fsdp,
        )
    out = {"trainer": trainer}
    if configs.ray.ray:
        return out
    searchers = {}
    for rank, name in enumerate(cfg.searcher_device_list()[: cfg.num_searchers]):
        engine = "VLLMEngine" if wants_vllm(cfg, torch.device(name)) else "HFEngine"
        searchers[str(rank)] = {"node": socket.gethostname(), "engine": engine, "device": name}
    on_gpu = cfg.weight_store == "cuda" or (
        cfg.weight_store == "auto" and device.startswith("cuda")
    )
    out["searchers"] = searchers
    path = "CUDA IPC (a store on the trainer's GPU)" if on_gpu else "shared memory"
    out["weights"] = {"path": f"{path}, on this machine"}
    return out


def tokenizer(cfg: TBAConfig):
    """The policy's tokenizer: the first load of ``--model`` in a job, so a model that cannot
    be found is named there, in one line."""
    if cfg.model.startswith((os.sep, ".", "~")) and not Path(cfg.model).expanduser().is_dir():
        raise RunError(f"--model {cfg.model!r}: no such directory")
    try:
        return AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except OSError as error:  # transformers' "not a local folder and not a repo on the hub"
        first = str(error).strip().split("\n")[0]
        raise RunError(
            f"--model {cfg.model!r}: no model there ({first}); give a local directory of a "
            "transformers model, or a hub name on a machine that can reach the hub"
        ) from None


# ----------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GPUNeeds:
    """What a job's paper run needs on a GPU besides the vLLM engines' shares, in GB: estimates
    from the policy's shapes at the run's batch (docs/paper_setup.md, "Expected wall-clock and
    memory"), which ``gpu_placement`` chooses the memory shares by."""

    searcher_gb: float  # beside vLLM on a searcher's GPU: the reference model, its log-softmax
    trainer_gb: float  # the trainer's process: weights, gradients, AdamW, store, activations
    trainer_checkpointed_gb: float  # the same with --gradient_checkpointing
    engine_gb: float  # the least a vLLM engine needs: its weights and a useful KV cache


# The GSM8K paper run (rho-1b, 1.1B parameters, bf16; P 7 x K 20 of up to ~700 tokens), from
# docs/paper_setup.md's table: the trainer's bf16 weights, gradients and AdamW moments (8.8 GB),
# the searchers' weight store and the evaluator's (2.2 each), one micro-batch's activations
# (~21; ~2.5 checkpointed) and fp32 log-softmax (~7), and a CUDA context per searcher and for
# the evaluator's engine (~2); a searcher's bf16 reference (2.2) and its log-softmax of 24
# sequences (~5) with its context.
GSM8K_PAPER_NEEDS = GPUNeeds(
    searcher_gb=8.0, trainer_gb=43.5, trainer_checkpointed_gb=24.5, engine_gb=8.0
)
RELEASED_SEARCHER_SHARE = 0.85  # TBAConfig.vllm_gpu_memory_utilization
HEADROOM = 0.95  # of a GPU's memory, planned; the rest for the allocator's fragmentation
# Where a Linux NVIDIA driver states its version (read for the one line of --preset auto).
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"


def local_ranks() -> int:
    """torchrun's ranks on this machine (LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def auto_preset(gpus: int) -> str:
    """``--preset auto``: paper with CUDA GPUs, else tiny, said in one line with the reason
    (a torch built for a CUDA the driver cannot run finds no GPU, and would otherwise train
    the tiny preset without a word)."""
    if gpus > 0:
        say(f"preset: paper ({gpus} CUDA GPU(s) found); choose the other with --preset tiny")
        return "paper"
    say(f"preset: tiny ({no_gpu_reason()}); choose the other with --preset paper")
    return "tiny"


def say(line: str) -> None:
    """Print ``line`` once per job: under torchrun on rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        print(line)


def no_gpu_reason() -> str:
    """Why torch sees no CUDA GPU here, in a few words."""
    import torch

    if torch.version.cuda is None:
        return f"no CUDA GPU: torch {torch.__version__} is a CPU build"
    try:
        driver = Path(NVIDIA_DRIVER_FILE).read_text().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        return "no CUDA GPU found"
    major = torch.version.cuda.split(".")[0]
    return (
        f"no usable CUDA GPU: NVIDIA driver {driver} is here, torch {torch.__version__} is "
        f"built for CUDA {torch.version.cuda}"
        + (", which needs driver R580 or newer" if major == "13" else "")
        + "; docs/paper_setup.md"
    )


def gpu_placement(
    gpus: int,
    memory_gb: float | None = None,
    ranks: int | None = None,
    needs: GPUNeeds | None = None,
) -> dict:
    """TBAConfig (and EvalConfig) values that place a paper run's processes on ``gpus`` CUDA
    GPUs of ``memory_gb`` each (the smallest of this machine's), with ``ranks`` trainer ranks
    on this machine (torchrun's LOCAL_WORLD_SIZE): the ranks train on GPUs 0 to ranks - 1, and
    every other GPU holds a searcher; one GPU is shared by the trainer and one searcher. With
    ``needs`` the memory shares are chosen from ``memory_gb`` (``memory_plan``). No GPU:
    nothing set. A GPU for every rank and none left for a searcher is a ConfigError."""
    if gpus == 0:
        return {}
    ranks = local_ranks() if ranks is None else ranks
    if ranks > 1 and gpus <= ranks:
        fewer = (
            f"--nproc-per-node {gpus - 1} or fewer" if gpus > 2 else "one rank, without torchrun"
        )
        raise ConfigError(
            f"torchrun's {ranks} ranks train on {gpus} GPU(s) here, which leaves none for a "
            f"searcher (vLLM takes its share of a GPU before the ranks load): run {fewer}, or "
            "place the searchers elsewhere (--searcher_devices, or --ray)"
        )
    shared = gpus == 1
    values = dict(
        trainer_device="cuda:0",
        num_searchers=1 if shared else gpus - ranks,
        searcher_devices="cuda:0" if shared else ",".join(f"cuda:{i}" for i in range(ranks, gpus)),
    )
    if needs is None:
        if shared:
            values["vllm_gpu_memory_utilization"] = 0.35
        return values
    if memory_gb is None:
        import torch

        memory_gb = min(torch.cuda.get_device_properties(i).total_memory / 1e9 for i in range(gpus))
    values.update(memory_plan(memory_gb, shared, needs))
    trainers = "cuda:0" if ranks == 1 else f"cuda:0-{ranks - 1}"
    chosen = ", ".join(
        f"--{k} {v}" if not isinstance(v, bool) else f"--{k}"
        for k, v in values.items()
        if k not in ("trainer_device", "searcher_devices", "num_searchers")
    )
    say(
        f"placement: trainer on {trainers}, searchers on {values['searcher_devices']}; on "
        f"{memory_gb:.0f} GB GPUs {chosen} (estimates: docs/paper_setup.md; flags override)"
    )
    return values


def memory_plan(memory_gb: float, shared: bool, needs: GPUNeeds) -> dict:
    """The memory shares for GPUs of ``memory_gb`` by ``needs``: the evaluator's vLLM engine
    gets ``engine_gb`` of the trainer's GPU; a searcher's engine what its GPU has left beside
    the reference model (at most the released 0.85), or, on a GPU shared with the trainer, what
    the trainer and the evaluator leave; gradient checkpointing only where the trainer does not
    fit without it. A ConfigError naming the least memory that fits when nothing does. Shares
    are in steps of 0.05."""
    plan = _fitting_plan(memory_gb, shared, needs)
    if plan is not None:
        return plan
    least = next(m for m in range(math.ceil(memory_gb), 1024) if _fitting_plan(m, shared, needs))
    raise ConfigError(
        f"the paper run does not fit GPUs of {memory_gb:.0f} GB: even with "
        f"--gradient_checkpointing it needs GPUs of about {least} GB"
        f"{' (one GPU, shared by the trainer and a searcher)' if shared else ''} "
        "(docs/paper_setup.md); use GPUs with more memory, or --preset tiny"
    )


def _fitting_plan(memory_gb: float, shared: bool, needs: GPUNeeds) -> dict | None:
    usable = HEADROOM * memory_gb
    eval_share = math.ceil(needs.engine_gb / memory_gb * 20) / 20
    for checkpointed in (False, True):
        trainer = needs.trainer_checkpointed_gb if checkpointed else needs.trainer_gb
        left = usable - trainer - eval_share * memory_gb  # on the trainer's GPU
        if shared:
            share = math.floor((left - needs.searcher_gb) / memory_gb * 20) / 20
        else:
            share = math.floor((usable - needs.searcher_gb) / memory_gb * 20) / 20
        share = min(share, RELEASED_SEARCHER_SHARE)
        if left >= 0 and share * memory_gb >= needs.engine_gb:
            plan = dict(vllm_gpu_memory_utilization=share, vllm_eval_memory_utilization=eval_share)
            if checkpointed:
                plan["gradient_checkpointing"] = True
            return plan
    return None


def check_devices(configs: Configs) -> None:
    """Under torchrun, before anything starts: no searcher on this machine may use a GPU that
    one of its trainer ranks trains on (a ConfigError naming the flags). vLLM would take its
    share of that GPU first, and the rank would run out of memory."""
    cfg = configs.tba
    if configs.ray.ray or data_parallel.world_size() <= 1:
        return  # Ray places its searchers itself, on GPUs it holds
    rank_gpus = {}
    for local_rank in range(local_ranks()):
        device = data_parallel.rank_device(cfg.trainer_device, local_rank)
        if device.type == "cuda":
            rank_gpus[device.index or 0] = local_rank
    for device in dict.fromkeys(cfg.searcher_device_list()):
        index = _cuda_index(device)
        if index in rank_gpus:
            raise ConfigError(
                f"--searcher_devices {cfg.searcher_devices}: {device} is also the GPU of "
                f"trainer rank {rank_gpus[index]} (--trainer_device {cfg.trainer_device} puts "
                f"local rank r on its r-th GPU); under torchrun a GPU trains or searches, not "
                f"both: name searcher GPUs from cuda:{max(rank_gpus) + 1} on"
            )


def _cuda_index(device: str) -> int | None:
    """The GPU index of a device string (``cuda`` alone is GPU 0), None for other devices."""
    parts = device.split(":")
    if parts[0] != "cuda":
        return None
    return int(parts[1]) if len(parts) > 1 and parts[1] else 0
