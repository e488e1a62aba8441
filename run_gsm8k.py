"""The main job: TBA on GSM8K -- the paper preset on 4xA100, or an offline tiny preset on a CPU.

    python run_gsm8k.py                      # auto: paper preset with CUDA GPUs, else tiny
    python run_gsm8k.py --preset tiny        # offline, CPU, synthetic GSM8K-format problems
    python run_gsm8k.py --preset smoke       # the paper preset for 10 steps: does it fit?
    python run_gsm8k.py --help               # every config field is a flag
    torchrun --nproc-per-node 4 run_gsm8k.py ...   # a data-parallel trainer
    (extensions/data_parallel.py)

GSM8K ships in data/gsm8k (OpenAI's JSONL, MIT licence); --data_dir points elsewhere.

Presets are dicts of config values; any explicit flag overrides them. Outputs in output_dir:
metrics.jsonl, results.json, checkpoint.pt (resumable) and final/ (model and tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from extensions import launch, report
from extensions.checks import print_summary, run_summary, weights_verdict
from extensions.cli import run_cli
from extensions.evaluate import EvalConfig, Evaluator, to_examples
from extensions.tiny import TINY_CHECKS, TINY_PRESET, tiny_task, tiny_warm_start
from plumbing.checkpoint import claimed, save_final, write_atomic, write_results
from plumbing.config import ConfigError, RunError, knob
from plumbing.models import load_causal_lm
from rewards import gsm8k_gold, gsm8k_reward
from trainer import run_tba

REPO = Path(__file__).resolve().parent

# The paper's GSM8K setup is TBAConfig's defaults; it only needs GPU placement (see main).
PAPER_PRESET: dict = {}
# First contact with a GPU box: the paper preset for ten steps, evaluated on 50 test problems,
# with the parity check after every weight load; then a summary of seconds per step, peak memory
# per process, realised m and lag, and whether the weights reached every engine.
SMOKE_PRESET: dict = dict(
    total_steps=10,
    eval_test_size=50,
    eval_subset=50,
    eval_samples=0,
    parity_check=True,
    output_dir="runs/smoke",
)


@dataclass
class GSM8KConfig:
    """Where the GSM8K job reads its data (run_gsm8k.py)."""

    data_dir: str = knob(
        "data/gsm8k",
        "GSM8K train.jsonl and test.jsonl (relative: here, else the repository's)",
    )


# ----------------------------------------------------------------------------- data


def read_gsm8k_jsonl(path: Path) -> list[dict]:
    """OpenAI's GSM8K JSONL; a missing file or a bad row is a RunError naming the file and
    line."""
    if not path.is_file():
        raise RunError(
            f"GSM8K file not found: {path} (--data_dir names a directory holding train.jsonl "
            "and test.jsonl, OpenAI's GSM8K JSONL)"
        )
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise RunError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise RunError(f"{path}:{lineno}: missing or empty field {key!r}")
            try:
                gsm8k_gold(row)
            except ValueError as exc:
                raise RunError(f"{path}:{lineno}: {exc}") from None
            rows.append(row)
    if not rows:
        raise RunError(f"{path}: no examples")
    return rows


def load_gsm8k(data_dir: str = "data/gsm8k") -> tuple[list[dict], list[dict]]:
    """(train, test) rows of ``data_dir``; a relative path missing from the working directory is
    read from the repository, which ships GSM8K in data/gsm8k."""
    path = Path(data_dir)
    if not path.is_absolute() and not path.exists():
        path = REPO / path
    return read_gsm8k_jsonl(path / "train.jsonl"), read_gsm8k_jsonl(path / "test.jsonl")


def check_prompt_lengths(
    examples: list[dict],
    tokenizer,
    max_positions: int | None,
    max_new_tokens: int,
    name: str,
) -> None:
    """Fail before any process starts if a prompt cannot fit the model's context."""
    if not max_positions:
        return
    for ex in examples:
        n = len(tokenizer(ex["prompt"])["input_ids"])
        if n + max_new_tokens > max_positions:
            raise RunError(
                f"{name} example {ex['id']}: prompt of {n} tokens + --max_new_tokens "
                f"{max_new_tokens} exceeds the model context of {max_positions}"
            )


# ----------------------------------------------------------------------------- main


def choose_preset(name: str) -> tuple[str, dict]:
    """``auto``: paper with CUDA GPUs (the trainer's ranks on the first, the rest search, memory
    shares from the GPUs' memory: launch.gpu_placement), else tiny."""
    gpus = torch.cuda.device_count()
    if name == "auto":
        name = launch.auto_preset(gpus)
    if name == "tiny":
        return name, dict(TINY_PRESET, **TINY_CHECKS)
    values = dict(PAPER_PRESET, **(SMOKE_PRESET if name == "smoke" else {}))
    values.update(launch.gpu_placement(gpus, needs=launch.GSM8K_PAPER_NEEDS))
    return name, values


def main(argv: list[str] | None = None) -> dict:
    parser = launch.argparser(
        "TBA on GSM8K. Every config field is a flag; --preset sets the base.",
        ["auto", "paper", "smoke", "tiny"],
        EvalConfig,
        GSM8KConfig,
    )
    args = parser.parse_args(argv)
    preset, base = choose_preset(args.preset)
    if preset == "tiny" and args.data_dir is not None:
        raise ConfigError("--data_dir: the tiny preset makes its own task; GSM8K is --preset paper")
    wall_start = time.time()
    configs = launch.parse(args, base, EvalConfig, GSM8KConfig)
    cfg = configs.tba
    # An explicit thread count applies before any torch work here (warm start, first evaluation);
    # run_tba then sets cfg.threads_per_process(), which is the same number when one was given.
    torch.set_num_threads(cfg.torch_threads or torch.get_num_threads())
    ranks = launch.torchrun(configs)  # under torchrun, ranks > 0 train in here, then return
    if ranks is not None and ranks.rank > 0:
        return {}
    with claimed(cfg):  # output_dir: refused if it holds another run, before any write there
        return train_and_evaluate(configs, preset, ranks, wall_start)


def train_and_evaluate(configs, preset: str, ranks, wall_start: float) -> dict:
    """Evaluate, run TBA (trainer.run_tba with the parts the flags ask for), save, evaluate
    again, and write results.json."""
    cfg = configs.tba
    eval_cfg, gsm8k_cfg = configs.task
    out_dir = Path(cfg.output_dir)
    if preset == "tiny":
        train, test, val = tiny_task()
        if not cfg.model:
            cfg = dataclasses.replace(cfg, model=tiny_warm_start(out_dir, train, val, cfg.seed))
            configs = dataclasses.replace(configs, tba=cfg)
    else:
        train, test = (to_examples(rows) for rows in load_gsm8k(gsm8k_cfg.data_dir))
    tokenizer = launch.tokenizer(cfg)
    model_config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    for name, rows in (("train", train), ("test", test)):
        check_prompt_lengths(
            rows,
            tokenizer,
            getattr(model_config, "max_position_embeddings", None),
            cfg.max_new_tokens,
            name,
        )
    test = test[: eval_cfg.eval_test_size or None]
    subset = test[: eval_cfg.eval_subset]
    torch.manual_seed(cfg.seed)

    evaluator = Evaluator(cfg, eval_cfg, tokenizer, probe=launch.parity_probe(configs))
    results_path = out_dir / "results.json"
    previous = json.loads(results_path.read_text()) if cfg.resume and results_path.exists() else {}
    if "accuracy_before" in previous:  # a resumed run keeps its first "before"
        before = {k: previous[k] for k in ("accuracy_before", "diversity_before")}
    else:
        initial = load_causal_lm(
            cfg.model,
            cfg.torch_dtype(),
            torch.device(cfg.trainer_device),
            cfg.trust_remote_code,
        )
        before = {
            "accuracy_before": evaluator.accuracy(initial, test, "eval before (greedy)"),
            "diversity_before": evaluator.diversity(initial, subset),
        }
        del initial
        write_atomic(results_path, json.dumps(before, indent=2))
    print(f"greedy accuracy before RL: {before['accuracy_before']:.4f} on {len(test)} problems")

    def on_step(trainer, metrics):
        if eval_cfg.eval_every and trainer.step % eval_cfg.eval_every == 0:
            model = trainer.whole_model()  # under --fsdp, gathered by every rank
            metrics["eval/accuracy"] = evaluator.accuracy(model, subset, "eval (subset)")

    rl_start = time.time()
    # The extensions the flags ask for (GRPO, the checks, Ray, torchrun's ranks, the tracker)
    # come in as parts; TBA itself is trainer.run_tba.
    with launch.extensions(configs, ranks, on_step) as (cfg, parts, on_step):
        trainer = run_tba(cfg, train, gsm8k_reward, parts=parts, on_step=on_step)
    rl_seconds = time.time() - rl_start

    final = save_final(out_dir, trainer.model, tokenizer)
    after = {
        "accuracy_after": evaluator.accuracy(trainer.model, test, "eval after (greedy)"),
        "diversity_after": evaluator.diversity(trainer.model, subset),
    }
    evaluator.close()  # its vLLM engine's process, if any
    summary = run_summary(out_dir, cfg.mop_prob)
    if configs.checks.parity_check:
        summary["weights"] = weights_verdict(cfg.num_searchers, out_dir, evaluator)
    results = {
        **before,
        **after,
        "rl_seconds": rl_seconds,
        "wall_seconds": time.time() - wall_start,
        "steps": trainer.step,
        "resumed": cfg.resume,
        "preset": preset,
        "test_size": len(test),
        "checkpoint": str(final),
        "summary": summary,
        "config": launch.config_dict(configs),
    }
    write_results(out_dir, results)
    print(f"curves: {report.plot_run(out_dir)}")
    print(
        f"greedy accuracy: {results['accuracy_before']:.4f} -> {results['accuracy_after']:.4f} "
        f"after {trainer.step} steps ({rl_seconds:.0f} s of RL this run); see {results_path}"
    )
    print_summary(summary)  # last: what the run measured, and what it checked
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
