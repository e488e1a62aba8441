"""tools/bench.py and its sections (tools/bench_*.py): the staleness harness's losses and runs,
--ray's parts, and the quick mode writing every key of every section."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from buffer import ReplayBuffer
from extensions.cli import run_cli
from extensions.tiny import TINY_PRESET, save_tiny_model
from helpers import REPO
from plumbing.config import ConfigError
from tools import bench, bench_accuracy, bench_staleness


def test_stale_loss_names():
    """Each --losses name is the flags its runs train with; tb_clip is TB's trust region by the
    core's rule at 0.05 (the radius that holds the sums from lag 1 to 256), tb_sampler its
    sampler's anchor alone, tb_fixed that anchor at 0.3 for every lag, tb_two_pass the
    synchronous mode's region PPO's way; NAME_VALUE sets the name's number."""

    def flags(**given):
        return {**bench_staleness.STALE_FLAGS, **given}

    assert bench_staleness.stale_loss("tb") == flags()
    assert bench_staleness.stale_loss("grpo") == flags(loss="grpo")
    assert bench_staleness.stale_loss("tb_clip") == flags(tb_clip_eps=bench_staleness.TB_CLIP_EPS)
    assert bench_staleness.TB_CLIP_EPS == 0.05
    sampler = flags(tb_clip_eps=0.075, sampler_only=True)
    assert bench_staleness.stale_loss("tb_sampler_0.075") == sampler
    fixed = flags(tb_clip_eps=0.3, tb_clip_horizon=math.inf, sampler_only=True)
    assert bench_staleness.stale_loss("tb_fixed") == fixed
    two_pass = flags(sync_two_pass=True, tb_clip_eps=0.1)
    assert bench_staleness.stale_loss("tb_two_pass_0.1") == two_pass
    assert bench_staleness.stale_loss("tb_clip_0.1") == flags(tb_clip_eps=0.1)
    assert bench_staleness.stale_loss("tb_m2_0.04") == flags(tb_m2_tau=0.04)
    assert bench_staleness.stale_loss("tb_m2_pushed") == flags(
        tb_m2_tau=bench_staleness.TB_M2_TAU, m2_pushed_only=True
    )
    assert bench_staleness.stale_loss("tb_clip_m2_0.2") == flags(tb_clip_eps=0.05, tb_m2_tau=0.2)
    assert bench_staleness.stale_loss("tb_clip_lag") == flags(tb_clip_eps=0.3, tb_clip_horizon=16.0)
    assert bench_staleness.stale_loss("tb_clip_lag_4") == flags(
        tb_clip_eps=0.3, tb_clip_horizon=4.0
    )
    assert bench_staleness.stale_loss("grpo_m2po") == flags(loss="grpo", grpo_m2po_tau=0.04)
    assert bench_staleness.stale_loss("grpo_decoupled_2") == flags(
        loss="grpo", grpo_decoupled=True, grpo_is_cap=2.0
    )
    assert bench_staleness.stale_loss("dr_grpo") == flags(loss="grpo", grpo_dr=True)
    assert bench_staleness.stale_loss("tb_prime") == flags(tb_prime=True, ref_reset_every=50)
    assert bench_staleness.stale_loss("tb_prime_25") == flags(tb_prime=True, ref_reset_every=25.0)
    assert bench_staleness.stale_loss("tb_prime_nois") == flags(
        tb_prime=True, prime_is=False, ref_reset_every=50
    )
    assert bench_staleness.stale_loss("tb_prime_cap_2") == flags(
        tb_prime=True, ref_reset_every=50, prime_ratio_cap=2.0
    )
    assert bench_staleness.STALE_FLAGS["prime_ratio_cap"] == 8.0  # the released clamp
    for bad in ("nope", "tb_clip_", "tb_clip_x", "TB", "tb_clip_-1", "tb_clip_nan", "tb_0.3"):
        with pytest.raises(ConfigError, match="--losses"):
            bench_staleness.stale_loss(bad)


def test_stale_order_is_tb_then_its_corrections_by_value_then_grpo():
    names = ["grpo_decoupled", "grpo", "tb_m2", "tb_clip", "tb_clip_0.1", "tb", "tb_clip_1.0"]
    names += ["tb_clip_m2_0.2", "grpo_m2po"]
    assert sorted(names, key=bench_staleness.stale_order) == [
        "tb",
        "tb_clip",
        "tb_clip_0.1",
        "tb_clip_1.0",
        "tb_m2",
        "tb_clip_m2_0.2",
        "grpo",
        "grpo_m2po",
        "grpo_decoupled",
    ]


def test_summarize_staleness_reports_the_second_half_and_the_corrections():
    runs = [
        {
            "loss": "tb_m2",
            "lag": 4,
            "seed": seed,
            "curve": [(0, 0.6), (100, 0.8), (200, 0.7 + seed / 10), (300, 0.9), (400, 0.8)],
            "offpolicy": {
                "offpolicy/clip_frac": 0.0,
                "offpolicy/m2_mask_frac": 0.1 * seed,
                "offpolicy/rho_q10": -0.2,
                "offpolicy/rho_q50": 0.0,
                "offpolicy/rho_q90": 0.1,
            },
        }
        for seed in (0, 1, 2)
    ]
    row = bench_staleness.summarize_staleness(runs)["tb_m2"]["4"]
    assert [s["mean_second_half"] for s in row["seeds"]] == pytest.approx(
        [0.8, 0.8333, 0.8667], 1e-3
    )
    assert row["median_mean_second_half"] == pytest.approx((0.8 + 0.9 + 0.8) / 3)
    assert row["median_mask_frac"] == pytest.approx(0.1)
    assert row["median_clip_frac"] == 0.0
    assert (row["median_rho_q10"], row["median_rho_q50"], row["median_rho_q90"]) == (-0.2, 0, 0.1)
    assert row["median_steps_to"] == 300 and row["steps_to_reached"] == 3
    # the oscillation of seed 0's second half, 0.7, 0.9, 0.8: its spread and its mean change
    assert row["seeds"][0]["second_half_sd"] == pytest.approx(0.0816, abs=1e-4)
    assert row["seeds"][0]["second_half_swing"] == pytest.approx(0.15)
    assert row["mean_mean_second_half"] == pytest.approx(0.8333, abs=1e-4)
    # the mean of each 100-step window's evaluations (here one each), per seed and paired by
    # seed against the same loss's d = 0
    assert row["seeds"][1]["windows"] == pytest.approx(
        {"1-100": 0.8, "101-200": 0.8, "201-300": 0.9, "301-400": 0.8}
    )
    assert "median_windows_vs_d0" not in row
    on_policy = [dict(run, lag=0, curve=[(0, 0.6), (50, 0.7), (100, 0.8)]) for run in runs]
    summary = bench_staleness.summarize_staleness(runs + on_policy)["tb_m2"]
    assert summary["0"]["median_windows"] == pytest.approx({"1-100": 0.75})
    assert summary["4"]["median_windows_vs_d0"] == pytest.approx({"1-100": 0.05})


def test_countdown_staleness_resets_the_reference_as_the_system_does(tmp_path):
    """countdown_staleness: Countdown's problems and preset; tb_prime_3 at lag 2 resets the
    trainer's reference at step 3 and the searcher's once it generates with version 3, so the
    two batches generated before the reset and trained after it are rescored, no other."""
    model = save_tiny_model(tmp_path / "model")
    small = dict(prompts_per_step=4, searcher_batch_prompts=4, max_new_tokens=12)
    run = bench_staleness.staleness_run(model, "tb_prime_3", 2, 0, 6, small, task="countdown")
    assert run["task"] == "countdown" and run["generated_by"] == [0, 0, 0, 1, 2, 3]
    rescored = [row["reference/rescored_frac"] for row in run["steps"]]
    assert rescored == [0, 0, 0, 1, 1, 0]
    assert all(row["prime/ratio_mean"] > 0 for row in run["steps"])


def test_hard_staleness_trains_on_the_harder_task_and_counts_its_level(tmp_path, monkeypatch):
    """hard_staleness: the runs take the harder task's sums and preset (a lag-2 run of the
    widened trust region, three steps from an untrained model); "steps to" counts 0.40 there."""
    asked = []
    real = bench_staleness.tiny_task
    monkeypatch.setattr(
        bench_staleness, "tiny_task", lambda data=None: asked.append(data) or real(data)
    )
    model = save_tiny_model(tmp_path / "model")
    run = bench_staleness.staleness_run(model, "tb_clip_lag", 2, 0, 3, {}, task="hard")
    assert asked == [bench_staleness.HARD_DATA]
    assert run["task"] == "hard" and run["generated_by"] == [0, 0, 0]
    assert [step for step, _ in run["curve"]] == [0, 3]
    assert run["offpolicy"]["offpolicy/clip_eps_mean"] == pytest.approx(0.3)  # lags <= 16
    curve = [(0, 0.33), (100, 0.41), (200, 0.39)]
    summary = bench_staleness.summarize_staleness([dict(run, curve=curve)])
    assert summary["tb_clip_lag"]["2"]["median_steps_to"] == 100


def test_staleness_through_the_buffer_trains_what_the_buffer_samples(tmp_path, monkeypatch):
    """--stale_buffer: each step's batch goes into the trainer's replay buffer and the step
    trains the P groups of K the buffer samples within max_train_lag, with a publish after it
    (three steps at lag 1 from an untrained model)."""
    drawn = []
    real = ReplayBuffer.sample

    def sample(self, num_prompts, per_prompt, min_version=None):
        groups, is_mop = real(self, num_prompts, per_prompt, min_version)
        drawn.append((len(groups), {len(g) for g in groups}, min_version, len(self.fresh)))
        return groups, is_mop

    monkeypatch.setattr(ReplayBuffer, "sample", sample)
    model = save_tiny_model(tmp_path / "model")
    run = bench_staleness.staleness_run(model, "tb_clip_0.05", 1, 0, 3, {}, through_buffer=True)
    p, k = TINY_PRESET["prompts_per_step"], TINY_PRESET["responses_per_prompt"]
    lag = TINY_PRESET["max_train_lag"]
    # each step: P groups of K, no item older than max_train_lag, one fresh batch since the
    # last publish
    assert drawn == [(p, {k}, step - lag, p) for step in range(3)]
    assert run["generated_by"] == [0, 0, 1]
    assert run["offpolicy"]["offpolicy/rho_abs_mean"] >= 0


def test_time_to_accuracy_reports_the_ratio_with_its_bootstrap_interval_and_steps():
    """A rival's time over async's comes with the 95% bootstrap interval of the ratio of the two
    medians (identical seeds give a point; a slow outlier widens the interval's top, not its
    bottom) and each mode's median steps to the target, from the runs' snapshots."""
    interval = bench_accuracy.median_ratio_interval
    assert interval([2.0, 2.0, 2.0], [1.0, 1.0]) == (2.0, 2.0)
    low, high = interval([10.0, 11.0, 12.0, 30.0, 9.0], [5.0, 6.0, 7.0, 8.0, 4.0])
    assert low < 10.0 / 6.0 < high and low > 1.0 and high >= 30.0 / 8.0 - 1e-9
    # By hand for two seeds a mode: the median is the mean of the two draws, 1/4 of the draws
    # take each single value twice, so the 2.5% and 97.5% points are the extreme ratios.
    assert interval([1.0, 3.0], [1.0, 2.0], draws=4000) == (0.5, 3.0)

    def run(mode, seed, curve):
        return {
            "task": "tiny",
            "mode": mode,
            "seed": seed,
            "curve": curve,
            "generated": [128 * (i + 1) for i in range(len(curve))],
            "time_to": {str(th): bench_accuracy.first_time(curve, th) for th in (0.8, 0.85, 0.9)},
            "steps_per_s": curve[-1][1] / curve[-1][0],
            "samples_per_s": 1.0,
            "lag_mean": 1.0,
            "mop_frac": 0.95,
            "accounting": {"searcher_s": 0.06, "seconds_per_step": 0.1},
        }

    fast = [(0.0, 0, 0.6), (1.0, 10, 0.86), (2.0, 20, 0.9)]
    slow = [(0.0, 0, 0.6), (1.0, 5, 0.7), (2.0, 10, 0.86), (3.0, 15, 0.9)]
    runs = [run("async", 0, fast), run("sync", 0, slow)]
    summary = bench_accuracy.summarize(runs, 60.0)
    assert summary["rivals"]["sync"] == 2.0 and summary["rivals_interval"]["sync"] == (2.0, 2.0)
    assert summary["async"]["steps_to_target"] == 10 and summary["sync"]["steps_to_target"] == 10


def test_ray_puts_the_timed_runs_searchers_on_the_clusters_searcher_nodes():
    """--ray ADDRESS: run_tba's pool becomes ray_searchers' actors, asking for the 'searcher'
    resource that extensions/ray_searchers.py's loopback cluster offers on its worker nodes only;
    without it, run_tba's own parts (None)."""
    from extensions import ray_searchers

    assert bench_accuracy.ray_parts("") is None
    parts = bench_accuracy.ray_parts("127.0.0.1:6390")
    assert parts.pool.func is ray_searchers.RaySearcherPool
    ray_cfg = parts.pool.keywords["ray_cfg"]
    assert ray_cfg.ray == "127.0.0.1:6390" and ray_cfg.resources() == {"searcher": 1.0}


def test_an_unknown_loss_is_a_usage_error_before_any_run(tmp_path, capsys):
    """--losses is checked before the warm start is trained: exit status 2, one line naming it."""
    out = tmp_path / "bench.json"
    argv = ["--sections", "staleness", "--losses", "tb,nope", "--out", str(out)]
    argv += ["--warm_start", str(tmp_path / "never")]
    assert run_cli(bench.main, argv) == 2
    err = capsys.readouterr().err
    assert "error: --losses: 'nope' is not one of tb, tb_clip, tb_sampler, tb_fixed," in err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "never").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("vllm_on_cpu")  # its engines section builds a CPU vLLM engine
def test_bench_quick_writes_every_key(tmp_path):
    """tools/bench.py --quick end to end: it exits 0 and writes every key. Timing goals are not
    asserted here; tools/bench.py reports them as measured times and ratios."""
    out = tmp_path / "bench.json"
    rivals = ["--rivals", "proximal_0.05"]  # beside plain sync: the trust region's rival
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--quick", "--out", str(out), *rivals],
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
    for section, task in (("time_to_accuracy", "tiny"), ("time_to_accuracy_hard", "hard")):
        tta = res[section]
        assert {"async", "sync", "sync_over_async", "goals", "overlap_limit"} <= set(tta)
        assert tta["modes"] == ["async", "sync", "proximal_0.05"]
        assert tta["strongest_rival"] in ("sync", "proximal_0.05")
        for mode in ("sync", "proximal_0.05"):
            assert 0 < tta[mode]["generate_share_f"] < 1 and tta[mode]["overlap_limit"] >= 1
            assert math.isfinite(tta["rivals"][mode])
        assert "one forward pass" in tta["proximal_0.05"]["extra_per_step"]
        low, high = tta["rivals_interval"]["proximal_0.05"]
        assert 0 < low <= high and tta["proximal_0.05"]["steps_to_target"] > 0
        assert tta["task"] == task and 0 < tta["generate_share_f"] < 1
        for key in ("window_accuracy", "step_accuracy", "generated_accuracy", "accounting"):
            assert key in tta["async"], key
        for name in ("new_frac", "distinct_frac", "trained_frac", "reuse", "lag", "train_s"):
            assert name in tta["async"]["accounting"], name
        assert math.isfinite(tta["sync_over_async"])
    assert "publish_and_load_s" in res["publish"]
    assert {(r["task"], r["mode"]) for r in res["runs"]} == {
        (task, mode) for task in ("tiny", "hard") for mode in ("async", "sync", "proximal_0.05")
    }
    for run in res["runs"]:
        assert run["curve"] and run["steps_per_s"] > 0 and run["samples_per_s"] > 0
        assert all(0 <= acc <= 1 for _, _, acc in run["curve"])
        assert len(run["generated"]) == len(run["curve"]) and run["generated"][0] > 0
        assert run["accounting"]["generated"] >= run["generated"][-1]
    assert res["time_to_accuracy"]["sync"]["0.85"]["median"] > 0
    assert (
        math.isfinite(res["publish"]["publish_over_copy"])
        and res["publish"]["publish_over_copy"] > 0
    )
    engines = res["engines"]
    if importlib.util.find_spec("vllm") is not None:
        assert engines["vllm_tokens_per_s"] > 0 and engines["hf_tokens_per_s"] > 0
        assert engines["vllm_load_s"] > 0 and engines["hf_load_s"] > 0
    assert "sync / async time to 0.85" in proc.stdout  # the printed report
    assert "the strongest rival" in proc.stdout
    assert "95% bootstrap" in proc.stdout and "steps to 0.85" in proc.stdout
    assert "overlap alone gives at most" in proc.stdout
    stale = res["staleness"]
    assert set(stale["summary"]["tb"]) == {"0", "2"}
    by_lag = {run["lag"]: run for run in stale["runs"]}
    assert by_lag[0]["generated_by"] == [0, 1, 2, 3]  # on-policy: the current weights
    assert by_lag[2]["generated_by"] == [0, 0, 0, 1]  # two versions behind, version 0 at first
    assert [step for step, _ in by_lag[2]["curve"]] == [0, 4]
