"""Watch a run as it learns: its metrics rows in a tracker, and a picture of its curves.

A run writes one metrics row per trainer step to ``output_dir/metrics.jsonl``. This module adds,
beside that file and never instead of it:

- ``Reporter``: every row also goes to a tracker the user already has, with the run's config.
  ``--report_to`` names ``none`` (the default) or one or more of, comma-separated (as the
  ``report_to`` list of transformers' Trainer): ``tensorboard`` (event files in
  ``RUN_DIR/tensorboard``; ``tensorboard --logdir RUN_DIR``), ``wandb`` (``RUN_DIR/wandb``;
  offline unless the user is logged in, see ``wandb_mode``), ``trackio`` (local-first, no
  account: its own store, ``trackio show`` opens the dashboard). Each tracker is an optional
  package, imported only when named; a missing one is an error that says what to install.
- ``plot_run``: ``RUN_DIR/curves.png``, one figure of the run's curves (reward and evaluation
  against steps and against seconds, the loss, the lag distribution, samples per second).

From a finished run's directory, ``python -m extensions.report RUN_DIR`` draws the picture and
prints its path; ``--report_to X`` also sends the run's rows to tracker(s) X after the fact.

An extension: the core never imports this file; every job offers ``--report_to`` through
extensions/launch.py, which logs each row and draws the picture at the end of a run. Beyond the
project's
config helpers (plumbing.config.knob): the standard library, matplotlib (for the picture) and the
named tracker only.
"""

from __future__ import annotations

import importlib
import json
import math
import netrc
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from extensions.cli import config_argparser, configs_from_args, run_cli
from plumbing.checkpoint import write_atomic
from plumbing.config import RunError, knob, need

TRACKERS = ("none", "tensorboard", "wandb", "trackio")  # each but none: its package's name
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
WANDB_DEFAULT_HOST = "https://api.wandb.ai"
LAG_BLOCKS = 20  # bars in the lag panel


@dataclass
class ReportConfig:
    """Where a run's metrics rows go besides metrics.jsonl."""

    report_to: str = knob(
        "none",
        "also send every metrics row, with the config, to trackers: none, or one or more of "
        "tensorboard (RUN_DIR/tensorboard), wandb (RUN_DIR/wandb; offline unless logged in), "
        "trackio (local; `trackio show`), comma-separated",
    )
    run_name: str = knob("", "the run's name in the tracker; empty: the output directory's name")
    project: str = knob("tba", "the wandb / trackio project the run goes to")

    def __post_init__(self) -> None:
        names = self.names()
        for name in names:
            need(name in TRACKERS, f"--report_to {name!r} is not one of {', '.join(TRACKERS)}")
        need("none" not in names or names == ["none"], "--report_to: none goes alone")

    def names(self) -> list[str]:
        """The comma-separated names of --report_to, as written."""
        return [name.strip() for name in self.report_to.split(",")]

    def trackers(self) -> list[str]:
        """The trackers named, in order, each once; [] for none."""
        return [name for name in dict.fromkeys(self.names()) if name != "none"]


class MissingPackage(ModuleNotFoundError, RunError):
    """A package an option needs is not installed: the message is the pip command."""


def _import_tracker(tracker: str):
    """The tracker's module, or an error that names the package and the pip command.

    Only a missing tracker package is reworded: an installed tracker that fails to import (a
    broken dependency of its own) keeps its own error, which is the one that helps."""
    try:
        return importlib.import_module(tracker)
    except ModuleNotFoundError as e:
        if e.name != tracker:
            raise
        raise MissingPackage(
            f"--report_to {tracker} needs the '{tracker}' package, which is not installed: "
            f"pip install {tracker}  (requirements-test.txt pins the version the tests use)",
            name=tracker,
        ) from e


def wandb_mode(environ: dict | None = None) -> str:
    """``online`` when the user can log to W&B, else ``offline`` (the run stays in RUN_DIR/wandb
    until ``wandb sync``). Decided without the network, from wandb's own sources of credentials:

    - ``WANDB_MODE``, when set, wins (``online``, ``offline``, ``disabled``);
    - ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE`` set: online;
    - what ``wandb login`` writes, a netrc entry for the W&B host (``WANDB_BASE_URL``, default
      api.wandb.ai) in ``NETRC`` or ``~/.netrc``: online;
    - otherwise offline, where wandb itself would stop the run, or prompt for a key.
    """
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(env.get("WANDB_BASE_URL") or WANDB_DEFAULT_HOST).netloc
    if env.get("NETRC"):
        candidates = [Path(env["NETRC"]).expanduser()]
    else:
        candidates = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in candidates:
        if not path.is_file():
            continue
        try:
            entry = netrc.netrc(path).authenticators(host)
        except (netrc.NetrcParseError, OSError) as e:
            warnings.warn(f"wandb: cannot read {path} ({e}); logging offline", stacklevel=2)
            return "offline"
        return "online" if entry is not None and entry[2] else "offline"
    return "offline"


def _json_safe(config: dict) -> dict:
    """The config as JSON values: what a tracker stores, and what a person reads back."""
    return json.loads(json.dumps(config, default=str))


class _TensorBoard:
    """Event files in RUN_DIR/tensorboard, through torch's SummaryWriter (torch is here anyway;
    the ``tensorboard`` package is what it writes with and what reads them)."""

    def __init__(self, run_dir: Path, config: dict):
        _import_tracker("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.make_writer = SummaryWriter
        self.log_dir = run_dir / "tensorboard"
        self.config = config
        self.writer = None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.writer is None:
            # Made at the first row: purge_step makes TensorBoard drop what an earlier process
            # wrote here from this step on, as a resumed run cuts metrics.jsonl back to its
            # checkpoint (and a fresh run in the same directory starts a fresh log).
            self.writer = self.make_writer(str(self.log_dir), purge_step=step)
            # Indented: the text plugin renders markdown, and this keeps the JSON as code.
            text = json.dumps(self.config, indent=2, sort_keys=True).replace("\n", "\n    ")
            self.writer.add_text("config", "    " + text, global_step=step)
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # one row a step: cheap, and TensorBoard shows it at once

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class _WandB:
    """A W&B run in RUN_DIR/wandb: online when logged in, else offline (``wandb_mode``)."""

    def __init__(self, run_dir: Path, config: dict, name: str, project: str):
        wandb = _import_tracker("wandb")
        self.mode = wandb_mode()
        self.run = wandb.init(
            project=project, name=name, dir=str(run_dir), config=config, mode=self.mode
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _Trackio:
    """A trackio run in its local store (``TRACKIO_DIR``, default ``HF_HOME/trackio``), where
    ``trackio show`` finds every project; ``TRACKIO_SPACE_ID`` sends it to a Space instead."""

    def __init__(self, config: dict, name: str, project: str):
        self.trackio = _import_tracker("trackio")
        # embed=False: never start a dashboard from a training process, even in a notebook.
        self.run = self.trackio.init(project=project, name=name, config=config, embed=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        # The module's finish, not the run's: it also forgets the run, which trackio would
        # otherwise finish a second time at exit.
        self.trackio.finish()


class Reporter:
    """One per run, on rank 0 only: ``log`` each metrics row, then ``close`` (or use ``with``).

    Under torchrun (``RANK`` > 0) it does nothing, so a job may make one on every rank and only
    rank 0's rows reach the tracker. A resumed run starts a new wandb / trackio run that begins
    at the checkpoint's step; in TensorBoard it continues the same curves (``_TensorBoard``).
    """

    def __init__(self, cfg: ReportConfig, run_dir: str | Path, config: dict):
        self.run_dir = Path(run_dir)
        self.run_name = cfg.run_name or self.run_dir.resolve().name
        self.trackers = []
        if not cfg.trackers() or int(os.environ.get("RANK", "0")) > 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        safe = _json_safe(config)
        try:
            for name in cfg.trackers():
                if name == "tensorboard":
                    self.trackers.append(_TensorBoard(self.run_dir, safe))
                elif name == "wandb":
                    self.trackers.append(_WandB(self.run_dir, safe, self.run_name, cfg.project))
                else:
                    self.trackers.append(_Trackio(safe, self.run_name, cfg.project))
        except BaseException:
            self.close(failed=True)  # the trackers started before the one that could not
            raise

    def log(self, row: dict) -> None:
        """Send one metrics row: ``row["step"]`` is the step, every other number a metric
        (``wall_time`` included); values that are not numbers are skipped."""
        if not self.trackers:
            return
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"a metrics row needs an integer 'step'; got {step!r}")
        scalars = {
            key: float(value)
            for key, value in row.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
        }
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def close(self, failed: bool = False) -> None:
        """Finish each tracker's run (``failed`` marks it so where the tracker can); twice is
        once. Every tracker is closed even when one raises; the first error is raised after."""
        trackers, self.trackers = self.trackers, []
        errors = []
        for tracker in trackers:
            try:
                tracker.close(failed)
            except Exception as error:  # noqa: BLE001 (raised below, after the others close)
                errors.append(error)
        if errors:
            raise errors[0]

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


# ----------------------------------------------------------------------------- the picture


def read_rows(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl. A torn last line (a run killed mid-write leaves one,
    without its newline) is left out; any other line that is not JSON is an error."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise RunError(f"no {METRICS_FILE} in {run_dir}: is it a run's output_dir?")
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line, and no newline after it: torn
                break
            raise RunError(f"{path}, line {number}: not JSON ({e})") from e
    if not rows:
        raise RunError(f"{path} has no rows: the run wrote no step yet")
    return rows


def _series(rows: list[dict], key: str, x_key: str = "step") -> tuple[list, list]:
    """(x, y) of the rows that have ``key`` as a finite number."""
    xs = []
    ys = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value) and x_key in row:
            xs.append(row[x_key])
            ys.append(value)
    return xs, ys


def _training_seconds(rows: list[dict]) -> list[dict]:
    """The rows with ``seconds``: wall_time summed over resumed segments (a resumed process
    counts its wall_time from 0 again, so the raw column jumps back)."""
    out = []
    offset = 0.0
    last = None
    for row in rows:
        row = dict(row)
        wall = row.get("wall_time")
        if isinstance(wall, int | float):
            if last is not None and wall < last:
                offset += last
            last = wall
            row["seconds"] = offset + wall
        out.append(row)
    return out


def _smooth(ys: list[float]) -> tuple[list[float], int]:
    """The trailing mean over a twentieth of the run (at least one step), and that window."""
    window = max(1, len(ys) // 20)
    out = []
    total = 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out, window


def _first_key(rows: list[dict], preferred: tuple[str, ...], prefix: str) -> str | None:
    """The first of ``preferred`` that a row has, else the first key with ``prefix``."""
    present = {key for row in rows for key in row}
    for key in preferred:
        if key in present:
            return key
    for key in sorted(present):
        if key.startswith(prefix):
            return key
    return None


def _missing(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}\nin {METRICS_FILE}", ha="center", va="center", color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _noisy_line(ax, xs, ys, color: str, label: str) -> None:
    """Each step faintly, the trailing mean boldly: per-step values of a small batch are noise."""
    smooth, window = _smooth(ys)
    if window > 1:
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        label = f"{label} (mean of {window} steps)"
    ax.plot(xs, smooth, color=color, linewidth=1.6, label=label)


def _reward_and_eval(ax, rows, x_key, eval_key, results, x_label) -> None:
    """reward/mean on the left axis, the evaluation metric (and results.json's before and after,
    on the whole test set) on the right: their scales differ outside GSM8K."""
    xs, ys = _series(rows, "reward/mean", x_key)
    ex, ey = _series(rows, eval_key, x_key) if eval_key else ([], [])
    if not xs and not ex:
        _missing(ax, f"reward/mean or eval/* against {x_key}")
        return
    ax.set_xlabel(x_label)
    handles = []
    if xs:
        _noisy_line(ax, xs, ys, "tab:blue", "reward/mean")
        ax.set_ylabel("reward/mean", color="tab:blue")
        handles += ax.get_legend_handles_labels()[0]
    else:
        ax.set_yticks([])
    if eval_key:
        twin = ax.twinx()
        twin.plot(ex, ey, "o-", color="tab:orange", markersize=4, label=f"{eval_key} (subset)")
        name = eval_key.removeprefix("eval/")
        before = results.get(f"{name}_before")
        after = results.get(f"{name}_after")
        all_x = xs + ex
        if isinstance(before, int | float):
            twin.plot([0], [before], "s", color="tab:red", label=f"{name} before (test)")
        if isinstance(after, int | float) and all_x:
            twin.plot([max(all_x)], [after], "D", color="tab:red", label=f"{name} after (test)")
        twin.set_ylabel(eval_key, color="tab:orange")
        handles += twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="best")
    ax.grid(alpha=0.3)


def _lag_shares(ax, rows) -> None:
    """The trajectories trained on, by lag (trainer step minus the version of the policy that
    made them), as shares stacked to 1 in up to LAG_BLOCKS blocks of consecutive steps: a
    step's own shares jump with its small batch."""
    keys = sorted(
        {k for row in rows for k in row if k.startswith("async/lag_") and k[10:11].isdigit()},
        key=lambda k: int(k[10:].removesuffix("plus")),
    )
    counted = [row for row in rows if "step" in row and sum(row.get(k, 0.0) for k in keys)]
    if not counted:
        _missing(ax, "async/lag_0 .. async/lag_4plus")
        return
    size = math.ceil(len(counted) / LAG_BLOCKS)
    blocks = [counted[i : i + size] for i in range(0, len(counted), size)]
    centers = []
    shares = {key: [] for key in keys}
    for block in blocks:
        counts = {key: sum(row.get(key, 0.0) for row in block) for key in keys}
        total = sum(counts.values())
        centers.append((block[0]["step"] + block[-1]["step"]) / 2)
        for key in keys:
            shares[key].append(counts[key] / total)
    width = 0.9 * size * (counted[-1]["step"] - counted[0]["step"] + 1) / len(counted)
    bottom = [0.0] * len(blocks)
    for key in keys:
        ax.bar(centers, shares[key], width=width, bottom=bottom, label=key[6:])
        bottom = [b + s for b, s in zip(bottom, shares[key], strict=True)]
    ax.set_ylim(0, 1.13)  # the legend goes in the band above 1, clear of the bars
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1])
    ax.set_xlabel(f"step (blocks of {size})" if size > 1 else "step")
    ax.set_ylabel("share of trajectories")
    ax.legend(fontsize=7, loc="upper center", ncol=len(keys), frameon=False)


def _summary(ax, rows, loss_key, eval_key, results, run_dir) -> None:
    """The numbers a person asks first, as text."""
    ax.axis("off")
    lines = [f"run: {Path(run_dir).resolve().name}", f"steps: {rows[-1].get('step', '?')}"]
    seconds = [row["seconds"] for row in rows if "seconds" in row]
    if seconds:
        lines.append(f"training seconds: {seconds[-1]:.0f}")
    for key in ("reward/mean", loss_key):
        _, ys = _series(rows, key) if key else ([], [])
        if ys:
            window = max(1, len(ys) // 20)
            first = sum(ys[:window]) / window
            last = sum(ys[-window:]) / window
            lines.append(f"{key}: {first:.4g} -> {last:.4g}")
            if window > 1:
                lines.append(f"  (means of the first and last {window} steps)")
    _, ys = _series(rows, eval_key) if eval_key else ([], [])
    if ys:
        lines.append(f"{eval_key} (subset): {ys[0]:.4g} -> {ys[-1]:.4g}")
    if eval_key:
        name = eval_key.removeprefix("eval/")
        before = results.get(f"{name}_before")
        after = results.get(f"{name}_after")
        if isinstance(before, int | float) and isinstance(after, int | float):
            lines.append(f"{name} on the test set: {before:.4g} -> {after:.4g}")
    _, lags = _series(rows, "async/lag_mean")
    if lags:
        lines.append(f"mean lag: {sum(lags) / len(lags):.3g} versions")
    _, rates = _series(rows, "throughput/samples_per_s")
    if rates:
        lines.append(f"samples/s, median: {sorted(rates)[len(rates) // 2]:.4g}")
    ax.text(0.02, 0.98, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=9)


def plot_run(run_dir: str | Path) -> Path:
    """Draw RUN_DIR/metrics.jsonl's curves into RUN_DIR/curves.png, and return its path.

    Panels: reward/mean and the evaluation metric (``eval/accuracy``, else another ``eval/*``)
    against steps, and against training seconds; the loss (``loss/tb``, ``loss/grpo``, else
    another ``loss/*``); the lag distribution; ``throughput/samples_per_s``; a summary. A
    metric the run did not write leaves its panel saying so. Raises a RunError without
    metrics.jsonl or when it has no rows.
    """
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        raise MissingPackage(
            "plot_run needs matplotlib, which is not installed: pip install matplotlib "
            "(requirements.txt has it)",
            name="matplotlib",
        ) from e
    run_dir = Path(run_dir)
    rows = _training_seconds(read_rows(run_dir))
    results_path = run_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    eval_key = _first_key(rows, ("eval/accuracy", "eval/win_rate"), "eval/")
    loss_key = _first_key(rows, ("loss/tb", "loss/grpo"), "loss/")

    # A bare Figure draws with Agg and touches no pyplot state: safe inside any process.
    fig = Figure(figsize=(15, 8), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3)
    fig.suptitle(f"{run_dir.resolve().name}: {len(rows)} steps", fontsize=12)

    _reward_and_eval(axes[0, 0], rows, "step", eval_key, results, "step")
    axes[0, 0].set_title("reward and evaluation, by step")
    _reward_and_eval(axes[0, 1], rows, "seconds", eval_key, results, "training seconds")
    axes[0, 1].set_title("reward and evaluation, by time")

    ax = axes[0, 2]
    ax.set_title(f"loss ({loss_key})" if loss_key else "loss")
    xs, ys = _series(rows, loss_key) if loss_key else ([], [])
    if xs:
        _noisy_line(ax, xs, ys, "tab:purple", loss_key)
        if min(ys) > 0 and max(ys) / min(ys) > 100:  # TB's loss falls by orders of magnitude
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    else:
        _missing(ax, "loss/*")

    axes[1, 0].set_title("lag distribution (trainer step - policy version)")
    _lag_shares(axes[1, 0], rows)

    ax = axes[1, 1]
    ax.set_title("throughput")
    xs, ys = _series(rows, "throughput/samples_per_s")
    if xs:
        _noisy_line(ax, xs, ys, "tab:green", "samples/s")
        ax.set_xlabel("step")
        ax.set_ylabel("samples per second")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    else:
        _missing(ax, "throughput/samples_per_s")

    axes[1, 2].set_title("summary")
    _summary(axes[1, 2], rows, loss_key, eval_key, results, run_dir)

    path = run_dir / CURVES_FILE
    write_atomic(path, lambda f: _save_png(fig, f))  # a reader never sees half a picture
    return path


def _save_png(fig, file) -> None:
    """The figure as a 256-colour PNG: under half the size of matplotlib's RGBA one (about
    100 KB, small enough to commit beside a README), and the eye sees no difference on a white
    figure of lines and text."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image  # matplotlib's own dependency, there wherever matplotlib is

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    pixels = canvas.buffer_rgba()
    height, width = pixels.shape[:2]
    image = Image.frombuffer("RGBA", (width, height), pixels, "raw", "RGBA", 0, 1)
    palette = image.convert("RGB").quantize(256)  # median cut, the default for RGB
    palette.save(file, format="PNG", optimize=True)


def replay(run_dir: str | Path, cfg: ReportConfig) -> int:
    """Send a finished run's metrics.jsonl to ``cfg.report_to``, with results.json's config
    when there is one; returns the number of rows sent."""
    rows = read_rows(run_dir)
    results_path = Path(run_dir) / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    with Reporter(cfg, run_dir, results.get("config", {})) as reporter:
        for row in rows:
            reporter.log(row)
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = config_argparser(
        "Draw a finished run's curves into RUN_DIR/curves.png and print its path; with "
        "--report_to, also send its metrics rows to those trackers.",
        ReportConfig,
    )
    parser.add_argument("run_dir", help="a run's output_dir, where its metrics.jsonl is")
    parser.usage = "%(prog)s RUN_DIR [--report_to TRACKERS] [--run_name NAME] [--project NAME]"
    args = parser.parse_args(argv)
    print(plot_run(args.run_dir))
    (cfg,) = configs_from_args(args, {}, ReportConfig)
    if cfg.trackers():
        count = replay(args.run_dir, cfg)
        print(f"{count} rows sent to {cfg.report_to}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_cli(main))
