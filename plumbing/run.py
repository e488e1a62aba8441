"""The run around trainer.run_tba's loop (a learner may skip): the output directory, signals,
resume, the metrics row and file, the progress bar, and shutdown.

Leaving the ``with Run(...)`` block, however it ends, stops what the loop registered with
``stops`` (last first: the intake thread, then the searcher processes, so that nothing adds to
the buffer and every process of the run has ended) and then, once the trainer is loaded,
writes a checkpoint: even when a stop fails, whose error is raised after the save. Ctrl-C and
SIGTERM end it the same way, with one line saying where and how to resume.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import torch
from tqdm import tqdm

from plumbing.checkpoint import CHECKPOINT, METRICS, claimed, resume_metrics
from plumbing.metrics import peak_memory_gb, progress_fields


class Interrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT or SIGTERM; its message says where, and how to resume."""


class Run:
    """The output files, the things to stop, the progress bar, and the trainer once loaded."""

    def __init__(self, cfg, show_progress: bool = True):
        self.cfg = cfg
        self.show_progress = show_progress
        self.device = torch.device(cfg.trainer_device)
        self.ckpt_path = Path(cfg.output_dir) / CHECKPOINT
        self.metrics_path = Path(cfg.output_dir) / METRICS
        self.to_stop: list = []  # what ``stops`` registered, stopped last first on exit
        self.trainer = None  # set once loaded (and resumed): only then is a checkpoint written
        self.bar = None
        self.metrics_file = None
        self.started = 0.0  # when training began: wall_time counts training, not start-up
        self.checkpoint_s = 0.0  # seconds of the latest periodic save, reported in the next row
        self.handlers: dict = {}
        self.late_signal = ""  # a signal that came while the run was ending: raised after the save
        self.exits = contextlib.ExitStack()

    def __enter__(self) -> Run:
        self.exits.enter_context(claimed(self.cfg))  # refuses a directory holding another run
        self.handlers = _raise_on_signals(self)
        torch.manual_seed(self.cfg.seed)
        torch.set_num_threads(self.cfg.threads_per_process())
        return self

    def say(self, line: str) -> None:
        """A line above the progress bar."""
        tqdm.write(line)

    def stops(self, thing):
        """Register ``thing`` (with a ``stop()``) to be stopped when the run ends; returns it."""
        self.to_stop.append(thing)
        return thing

    def resume(self, trainer):
        """``trainer``, resumed from checkpoint.pt with --resume (``claimed`` found one there)
        and metrics.jsonl cut to its step; then training begins: the metrics file, the bar."""
        if self.cfg.resume:
            trainer.load(self.ckpt_path)
            self.say(f"resumed from {self.ckpt_path} at step {trainer.step}")
            resume_metrics(self.metrics_path, trainer.step, self.say)
        self.trainer = trainer
        self.bar = tqdm(
            total=self.cfg.total_steps,
            initial=trainer.step,
            desc="TBA",
            disable=not self.show_progress,
            dynamic_ncols=True,
        )
        self.metrics_file = open(self.metrics_path, "a")  # noqa: SIM115 (closed in __exit__)
        self.started = time.time()
        return trainer

    def row(self, metrics: dict, pool, t0: float, wait_s: float, publish_s: float) -> dict:
        """The step's metrics row: the trainer's, the buffer's, the searchers' and the times."""
        trainer = self.trainer
        row = {"step": trainer.step, "wall_time": time.time() - self.started, **metrics}
        row.update(trainer.buffer.stats(trainer.step))
        row.update(pool.metrics())
        row["time/wait"] = wait_s
        row["time/publish"] = publish_s
        row["memory/trainer_peak_gb"] = peak_memory_gb(self.device)
        row["time/step"] = time.perf_counter() - t0
        row["time/checkpoint"] = self.checkpoint_s  # the save after the previous row
        # The whole iteration but the on_step callback (evaluation), with that save: time/step
        # over time/loop is the share of the trainer's loop that trains.
        row["time/loop"] = time.perf_counter() - t0 + self.checkpoint_s
        return row

    def log(self, row: dict) -> None:
        """The row to metrics.jsonl and the bar; then the checkpoint when one is due. After the
        row: a kill between the two leaves the log a row ahead, which --resume cuts back; the
        other order would leave a hole."""
        print(json.dumps(row), file=self.metrics_file, flush=True)
        self.bar.update(1)
        self.bar.set_postfix(progress_fields(row))
        self.checkpoint_s = 0.0
        if self.trainer.step % (self.cfg.checkpoint_every or self.trainer.publish_every) == 0:
            t_save = time.perf_counter()
            self.trainer.save(self.ckpt_path)
            self.checkpoint_s = time.perf_counter() - t_save

    def __exit__(self, kind, error, tb) -> None:
        """Stop what was registered, then save. It runs to the end: a second Ctrl-C (or
        torchrun's SIGTERM to every rank) must not cut the checkpoint short (the handler notes a
        signal that comes now, ``_raise_on_signals``), and a stop that fails does not skip the
        save (its error is raised after it)."""
        stop_error = None
        try:
            if self.bar is not None:
                self.bar.close()
            if self.metrics_file is not None:
                self.metrics_file.close()
            for thing in reversed(self.to_stop):
                try:
                    thing.stop()
                except Exception as failed:  # noqa: BLE001 -- said now, raised after the save
                    self.say(f"stopping {type(thing).__name__} failed: {failed!r}")
                    stop_error = stop_error or failed
            if self.trainer is not None:
                self.trainer.save(self.ckpt_path)
        finally:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)
            self.exits.close()
        if error is None and self.late_signal:
            error = Interrupted(self.late_signal)  # the run had ended; the save is written
        if isinstance(error, Interrupted):
            trainer = self.trainer
            where = f"at step {trainer.step}" if trainer is not None else "before training"
            resume = f"; {self.ckpt_path} continues it with --resume" if trainer is not None else ""
            raise Interrupted(f"stopped by {error} {where}{resume}") from None
        if stop_error is not None and error is None:
            raise stop_error


def _raise_on_signals(run: Run) -> dict:
    """Make SIGINT and SIGTERM raise Interrupted in the main thread; returns the old handlers.
    Both are set: a background process inherits SIGINT ignored. While ``run`` is ending (the
    signal lands in ``Run.__exit__`` or below it) the signal is noted, not raised: ignoring the
    signals from inside ``__exit__`` left a window, the call itself, where torchrun's SIGTERM,
    sent the moment another rank died and so as this rank's collective failed, was raised on
    entering ``__exit__`` and skipped the final checkpoint."""

    def interrupt(signum, frame):
        name = signal.Signals(signum).name
        if _ending(frame):
            run.late_signal = run.late_signal or name
            return
        raise Interrupted(name)

    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}


def _ending(frame) -> bool:
    """Whether ``frame`` (where a signal handler runs) is ``Run.__exit__`` or called from it."""
    while frame is not None:
        if frame.f_code is Run.__exit__.__code__:
            return True
        frame = frame.f_back
    return False
