"""No run is ever lost (plumbing/checkpoint.py, plumbing/run.py): a launch into
a directory that holds a run changes none of its bytes unless asked to archive or replace it;
--resume without a checkpoint is an error; every file a run writes whole is the old file or the
new one after a write cut part-way (raised or killed), never half; a torn last metrics line is
dropped on resume; the final checkpoint is written even when stopping the searchers fails."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import run_gsm8k
from buffer import Trajectory
from extensions.cli import run_cli
from extensions.tiny import (
    build_char_tokenizer,
    build_tiny_model,
    cpu_config,
    is_cached,
    supervised_warm_start,
)
from jobs import run_countdown, run_math, run_redteam, run_tldr
from plumbing import checkpoint
from plumbing.checkpoint import claimed, load_checkpoint, resume_metrics, save_checkpoint
from plumbing.config import ConfigError, RunError
from plumbing.run import Run
from test_tba import tiny_examples
from trainer import Parts, run_tba

JOBS = {  # each job's main and the flags of its CPU preset
    "gsm8k": (run_gsm8k, ["--preset", "tiny"]),
    "tldr": (run_tldr, ["--preset", "tiny"]),
    "redteam": (run_redteam, ["--preset", "tiny"]),
    "countdown": (run_countdown, ["--preset", "tiny"]),
    "math": (run_math, ["--preset", "dry_run"]),
}
OLD = 1_000_000_000  # the mtime (s) of every file of the old run: a rewrite shows


def finished_run(out: Path) -> Path:
    """A directory as a finished run leaves it: checkpoint, metrics, results, the final model,
    the warm-start cache and the curves, every mtime set to ``OLD``."""
    out.mkdir(parents=True)
    save_checkpoint(out / "checkpoint.pt", {"trainer": {"step": 3}, "config": {}})
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "results.json").write_text(json.dumps({"accuracy_after": 0.5}))
    for sub, name in (("final", "model.safetensors"), ("warm_start", "config.json")):
        (out / sub).mkdir()
        (out / sub / name).write_bytes(b"weights of " + sub.encode())
    (out / "curves.png").write_bytes(b"\x89PNG")
    for path in [*out.rglob("*"), out]:
        os.utime(path, (OLD, OLD))
    return out


def snapshot(root: Path) -> dict:
    """Every entry under ``root``: a file's bytes and mtime, a directory's mtime (which an
    entry added or removed changes)."""
    found = {}
    for path in sorted(root.rglob("*")):
        mtime = path.stat().st_mtime_ns
        found[str(path.relative_to(root))] = (path.read_bytes() if path.is_file() else None, mtime)
    return found


def launch(job: str, out: Path, *flags: str) -> tuple[int, str]:
    """The job's command line as a person runs it (extensions/cli.run_cli): exit status and
    what it printed to stderr."""
    module, preset = JOBS[job]
    argv = [*preset, "--output_dir", str(out), *flags]
    err = Path(out.parent / f"{job}.stderr")
    with open(err, "w") as f, contextlib.redirect_stderr(f):
        status = run_cli(module.main, argv)
    return status, err.read_text()


# ----------------------------------------------------------------------------- a second launch


def must_stop_at_the_claim(job: str, monkeypatch) -> None:
    """The job's work after it claims its directory, which these launches must never reach."""

    def train_and_evaluate(*args):
        pytest.fail(f"{job} went on past its claim of the output directory")

    monkeypatch.setattr(JOBS[job][0], "train_and_evaluate", train_and_evaluate)


@pytest.mark.parametrize("job", JOBS)
def test_a_second_launch_into_a_finished_run_stops_before_writing(job, tmp_path, monkeypatch):
    """Without --resume or --existing_run, every job refuses a directory that holds a run, in
    one line naming it and the ways on, before it writes anything there."""
    must_stop_at_the_claim(job, monkeypatch)
    out = finished_run(tmp_path / "run")
    before = snapshot(out)
    status, said = launch(job, out)
    assert status == 2 and said.count("\n") == 1, said
    assert f"--output_dir {out.resolve()} holds a run" in said and "--resume" in said
    assert "--existing_run archive" in said and "--existing_run replace" in said
    assert snapshot(out) == before
    assert {p.name for p in tmp_path.iterdir()} == {f"{job}.stderr", "run"}


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("how", ["archive", "replace"])
def test_existing_run_archive_moves_the_run_aside_whole_and_replace_deletes_it(
    job, how, tmp_path, monkeypatch
):
    """--existing_run archive: the old run, every byte and mtime, at RUN.archive-1 (the next
    one at RUN.archive-2), and the job starts in an empty RUN; replace: the old run is gone.
    The job's work after its claim is stubbed: what is checked is the directory it is given."""
    module, _ = JOBS[job]
    given = []

    def train_and_evaluate(configs, *args):
        out = Path(configs.tba.output_dir)
        given.append(sorted(p.name for p in out.iterdir()))
        (out / "metrics.jsonl").write_text('{"step": 1}\n')  # the new run's first row
        return {}

    monkeypatch.setattr(module, "train_and_evaluate", train_and_evaluate)
    out = finished_run(tmp_path / "run")
    before = snapshot(out)
    for _ in range(2):
        assert launch(job, out, "--existing_run", how) == (0, "")
    assert given == [[], []]
    archives = sorted(p.name for p in tmp_path.glob("run.archive-*"))
    if how == "archive":
        assert archives == ["run.archive-1", "run.archive-2"]
        assert snapshot(tmp_path / "run.archive-1") == before
        assert (tmp_path / "run.archive-2" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    else:
        assert archives == []
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]


def test_replace_refuses_the_current_directory(tmp_path, monkeypatch):
    out = finished_run(tmp_path / "run")
    before = snapshot(out)
    monkeypatch.chdir(out)
    cfg = types.SimpleNamespace(output_dir=".", resume=False, existing_run="replace")
    with pytest.raises(ConfigError, match="is the current directory"), claimed(cfg):
        pass
    assert snapshot(out) == before


@pytest.mark.parametrize("job", JOBS)
def test_resume_without_a_checkpoint_is_a_one_line_error(job, tmp_path, monkeypatch):
    """--resume where there is no checkpoint (a typo, a moved file) never starts over: one
    line naming the directory; a directory that is missing is not made, one that holds a run
    killed before its first checkpoint is left as it is."""
    must_stop_at_the_claim(job, monkeypatch)
    missing = tmp_path / "typo"
    status, said = launch(job, missing, "--resume")
    assert status == 2 and said.count("\n") == 1, said
    assert f"--resume: no checkpoint.pt in {missing.resolve()}" in said
    assert not missing.exists()
    out = finished_run(tmp_path / "run")
    (out / "checkpoint.pt").unlink()
    before = snapshot(out)
    status, said = launch(job, out, "--resume")
    assert status == 2 and said.count("\n") == 1 and f"no checkpoint.pt in {out.resolve()}" in said
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- writes cut part-way


class Cut(OSError):
    """A write cut part-way (a full disk, an I/O error)."""


CUT = types.SimpleNamespace(how=None)  # during a cut write: "raise" or "kill"


def cut_here() -> None:
    """Where a write is cut: raise Cut, or SIGKILL this process (``CUT.how``); else nothing."""
    if CUT.how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if CUT.how == "raise":
        raise Cut("the write was cut part-way")


class CutFile:
    """A file opened for writing that takes half of the first bytes written, then is cut."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        data = bytes(data)
        self.f.write(data[: max(1, len(data) // 2)])
        self.f.flush()
        cut_here()
        return len(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


class CuttingOs:
    """``os`` as plumbing/checkpoint.py sees it (write_atomic's), but every file it opens for
    writing is a CutFile."""

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, *args, **kwargs):
        return CutFile(os.fdopen(fd, *args, **kwargs))


def cut_after_the_model(tokenizer, monkeypatch) -> None:
    """A directory save (model, then tokenizer) cut once the tokenizer's files are written."""
    save = tokenizer.save_pretrained

    def save_pretrained(directory, **kwargs):
        saved = save(directory, **kwargs)
        cut_here()
        return saved

    monkeypatch.setattr(tokenizer, "save_pretrained", save_pretrained)


def run_cut(write) -> None:
    """``write``, cut as ``CUT.how`` says: here, where the cut raises; in a forked child, where
    it kills the process."""
    if CUT.how == "raise":
        with pytest.raises(Cut):
            write()
        return
    pid = os.fork()
    if pid == 0:  # the child: the cut kills it; were it to return, exit 3 (no cut came)
        try:
            # One thread: the OpenMP threads of the parent's torch are not in a forked child,
            # and a parallel region there waits for them forever (the warm start's training).
            torch.set_num_threads(1)
            write()
        finally:
            os._exit(3)
    deadline = time.monotonic() + 120  # a hang detector: the write takes about a second
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked write hung")
    assert os.WIFSIGNALED(done[1]) and os.WTERMSIG(done[1]) == signal.SIGKILL, done


def litter(root: Path) -> list[Path]:
    """The temporary files and directories of cut writes under ``root``."""
    return list(root.rglob(".*.tmp"))


def snapshot_but_litter(root: Path) -> dict:
    found = snapshot(root)
    for path in litter(root):
        prefix = str(path.relative_to(root))
        found = {k: v for k, v in found.items() if not k.startswith(prefix)}
    return found


TLDR_ROWS = [{"query": f"POST: {i}\nTL;DR:", "reference_response": f" {i}"} for i in range(50)]


def each_file(name: str, tmp_path: Path, monkeypatch) -> tuple:
    """(write, old_or_nothing, new) for one file a run writes: ``write`` writes it whole;
    ``old_or_nothing()`` holds after a cut write, ``new()`` after a whole one."""
    out = finished_run(tmp_path / "run")
    before = snapshot(out)

    def unchanged() -> bool:
        return snapshot_but_litter(out) == before

    fresh = tmp_path / "fresh"
    if name == "results.json":
        return (
            lambda: checkpoint.write_results(out, {"accuracy_after": 0.75}),
            unchanged,
            lambda: json.loads((out / name).read_text()) == {"accuracy_after": 0.75},
        )
    if name == "checkpoint.pt":
        state = {"trainer": {"step": 4, "weights": torch.arange(10_000.0)}, "config": {}}
        return (
            lambda: save_checkpoint(out / name, state),
            unchanged,
            lambda: load_checkpoint(out / name, torch.device("cpu"))["step"] == 4,
        )
    if name == "metrics.jsonl, cut back on resume":
        path = out / "metrics.jsonl"
        return (
            lambda: resume_metrics(path, 2),
            unchanged,
            lambda: [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2],
        )
    if name == "final/":
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, hidden=16, layers=1, heads=1)
        cut_after_the_model(tokenizer, monkeypatch)
        return (
            lambda: checkpoint.save_final(out, model, tokenizer),
            unchanged,
            lambda: (out / "final" / "config.json").is_file(),
        )
    if name == "the TL;DR download":
        datasets = types.ModuleType("datasets")
        datasets.load_dataset = lambda name: {"train": TLDR_ROWS, "validation": TLDR_ROWS}
        monkeypatch.setitem(sys.modules, "datasets", datasets)
        files = [fresh / "train.jsonl", fresh / "validation.jsonl"]
        return (
            lambda: run_tldr.load_tldr(str(fresh)),
            lambda: not any(f.exists() for f in files),
            lambda: [len(split) for split in run_tldr.load_tldr(str(fresh))] == [50, 50],
        )
    if name == "the TL;DR proxy's cache":
        pairs = dict(preference_pairs=40, heldout_pairs=40)
        monkeypatch.setattr(run_tldr, "TINY_TASK", dict(run_tldr.TINY_TASK, **pairs))
        return (
            lambda: run_tldr.tiny_reward_model(fresh),
            lambda: not (fresh / "reward_model.json").exists(),
            lambda: (fresh / "reward_model.json").is_file(),
        )
    assert name == "the warm-start cache"
    tokenizer = build_char_tokenizer()
    cut_after_the_model(tokenizer, monkeypatch)
    rows = [([5, 6], [7, tokenizer.eos_token_id])] * 4
    cache = fresh / "warm_start"
    spec = dict(max_steps=2, lr=1e-3, batch=2)
    return (
        lambda: supervised_warm_start(cache, tokenizer, rows, spec, 0, "warm start"),
        lambda: not cache.exists() and not is_cached(cache),
        lambda: is_cached(cache),
    )


FILES = [
    "results.json",
    "checkpoint.pt",
    "metrics.jsonl, cut back on resume",
    "final/",
    "the TL;DR download",
    "the TL;DR proxy's cache",
    "the warm-start cache",
]


@pytest.mark.parametrize("how", ["raise", "kill"])
@pytest.mark.parametrize("name", FILES)
def test_a_file_cut_mid_write_is_the_old_one_or_none(name, how, tmp_path, monkeypatch):
    """Each file a run writes whole, cut part-way by an error or a SIGKILL: what is left is
    the old file (or none, where there was none), never half of the new one; a cut that
    raises leaves no temporary behind. Written again without a cut, it is the new one."""
    write, old_or_nothing, new = each_file(name, tmp_path, monkeypatch)
    with monkeypatch.context() as cutting:
        cutting.setattr(CUT, "how", how)
        cutting.setattr(checkpoint, "os", CuttingOs())
        run_cut(write)
    assert old_or_nothing()
    assert len(litter(tmp_path)) <= (1 if how == "kill" else 0)
    write()
    assert new()


def test_a_warm_start_cache_counts_only_when_its_marker_says_so(tmp_path, capsys):
    """A directory at the cache's path without the marker written last (a save that died
    part-way, or one of an earlier version of the code) is no cache: trained and saved again."""
    tokenizer = build_char_tokenizer()
    cache = tmp_path / "warm_start"
    build_tiny_model(tokenizer, hidden=16, layers=1, heads=1).save_pretrained(cache)
    rows = [([5, 6], [7, tokenizer.eos_token_id])] * 4
    spec = dict(max_steps=2, lr=1e-3, batch=2)
    assert not is_cached(cache)
    supervised_warm_start(cache, tokenizer, rows, spec, 0, "warm start")
    assert is_cached(cache) and (cache / "tokenizer_config.json").is_file()
    assert "cached" not in capsys.readouterr().out
    supervised_warm_start(cache, tokenizer, rows, spec, 0, "warm start")
    assert f"warm start: cached at {cache}" in capsys.readouterr().out


def test_resume_drops_a_torn_last_metrics_line_with_a_warning(tmp_path):
    """A kill mid-row leaves metrics.jsonl's last line torn: resume drops it and says so; a
    torn line before the last is damage, a RunError naming the file and line."""
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    path.write_text(rows + '{"step": 4, "loss/t')
    said = []
    resume_metrics(path, 3, said.append)
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2, 3]
    assert len(said) == 1 and str(path) in said[0] and "torn" in said[0]
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(RunError, match=r"metrics.jsonl:2: not a JSON row"):
        resume_metrics(path, 3)


# ----------------------------------------------------------------------------- the final save


class ScriptedPool:
    """A searcher pool in this process, called as SearcherPool is: it hands the trainer
    scripted trajectories of version 0."""

    def __init__(self, cfg, examples, reward_fn, store, make, log):
        self.prompts_per_batch = cfg.searcher_batch_prompts
        self.k = cfg.num_generations
        self.stopped = False

    def start(self) -> None:
        pass

    def wait_ready(self) -> None:
        pass

    def collect(self, timeout: float) -> list[Trajectory]:
        time.sleep(min(timeout, 0.01))
        return [
            Trajectory(p, [5, 6], [7 + j, 8], float(j % 2), -4.0, 0)
            for p in range(self.prompts_per_batch)
            for j in range(self.k)
        ]

    def metrics(self) -> dict:
        return {}

    def stop(self) -> None:
        self.stopped = True


class PoolWhoseStopFails(ScriptedPool):
    def stop(self) -> None:
        super().stop()
        raise RuntimeError("the searchers did not stop")


def scripted_cfg(tiny_model_dir: str, tmp_path: Path):
    """Three steps on a ScriptedPool's data, no periodic checkpoint: only the final one."""
    return cpu_config(
        tiny_model_dir,
        output_dir=str(tmp_path / "run"),
        total_steps=3,
        checkpoint_every=1000,
        prompts_per_step=2,
        searcher_batch_prompts=2,
        num_generations=4,
        responses_per_prompt=4,
        initial_samples=8,
        barrier_lag=-1,  # the scripted data is of version 0 throughout
        max_train_lag=-1,
        replay_ratio=0.0,
        timeout_s=60,
    )


def test_the_final_checkpoint_is_written_when_stopping_the_searchers_fails(
    tiny_model_dir, tmp_path
):
    """plumbing/run.Run.__exit__: a stop that raises is raised after the final checkpoint,
    which holds the last step (no periodic save came before it)."""
    cfg = scripted_cfg(tiny_model_dir, tmp_path)
    pools = []

    def pool(*args):
        pools.append(PoolWhoseStopFails(*args))
        return pools[-1]

    with pytest.raises(RuntimeError, match="the searchers did not stop"):
        run_tba(cfg, tiny_examples(), lambda c, e: 0.0, parts=Parts(pool=pool), show_progress=False)
    assert pools[0].stopped
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt", torch.device("cpu"))["step"] == 3


@pytest.mark.parametrize("ending", ["a failed step", "the last step"])
def test_a_signal_as_the_run_ends_does_not_skip_the_final_checkpoint(
    ending, tiny_model_dir, tmp_path
):
    """torchrun sends SIGTERM to every rank the moment one dies, so on a live rank it lands as
    the failed collective's error unwinds into plumbing/run.Run.__exit__: the final checkpoint
    is still written, and the run's own error is the one raised. Here SIGTERM is sent as
    ``__exit__`` is called (a profile hook set by the step), where it once escaped ``__exit__``
    before the save (1 run of the data-parallel kill test in 2 full-suite runs). After the last
    step the signal is not dropped either: the run says it was stopped, after the save."""
    cfg = scripted_cfg(tiny_model_dir, tmp_path)
    sent = []

    def sigterm_on_exit(frame, event, arg):
        if event == "call" and frame.f_code is Run.__exit__.__code__:
            sys.setprofile(None)
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step(trainer, metrics):
        if trainer.step == 3:
            sys.setprofile(sigterm_on_exit)
            if ending == "a failed step":
                raise RuntimeError("rank 1 died")

    raised = None
    try:
        run_tba(
            cfg,
            tiny_examples(),
            lambda c, e: 0.0,
            parts=Parts(pool=ScriptedPool),
            on_step=on_step,
            show_progress=False,
        )
    except BaseException as error:  # noqa: BLE001 -- a KeyboardInterrupt must not end pytest
        raised = error
    finally:
        sys.setprofile(None)
    assert sent, "the hook never saw Run.__exit__ called"
    if ending == "a failed step":
        assert isinstance(raised, RuntimeError) and str(raised) == "rank 1 died", repr(raised)
    else:
        assert str(raised).startswith("stopped by SIGTERM at step 3;"), repr(raised)
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt", torch.device("cpu"))["step"] == 3
