"""What the README and the docs say of the code holds: the core's line counts are
``tools.linecount``'s, the layout's bounds hold, and every command they show names an entry
point that exists (a script or a module with a ``__main__`` block, and the flags it is given)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from helpers import REPO
from tools import linecount

PACKAGES = ("extensions", "jobs", "tools", "plumbing")
PAGES = [REPO / "README.md", REPO / "OPERATIONS.md", *sorted((REPO / "docs").glob("*.md"))]
# `python [-m] TARGET` in a code block or inline code; TARGET a .py path or a dotted module
COMMAND = re.compile(
    r"(?:python|torchrun[^`\n]*?)\s+(-m\s+[\w.]+|[\w./]+\.py)((?:\s+--?\w[\w-]*)*)"
)


def test_the_readme_counts_are_the_tools():
    readme = (REPO / "README.md").read_text()
    shown = readme.split("<!-- linecount -->\n")[1].split("<!-- /linecount -->")[0].strip()
    assert shown == linecount.table(), "run `python -m tools.linecount` and paste its table"


def test_the_layouts_bounds_hold():
    assert linecount.broken_bounds() == []


def entry_points() -> dict[str, set[str]]:
    """Every ``python`` target the pages name, and the flags given to it."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        for target, flags in COMMAND.findall(page.read_text()):
            found.setdefault(target, set()).update(re.findall(r"--?[\w][\w-]*", flags))
    return found


def source_of(target: str) -> Path | None:
    if target.startswith("-m"):
        spec = importlib.util.find_spec(target.split()[1])
        return None if spec is None or spec.origin is None else Path(spec.origin)
    path = REPO / target
    return path if path.is_file() else None


def test_every_command_the_docs_show_starts():
    """Each target exists, runs as a program, and knows each long flag it is shown with (the
    flag's name appears in its source or in a config it reads: the CLI derives flags from the
    configs' field names)."""
    targets = entry_points()
    assert "run_gsm8k.py" in targets and "-m jobs.run_countdown" in targets
    fields = {
        m for path in REPO.rglob("*.py") for m in re.findall(r"^\s+(\w+):", path.read_text(), re.M)
    }
    for target, flags in sorted(targets.items()):
        if target.startswith("-m") and target.split()[1].split(".")[0] not in PACKAGES:
            continue  # another program's module (pytest, wandb, torch.distributed.run)
        source = source_of(target)
        assert source is not None, f"{target}: no such script or module"
        text = source.read_text()
        assert '__name__ == "__main__"' in text, f"{target}: not a program"
        for flag in flags:
            name = flag.lstrip("-").replace("-", "_")
            known = name in fields or f'"{flag}"' in text or f"'{flag}'" in text
            assert known or flag in ("-m", "-c", "-q", "-n", "-x"), f"{target} {flag}: unknown flag"
