"""Countdown (jobs/run_countdown.py): the problems made in code, the reward, and the job end to end
in TBA′'s setting (its loss, the async level, the reference reset, the parity check)."""

from __future__ import annotations

import json

import pytest

from jobs import run_countdown
from jobs.run_countdown import (
    FORMAT_REWARD,
    MALFORMED_REWARD,
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
            "20",
            "--eval_subset",
            "10",
            "--eval_samples",
            "2",
            "--eval_every",
            "5",
        ]
    )
    assert results["steps"] == 10 and 0 <= results["accuracy_after"] <= 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["async/lag_max"] <= 2 and r["async/new_frac"] == 1.0 for r in rows)
    assert [r["reference/version"] for r in rows] == [0, 0, 0, 4, 4, 4, 4, 8, 8, 8]
    assert all(0 <= r["reference/rescored_frac"] <= 1 for r in rows)
    assert all(r["loss/tb_prime"] == r["loss/tb_prime"] for r in rows)  # not NaN
    assert json.loads((out / "results.json").read_text())["config"]["tb_prime"] is True
