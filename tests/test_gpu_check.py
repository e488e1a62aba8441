"""The GPU check (tests/gpu_check.py) on the CPU: its dry run takes every step at tiny shapes and
writes every figure; the estimate's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpu_check
from helpers import REPO


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_figure(tmp_path):
    out = tmp_path / "gpu_check.json"
    argv = ["--dry_run", "--out", str(out), "--timed_steps", "1", "--timed_calls", "1"]
    proc = subprocess.run(
        [sys.executable, "tests/gpu_check.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["shape"] == gpu_check.DRY
    assert res["cuda_tests"]["returncode"] == 0 and "skipped" in res["cuda_tests"]["summary"]
    trainer, published, searcher = res["trainer"], res["publish"], res["searcher"]
    assert trainer["step_s"] > 0 and trainer["peak_memory_gb"] > 0
    assert trainer["response_tokens_per_step"] == 2 * 4 * 16
    assert published["store"] == "cpu" and published["publish_s"] > 0
    assert published["publish_via_host_s"] > 0 and published["ray_snapshot_s"] > 0
    # The searcher's process loaded the version the trainer published (2 steps), and its probe
    # log-prob matched the trainer's.
    assert searcher["version"] == 2 and searcher["parity"]
    assert searcher["probe_got"] == pytest.approx(published["probe_logprob"], abs=1e-3)
    assert searcher["generate_call_s"] > 0 and 0 < searcher["tokens_per_call"] <= 2 * 4 * 16
    assert res["estimate"]["on_this_device"]["async_min"] > 0
    assert "estimate of the paper run" in proc.stdout and "parity ok" in proc.stdout
    # The same version again by a gloo weight group into the searcher's staging copy, then its
    # engine (its weights zeroed first), the probe matching; NCCL needs the GPU.
    group = res["weight_group"]
    assert group["arrived"] and group["whole"] and group["parity"]
    assert group["probe_got"] == pytest.approx(published["probe_logprob"], abs=1e-3)
    assert group["send_s"] > 0 and group["receive_s"] > 0 and group["nccl_one_rank"] is None
    assert "weight group (gloo, two processes here)" in proc.stdout


def test_estimate_takes_the_slower_of_trainer_and_searchers():
    """700 steps of 4 s plus half a 0.2 s publish: 47.8 min; searchers making 7 prompts a step
    at 3 a call, 20 s a call, over 3 of them: 15.6 s a step, 181.5 min. On an H100 the A100
    figure is 989 / 312 times longer."""
    results = {
        "trainer": {"step_s": 4.0},
        "publish": {"publish_s": 0.2},
        "searcher": {"generate_call_s": 20.0},
        "machine": {"device": "NVIDIA H100 80GB HBM3"},
    }
    got = gpu_check.estimate(results, gpu_check.PAPER)
    here = got["on_this_device"]
    assert here["trainer_bound_min"] == pytest.approx(700 * 4.1 / 60)
    assert here["hf_searcher_bound_min"] == pytest.approx(700 * 7 / 3 * 20 / 3 / 60)
    assert here["async_min"] == here["hf_searcher_bound_min"]
    assert got["scale"] == pytest.approx(989 / 312)
    assert got["scaled_to_A100"]["async_min"] == pytest.approx(here["async_min"] * 989 / 312)
    results["machine"]["device"] = "cpu"
    assert "scaled_to_A100" not in gpu_check.estimate(results, gpu_check.PAPER)
