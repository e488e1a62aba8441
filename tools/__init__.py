"""Tools around the project, run as modules from the repository's root: the benchmarks
(``python -m tools.bench``), the writer of docs/walkthrough.md (``python -m tools.walkthrough``)
and the README's line counts (``python -m tools.linecount``)."""
