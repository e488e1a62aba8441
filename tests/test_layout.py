"""The layout the README promises, checked from the source: the core (the card's files) imports
no extension, buffer.py and rewards.py import nothing of the project, and no project module
imports another in a cycle."""

from __future__ import annotations

import ast

from helpers import REPO

CORE = {"tba", "buffer", "searcher", "engines", "trainer", "rewards", "run_gsm8k"}
ALONE = {"buffer", "rewards"}  # each copies out alone (DEVELOPERS.md rule 6)
# run_gsm8k is the main job: it may assemble the extensions a flag asks for, through launch, and
# end as every entry script does, through cli
JOB_USES = {"cli", "launch", "tiny", "evaluate", "checks", "report"}


def project_modules() -> set[str]:
    return {path.stem for path in REPO.glob("*.py")}


def imports_of(name: str) -> set[str]:
    """The project modules ``name``.py imports, at any depth of its code."""
    tree = ast.parse((REPO / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & project_modules()


def test_the_core_imports_no_extension():
    for name in CORE - {"run_gsm8k"}:
        assert imports_of(name) <= CORE, (name, imports_of(name) - CORE)
    assert imports_of("run_gsm8k") <= CORE | JOB_USES, imports_of("run_gsm8k") - CORE - JOB_USES


def test_buffer_and_rewards_import_nothing_of_the_project():
    for name in ALONE:
        assert imports_of(name) == set(), (name, imports_of(name))


def test_no_import_cycles():
    graph = {name: imports_of(name) - {name} for name in project_modules()}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", " -> ".join([*path, name, other])
            if other not in state:
                visit(other, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
