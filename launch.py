"""What every job shares (run_gsm8k.py, run_tldr.py, run_redteam.py): its command line, built from
the configs of the core, of the job and of the extensions; the ``trainer.Parts`` its flags ask
for (GRPO, the checks, searchers as Ray actors); torchrun's ranks (a data-parallel trainer);
the tracker every metrics row also goes to (report.py); and where the processes go on the GPUs
a machine has.

    configs = launch.parse(parser, args, preset_values, EvalConfig)  # one config per component
    ranks = launch.torchrun(configs)   # ranks > 0 train under rank 0 in here, then return
    trainer = launch.run(configs, ranks, examples, reward_fn, on_step=...)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

import checks
import data_parallel
import grpo
import ray_searchers
import report
from tba import RunError, TBAConfig, config_argparser, configs_from_args
from trainer import Parts, Trainer, run_tba

# The extensions every job offers, by the config that switches them on.
EXTENSION_CONFIGS = (
    grpo.GRPOConfig,
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
    grpo_cfg, checks_cfg, dp_cfg, ray_cfg, report_cfg, *task = rest
    return Configs(tba, grpo_cfg, checks_cfg, dp_cfg, ray_cfg, report_cfg, task)


def config_dict(configs: Configs) -> dict:
    """Every field of every config, for results.json."""
    values = {}
    for config in (
        configs.tba,
        configs.grpo,
        configs.checks,
        configs.data_parallel,
        configs.ray,
        configs.report,
        *configs.task,
    ):
        values.update(dataclasses.asdict(config))
    return values


def parts(configs: Configs) -> Parts:
    """The parts of a run (trainer.Parts): TB, or what the extensions' flags ask for."""
    chosen = grpo.install(Parts(), configs.grpo)
    probe = parity_probe(configs)
    if probe is not None:
        chosen = checks.install(chosen, probe)
    return ray_searchers.install(chosen, configs.ray)  # Ray itself is imported only if asked


def parity_probe(configs: Configs) -> checks.ParityProbe | None:
    """With --parity_check, the probe of ``checks.PROBE_TEXT`` in the policy's tokens."""
    if not configs.checks.parity_check:
        return None
    cfg = configs.tba
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    tokens = tokenizer(checks.PROBE_TEXT)["input_ids"]
    return checks.ParityProbe.from_prompt(tokens, configs.checks.parity_tol)


def torchrun(configs: Configs) -> data_parallel.Ranks | None:
    """None without torchrun. Under torchrun, this process's rank among the trainer's: rank 0
    goes on with the job; a rank > 0 trains its share of every step rank 0 hands out, in here,
    until rank 0's run ends, and then the job should return (``rank > 0``)."""
    if data_parallel.world_size() <= 1:
        return None
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


def run(
    configs: Configs,
    ranks: data_parallel.Ranks | None,
    examples: list[dict],
    reward_fn: Callable,
    on_step: Callable[[Trainer, dict], None] | None = None,
) -> Trainer:
    """``run_tba`` with the parts the flags ask for, every metrics row also sent to the tracker
    of --report_to; under torchrun as rank 0 of the data-parallel trainer (whose trained model,
    sharded or not, is whole in the returned trainer)."""
    cfg = configs.tba
    chosen = parts(configs)
    reporter = report.Reporter(configs.report, cfg.output_dir, config_dict(configs))

    def step(trainer: Trainer, metrics: dict) -> None:
        if on_step is not None:
            on_step(trainer, metrics)
        reporter.log(metrics)  # after the job's evaluation, whose keys go with the row

    trainer = None
    try:
        if ranks is None:
            trainer = run_tba(cfg, examples, reward_fn, parts=chosen, on_step=step)
        else:
            cfg = dataclasses.replace(cfg, trainer_device=str(ranks.device))
            chosen = data_parallel.install(chosen, configs.data_parallel, ranks)
            try:
                trainer = run_tba(cfg, examples, reward_fn, parts=chosen, on_step=step)
            finally:
                data_parallel.finish(ranks, trainer)
            ranks.close()
    finally:
        reporter.close(failed=trainer is None)
    return trainer


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


def gpu_placement(gpus: int) -> dict:
    """TBAConfig values that place the processes on ``gpus`` CUDA GPUs: GPU 0 trains, each
    other GPU holds a searcher; one GPU is shared (vLLM takes a slice); none: nothing set."""
    if gpus >= 2:
        return dict(
            num_searchers=gpus - 1,
            trainer_device="cuda:0",
            searcher_devices=",".join(f"cuda:{i}" for i in range(1, gpus)),
        )
    if gpus == 1:
        return dict(
            num_searchers=1,
            trainer_device="cuda:0",
            searcher_devices="cuda:0",
            vllm_gpu_memory_utilization=0.35,
        )
    return {}
