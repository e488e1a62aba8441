"""extensions/report.py: each tracker holds, step for step, what metrics.jsonl holds, read back with
that tracker's own reader; the picture is drawn from any run, whatever metrics it wrote; a missing
tracker names what to install. No test reaches the network, and every tracker's files stay in
tmp_path: wandb and trackio write and read in child processes whose environment points them
there (trackio fixes its store's directory at import)."""

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from extensions import report
from extensions.cli import config_argparser, configs_from_args
from plumbing.config import ConfigError, RunError

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"model": "tiny", "beta": 0.05, "publish_every": 2, "synchronous": False, "note": None}


def fake_rows(first: int = 1, last: int = 12, scale: float = 1.0) -> list[dict]:
    """Metrics rows shaped as run_tba writes them: an evaluation every 4 steps, a diverged
    (NaN) loss once, an int, and a string that no tracker takes."""
    rows = []
    for step in range(first, last + 1):
        lag_1 = float(step % 3)
        row = {
            "step": step,
            "wall_time": 0.37 * step + 1e-9 * step * step,
            "loss/tb": scale * 70.0 / step if step != 7 else math.nan,
            "reward/mean": scale * (0.3 + 0.02 * step),
            "async/lag_mean": lag_1 / 8,
            "async/lag_0": 8.0 - lag_1,
            "async/lag_1": lag_1,
            "async/lag_2": 0.0,
            "async/lag_3": 0.0,
            "async/lag_4plus": 0.0,
            "async/batches_in": step % 4,
            "throughput/samples_per_s": 300.0 + 1.0 / 3.0 * step,
            "train/lr": 4e-05,
            "note": "not a number",
        }
        if step % 4 == 0:
            row["eval/accuracy"] = scale * (0.6 + 0.01 * step)
        rows.append(row)
    return rows


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    results = {"accuracy_before": 0.55, "accuracy_after": 0.8, "config": CONFIG}
    (path / "results.json").write_text(json.dumps(results))
    return path


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "run_a", fake_rows())


def numbers(rows: list[dict], cast=float) -> dict[int, dict[str, float]]:
    """What a tracker should hold: each row's numbers but the step, as the tracker stores them."""
    return {
        row["step"]: {
            key: cast(value)
            for key, value in row.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
        }
        for row in rows
    }


def float32(value: float) -> float:
    """TensorBoard keeps scalars as float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def assert_same(logged: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]):
    """Equal step for step and key for key, NaN equal to NaN; nothing more, nothing less."""
    assert sorted(logged) == sorted(expected)
    for step, values in expected.items():
        assert sorted(logged[step]) == sorted(values), f"step {step}"
        for key, value in values.items():
            got = logged[step][key]
            same = got == value or (math.isnan(got) and math.isnan(value))
            assert same, f"step {step}, {key}: logged {got!r}, metrics.jsonl has {value!r}"


def tracker_env(tmp_path: Path) -> dict[str, str]:
    """A child's environment: offline, and every tracker's directory in tmp_path."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("WANDB_", "TRACKIO_", "HF_"))
    }
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(
        {
            "HOME": str(home),
            "PYTHONPATH": str(REPO),
            # Explicit, whatever this machine's login: a test never syncs to W&B.
            "WANDB_MODE": "offline",
            "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
            "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
            "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
            "WANDB_ARTIFACT_DIR": str(tmp_path / "wandb_artifacts"),
            "TRACKIO_DIR": str(tmp_path / "trackio"),
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_OFFLINE": "1",
        }
    )
    return env


def run_child(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


REPLAY = (
    "import sys; from extensions import report; "
    "report.replay(sys.argv[1], report.ReportConfig(*sys.argv[2:]))"
)


def tensorboard_scalars(log_dir: Path):
    """The event files' scalars as TensorBoard's EventAccumulator reads them, {step: {tag:
    value}}; a step twice in one tag is an error (the accumulator keeps both)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    logged = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in logged.get(event.step, {}), f"{tag} twice at step {event.step}"
            logged.setdefault(event.step, {})[tag] = event.value
    return events, logged


def test_tensorboard_holds_every_row(run_dir):
    """Event files read back with TensorBoard's EventAccumulator; the config as text."""
    rows = report.read_rows(run_dir)
    with report.Reporter(report.ReportConfig("tensorboard"), run_dir, CONFIG) as reporter:
        for row in rows:
            reporter.log(row)

    events, logged = tensorboard_scalars(run_dir / "tensorboard")
    assert_same(logged, numbers(rows, float32))
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(textwrap.dedent(text)) == CONFIG


def test_tensorboard_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    """A run killed after step 8 and resumed from its step-4 checkpoint logs steps 5.. again:
    TensorBoard must show the resumed values alone, as the cut metrics.jsonl does. (Its own
    guess at a restart, a step going back, purges tag by tag at that tag's first repeated step:
    eval/accuracy, first logged again at step 8, the old last step, would be there twice.)"""
    first = fake_rows(1, 8)
    resumed = fake_rows(5, 10, scale=2.0)
    for rows in (first, resumed):
        with report.Reporter(report.ReportConfig("tensorboard"), tmp_path, CONFIG) as reporter:
            for row in rows:
                reporter.log(row)

    _, logged = tensorboard_scalars(tmp_path / "tensorboard")
    assert_same(logged, numbers(first[:4] + resumed, float32))


def history_value(value):
    """wandb's JSON writes NaN and infinities as strings."""
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    return special.get(value, value)


def read_wandb(run_dir: Path, env: dict[str, str], tmp_path: Path) -> tuple[dict, dict]:
    """The rows ({step: {key: value}}) and the run record of the offline run in RUN_DIR/wandb,
    read back with wandb's own reader of its .wandb log (``wandb leet inspect --json``: wandb
    ships no Python reader of it any more)."""
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    lines = run_child(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline)], env, tmp_path
    ).splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    logged = {}
    for record in records:
        if record["type"] == "history":
            item = record["history"]["item"]
            step = item["_step"]
            for key, value in item.items():
                if not key.startswith("_"):
                    logged.setdefault(step, {})[key] = float(history_value(value))
    (run,) = [record["run"] for record in records if record["type"] == "run"]
    return logged, run


def test_wandb_offline_run_holds_every_row(run_dir, tmp_path):
    """An offline run in RUN_DIR/wandb holds every row and the config."""
    env = tracker_env(tmp_path)
    run_child([sys.executable, "-c", REPLAY, str(run_dir), "wandb", "run-a"], env, tmp_path)
    logged, run = read_wandb(run_dir, env, tmp_path)
    assert_same(logged, numbers(report.read_rows(run_dir)))
    assert run["display_name"] == "run-a"
    assert run["project"] == "tba"
    config = {k: v for k, v in run["config"]["update"].items() if not k.startswith("_")}
    assert config == CONFIG


TRACKIO_READ = """
import json, sys
import trackio
from trackio.sqlite_storage import SQLiteStorage

project, name = sys.argv[1:]
runs = [run for run in trackio.Api().runs(project) if run.name == name]
logs = SQLiteStorage.get_logs(project, name)
print(json.dumps({"runs": len(runs), "config": runs[0].config, "logs": logs}, default=str))
"""


def read_trackio(project: str, name: str, env: dict, tmp_path: Path) -> tuple[dict, dict]:
    """The rows and the config of a run in trackio's local store (TRACKIO_DIR), read back with
    trackio's own API: the run and its config from ``trackio.Api``, its metrics from the store
    the dashboard reads."""
    assert list((tmp_path / "trackio").glob("*.db")), "no store in TRACKIO_DIR"
    read = json.loads(run_child([sys.executable, "-c", TRACKIO_READ, project, name], env, tmp_path))
    assert read["runs"] == 1
    logged = {}
    for entry in read["logs"]:
        step = entry["step"]
        for key, value in entry.items():
            if key not in ("step", "timestamp"):
                logged.setdefault(step, {})[key] = float(value)
    return logged, {k: v for k, v in read["config"].items() if not k.startswith("_")}


def test_trackio_local_store_holds_every_row(run_dir, tmp_path):
    """A run in trackio's local store holds every row and the config."""
    env = tracker_env(tmp_path)
    args = [str(run_dir), "trackio", "run-a", "tba-test"]
    run_child([sys.executable, "-c", REPLAY, *args], env, tmp_path)
    logged, config = read_trackio("tba-test", "run-a", env, tmp_path)
    assert_same(logged, numbers(report.read_rows(run_dir)))
    assert config == CONFIG


@pytest.mark.slow
def test_a_tiny_run_sends_every_metrics_row_to_each_tracker(tiny_model_dir, tmp_path):
    """The main job, a few steps of the tiny preset with --report_to naming all three trackers:
    each holds what metrics.jsonl holds, step for step (evaluation rows included), with the
    run's config; and the run leaves its picture."""
    env = tracker_env(tmp_path)
    out = tmp_path / "tiny_run"
    flags = ["--preset", "tiny", "--model", tiny_model_dir, "--output_dir", str(out)]
    flags += ["--total_steps", "3", "--eval_every", "2", "--eval_test_size", "4"]
    flags += ["--eval_subset", "4", "--eval_samples", "0", "--initial_samples", "16"]
    flags += ["--report_to", "tensorboard,wandb,trackio", "--project", "tba-test"]
    flags += ["--run_name", "tiny"]
    run_child([sys.executable, str(REPO / "run_gsm8k.py"), *flags], env, tmp_path, timeout=300)
    rows = report.read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval/accuracy" in rows[1]
    _, logged = tensorboard_scalars(out / "tensorboard")
    assert_same(logged, numbers(rows, float32))
    logged, run = read_wandb(out, env, tmp_path)
    assert_same(logged, numbers(rows))
    assert run["config"]["update"]["total_steps"] == 3
    logged, config = read_trackio("tba-test", "tiny", env, tmp_path)
    assert_same(logged, numbers(rows))
    assert config["report_to"] == "tensorboard,wandb,trackio" and config["total_steps"] == 3
    assert_png(out / "curves.png")


class _Hidden:
    """A finder that makes a package look absent, as where it was never installed."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def hide(monkeypatch, name: str) -> None:
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(sys, "meta_path", [_Hidden(name), *sys.meta_path])


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "trackio"])
def test_missing_tracker_names_the_package_and_the_command(tracker, tmp_path, monkeypatch):
    hide(monkeypatch, tracker)
    with pytest.raises(ModuleNotFoundError, match=f"pip install {tracker}") as caught:
        report.Reporter(report.ReportConfig(tracker), tmp_path, CONFIG)
    assert f"--report_to {tracker} needs the '{tracker}' package" in str(caught.value)


def test_missing_matplotlib_names_the_package(run_dir, monkeypatch):
    hide(monkeypatch, "matplotlib")
    with pytest.raises(ModuleNotFoundError, match="pip install matplotlib"):
        report.plot_run(run_dir)


def test_none_and_ranks_above_zero_write_nothing(tmp_path, monkeypatch):
    """Under torchrun only rank 0 reports; ``none`` imports no tracker."""
    with report.Reporter(report.ReportConfig("none"), tmp_path, CONFIG) as reporter:
        reporter.log(fake_rows()[0])
    monkeypatch.setenv("RANK", "1")
    with report.Reporter(report.ReportConfig("tensorboard"), tmp_path, CONFIG) as reporter:
        reporter.log(fake_rows()[0])
    assert list(tmp_path.iterdir()) == []


def test_flags_and_their_checks():
    """The flags come from ReportConfig (cli.config_argparser), as every job's do."""
    parser = config_argparser("", report.ReportConfig)

    def parse(*flags: str) -> report.ReportConfig:
        return configs_from_args(parser.parse_args(flags), {}, report.ReportConfig)[0]

    assert parse("--report_to", "wandb", "--project", "p") == report.ReportConfig(
        report_to="wandb", run_name="", project="p"
    )
    assert parse() == report.ReportConfig()
    with pytest.raises(ConfigError, match="--report_to 'mlflow' is not one of none"):
        parse("--report_to", "mlflow")
    assert parse("--report_to", "wandb, tensorboard,wandb").trackers() == ["wandb", "tensorboard"]
    assert parse("--report_to", "none").trackers() == []
    with pytest.raises(ConfigError, match="--report_to 'mlflow' is not one of none"):
        parse("--report_to", "wandb,mlflow")
    with pytest.raises(ConfigError, match="none goes alone"):
        parse("--report_to", "none,wandb")


def test_a_tracker_that_cannot_start_closes_the_ones_before_it(tmp_path, monkeypatch):
    """--report_to tensorboard,wandb without wandb: the error names wandb, and TensorBoard's
    writer, started first, is closed, not left open."""
    hide(monkeypatch, "wandb")
    closed = []
    monkeypatch.setattr(report._TensorBoard, "close", lambda self, failed: closed.append(failed))
    with pytest.raises(ModuleNotFoundError, match="pip install wandb"):
        report.Reporter(report.ReportConfig("tensorboard,wandb"), tmp_path, CONFIG)
    assert closed == [True]


@pytest.mark.parametrize(
    ("env", "netrc_text", "mode"),
    [
        ({}, None, "offline"),
        ({}, "machine example.com login u password k\n", "offline"),
        ({}, "machine api.wandb.ai login user password key123\n", "online"),
        ({"WANDB_API_KEY": "key123"}, None, "online"),
        ({"WANDB_API_KEY": "key123", "WANDB_MODE": "disabled"}, None, "disabled"),
        ({"WANDB_MODE": "offline"}, "machine api.wandb.ai login user password k\n", "offline"),
        (
            {"WANDB_BASE_URL": "https://wandb.example.com"},
            "machine wandb.example.com login user password k\n",
            "online",
        ),
    ],
)
def test_wandb_mode_is_online_only_with_credentials(env, netrc_text, mode, tmp_path):
    netrc_path = tmp_path / "netrc"
    if netrc_text is not None:
        netrc_path.write_text(netrc_text)
    assert report.wandb_mode({**env, "NETRC": str(netrc_path)}) == mode


def assert_png(path: Path):
    """A whole PNG (decoded to its last row) of the figure's size, 15 x 8 inches at 100 dpi,
    with lines and text on it, not a blank figure."""
    from PIL import Image  # matplotlib's dependency

    with Image.open(path) as image:
        image.load()  # a truncated file raises here
        assert (image.format, image.size) == ("PNG", (1500, 800)), path
        assert len(image.convert("RGB").getcolors(1500 * 800)) > 20, f"{path} is blank"


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures plot_run draws, kept as it saves them, to read what each panel holds."""
    kept = []
    save = report._save_png
    monkeypatch.setattr(report, "_save_png", lambda fig, path: save(kept.append(fig) or fig, path))
    return kept


PANELS = {
    "reward and evaluation, by step",
    "reward and evaluation, by time",
    "lag distribution (trainer step - policy version)",
    "throughput",
    "summary",
}


def panels(fig) -> dict[str, dict]:
    """What each titled panel of ``fig`` draws, its twin axes (the evaluation's) included: the
    labels of its lines, its bars, and its text."""
    drawn = {}
    for ax in fig.axes:
        if ax.get_title():
            axes = ax.get_shared_x_axes().get_siblings(ax)
            drawn[ax.get_title()] = {
                "lines": {line.get_label() for a in axes for line in a.lines},
                "bars": sum(len(a.patches) for a in axes),
                "text": "\n".join(t.get_text() for a in axes for t in a.texts),
            }
    return drawn


def test_plot_run_draws_every_panel(run_dir, figures):
    """A run that wrote every metric: reward and the evaluation against steps and seconds, the
    loss, the lags as bars (12 steps: a block each, five lags), the throughput, and the
    summary's numbers; no panel says a metric is missing. The PNG is that figure, written
    whole, with no partial file left."""
    path = report.plot_run(run_dir)
    assert path == run_dir / "curves.png"
    assert_png(path)
    assert not list(run_dir.glob("*.partial"))
    (fig,) = figures
    drawn = panels(fig)
    assert set(drawn) == PANELS | {"loss (loss/tb)"}
    for by in ("step", "time"):
        lines = drawn[f"reward and evaluation, by {by}"]["lines"]
        want = {"reward/mean", "eval/accuracy (subset)", "accuracy before (test)"}
        assert want | {"accuracy after (test)"} == lines, lines
    assert drawn["loss (loss/tb)"]["lines"] == {"loss/tb"}
    assert drawn["lag distribution (trainer step - policy version)"]["bars"] == 12 * 5
    assert drawn["throughput"]["lines"] == {"samples/s"}
    summary = drawn["summary"]["text"]
    assert "steps: 12" in summary and "accuracy on the test set: 0.55 -> 0.8" in summary
    assert not [title for title, d in drawn.items() if "in metrics.jsonl" in d["text"]]


def test_plot_run_with_missing_metrics_and_a_torn_last_line(tmp_path, figures):
    """A GRPO run without evaluation, throughput or lags, killed in the middle of a line: every
    panel still drawn, its loss from the 5 whole rows, the missing ones saying what is
    missing."""
    rows = [{"step": s, "wall_time": 0.5 * s, "loss/grpo": 0.1 - 0.01 * s} for s in range(1, 6)]
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 6, "wall'
    tmp_path.joinpath("metrics.jsonl").write_text(text)
    assert_png(report.plot_run(tmp_path))
    drawn = panels(figures[0])
    assert set(drawn) == PANELS | {"loss (loss/grpo)"}
    assert drawn["loss (loss/grpo)"]["lines"] == {"loss/grpo"}
    missing = {
        "reward and evaluation, by step": "no reward/mean or eval/* against step",
        "reward and evaluation, by time": "no reward/mean or eval/* against seconds",
        "lag distribution (trainer step - policy version)": "no async/lag_0 .. async/lag_4plus",
        "throughput": "no throughput/samples_per_s",
    }
    for title, says in missing.items():
        assert drawn[title]["text"] == f"{says}\nin metrics.jsonl", title
        assert not drawn[title]["lines"] and not drawn[title]["bars"], title
    assert "steps: 5" in drawn["summary"]["text"]


def test_plot_run_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(RunError, match=r"no metrics\.jsonl"):
        report.plot_run(tmp_path)
    tmp_path.joinpath("metrics.jsonl").write_text("")
    with pytest.raises(RunError, match="has no rows"):
        report.plot_run(tmp_path)
    tmp_path.joinpath("metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(RunError, match="line 2: not JSON"):
        report.plot_run(tmp_path)


def test_command_line_draws_a_finished_runs_picture(run_dir, tmp_path):
    out = run_child(
        [sys.executable, "-m", "extensions.report", str(run_dir)],
        {**os.environ, "PYTHONPATH": str(REPO)},
        tmp_path,
    )
    assert out.strip() == str(run_dir / "curves.png")
    assert_png(run_dir / "curves.png")
