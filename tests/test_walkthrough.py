"""docs/walkthrough.md says what the code does: ``tools/walkthrough.py`` writes the page again from
a real run of the core's classes (about 40 s of one core), in a fresh process so that it picks its
kernels (AVX2 on x86-64, whether or not the CPU has AVX-512), and every word and number must match
the page (numbers to the page's three decimals, within a rounding step); and every function,
class and file the page names exists, the file being the one that defines the function."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import platform
import re
import subprocess
import sys

import pytest
import torch

from tba import TBAConfig
from tools import walkthrough

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?")
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
# Where the page's names live: the core, and the preset's extensions it runs.
MODULES = ("tba", "searcher", "buffer", "trainer", "engines", "rewards", "extensions.checks")
HINT = "the code changed what the page shows: run `python -m tools.walkthrough` and read the diff"


def test_the_walkthrough_page_matches_a_fresh_run(tmp_path):
    out = tmp_path / "walkthrough.md"
    command = [sys.executable, "-m", "tools.walkthrough", "--out", str(out)]
    # a hang detector: 65-86 s in the suite, 830 s once on two threads beside a CPU hog
    done = subprocess.run(
        command, cwd=walkthrough.REPO, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = out.read_text()
    page = walkthrough.PAGE.read_text()
    written_on, here = machine_of(page), machine_of(fresh)
    assert written_on == here, (
        f"docs/walkthrough.md holds a run on {written_on}; this machine is {here}, whose float "
        "rounding samples another run: write the page on this machine (`python -m "
        "tools.walkthrough`), check that its words still hold, and commit it"
    )
    assert NUMBER.split(fresh) == NUMBER.split(page), f"{HINT}\n{first_difference(page, fresh)}"
    found = zip(NUMBER.finditer(fresh), NUMBER.finditer(page), strict=True)
    for ours, theirs in found:
        mine, said = float(ours.group()), float(theirs.group())
        line = page.count("\n", 0, theirs.start()) + 1
        assert abs(mine - said) <= 2e-3 + 1e-3 * abs(said), (
            f"{ours.group()} where docs/walkthrough.md:{line} says {theirs.group()}: {HINT}"
        )


def test_the_walkthrough_refuses_a_process_whose_kernels_it_cannot_choose(tmp_path, monkeypatch):
    """Where torch was imported before tools.walkthrough could pick AVX2 kernels and chose AVX-512
    (as in a pytest worker on such a CPU), the writer stops, naming why, rather than write a page
    that no other kind of CPU reproduces."""
    torch.set_num_threads(1)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with pytest.raises(RuntimeError, match="ATen's AVX512 kernels, not AVX2: it was imported"):
        walkthrough.main(["--out", str(tmp_path / "walkthrough.md")])
    assert not (tmp_path / "walkthrough.md").exists()


def test_the_walkthrough_refuses_a_process_whose_threads_it_cannot_set(tmp_path, monkeypatch):
    """The page's run is one thread's arithmetic; where torch.set_num_threads is vetoed (a
    vLLM engine built in the process, tests/helpers.torch_threads_kept) it stops, naming why."""
    torch.set_num_threads(2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # vLLM's no-op
    with pytest.raises(RuntimeError, match="torch kept 2 threads, not 1: a vLLM engine"):
        walkthrough.main(["--out", str(tmp_path / "walkthrough.md")])
    assert not (tmp_path / "walkthrough.md").exists()


def machine_of(page: str) -> str:
    """The CPU a page's last line says its run was on."""
    last = page.rstrip().splitlines()[-1]
    assert last.startswith(walkthrough.MACHINE_LINE), f"no machine line at the end: {last!r}"
    return last.removeprefix(walkthrough.MACHINE_LINE).rstrip(".")


def first_difference(page: str, fresh: str, lines: int = 12) -> str:
    """The first lines of the diff from the page to a fresh run's page."""
    diff = difflib.unified_diff(
        page.splitlines(), fresh.splitlines(), "docs/walkthrough.md", "a fresh run", n=0
    )
    return "\n".join(line.rstrip("\n")[:300] for line in list(diff)[:lines])


def defined_in(name: str):
    """The module file that defines ``name`` (``Class.method`` or a function, a class, a constant
    of one of MODULES, or extensions/tiny.py's preset), or None."""
    head, *rest = name.split(".")
    for module in (importlib.import_module(m) for m in (*MODULES, "extensions.tiny")):
        found = getattr(module, head, None)
        for part in rest:
            found = getattr(found, part, None)
        if found is not None and head in vars(module):
            owner = found if inspect.isclass(found) or inspect.isroutine(found) else None
            return inspect.getsourcefile(inspect.unwrap(owner)) if owner else module.__file__
    return None


def test_the_walkthrough_names_only_what_exists():
    page = walkthrough.PAGE.read_text()
    knobs = {f.name for f in dataclasses.fields(TBAConfig)}
    for quoted in re.findall(r"`([^`\n]+)`", page):
        if "/" in quoted or " " in quoted or not NAME.match(quoted):
            continue  # a response, a metric's key, a command
        for name in NAME.findall(quoted):  # WeightStore.load_into(HFEngine.load_weights): both
            if name in knobs:
                continue
            where = defined_in(name)
            assert where is not None, f"docs/walkthrough.md names `{name}`, which no longer exists"
            relative = where.removeprefix(f"{walkthrough.REPO}/")
            assert relative in page, f"docs/walkthrough.md names `{name}` but not {relative}"
    for path in set(re.findall(r"[\w/]+\.py\b", page)):
        assert (walkthrough.REPO / path).is_file(), f"docs/walkthrough.md names {path}: missing"
