"""The config's plumbing (a learner may skip): how a knob is declared and checked, the errors a
person can fix, and ``SystemConfig``, the knobs of processes, devices, engines, memory, restarts,
timeouts and outputs, which ``tba.TBAConfig`` extends with the algorithm's own.

A knob is a dataclass field with its help text and bounds (``knob``): the command line shows the
help (extensions/cli.py), ``check_bounds`` checks the bounds, so every config, the core's and
each extension's, validates itself the same way when it is built.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


def knob(
    default,
    help: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    choices: tuple | None = None,
):
    """A config field with its help text and its bounds (value >= at_least, > above,
    <= at_most, one of choices), which ``check_bounds`` checks."""
    bounds = {"at_least": at_least, "above": above, "at_most": at_most, "choices": choices}
    return field(default=default, metadata={"help": help, **bounds})


class RunError(ValueError):
    """Something the person running a job can fix, not a bug: a file missing or malformed, a
    checkpoint that is not one, a model that cannot be found. The message names the flag or
    the file and what to do; the entry scripts print it as one line (``cli.run_cli``)."""


class ConfigError(RunError):
    """A configuration value, or a combination of values, that cannot work; the message names
    the flag. The entry scripts print it as a usage error (one line, exit status 2)."""


def need(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``: the configs' validation reads as a list."""
    if not ok:
        raise ConfigError(message)


def check_bounds(config) -> None:
    """Raise ConfigError naming the flag of the first of ``config``'s knobs outside its bounds."""
    for f in dataclasses.fields(config):
        value, bounds = getattr(config, f.name), f.metadata
        low, above, high = bounds.get("at_least"), bounds.get("above"), bounds.get("at_most")
        need(low is None or value >= low, f"--{f.name} must be >= {low}, got {value}")
        need(above is None or value > above, f"--{f.name} must be > {above}, got {value}")
        need(high is None or value <= high, f"--{f.name} must be <= {high}, got {value}")
        choices = bounds.get("choices")
        need(
            choices is None or value in choices,
            f"--{f.name} {value!r} is not one of {', '.join(map(str, choices or ()))}",
        )


@dataclass
class SystemConfig:
    """The plumbing's knobs: processes, devices, engines, memory, restarts, timeouts, outputs.
    ``tba.TBAConfig`` adds the algorithm's; its defaults are the released run's placement on
    4 GPUs (trainer on the first, one searcher on each of the others)."""

    num_searchers: int = knob(3, "searcher processes S (paper: 3, one per GPU)", at_least=1)
    searcher_devices: str = knob(
        "cuda:1,cuda:2,cuda:3", "one device per searcher (comma list), or one for all"
    )
    trainer_device: str = knob("cuda:0", "device of the trainer, which runs in the main process")
    engine: str = knob(
        "auto",
        "generation engine: vllm | hf (transformers) | auto: vLLM on a GPU if installed",
        choices=("auto", "vllm", "hf"),
    )
    vllm_gpu_memory_utilization: float = knob(0.85, "fraction of a searcher GPU vLLM may take")
    vllm_kv_cache_gb: float = knob(
        0.0,
        "KV cache of each vLLM searcher in GB, fixed instead of sized from the memory free at its "
        "start-up; vLLM still needs vllm_gpu_memory_utilization of the GPU free (0: sized)",
        at_least=0,
    )
    vllm_compile: bool = knob(
        True,
        "vLLM compiled, its default: torch.compile, and CUDA graphs on a GPU; "
        "off (--no-vllm_compile): eager, faster to start",
    )
    weight_store: str = knob(
        "auto",
        "cuda (CUDA IPC; auto with a CUDA trainer) | shared_memory (no GPU peer access)",
        choices=("auto", "cuda", "shared_memory"),
    )
    trust_remote_code: bool = knob(
        False, "let transformers run model code from the hub (off: safer)"
    )
    gradient_checkpointing: bool = knob(False, "trade trainer compute for activation memory")
    micro_batch_size: int = knob(
        20,
        "sequences per forward pass, in whole prompt groups (at least one; "
        "the gradient does not depend on it); 0: all in one pass",
        at_least=0,
    )
    queue_size: int = knob(
        8, "bound of the trajectory queue, in messages (one per generate call)", at_least=1
    )
    max_searcher_restarts: int = knob(
        3, "restarts allowed per run, all searchers together; one more failure stops it", at_least=0
    )
    torch_threads: int = knob(0, "torch CPU threads per process; 0: cores / processes", at_least=0)
    timeout_s: float = knob(
        600.0, "longest wait for any process or queue before failing loudly", above=0
    )
    seed: int = knob(0, "seed of trainer, buffer and searchers (searcher s uses seed + 1 + s)")
    output_dir: str = knob("runs/gsm8k", "metrics.jsonl, results.json, checkpoints")
    resume: bool = knob(
        False, "continue from output_dir/checkpoint.pt (weights, optimizer, step, RNG, buffer)"
    )
    existing_run: str = knob(
        "refuse",
        "when output_dir holds a run and --resume is off: refuse (change nothing) | archive "
        "(move it to output_dir/archive-N first) | replace (delete it)",
        choices=("refuse", "archive", "replace"),
    )
    checkpoint_every: int = knob(
        175,
        "resumable checkpoint every this many steps (0: every k); released: 4 a run",
        at_least=0,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the field when a value or a combination cannot work."""
        check_bounds(self)
        devices = len(self.searcher_device_list())
        need(
            devices in (1, self.num_searchers),
            f"--searcher_devices lists {devices} devices for {self.num_searchers} searchers "
            "(one each, or one)",
        )

    def searcher_device_list(self) -> list[str]:
        """One device string per searcher."""
        devices = [d.strip() for d in self.searcher_devices.split(",") if d.strip()]
        return devices * self.num_searchers if len(devices) == 1 else devices

    def threads_per_process(self) -> int:
        """torch CPU threads for the trainer and each searcher: ``torch_threads``, or the cores
        split evenly over the S + 1 processes (oversubscribed threads only spin)."""
        return self.torch_threads or max(1, (os.cpu_count() or 1) // (self.num_searchers + 1))


def check_combinations(cfg) -> None:
    """The combinations of ``tba.TBAConfig``'s knobs that cannot work, each a ConfigError naming
    the flags."""
    need(
        max(cfg.num_generations, cfg.responses_per_prompt) <= cfg.buffer_capacity,
        f"--num_generations ({cfg.num_generations}) and --responses_per_prompt "
        f"({cfg.responses_per_prompt}) must be <= --buffer_capacity "
        f"({cfg.buffer_capacity}), or one generate call evicts its own samples",
    )
    for name in ("barrier_lag", "max_train_lag"):
        bound = getattr(cfg, name)
        need(
            bound == -1 or bound >= cfg.publish_every - 1,
            f"--{name} must be -1 (no bound) or >= publish_every - 1 = "
            f"{cfg.publish_every - 1}: only every k-th version is published (got {bound})",
        )
    need(
        cfg.warmup_steps + cfg.stable_steps + cfg.decay_steps >= 1,
        "--warmup_steps + --stable_steps + --decay_steps must be >= 1",
    )
    need(
        not cfg.synchronous
        or cfg.num_searchers * cfg.searcher_batch_prompts >= cfg.prompts_per_step,
        "--synchronous generates one batch per searcher per version: num_searchers * "
        "searcher_batch_prompts must be >= prompts_per_step",
    )
