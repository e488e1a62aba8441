"""The layout the README promises, checked from the source: the root is the card's core, each
layer imports only from itself and the layers below it (plumbing < the core < extensions <
jobs < tools), buffer.py and rewards.py import nothing of the project, and no module is in an
import cycle (the README's line counts: tests/test_docs.py)."""

from __future__ import annotations

import ast

from helpers import LAYERS, REPO, project_modules

CORE = {"tba", "buffer", "searcher", "engines", "trainer", "rewards", "run_gsm8k"}
ALONE = {"buffer", "rewards"}  # each copies out alone (DEVELOPERS.md rule 6)
# run_gsm8k is the main job: it may assemble the extensions a flag asks for, through launch, and
# end as every entry script does, through cli
JOB_USES = {"extensions.cli", "extensions.launch", "extensions.tiny", "extensions.evaluate"}
JOB_USES |= {"extensions.checks", "extensions.report"}


def imports_of(name: str) -> set[str]:
    """The project modules ``name`` imports, at any depth of its code (``from pkg import mod``
    counts as an import of ``pkg.mod``)."""
    path = REPO / (name.replace(".", "/") + ".py")
    modules = project_modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found & set(modules)


def test_the_root_is_the_card():
    assert {path.stem for path in REPO.glob("*.py")} == CORE | {"test_tba"}


def test_each_layer_imports_only_itself_and_the_layers_below():
    modules = project_modules()
    for name, layer in modules.items():
        allowed = set(LAYERS[: LAYERS.index(layer) + 1])
        above = {m for m in imports_of(name) if modules[m] not in allowed}
        if name == "run_gsm8k":
            above -= JOB_USES
        assert not above, f"{name} ({layer}) imports {sorted(above)}, a layer above it"


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


def test_every_plumbing_file_says_a_learner_may_skip_it():
    for path in (REPO / "plumbing").glob("*.py"):
        first = ast.get_docstring(ast.parse(path.read_text())).split("\n\n")[0]
        assert "(a learner may skip)" in first, path.name
