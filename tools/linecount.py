"""The core's line counts, as the README's reading table shows them (tests/test_layout.py checks
that the table is this tool's output).

    python -m tools.linecount            # the table, in markdown
    python -m tools.linecount --check    # exit 1 if a bound of the layout is broken

Lines are every line of a file; code lines are those that are not blank, a comment or a
docstring. A code line is the algorithm's when it lies in a definition (a function, a method or
a class, with all it holds) whose docstring begins with a step label of tba.py's algorithm:
"1a.", "1b-1c.", "2.", "3-4.", "4.", "5." and so on. The rest is what the algorithm needs around
it: imports, errors and their messages, validation, metrics, statistics, packing, the reward's
parsing, the job's data and evaluation.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The core, in the README's reading order: the algorithm, then step 1 to step 5, then the job.
CORE = (
    "tba.py",
    "searcher.py",
    "engines.py",
    "buffer.py",
    "trainer.py",
    "rewards.py",
    "run_gsm8k.py",
)
STEP_LABEL = re.compile(r"^\d[a-d]?(?:[-,] ?\d[a-d]?)*\. ")
CORE_LIMIT = 400  # lines of one core file
CORE_TOTAL_LIMIT = 2400  # of the seven together
SOURCE_LIMIT = 800  # of any source file outside tests/
README_LIMIT = 250
ALGORITHM_SHARE = 0.5  # of the core's code lines, at least


def docstring_lines(tree: ast.Module) -> set[int]:
    """The line numbers of every docstring (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.update(range(first.lineno, first.end_lineno + 1))
    return found


def algorithm_lines(tree: ast.Module) -> set[int]:
    """The line numbers of the definitions whose docstring begins with a step label."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node) or ""
            if STEP_LABEL.match(doc):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                found.update(range(first, node.end_lineno + 1))
    return found


def count(path: Path) -> dict[str, int]:
    """Lines, code lines and the algorithm's code lines of one Python file."""
    text = path.read_text()
    tree = ast.parse(text)
    docs = docstring_lines(tree)
    algorithm = algorithm_lines(tree)
    code = [
        number
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docs
    ]
    return {
        "lines": len(text.splitlines()),
        "code": len(code),
        "algorithm": sum(number in algorithm for number in code),
    }


def table() -> str:
    """The README's table: each core file's lines, code lines and the algorithm's code lines."""
    rows = ["| file | lines | code | algorithm |", "| --- | ---: | ---: | ---: |"]
    totals = {"lines": 0, "code": 0, "algorithm": 0}
    for name in CORE:
        counts = count(REPO / name)
        for key in totals:
            totals[key] += counts[key]
        rows.append(f"| `{name}` | {counts['lines']} | {counts['code']} | {counts['algorithm']} |")
    share = totals["algorithm"] / totals["code"]
    rows.append(
        f"| all seven | {totals['lines']} | {totals['code']} | {totals['algorithm']} "
        f"({share:.0%}) |"
    )
    return "\n".join(rows)


def broken_bounds() -> list[str]:
    """Every bound of the layout that the tree breaks, one line each."""
    broken = []
    total = {"lines": 0, "code": 0, "algorithm": 0}
    for name in CORE:
        counts = count(REPO / name)
        for key in total:
            total[key] += counts[key]
        if counts["lines"] > CORE_LIMIT:
            broken.append(f"{name}: {counts['lines']} lines, more than {CORE_LIMIT}")
    if total["lines"] > CORE_TOTAL_LIMIT:
        broken.append(f"the core: {total['lines']} lines, more than {CORE_TOTAL_LIMIT}")
    if total["algorithm"] < ALGORITHM_SHARE * total["code"]:
        broken.append(f"the algorithm: {total['algorithm']} of {total['code']} code lines")
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative.parts[0] in ("tests", ".git") or relative.name.startswith("test_"):
            continue
        lines = len(path.read_text().splitlines())
        if lines > SOURCE_LIMIT:
            broken.append(f"{relative}: {lines} lines, more than {SOURCE_LIMIT}")
    readme = len((REPO / "README.md").read_text().splitlines())
    if readme > README_LIMIT:
        broken.append(f"README.md: {readme} lines, more than {README_LIMIT}")
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a bound is broken")
    args = parser.parse_args(argv)
    if args.check:
        broken = broken_bounds()
        print("\n".join(broken) or "every bound holds")
        return 1 if broken else 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
