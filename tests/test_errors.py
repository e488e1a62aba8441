"""What a person sees when a run cannot go on: a configuration that cannot work, a file that is
missing or malformed, a model that is not there, a checkpoint that is not one, a stop by signal.
Each is one line on stderr (after argparse's usage line for a flag), with a distinct exit status
and no traceback; a bug keeps its traceback (cli.run_cli)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import run_gsm8k
from extensions import launch, report
from extensions.cli import run_cli
from extensions.tiny import cpu_config, save_tiny_model
from helpers import cli_run, project_modules, stop_run, wait_for_rows
from jobs import run_redteam, run_tldr
from plumbing.config import ConfigError, RunError, SystemConfig
from plumbing.processes import SearcherFailed
from tba import TBAConfig
from tools import bench
from trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def failure(capsys, main, argv: list[str]) -> tuple[int, list[str]]:
    """run_cli(main, argv)'s exit status and its stderr lines; asserts that no traceback was
    printed and the message is one line."""
    status = run_cli(main, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return status, lines


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["--lr", "-1"], 2, "error: --lr must be > 0, got -1.0"),
        (["--prompts_per_step", "0"], 2, "error: --prompts_per_step must be >= 1, got 0"),
        (["--responses_per_prompt", "1"], 2, "error: --responses_per_prompt must be >= 2, got 1"),
        (["--preset", "tiny", "--data_dir", "x"], 2, "the tiny preset makes its own task"),
        (["--preset", "tiny", "--model", "/no/such/model"], 1, "--model '/no/such/model': no such"),
    ],
)
def test_gsm8k_job_refuses_in_one_line(capsys, argv, status, message):
    got, lines = failure(capsys, run_gsm8k.main, argv)
    assert got == status
    assert message in lines[0]


def test_gsm8k_data_missing_or_malformed_names_the_file_and_line(capsys, tmp_path):
    got, lines = failure(capsys, run_gsm8k.main, ["--preset", "paper", "--data_dir", str(tmp_path)])
    assert got == 1
    assert f"GSM8K file not found: {tmp_path / 'train.jsonl'}" in lines[0]
    good = '{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n'
    (tmp_path / "train.jsonl").write_text(good + "{not json\n")
    (tmp_path / "test.jsonl").write_text(good)
    got, lines = failure(capsys, run_gsm8k.main, ["--preset", "paper", "--data_dir", str(tmp_path)])
    assert got == 1
    assert f"{tmp_path / 'train.jsonl'}:2: malformed JSON" in lines[0]


def test_other_jobs_refuse_in_one_line(capsys, tmp_path):
    fresh = ["--output_dir", str(tmp_path / "run")]  # not the default, which may hold a run
    argv = ["--preset", "paper", "--data_dir", str(tmp_path), *fresh]
    got, lines = failure(capsys, run_tldr.main, argv)
    assert (got, "TL;DR data not found") == (1, lines[0].split(": error: ")[1][:20])
    got, lines = failure(capsys, run_redteam.main, ["--preset", "paper", *fresh])
    assert got == 2 and "the paper preset needs --model" in lines[0]
    got, lines = failure(capsys, report.main, [str(tmp_path)])
    assert got == 1 and f"no metrics.jsonl in {tmp_path}" in lines[0]
    got, lines = failure(capsys, bench.main, ["--set", "no_such_field=1"])
    assert got == 2 and "--set no_such_field=1: expected FIELD=VALUE" in lines[0]
    got, lines = failure(capsys, bench.main, ["--sections", "stalenes"])
    assert got == 2 and "--sections: unknown ['stalenes']" in lines[0]


def test_a_bug_keeps_its_traceback_and_debug_keeps_every_traceback(capsys, monkeypatch):
    def buggy(argv):
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        run_cli(buggy, [])

    def refuses(argv):
        raise ConfigError("--lr must be > 0, got -1.0")

    monkeypatch.setenv("TBA_DEBUG", "1")
    assert run_cli(refuses, []) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].endswith("got -1.0")


def test_interrupt_outside_training_says_so(capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    assert run_cli(interrupted, []) == 128 + signal.SIGINT
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("stopped by SIGINT outside training (no checkpoint was written then)")
    )


# A job whose teardown is slow inside a weakref callback (as freeing torch.distributed's and
# FSDP's objects is), then works on: a signal that lands in the callback must still stop it.
SIGNAL_IN_CALLBACK = """
import gc, sys, time, weakref
from extensions.cli import run_cli

class Held:
    pass

def slow_callback(ref):
    print("in callback", flush=True)
    time.sleep(3)

def main(argv):
    held = Held()
    keep = weakref.ref(held, slow_callback)
    del held  # the callback runs here
    time.sleep(30)  # the rest of the job, which a dropped signal would let finish

sys.exit(run_cli(main, []))
"""


def test_signal_inside_a_callback_stops_the_job_in_one_line():
    """SIGTERM that arrives while Python runs a weakref callback (where an exception cannot be
    raised into the job: Python prints "Exception ignored" and drops it) still stops the job,
    with one line and exit status 143, not a traceback and a job that runs on."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_IN_CALLBACK],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "TBA_DEBUG"},
    )
    try:
        assert proc.stdout.readline().strip() == "in callback"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # a dropped signal ends it at 33 s, status 0
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines() == [
        "-c: stopped by SIGTERM outside training (no checkpoint was written then)"
    ], err


def test_searcher_failure_is_a_run_error():
    """A dead searcher's message is its own traceback, printed by run_cli without the trainer's
    (test_system checks the message itself)."""
    assert issubclass(SearcherFailed, RunError)


def knob_configs() -> list[type]:
    """Every config of the project: a dataclass, declared in a module of plumbing, the core,
    extensions, jobs or tools, whose fields are knobs (``plumbing.config.knob``: help text in
    the metadata)."""
    found = []
    for name in sorted(project_modules()):
        for value in vars(importlib.import_module(name)).values():
            if (
                isinstance(value, type)
                and value.__module__ == name
                and dataclasses.is_dataclass(value)
                and any("help" in f.metadata for f in dataclasses.fields(value))
            ):
                found.append(value)
    return found


# Where the nearest value outside each kind of bound lies, and its edge inside, in steps from
# the bound: at_least 3 refuses 2 and takes 3, above 0 refuses 0 and takes 0.001.
EDGES = {"at_least": (-1, 0), "above": (0, 1), "at_most": (1, 0)}


def bound_cases() -> list:
    """(config, knob, bound, a value outside the bound, the values at its edge inside it) for
    every bound a knob declares (``at_least``, ``above``, ``at_most``, ``choices``), from the
    dataclass metadata: a knob added with a bound is checked here without a line of test."""
    cases = []
    for config in knob_configs():
        for f in dataclasses.fields(config):
            kind = type(f.default)
            step = 1 if kind is int else 1e-3  # the nearest value outside a bound, or inside
            meta = f.metadata
            for bound, (out, edge) in EDGES.items():
                if meta.get(bound) is not None:
                    outside, inside = meta[bound] + out * step, meta[bound] + edge * step
                    case = (config, f.name, bound, kind(outside), [kind(inside)])
                    cases.append(pytest.param(*case, id=f"{config.__name__}.{f.name}.{bound}"))
            if meta.get("choices") is not None:
                case = (config, f.name, "choices", "not_a_choice", list(meta["choices"]))
                cases.append(pytest.param(*case, id=f"{config.__name__}.{f.name}.choices"))
    return cases


def own_bound_message(name: str, bound: str, value) -> str:
    """What ``plumbing.config.check_bounds`` says of ``value`` outside ``name``'s ``bound``,
    without the bound's number."""
    if bound == "choices":
        return f"--{name} {value!r} is not one of"
    sign = {"at_least": ">=", "above": ">", "at_most": "<="}[bound]
    return f"--{name} must be {sign}"


@pytest.mark.parametrize("config, name, bound, outside, inside", bound_cases())
def test_every_knobs_bound_refuses_a_value_outside_it_naming_the_flag(
    config, name, bound, outside, inside
):
    """Each bound a knob declares, of every config (the core's, each extension's, each job's),
    violated once: a ConfigError that names the flag and the value (one line on stderr,
    test_gsm8k_job_refuses_in_one_line). The value at the bound's edge inside it is not refused
    by that bound (a combination with other knobs may refuse it, naming them)."""
    with pytest.raises(ConfigError) as refused:
        config(**{name: outside})
    message = str(refused.value)
    assert message.startswith(f"--{name} ") and str(outside) in message, message
    for value in inside:
        try:
            config(**{name: value})
        except ConfigError as error:
            assert not str(error).startswith(own_bound_message(name, bound, value)), error


def test_the_bounds_cases_cover_every_config():
    """The search for configs finds the core's and every extension's (an import that found
    none would leave the test above with no case at all)."""
    configs = knob_configs()
    assert {SystemConfig, TBAConfig, *launch.EXTENSION_CONFIGS} <= set(configs), configs
    bounded = {(c.values[0], c.values[1]) for c in bound_cases()}
    assert (TBAConfig, "responses_per_prompt") in bounded and len(bounded) > 40, len(bounded)


def test_checkpoint_that_is_not_one_or_of_another_model(tmp_path):
    small = save_tiny_model(tmp_path / "small", hidden=16)
    large = save_tiny_model(tmp_path / "large", hidden=32)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    trainer = Trainer(cpu_config(small), torch.device("cpu"), pad_id=0, eos_id=1)
    with pytest.raises(RunError, match=r"garbage\.pt is not a checkpoint of this program"):
        trainer.load(garbage)
    torch.save({"weights": [1, 2]}, garbage)  # a torch file, but not ours
    with pytest.raises(RunError, match=r"is not a checkpoint of this program \(KeyError"):
        trainer.load(garbage)
    trainer.save(tmp_path / "small.pt")
    other = Trainer(cpu_config(large), torch.device("cpu"), pad_id=0, eos_id=1)
    with pytest.raises(RunError, match=r"small\.pt does not fit this run"):
        other.load(tmp_path / "small.pt")


@pytest.mark.parametrize(
    "script, argv, status, message",
    [
        (["run_gsm8k.py"], ["--lr", "-1"], 2, "run_gsm8k.py: error: --lr must be > 0, got -1.0"),
        (["-m", "extensions.report"], ["/"], 1, "report.py: error: no metrics.jsonl in /:"),
    ],
)
def test_entry_scripts_print_one_line(script, argv, status, message):
    """The scripts as a person runs them: the exit status and the last line of stderr."""
    done = subprocess.run(
        [sys.executable, *script, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TBA_DEBUG"},
    )
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr


@pytest.mark.slow
def test_sigterm_mid_run_says_where_and_how_to_resume(tiny_model_dir, tmp_path):
    with cli_run(tiny_model_dir, tmp_path, "--total_steps", "100000") as proc:
        wait_for_rows(tmp_path, 3, proc)
        stop_run(proc, signal.SIGTERM, wait_s=60, settle_s=30)  # hangs (ProcessPool.stop)
        output = proc.stdout.read()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("run_gsm8k.py: stopped by SIGTERM at step "), output[-3000:]
    assert last.endswith(f"{tmp_path / 'checkpoint.pt'} continues it with --resume")
    assert "Traceback" not in output
