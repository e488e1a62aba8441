"""Checkpoints, resume and the run's directory (a learner may skip).

* ``claimed(cfg)``: a launch takes its output directory before it writes a byte there. A
  directory that holds a run is refused unless the launch resumes it (``--resume``, which then
  needs a checkpoint) or says what to do with the old run (``--existing_run archive|replace``).
* ``write_atomic``: every file a run writes whole is written to a temporary file and renamed,
  so a kill leaves the old file or the new one, never half of either; ``write_dir_atomic``
  the same for a directory (a saved model); ``save_final`` and ``write_results`` the files a job
  writes when its run ends.
* ``save_checkpoint`` / ``load_checkpoint``: a resumable checkpoint of tensors and plain
  containers (``torch.load(weights_only=True)`` reads it, never unpickling code).
* ``buffer_state`` / ``load_buffer_state``: the replay buffer in that form.
* ``resume_metrics``: metrics.jsonl cut back to the checkpoint's step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
from array import array
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import torch

from plumbing.config import ConfigError, RunError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# A directory holding any of these holds a run (the trainer's files, and the result a job
# writes after its first evaluation).
RUN_FILES = (CHECKPOINT, METRICS, "results.json")

# ----------------------------------------------------------------------------- the run's directory

_held: set[Path] = set()  # output directories this process has claimed and not let go


@contextlib.contextmanager
def claimed(cfg) -> Iterator[Path]:
    """Hold ``cfg.output_dir`` for this launch: made if missing; refused (a ConfigError naming
    the directory and the ways on) when it holds a run and ``cfg.resume`` is off, unless
    ``cfg.existing_run`` archives or replaces that run first; with ``cfg.resume``, a checkpoint
    must be there. A job claims it before its first write, and ``run_tba`` within the job finds
    it held by the same process and goes on."""
    path = Path(cfg.output_dir).resolve()
    if path in _held:
        yield path
        return
    holds_run = [name for name in RUN_FILES if (path / name).exists()]
    if cfg.resume:
        if not (path / CHECKPOINT).is_file():
            raise ConfigError(
                f"--resume: no {CHECKPOINT} in {path}; name the directory of the run to "
                "continue with --output_dir, or start a new run without --resume"
            )
    elif holds_run and cfg.existing_run == "refuse":
        raise ConfigError(
            f"--output_dir {path} holds a run ({', '.join(holds_run)}): continue it with "
            "--resume, choose a new --output_dir, or pass --existing_run archive (moved to "
            f"{path.name}.archive-N beside it) or --existing_run replace (deleted)"
        )
    elif holds_run:
        _set_aside(path, cfg.existing_run)
    path.mkdir(parents=True, exist_ok=True)
    _held.add(path)
    try:
        yield path
    finally:
        _held.discard(path)


def _set_aside(path: Path, how: str) -> None:
    """Move the run in ``path`` to ``path.archive-N`` (the first N free), or delete it."""
    if how == "replace":
        cwd = Path.cwd().resolve()
        if path in (cwd, *cwd.parents, Path.home().resolve()):
            raise ConfigError(
                f"--existing_run replace: {path} is the current directory, one above it or "
                "the home directory; delete it by hand, or choose another --output_dir"
            )
        shutil.rmtree(path)
        return
    n = 1
    while path.with_name(f"{path.name}.archive-{n}").exists():
        n += 1
    archive = path.with_name(f"{path.name}.archive-{n}")
    path.rename(archive)
    print(f"--existing_run archive: the run in {path} moved to {archive}", flush=True)


def write_atomic(path: Path, data: str | bytes | Callable) -> None:
    """Write ``data`` (text, bytes, or a function that writes to the binary file it is given)
    to ``path`` whole or not at all: a temporary file beside it, flushed to disk, then renamed
    over it (a rename is atomic within a file system)."""
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_dir_atomic(path: Path, fill: Callable[[Path], None]) -> None:
    """Write the directory ``path`` (a saved model) whole or not at all: ``fill`` writes into a
    temporary directory beside it, whose files are flushed to disk, and that is renamed into
    place. A directory already at ``path`` is renamed aside first and deleted after, so that a
    kill leaves the old directory (perhaps under its aside name) or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        fill(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        if not path.exists():
            os.rename(tmp, path)
            return
        aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
        os.rename(path, aside)  # over the empty directory mkdtemp made
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(aside, path)
            raise
        shutil.rmtree(aside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_final(out_dir: Path, model, tokenizer) -> Path:
    """``model`` and ``tokenizer`` (transformers' ``save_pretrained``) to ``out_dir/final``,
    whole or not at all; returns the directory."""
    final = Path(out_dir) / "final"

    def fill(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    write_dir_atomic(final, fill)
    return final


def write_results(out_dir: Path, results: dict) -> Path:
    """``results`` to ``out_dir/results.json``, whole or not at all; returns the file."""
    path = Path(out_dir) / "results.json"
    write_atomic(path, json.dumps(results, indent=2))
    return path


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: Path, state: dict) -> None:
    """``state`` (tensors and plain containers) to ``path``, atomically: a kill during a save
    never breaks the latest checkpoint."""
    write_atomic(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path, device: torch.device, key: str = "trainer") -> dict:
    """The ``key`` part of the state ``save_checkpoint`` wrote, read with
    ``weights_only=True``. A file that is not a checkpoint of this program is a RunError
    naming it."""
    try:
        return torch.load(path, map_location=device, weights_only=True)[key]
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, TypeError) as error:
        # torch's own words for an unreadable pickle are about its weights_only default,
        # which would mislead here.
        why = "torch.load cannot read it" if isinstance(error, pickle.UnpicklingError) else ""
        raise RunError(
            f"{path} is not a checkpoint of this program ({why or first_line(error)}); "
            "move it away, or run without --resume"
        ) from None


class Checkpointed:
    """``save`` and ``load`` of a trainer (trainer.Trainer is one), from its ``state_dict``,
    ``load_state_dict``, ``cfg`` and ``device``; the seams an extension overrides to save or
    load on several ranks (extensions/data_parallel.py)."""

    def save(self, path: Path) -> None:
        """A resumable checkpoint of the state and the config, written atomically."""
        save_checkpoint(
            path, {"trainer": self.state_dict(), "config": dataclasses.asdict(self.cfg)}
        )

    def load(self, path: Path) -> None:
        """A checkpoint of ``save``; one of another model is a RunError naming the file."""
        state = load_checkpoint(path, self.device)
        try:
            self.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as error:
            raise RunError(
                f"{path} does not fit this run ({first_line(error)}): --model and the "
                "extensions' flags must be the checkpoint's, and the code of its version"
            ) from None


def first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n")[0][:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def resume_metrics(path: Path, step: int, log=print) -> None:
    """Cut metrics.jsonl back to the rows of steps up to ``step`` (a kill between a row and its
    checkpoint leaves the log a row ahead), rewritten atomically; a torn last line (a kill
    mid-write) is dropped with a warning, a torn line elsewhere is an error."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                log(f"{path}: its last line is torn (a kill mid-write); dropped on resume")
                continue
            raise RunError(f"{path}:{i + 1}: not a JSON row; the log is damaged") from None
        if row["step"] <= step:
            kept.append(line)
    write_atomic(path, "".join(line + "\n" for line in kept))


# ----------------------------------------------------------------------------- the replay buffer

# A group's items as one record of columns, packed, so that the unpickler of
# torch.load(weights_only=True), written in Python, handles a few objects per prompt rather than
# a few hundred per trajectory. The buffer packs token ids as int32 ("i") and per-token
# log-probs as float64 ("d"); counts here are int64 ("q"). Format 6 is the buffer's since it
# kept each item's reference version.
BUFFER_FORMAT = 6
_SETS = ("fresh", "mop_drawn", "mop_since_publish", "any_drawn")  # the buffer's prompt sets
_COUNTS = ("num_added", "num_drawn", "num_drawn_first", "newest_version")


def buffer_state(buffer) -> dict:
    """A buffer.ReplayBuffer's whole state in plain containers and strings (packed bytes as
    latin-1 text, ``_text``); a prompt's bytes are one object, which pickle writes once."""
    with buffer._lock:
        return {
            "format": BUFFER_FORMAT,
            "packing": _packing(),
            "capacity": buffer.capacity,
            "mop_prob": buffer.mop_prob,
            "inv_temp": buffer.inv_temp,
            "rng": _rng_to_list(buffer.rng.getstate()),
            **{name: getattr(buffer, name) for name in _COUNTS},
            "groups": [[pid, _columns(g)] for pid, g in buffer.by_prompt.items()],
            **{s: [p for p in buffer.by_prompt if p in getattr(buffer, s)] for s in _SETS},
        }


def load_buffer_state(buffer, state: dict, stored: type) -> None:
    """``state`` (of ``buffer_state``) into ``buffer``, its items rebuilt as ``stored``
    (buffer.StoredTrajectory)."""
    if state.get("format") != BUFFER_FORMAT:
        raise ValueError(
            f"replay buffer state of format {state.get('format')}, this code reads format "
            f"{BUFFER_FORMAT}"
        )
    if state["packing"] != _packing():
        raise ValueError(
            f"the replay buffer was packed as {state['packing']}, this machine packs {_packing()}"
        )
    with buffer._lock:
        buffer.capacity, buffer.mop_prob = state["capacity"], state["mop_prob"]
        buffer.inv_temp = state["inv_temp"]
        buffer.rng.setstate(_rng_from_list(state["rng"]))
        for name in _COUNTS:
            setattr(buffer, name, state[name])
        buffer.by_prompt = {
            _key(pid): _from_columns(_key(pid), columns, stored) for pid, columns in state["groups"]
        }
        for name in _SETS:
            setattr(buffer, name, {_key(p) for p in state[name]})
        buffer.reindex()


def _pack(values, typecode: str) -> bytes:
    return array(typecode, values).tobytes()


def _unpack(data: bytes, typecode: str) -> list:
    values = array(typecode)
    values.frombytes(data)
    return values.tolist()


def _text(packed: bytes | None) -> str | None:
    """Packed bytes as a latin-1 string. torch.save pickles bytes as a latin-1 string anyway
    (pickle protocol 2), except empty bytes, which it writes as a call of ``bytes`` that
    torch.load(weights_only=True) refuses; an empty response or per-token list is real (a
    response of only EOS)."""
    return None if packed is None else packed.decode("latin-1")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode("latin-1")


def _columns(group: list) -> dict:
    """A group's items as one record of columns; a behaviour log-prob not recorded is NaN (a
    recorded one never is)."""
    behaviour = [math.nan if t.behaviour_logprob is None else t.behaviour_logprob for t in group]
    return {
        "prompt_tokens": _text(group[0].prompt),
        "response_tokens": _text(b"".join(t.response for t in group)),
        "response_bytes": _text(_pack([len(t.response) for t in group], "q")),
        "reward": _text(_pack([t.reward for t in group], "d")),
        "ref_logprob": _text(_pack([t.ref_logprob for t in group], "d")),
        "version": _text(_pack([t.version for t in group], "q")),
        "ref_version": _text(_pack([t.ref_version for t in group], "q")),
        "draws": _text(_pack([t.draws for t in group], "q")),
        "behaviour_logprob": _text(_pack(behaviour, "d")),
        "token_logprobs": [
            None
            if t.packed_token_logprobs is None
            else {k: _text(v) for k, v in t.packed_token_logprobs.items()}
            for t in group
        ],
    }


def _from_columns(prompt_id: Hashable, columns: dict, stored: type) -> list:
    """The items of a record of ``_columns``, sharing one prompt record (as the buffer does). A
    state written before the reference had a version holds none: the run's own p_ref, 0."""
    sizes = _unpack(_bytes(columns["response_bytes"]), "q")
    read = {"ref_version": [0] * len(sizes)}
    for name, code in _NUMBERS:
        if name in columns:
            read[name] = _unpack(_bytes(columns[name]), code)
    token_logprobs = [
        None if per_item is None else {k: _bytes(v) for k, v in per_item.items()}
        for per_item in columns["token_logprobs"]
    ]
    if {len(c) for c in read.values()} | {len(token_logprobs)} != {len(sizes)}:
        raise ValueError(f"replay buffer state: columns of unequal length, prompt {prompt_id!r}")
    prompt = _bytes(columns["prompt_tokens"])
    responses = _bytes(columns["response_tokens"])
    items = []
    start = 0
    for i, size in enumerate(sizes):
        behaviour = read["behaviour_logprob"][i]
        items.append(
            stored(
                prompt_id,
                prompt,
                responses[start : start + size],
                read["reward"][i],
                read["ref_logprob"][i],
                read["version"][i],
                token_logprobs[i],
                None if math.isnan(behaviour) else behaviour,
                read["draws"][i],
                read["ref_version"][i],
            )
        )
        start += size
    if start != len(responses):
        raise ValueError(f"replay buffer state: response bytes of {prompt_id!r} corrupt")
    return items


_NUMBERS = (  # the number columns and their typecodes
    ("reward", "d"),
    ("ref_logprob", "d"),
    ("version", "q"),
    ("ref_version", "q"),
    ("draws", "q"),
    ("behaviour_logprob", "d"),
)


def _packing() -> list:
    """How numbers are laid out here: the typecodes, their sizes, and the byte order."""
    return ["i", "d", "q"] + [array(code).itemsize for code in "idq"] + [sys.byteorder]


def _key(pid):
    """Prompt ids round-trip through lists; tuples come back as lists and must be hashable."""
    return tuple(pid) if isinstance(pid, list) else pid


def _rng_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
