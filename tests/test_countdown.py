"""Countdown (jobs/run_countdown.py): the problems made in code, the reward, and the job end to end
in TBA′'s setting (its loss, the async level, the reference reset, the parity check).

No test here shows the job learning, for want of time. An untrained model never writes an
answer the reward pays for more than its format, so learning needs a supervised warm start
first. The smallest setting found that learns measurably: problems of two numbers, a 300-step
warm start, then 60 TB steps at lr 1e-3 (greedy accuracy on 100 held-out problems, 3 runs:
0.11 -> 0.18 after 40 steps, 0.27 -> 0.39 and 0.18 -> 0.50 after 60; 30 steps at lr 3e-3
went 0.11 -> 0.10). Each run took 4-7 minutes on the shared 2-core machine (load 16-19), where
this whole file takes under one and a half (its end-to-end run below included). The tiny
preset's own numbers (0.360 -> 0.505 over 400 steps) are in docs/tba_prime.md.
"""

from __future__ import annotations

import json

import pytest

from helpers import time_limit
from jobs import run_countdown
from jobs.run_countdown import (
    FORMAT_REWARD,
    MALFORMED_REWARD,
    MAX_EXPRESSION_CHARS,
    countdown_problems,
    countdown_reward,
    evaluate_expression,
)

EXAMPLE = {"numbers": [3, 4, 7], "target": 25}


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>3*7+4</answer>", 1.0),
        ("<answer> (7 * 3) + 4 </answer>", 1.0),
        ("<answer>4+3*7</answer>", 1.0),
        ("thinking <answer>3+4</answer> ... <answer>7*3+4</answer>", 1.0),  # the last answer
        ("<answer>3*7+4+0</answer>", FORMAT_REWARD),  # a number not given
        ("<answer>7*4-3</answer>", 1.0),  # another solution, as right as the first
        ("<answer>3*7</answer>", FORMAT_REWARD),  # a number left out
        ("<answer>3*7+4+4</answer>", FORMAT_REWARD),  # a number used twice
        ("<answer>3*7+4=25</answer>", MALFORMED_REWARD),  # not an expression
        ("<answer>3/(7-7)+4</answer>", MALFORMED_REWARD),  # divides by zero
        ("<answer>__import__('os')</answer>", MALFORMED_REWARD),  # nothing runs
        ("<answer></answer>", MALFORMED_REWARD),
        ("3*7+4", 0.0),  # no answer
        ("", 0.0),
    ],
)
def test_countdown_reward(completion, expected):
    assert countdown_reward(completion, EXAMPLE) == expected


def test_countdown_reward_allows_only_countdowns_arithmetic():
    """Each a case the reward could get wrong: ``**`` and ``//`` are not Countdown's (each
    example here would be solved by one), so neither is an expression; a number written with
    a leading zero is not a number; unary minus is arithmetic; a completion that is not text
    scores 0; an expression longer than MAX_EXPRESSION_CHARS is not an answer (padding at the
    bound counts); and ``9**9**9**9``, 10 characters, is refused without being evaluated."""
    assert countdown_reward("<answer>3**2*1</answer>", {"numbers": [1, 2, 3], "target": 9}) == (
        MALFORMED_REWARD
    )
    halves = {"numbers": [2, 7, 9], "target": 12}
    assert countdown_reward("<answer>9+7//2</answer>", halves) == MALFORMED_REWARD
    assert countdown_reward("<answer>9+7/2</answer>", halves) == FORMAT_REWARD  # 12.5
    assert countdown_reward("<answer>03*7+4</answer>", EXAMPLE) == MALFORMED_REWARD
    assert countdown_reward("<answer>-3+7*4</answer>", EXAMPLE) == 1.0
    assert countdown_reward("<answer>-(3-7*4)</answer>", EXAMPLE) == 1.0
    for completion in (None, 25, b"<answer>3*7+4</answer>", ["<answer>3*7+4</answer>"]):
        assert countdown_reward(completion, EXAMPLE) == 0.0
    at_bound = "3*7+" + " " * (MAX_EXPRESSION_CHARS - 5) + "4"
    assert len(at_bound) == MAX_EXPRESSION_CHARS
    assert countdown_reward(f"<answer>{at_bound}</answer>", EXAMPLE) == 1.0
    assert countdown_reward(f"<answer>{at_bound[:4]} {at_bound[4:]}</answer>", EXAMPLE) == (
        MALFORMED_REWARD
    )
    assert evaluate_expression("2**3") is None  # first: were ** evaluated, the next would hang
    with time_limit(10):  # a hang detector: refused at once
        assert evaluate_expression("9**9**9**9") is None
        power_tower = {"numbers": [9, 9, 9, 9], "target": 1}
        assert countdown_reward("<answer>9**9**9**9</answer>", power_tower) == MALFORMED_REWARD


def test_countdown_problems_have_their_solutions():
    """Every problem made in code is solved by its own solution (each number once, the target
    an integer in range), with the numbers shown sorted; fractions count exactly."""
    rows = countdown_problems(300, seed=5)
    assert len({r["id"] for r in rows}) == 300
    for row in rows:
        assert countdown_reward(row["solution"], row) == 1.0
        assert row["numbers"] == sorted(row["numbers"]) and 1 <= row["target"] <= 99
        assert row["prompt"].endswith(f"make {row['target']}.\n")
    assert evaluate_expression("8/(3-8/3)") == pytest.approx(24.0)
    assert countdown_reward("<answer>8/(3-8/3)</answer>", {"numbers": [3, 3, 8, 8], "target": 24})


@pytest.mark.slow
def test_countdown_job_in_tbas_prime_setting(tiny_model_dir, tmp_path):
    """jobs/run_countdown.py --preset tiny_prime on an untrained model (no warm start): TBA′'s loss,
    each batch trained once at most 2 versions behind, the reference reset every 4 steps on
    the trainer and the searcher, the parity check after every load; results and metrics."""
    out = tmp_path / "run"
    results = run_countdown.main(
        [
            "--preset",
            "tiny_prime",
            "--model",
            tiny_model_dir,
            "--output_dir",
            str(out),
            "--total_steps",
            "10",
            "--async_level",
            "2",
            "--ref_reset_every",
            "4",
            "--prompts_per_step",
            "4",
            "--searcher_batch_prompts",
            "4",
            "--max_new_tokens",
            "12",
            "--eval_test_size",
            "4",
            "--eval_samples",
            "0",
            "--eval_every",
            "0",
        ]
    )
    assert results["steps"] == 10
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["async/lag_max"] <= 2 and r["async/new_frac"] == 1.0 for r in rows)
    assert [r["reference/version"] for r in rows] == [0, 0, 0, 4, 4, 4, 4, 8, 8, 8]
    # Before the first reset every item's log p_ref is of the run's reference: none rescored.
    assert [r["reference/rescored_frac"] for r in rows if r["reference/version"] == 0] == [0.0] * 3
    assert all(r["loss/tb_prime"] == r["loss/tb_prime"] for r in rows)  # not NaN
    assert json.loads((out / "results.json").read_text())["config"]["tb_prime"] is True
