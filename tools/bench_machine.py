"""tools/bench.py's machine: its versions and how much two processes gain over one right now
(2.0 on two idle cores); asynchrony overlaps two processes, so it needs that gain."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys
import time

import torch
import torch.multiprocessing as mp


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the machine


def _spin(seconds: float, start, out_q) -> None:
    """A single-threaded matmul loop, the system's kind of work; reports iterations per second."""
    torch.set_num_threads(1)
    a, w = torch.randn(1536, 192), torch.randn(192, 768)
    out_q.put("ready")
    start.wait(timeout=120)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        (a @ w).relu_().sum()
        n += 1
    out_q.put(n / seconds)


def parallel_speedup(seconds: float) -> float:
    """Throughput of two concurrent single-threaded processes over one alone."""
    ctx, rates = mp.get_context("spawn"), []
    for n in (1, 2):
        start, out_q = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(seconds, start, out_q)) for _ in range(n)]
        for p in procs:
            p.start()
        for _ in procs:  # each has imported torch: start them together
            out_q.get(timeout=120)
        start.set()
        rates.append(sum(out_q.get(timeout=120) for _ in procs))
        for p in procs:
            p.join(timeout=30)
    return rates[1] / rates[0]


def cpu_kind() -> str:
    """The CPU's model and the vector kernels ATen chose for it: float rounding (MKL's and ATen's
    kernels, picked by vendor and capability) differs between kinds, and so do a seeded run's
    samples and every speed figure."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as cpuinfo:
            lines = cpuinfo.read().splitlines()
        for line in lines:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, ATen {torch.backends.cpu.get_cpu_capability()}"


def machine_info() -> dict:
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "cpu": cpu_kind(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
