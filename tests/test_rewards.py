"""The GSM8K reward on the data the repository ships and on odd inputs."""

from __future__ import annotations

import pytest

from helpers import REPO
from rewards import extract_answer, gsm8k_reward
from run_gsm8k import load_gsm8k


def test_gsm8k_ships_with_the_repository_and_every_gold_answer_scores():
    """data/gsm8k is OpenAI's GSM8K (MIT): read by the main job's loader, from the repository."""
    train, test = load_gsm8k()  # the default data_dir, data/gsm8k
    assert (len(train), len(test)) == (7473, 1319)
    assert (REPO / "data" / "gsm8k" / "LICENSE").read_text().startswith("MIT License")
    rows = train + test
    for ex in rows:
        assert gsm8k_reward(ex["answer"], ex) == 1.0, ex["answer"][-80:]
        head, gold = ex["answer"].rsplit("####", 1)
        wrong = str(int(gold.strip().replace(",", "")) + 1)
        assert gsm8k_reward(f"{head}#### {wrong}", ex) == 0.0, ex["answer"][-80:]


def test_gsm8k_reward_numbers_negatives_decimals():
    assert gsm8k_reward("It is -3 degrees", {"answer": "#### -3"}) == 1.0
    assert gsm8k_reward("It is \u22123 degrees", {"answer": "#### -3"}) == 1.0
    assert gsm8k_reward("costs $18.00", {"answer": "#### 18"}) == 1.0
    assert gsm8k_reward("2.5 cups", {"answer": "#### 2.5"}) == 1.0
    assert gsm8k_reward("2.50 cups", {"answer": "#### 2.5"}) == 1.0
    assert gsm8k_reward("25 cups", {"answer": "#### 2.5"}) == 0.0


@pytest.mark.parametrize(
    "odd",
    [
        "",
        "no digits here",
        "日本語の答え ✓ 🎉",
        "x" * 10_000,
        "9" * 10_000,
        "1e400000",
        "#### ",
        "\\boxed{}",
        None,
        12,
    ],
)
def test_gsm8k_reward_odd_inputs_score_zero_without_raising(odd):
    assert gsm8k_reward(odd, {"answer": "#### 7"}) == 0.0


def test_gsm8k_reward_bad_example_is_loud():
    with pytest.raises(ValueError, match="gold"):
        gsm8k_reward("7", {"answer": "no marker"})
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("7", {"answer": "#### seven"})
    assert extract_answer("#### 12") == 12
