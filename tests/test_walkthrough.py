"""docs/walkthrough.md says what the code does: ``tools/walkthrough.py`` writes the page again from
a real run of the core's classes, and every word and number must match the page (numbers to the
page's three decimals, within a rounding step)."""

from __future__ import annotations

import re

from tools import walkthrough

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?")


def test_the_walkthrough_page_matches_a_fresh_run(tmp_path):
    fresh = walkthrough.main(["--out", str(tmp_path / "walkthrough.md")]).read_text()
    page = walkthrough.PAGE.read_text()
    hint = (
        "the code changed what the page shows: run `python -m tools.walkthrough` and read the diff"
    )
    assert NUMBER.split(fresh) == NUMBER.split(page), hint
    for ours, theirs in zip(NUMBER.findall(fresh), NUMBER.findall(page), strict=True):
        assert abs(float(ours) - float(theirs)) <= 2e-3 + 1e-3 * abs(float(theirs)), (
            f"{ours} where the page says {theirs}: {hint}"
        )
