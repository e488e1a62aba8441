"""The checks (extensions/checks.py): the smoke preset's summary and the weights verdict."""

from __future__ import annotations

import json
import pickle
import statistics
import types

import pytest

import run_gsm8k
from extensions import checks, grpo, launch
from extensions.evaluate import EvalConfig
from helpers import checked, child_pids, cpu_main_args, time_limit
from plumbing.processes import WeightsNotLoaded
from run_gsm8k import main
from searcher import Searcher
from test_tba import digit_reward, pace, read_metrics, tiny_cfg, tiny_examples
from trainer import Parts, run_tba


@pytest.mark.slow
def test_every_loaded_version_is_the_published_one(tiny_model_dir, tmp_path):
    """With the checks installed, the trainer keeps each published version's checksum and every
    searcher reports the checksum of the version it holds after each load: the two agree, and
    training really changed the weights."""
    cfg = tiny_cfg(tiny_model_dir, tmp_path, total_steps=16)
    with time_limit(240):  # a hang: 49 s at a load of 10 on two cores
        trainer = run_tba(
            cfg,
            tiny_examples(),
            digit_reward,
            parts=checked(cfg),
            on_step=pace,
            show_progress=False,
        )
    assert sorted(trainer.published) == list(range(0, 17, 2))
    seen = 0
    for r in read_metrics(tmp_path):
        for rank in (0, 1):
            if f"searcher{rank}/checksum" in r:
                version = int(r[f"searcher{rank}/version"])
                assert r[f"searcher{rank}/checksum"] == pytest.approx(
                    trainer.published[version], rel=1e-12
                )
                seen += 1
    assert seen > 0 and len(set(trainer.published.values())) > 3
    assert child_pids() == []


@pytest.mark.slow
def test_smoke_preset_reports_step_time_memory_mop_and_lag(tiny_model_dir, tmp_path, capsys):
    """--preset smoke: the paper preset (bf16, N = 24, K = 20, P = 7) for ten steps, parity
    checked after every weight load, then the summary a user needs on a new GPU box, ending with
    whether the weights reached every engine. Here on CPU with a tiny model and short answers."""

    rows = "".join(
        json.dumps({"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"}) + "\n"
        for a in range(30)
    )
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "test.jsonl").write_text(rows)
    with time_limit(240):
        results = main(
            cpu_main_args(
                "smoke",
                tiny_model_dir,
                tmp_path,
                "--max_new_tokens",
                "8",
                "--initial_samples",
                "48",
                "--torch_threads",
                "1",
            )
        )
    summary = results["summary"]
    # The summary is this run's metrics.jsonl, each number of its own key.
    rows = read_metrics(tmp_path / "out")
    assert summary["steps"] == len(rows) == 10
    assert summary["seconds_per_step_median"] == statistics.median(r["time/step"] for r in rows)
    assert summary["initial_fill_s"] == rows[0]["time/wait"]
    assert summary["mop_frac"] == pytest.approx(statistics.fmean(r["async/mop_frac"] for r in rows))
    assert summary["lag_mean"] == pytest.approx(statistics.fmean(r["async/lag_mean"] for r in rows))
    assert summary["lag_max"] == max(r["async/lag_max"] for r in rows)
    peaks = {"trainer": "memory/trainer_peak_gb", "searcher0": "searcher0/peak_mem_gb"}
    assert summary["peak_memory_gb"] == {
        k: max(r.get(v, 0) for r in rows) for k, v in peaks.items()
    }
    # In GB: a process holding torch and a model takes a few hundred MB (not MB, not bytes).
    assert all(0.1 < gb < 24 for gb in summary["peak_memory_gb"].values())
    assert results["test_size"] == 30 and results["config"]["dtype"] == "bfloat16"
    assert results["config"]["parity_check"]
    assert summary["weights"].startswith("weights reached every searcher (searcher0 up to version")
    assert summary["weights"].endswith("and the evaluator (it runs the trainer's model itself)")
    printed = capsys.readouterr().out
    for text in (
        "s/step (median)",
        "peak memory per process: trainer",
        "most-on-policy fraction",
        "lag mean",
    ):
        assert text in printed, text
    assert printed.splitlines()[-1] == summary["weights"]
    assert summary["ran"]["trainer"]["ranks"] == 1
    assert summary["ran"]["weights"]["path"] == "shared memory, on this machine"
    assert "searchers: 0 HFEngine on cpu at" in printed and "weights: shared memory" in printed
    assert child_pids() == []


def test_a_check_not_asked_for_is_not_reported(capsys):
    """The summary's last line is the weights verdict only when --parity_check made one."""
    summary = dict(
        steps=3,
        seconds_per_step_median=0.1,
        initial_fill_s=0.0,
        peak_memory_gb={"trainer": 0.5},
        mop_frac=0.95,
        mop_prob=0.95,
        lag_mean=1.0,
        lag_max=1,
    )
    checks.print_summary(summary)
    printed = capsys.readouterr().out
    assert "weights" not in printed and "checked" not in printed
    checks.print_summary(dict(summary, weights="weights reached every searcher (...)"))
    assert capsys.readouterr().out.splitlines()[-1] == "weights reached every searcher (...)"


def test_the_summary_says_what_ran_where(tmp_path, tiny_model_dir, capsys):
    """ran.json, merged from what each part records (extensions/launch.py the trainer and the local
    searchers; a Ray pool its actors and weight path), with the weights' times from the
    metrics, in the summary and its printed lines."""
    tasks = (EvalConfig, run_gsm8k.GSM8KConfig)
    argv = ["--model", tiny_model_dir, "--output_dir", str(tmp_path), "--num_searchers", "2"]
    args = launch.argparser("", ["paper"], *tasks).parse_args(argv)
    configs = launch.parse(args, {"searcher_devices": "cpu", "trainer_device": "cpu"}, *tasks)
    checks.record_ran(tmp_path, launch.ran_here(configs, None))
    rows = [
        {"time/publish": 0.02, "time/load": 0.0},
        {"time/publish": 0.04, "time/load": 0.01},
        {"time/publish": 0.03},
    ]
    ran = checks.what_ran(tmp_path, rows)
    assert ran["trainer"]["ranks"] == 1 and ran["trainer"]["device"] == "cpu"
    assert {s["engine"] for s in ran["searchers"].values()} == {"HFEngine"}
    assert ran["weights"]["path"] == "shared memory, on this machine"
    assert ran["weights"]["publish_s_median"] == pytest.approx(0.03)
    assert ran["weights"]["load_s_mean"] == pytest.approx(0.01)
    ray_pool = {
        "searchers": {"0": {"node": "10.0.0.2", "engine": "VLLMEngine", "device": "cuda:0"}},
        "weights": {"path": "broadcast (gloo, buckets of 64 MiB)", "versions_sent": 9},
    }
    ray_pool["searchers"]["0"]["ray_actor"] = True
    ray_pool["weights"]["seconds_per_version"] = 0.5
    checks.record_ran(tmp_path, ray_pool)  # replaces the searchers and the weights, keeps the rest
    lines = checks.ran_lines(checks.what_ran(tmp_path, rows))
    host = ran["trainer"]["node"]
    assert lines == [
        f"trainer: 1 process, rank 0 on cpu at {host}",
        "searchers (Ray actors): 0 VLLMEngine on cuda:0 at 10.0.0.2",
        "weights: broadcast (gloo, buckets of 64 MiB): publish 0.030 s, to every searcher 0.500 "
        "s per version (median of 9), each engine's load 0.010 s",
    ]


def test_weights_verdict_names_what_was_not_confirmed(tmp_path):
    rows = [
        {"step": 1, "searcher0/version": 0.0, "searcher1/version": 0.0},
        {"step": 2, "searcher0/version": 2.0, "searcher1/version": 0.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = types.SimpleNamespace(vllm=None)
    on_vllm = types.SimpleNamespace(vllm=object(), checked_loads=0)

    def verdict(num_searchers, evaluator):
        return checks.weights_verdict(num_searchers, tmp_path, evaluator)

    assert verdict(1, hf) == (
        "weights reached every searcher (searcher0 up to version 2; parity checked after every "
        "load) and the evaluator (it runs the trainer's model itself)"
    )
    assert verdict(3, on_vllm) == (
        "weights NOT confirmed for: searcher1 (only version 0 checked, the weights it started "
        "from), searcher2 (no batch arrived), the evaluator (no vLLM load checked)"
    )


def test_the_parity_tolerance_has_a_floor_in_bf16(monkeypatch, tiny_model_dir):
    """A trained policy's probe log-prob is small (-3 nats: 2% of it is 0.06), while bf16 vLLM
    and the bf16 trainer differ by up to 0.17 nats on such sequences (docs/staleness.md): the
    floor (--parity_abs_tol 0.5, bf16 and fp16 only) lets that pass, where the relative
    tolerance alone stopped the run; garbled weights (nats off) still fail."""
    differences = iter([0.15, 0.15, 3.0])
    monkeypatch.setattr(checks, "engine_logprob", lambda engine, p, r: -3.0 + next(differences))
    floored = checks.ParityProbe([5], [6, 7], tolerance=0.02, floor=0.5)
    floored.check(None, -3.0, "searcher 0")  # 0.15 < 0.5: bf16's arithmetic
    with pytest.raises(WeightsNotLoaded, match=r"tolerance 0\.06 nats"):
        checks.ParityProbe([5], [6, 7], tolerance=0.02).check(None, -3.0, "searcher 0")
    with pytest.raises(WeightsNotLoaded, match="post-sync parity check failed"):
        floored.check(None, -3.0, "searcher 0")
    tasks = (EvalConfig, run_gsm8k.GSM8KConfig)
    for dtype, floor in (("bfloat16", 0.5), ("float32", 0.0)):
        argv = ["--model", tiny_model_dir, "--dtype", dtype, "--parity_check"]
        args = launch.argparser("", ["paper"], *tasks).parse_args(argv)
        assert launch.parity_probe(launch.parse(args, {}, *tasks)).floor == floor


def test_the_checked_searcher_stacks_over_an_extensions_searcher(monkeypatch):
    """--parity_check with --loss grpo: the searcher the checks install is GRPO's too (it keeps
    the per-token log-probs GRPO's loss reads), and what the searcher processes get pickles."""
    probe = checks.ParityProbe([1, 2], [3], 0.02)
    parts = checks.install(grpo.install(Parts(), grpo.GRPOConfig(loss="grpo")), probe)
    make = pickle.loads(pickle.dumps(parts.searcher))
    monkeypatch.setattr(Searcher, "__init__", lambda self, setup: None)  # no model to load
    searcher = make(None)
    assert isinstance(searcher, checks.CheckedSearcher) and isinstance(searcher, grpo.GRPOSearcher)
    assert searcher.parity == probe
    plain = checks.install(Parts(), probe).searcher(None)
    assert isinstance(plain, checks.CheckedSearcher) and not isinstance(plain, grpo.GRPOSearcher)
