"""MATH (jobs/run_math.py): the Hendrycks equivalence on the shipped sample's known answers, the
loader, the 7B recipe's memory plan, and the recipe's code paths on a CPU (the dry run)."""

from __future__ import annotations

import json

import pytest

from jobs import run_math
from jobs.run_math import (
    PAPER_PRESET,
    QWEN25_7B,
    SAMPLE,
    is_equiv,
    last_boxed,
    math_reward,
    memory_plan,
    normalize_answer,
    read_math_jsonl,
)
from plumbing.config import ConfigError, RunError

# The sample's answers as written in its solutions, and answers that equal them under the MATH
# checker's rules (by the row's order in data/math/sample.jsonl), then answers that do not.
KNOWN = [
    ("6", ["6", "x = 6", " 6 "], ["7", "6.0"]),
    (
        "\\frac{5}{6}",
        ["\\dfrac{5}{6}", "\\frac56", "5/6", "\\tfrac{5}{6}"],
        ["0.8333", "\\frac{6}{5}"],
    ),
    ("55^\\circ", ["55", "55^{\\circ}", "55^\\circ"], ["35"]),
    ("6", ["6"], ["3!"]),  # no arithmetic: 3! is not 6 to the checker
    ("2", ["2"], ["1024"]),
    ("2\\sqrt{3}", ["2\\sqrt3", "2 \\sqrt{3}"], ["\\sqrt{12}"]),
    ("2, 3", ["2,3", "2, 3"], ["3, 2"]),  # order matters to the checker
    (
        "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}",
        ["\\begin{pmatrix}3\\\\7\\end{pmatrix}"],
        ["\\begin{pmatrix} 7 \\\\ 3 \\end{pmatrix}"],
    ),
    ("\\$7.50", ["7.50", "\\$7.50"], ["7.5"]),
    ("25\\%", ["25", "25\\%"], ["0.25"]),
    ("(-\\infty, 3]", ["(-\\infty,3]", "\\left(-\\infty, 3\\right]"], ["(-\\infty, 3)"]),
    ("\\dfrac{1}{4}", ["\\frac{1}{4}", "1/4", "\\frac14"], ["0.25"]),
    ("5\\text{ inches}", ["5", "5\\text{ in}"], ["5\\text{in}"]),  # "\\text{ " starts units
    ("0.5", ["\\frac{1}{2}", ".5", "1/2"], ["0.50"]),
    ("\\left( 1, 2 \\right)", ["(1,2)", "(1, 2)"], ["(2,1)"]),
    ("-\\frac{1}{3}", ["-\\frac13", "-\\dfrac{1}{3}"], ["\\frac{-1}{3}", "-1/3"]),
    ("a = 7", ["7", "a=7"], ["a = 8"]),
    ("x^2 + 2x + 1", ["x^2+2x+1"], ["(x+1)^2"]),
    ("\\tfrac{1}{8}", ["\\frac{1}{8}", "1/8", "\\frac18"], ["0.125"]),
    ("\\text{no}", ["\\text{no}"], ["\\text{yes}", "no"]),
]


def test_math_reward_agrees_with_the_known_answers_of_the_sample():
    """Each sample row's gold answer is its solution's last \\boxed{}; a completion boxing any
    form the checker's rules equate with it scores 1 (wrapped in reasoning, a second box
    before, the sample's own gold), and the other forms 0."""
    rows = read_math_jsonl(SAMPLE)
    assert len(rows) == len(KNOWN) == 20
    for row, (gold, same, different) in zip(rows, KNOWN, strict=True):
        assert row["answer"] == gold
        for answer in [gold, *same]:
            completion = f"We compute. Not \\boxed{{0}} but:\n$\\boxed{{{answer}}}$. Done."
            assert math_reward(completion, row) == 1.0, (gold, answer)
        for answer in different:
            assert math_reward(f"so \\boxed{{{answer}}}", row) == 0.0, (gold, answer)
    assert math_reward("the answer is 6, unboxed", rows[0]) == 0.0
    assert math_reward("\\boxed{6", rows[0]) == 0.0  # never closed
    assert math_reward("\\boxed 6$ is it", rows[0]) == 1.0  # \boxed without braces


def test_math_checker_rules():
    assert last_boxed("\\boxed{\\frac{1}{2}} and \\fbox{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None
    assert normalize_answer("\\left( 3, \\frac12 \\right)") == "(3,\\frac{1}{2})"
    assert normalize_answer("k = \\sqrt2") == "\\sqrt{2}"
    assert normalize_answer("total = 5") == "total=5"  # a long name is kept
    assert normalize_answer("") == ""
    assert not is_equiv(None, "1") and not is_equiv("1", None)


def test_math_loader_reads_the_hendrycks_format_and_names_bad_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        json.dumps({"problem": "1+1?", "solution": "It is \\boxed{2}.", "level": "Level 1"})
        + "\n\n"
        + json.dumps({"problem": "2+2?", "answer": "4"})
        + "\n"
    )
    rows = read_math_jsonl(path)
    assert [r["answer"] for r in rows] == ["2", "4"] and rows[0]["level"] == "Level 1"
    path.write_text(json.dumps({"problem": "1+1?", "solution": "two"}) + "\n")
    with pytest.raises(RunError, match=r"train.jsonl:1: no 'answer' and no \\boxed"):
        read_math_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(RunError, match=r"train.jsonl:1: malformed JSON"):
        read_math_jsonl(path)
    with pytest.raises(RunError, match="MATH file not found"):
        read_math_jsonl(tmp_path / "missing.jsonl")


def test_the_7b_recipes_memory_plan_fits_an_80_gb_gpu():
    """Qwen2.5-7B's 7,615,616,512 parameters (transformers' count of its config); the paper
    preset's trainer rank and searcher within 95% of 80 GB, worst case (every sequence 4,096
    tokens); a prompt's 16 responses in one pass would not fit, hence one a pass."""
    assert run_math.parameters(QWEN25_7B)["total"] == 7_615_616_512
    plan = memory_plan(rows=PAPER_PRESET["micro_batch_size"])
    run_math.check_memory_plan(plan)
    assert 55 < plan["trainer rank"]["total"] < 76 and 60 < plan["searcher"]["total"] < 76
    with pytest.raises(ConfigError, match="trainer rank needs"):
        run_math.check_memory_plan(memory_plan(rows=PAPER_PRESET["responses_per_prompt"]))
    for key, value in dict(tb_prime=True, async_level=10, ref_reset_every=50, lr=1e-6).items():
        assert PAPER_PRESET[key] == value
    assert PAPER_PRESET["prompts_per_step"] * PAPER_PRESET["responses_per_prompt"] == 512


@pytest.mark.slow
def test_math_dry_run_runs_the_recipes_code_paths(tmp_path):
    """--preset dry_run: a random Qwen2-architecture model (grouped-query attention) on the
    sample, the paper preset's algorithm: TBA′'s loss as released with one response a
    pass, importance sampling, the async level, the reference reset (every 2 steps here)."""
    out = tmp_path / "run"
    argv = ["--preset", "dry_run", "--output_dir", str(out), "--total_steps", "3"]
    argv += ["--max_new_tokens", "12", "--eval_test_size", "2", "--prompts_per_step", "1"]
    results = run_math.main([*argv, "--searcher_batch_prompts", "1"])
    assert results["steps"] == 3 and results["accuracy_after"] == 0.0  # a random model
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reference/version"] for r in rows] == [0, 2, 2]
    assert all(r["async/lag_max"] <= 10 and abs(r["prime/ratio_mean"] - 1) < 0.1 for r in rows)
    config = results["config"]
    assert config["micro_batch_size"] == 1 and config["prime_kl_from"] == "asymmetric"
    # --eval_only of the run's final model, with the run's own output_dir (the default's case):
    # it evaluates and writes nothing there, where a launch that trains is refused.
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    final = str(out / "final")
    evaluated = run_math.main([*argv, "--eval_only", final])
    assert evaluated == {"accuracy": 0.0, "test_size": 2}
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == (
        before
    )
