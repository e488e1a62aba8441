"""bench.py's quick mode writes every key of every section."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow
def test_bench_quick_writes_every_key(tmp_path):
    """bench.py --quick end to end: it exits 0 and writes every key. Timing goals are not
    asserted here; bench.py reports them as measured times and ratios."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench.py", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in (
        "machine",
        "time_to_accuracy",
        "runs",
        "engines",
        "publish",
        "plot",
        "parallel_speedup_start",
        "parallel_speedup_end",
        "total_runtime_s",
    ):
        assert key in res, key
    tta = res["time_to_accuracy"]
    assert {"async", "sync", "sync_over_async", "goals"} <= set(tta)
    assert "window_accuracy" in tta["async"] and "publish_and_load_s" in res["publish"]
    assert {r["mode"] for r in res["runs"]} == {"async", "sync"}
    for run in res["runs"]:
        assert run["curve"] and run["steps_per_s"] > 0 and run["samples_per_s"] > 0
        assert all(0 <= acc <= 1 for _, _, acc in run["curve"])
    assert tta["sync"]["0.9"]["median"] > 0 and math.isfinite(tta["sync_over_async"])
    assert (
        math.isfinite(res["publish"]["publish_over_copy"])
        and res["publish"]["publish_over_copy"] > 0
    )
    engines = res["engines"]
    if importlib.util.find_spec("vllm") is not None:
        assert engines["vllm_tokens_per_s"] > 0 and engines["hf_tokens_per_s"] > 0
        assert engines["vllm_load_s"] > 0 and engines["hf_load_s"] > 0
    assert "sync / async time to 0.9" in proc.stdout  # the printed report
    stale = res["staleness"]
    assert set(stale["summary"]["tb"]) == {"0", "2"}
    by_lag = {run["lag"]: run for run in stale["runs"]}
    assert by_lag[0]["generated_by"] == [0, 1, 2, 3]  # on-policy: the current weights
    assert by_lag[2]["generated_by"] == [0, 0, 0, 1]  # two versions behind, version 0 at first
    assert [step for step, _ in by_lag[2]["curve"]] == [0, 4]
