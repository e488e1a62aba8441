"""TBA on Countdown: make a target from given numbers with + - * /, each number once. A second
offline task beside the sums, the one TBA′'s released code trains Qwen3 on (docs/tba_prime.md);
here a tiny preset on a CPU with every piece built in code.

    python -m jobs.run_countdown                  # the tiny preset: warm start, then TBA, minutes
    python -m jobs.run_countdown --help           # every config field is a flag

The task (``countdown_problems``): three numbers from 1-9 and a target, the value of a random
expression that uses each number once with + - * (so every problem has an answer); the prompt
names them, the answer is an expression inside ``<answer>...</answer>``, the released code's
format. The reward (``countdown_reward``) checks the expression: it must use exactly the given
numbers, each once, and equal the target. It also pays for format, as the released code does
(its Countdown reward is reasoning-gym's ``score_answer``): 0.05 for a well-formed expression
that misses, 0.01 for an answer that is not one, 0 without an answer.

The tiny preset (``TINY_PRESET``): the tiny Llama of the sums over the same character
tokenizer, warm-started by supervised steps on one solution per problem (the expression that
made its target) until greedy accuracy on a validation set reaches ``TINY_WARM_START["target"]``;
then the asynchronous system of ``run_gsm8k.py --preset tiny`` on this task. Greedy accuracy is
the share of held-out problems whose greedy answer scores 1.

Outputs in output_dir: metrics.jsonl, results.json (``accuracy_before``, ``accuracy_after``),
checkpoint.pt and final/.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from extensions import launch, report
from extensions.checks import print_summary, run_summary
from extensions.cli import run_cli
from extensions.evaluate import EvalConfig, Evaluator
from extensions.tiny import (
    TINY_CHECKS,
    answer_rows,
    build_char_tokenizer,
    cpu_config,
    supervised_warm_start,
)
from extensions.tiny import TINY_PRESET as SUMS_PRESET
from plumbing.checkpoint import claimed, save_final, write_results
from plumbing.config import ConfigError
from plumbing.models import load_causal_lm
from tba import TBAConfig
from trainer import run_tba

# ----------------------------------------------------------------------------- the task

PROMPT = "Use {numbers} once each to make {target}.\n"
ANSWER = "<answer>{expression}</answer>"
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Countdown's four operations, and no other: not ``**`` (``9**9**9**9`` fits in
# MAX_EXPRESSION_CHARS and would keep a searcher busy for hours), nor ``//`` (not Countdown's).
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
# The released code's partial rewards (reasoning-gym's countdown ``score_answer``): an answer
# that is a well-formed expression but misses, and one that is not an expression.
FORMAT_REWARD = 0.05
MALFORMED_REWARD = 0.01
MAX_EXPRESSION_CHARS = 64  # longer is not an answer to three numbers (and bounds the parse)

# Problems: COUNT numbers from LOW to HIGH, a target between 1 and MAX_TARGET.
TINY_TASK = dict(count=3, low=1, high=9, max_target=99, train=4000, test=200, val=100)
TINY_MODEL = dict(hidden=64, layers=2, heads=2)  # the sums' tiny Llama (tiny.TINY_MODEL)


def countdown_problems(count: int, seed: int, task: dict = TINY_TASK) -> list[dict]:
    """Countdown problems made in code: ``numbers`` (a list of ``task["count"]`` from ``low`` to
    ``high``), ``target`` (1 to ``max_target``), ``solution`` (the expression that made it, each
    number once, + - * only, so the target is an integer), and ``id`` and ``prompt``."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        numbers = [rng.randint(task["low"], task["high"]) for _ in range(task["count"])]
        ops = [rng.choice("+-*") for _ in range(task["count"] - 1)]
        expression = str(numbers[0]) + "".join(
            op + str(n) for op, n in zip(ops, numbers[1:], strict=True)
        )
        target = evaluate_expression(expression)
        if target is None or not 1 <= target <= task["max_target"] or target != int(target):
            continue
        shown = sorted(numbers)  # the prompt does not give the solution's order away
        rows.append(
            {
                "id": len(rows),
                "prompt": PROMPT.format(numbers=" ".join(map(str, shown)), target=int(target)),
                "numbers": shown,
                "target": int(target),
                "solution": ANSWER.format(expression=expression),
            }
        )
    return rows


def countdown_task(task: dict = TINY_TASK) -> tuple[list[dict], list[dict], list[dict]]:
    """The (train, test, validation) problems of the tiny task: disjoint seeds."""
    return (
        countdown_problems(task["train"], seed=1, task=task),
        countdown_problems(task["test"], seed=2, task=task),
        countdown_problems(task["val"], seed=3, task=task),
    )


# ----------------------------------------------------------------------------- the reward


def evaluate_expression(text: str) -> float | None:
    """The value of an arithmetic expression of integers, + - * / and parentheses (unary minus
    allowed), or None when ``text`` is not one, is longer than MAX_EXPRESSION_CHARS or divides
    by zero. Parsed by ``ast`` and evaluated node by node: nothing else in the text runs. A
    number with a leading zero (``07``) is not one, as in Python's grammar."""
    if len(text) > MAX_EXPRESSION_CHARS or not re.fullmatch(r"[\d+\-*/() ]+", text):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node) -> float:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not an arithmetic expression")

    try:
        return float(value(tree.body))
    except (ValueError, ZeroDivisionError):
        return None


def countdown_reward(completion: str, example: dict) -> float:
    """1.0 when the completion's last ``<answer>...</answer>`` is an expression that uses
    exactly ``example["numbers"]`` (each once) and equals ``example["target"]``; otherwise the
    released code's format rewards: ``FORMAT_REWARD`` for a well-formed expression that misses
    (a wrong value, or other numbers), ``MALFORMED_REWARD`` for an answer that is not an
    expression, 0 without an answer. Never raises on a completion."""
    answers = _ANSWER_RE.findall(completion) if isinstance(completion, str) else []
    if not answers:
        return 0.0
    expression = answers[-1].strip()
    value = evaluate_expression(expression)
    if value is None:
        return MALFORMED_REWARD
    used = Counter(int(n) for n in re.findall(r"\d+", expression))
    if used == Counter(example["numbers"]) and abs(value - example["target"]) < 1e-9:
        return 1.0
    return FORMAT_REWARD


# ----------------------------------------------------------------------------- tiny preset

# The sums' tiny preset (tiny.TINY_PRESET: one searcher, TB's trust region, k = 1, data at most
# two versions old, one step per batch generated) with answers of up to 32 characters. Greedy
# accuracy on the 200 held-out problems rises from the warm start's ~0.4 to ~0.5 in 400 steps
# (docs/tba_prime.md has the runs); the sums' 0.6 -> 0.85-0.9 is an easier climb.
TINY_PRESET: dict = dict(SUMS_PRESET, max_new_tokens=32, output_dir="runs/countdown")
# TBA′'s setting on the same task (tba_prime.PRIME_VALUES): its loss with importance sampling,
# each batch trained once at most ten versions behind, the reference reset every 50 steps.
TINY_PRIME_PRESET: dict = dict(
    TINY_PRESET,
    tb_prime=True,
    prime_is=True,
    async_level=10,
    ref_reset_every=50,
    tb_clip_eps=0.0,  # the core's trust region is of tb_loss, which --tb_prime replaces
    barrier_lag=-1,
    max_train_lag=-1,
    replay_ratio=0.0,
    output_dir="runs/countdown_prime",
)
# Supervised warm start on one solution per problem (the tiny sums' recipe, extensions/tiny.py): the
# tiny Llama reaches ~0.6 greedy accuracy on held-out problems after 6,000 steps, so the
# warm start stops at 0.4 on validation and leaves RL the rest.
TINY_WARM_START = dict(
    max_steps=6000,
    lr=3e-3,
    batch=32,
    target=0.4,
    check_every=100,
    check_every_near=25,
    near=0.25,
    val=TINY_TASK["val"],
)


class CountdownEvaluator(Evaluator):
    """Greedy accuracy and pass@n on Countdown problems: an answer counts when
    ``countdown_reward`` pays it 1."""

    answer_reward = staticmethod(countdown_reward)


def tiny_countdown_evaluator(tokenizer) -> CountdownEvaluator:
    """The evaluator of the tiny preset's greedy answers (tiny.tiny_evaluator's, on Countdown)."""
    cfg = cpu_config("", max_new_tokens=TINY_PRESET["max_new_tokens"])
    eval_cfg = EvalConfig(eval_batch_size=TINY_PRESET["eval_batch_size"])
    return CountdownEvaluator(cfg, eval_cfg, tokenizer)


def tiny_warm_start(out_dir: Path, train: list[dict], val: list[dict], seed: int) -> str:
    """The Countdown warm start: supervised on one solution per problem until greedy accuracy
    on ``val`` reaches ``TINY_WARM_START["target"]``; in ``out_dir/warm_start`` (cached)."""
    tokenizer = build_char_tokenizer()
    evaluator = tiny_countdown_evaluator(tokenizer)
    return supervised_warm_start(
        out_dir / "warm_start",
        tokenizer,
        answer_rows(tokenizer, train, "solution"),
        TINY_WARM_START,
        seed,
        "countdown warm start",
        check=lambda model: evaluator.accuracy(model, val, "warm start validation"),
    )


# ----------------------------------------------------------------------------- main


def choose_preset(name: str) -> dict:
    presets = {"tiny": TINY_PRESET, "tiny_prime": TINY_PRIME_PRESET}
    return dict(presets[name], **TINY_CHECKS)


def main(argv: list[str] | None = None) -> dict:
    parser = launch.argparser(
        "TBA on Countdown (offline, CPU). Every config field is a flag; --preset sets the base.",
        ["tiny", "tiny_prime"],
        EvalConfig,
    )
    args = parser.parse_args(argv)
    wall_start = time.time()
    configs = launch.parse(args, choose_preset(args.preset), EvalConfig)
    cfg: TBAConfig = configs.tba
    torch.set_num_threads(cfg.torch_threads or torch.get_num_threads())
    if cfg.dtype != "float32" or cfg.engine == "vllm":
        raise ConfigError("jobs/run_countdown.py is the tiny CPU task: fp32 and the hf engine")
    ranks = launch.torchrun(configs)
    if ranks is not None and ranks.rank > 0:
        return {}
    with claimed(cfg):  # output_dir: refused if it holds another run, before any write there
        return train_and_evaluate(configs, args.preset, ranks, wall_start)


def train_and_evaluate(configs, preset: str, ranks, wall_start: float) -> dict:
    """The warm start (unless --model), evaluate, run TBA, save, evaluate again, and write
    results.json."""
    cfg: TBAConfig = configs.tba
    (eval_cfg,) = configs.task
    out_dir = Path(cfg.output_dir)
    train, test, val = countdown_task()
    if not cfg.model:
        cfg = dataclasses.replace(cfg, model=tiny_warm_start(out_dir, train, val, cfg.seed))
        configs = dataclasses.replace(configs, tba=cfg)
    tokenizer = launch.tokenizer(cfg)
    test = test[: eval_cfg.eval_test_size or None]
    subset = test[: eval_cfg.eval_subset]
    evaluator = CountdownEvaluator(cfg, eval_cfg, tokenizer, probe=launch.parity_probe(configs))
    initial = load_causal_lm(
        cfg.model, cfg.torch_dtype(), torch.device(cfg.trainer_device), cfg.trust_remote_code
    )
    before = {
        "accuracy_before": evaluator.accuracy(initial, test, "eval before (greedy)"),
        "diversity_before": evaluator.diversity(initial, subset),
    }
    del initial
    print(f"greedy accuracy before RL: {before['accuracy_before']:.4f} on {len(test)} problems")

    def on_step(trainer, metrics):
        if eval_cfg.eval_every and trainer.step % eval_cfg.eval_every == 0:
            metrics["eval/accuracy"] = evaluator.accuracy(trainer.whole_model(), subset, "eval")

    rl_start = time.time()
    with launch.extensions(configs, ranks, on_step) as (run_cfg, parts, on_step):
        trainer = run_tba(run_cfg, train, countdown_reward, parts=parts, on_step=on_step)
    rl_seconds = time.time() - rl_start
    final = save_final(out_dir, trainer.model, tokenizer)
    after = {
        "accuracy_after": evaluator.accuracy(trainer.model, test, "eval after (greedy)"),
        "diversity_after": evaluator.diversity(trainer.model, subset),
    }
    summary = run_summary(out_dir, cfg.mop_prob)
    results = {
        **before,
        **after,
        "rl_seconds": rl_seconds,
        "wall_seconds": time.time() - wall_start,
        "steps": trainer.step,
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
        f"after {trainer.step} steps ({rl_seconds:.0f} s of RL)"
    )
    print_summary(summary)
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
