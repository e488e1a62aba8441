"""Where a job's processes go on a machine's GPUs (extensions/launch.py): the trainer's ranks and
the searchers never share a GPU, the memory shares come from the GPUs' memory, and ``--preset auto``
says why it found no GPU. The GPUs are faked: their count, memory and driver."""

from __future__ import annotations

import types

import pytest
import torch

import run_gsm8k
from extensions import launch
from extensions.cli import run_cli
from plumbing.config import ConfigError

NEEDS = launch.GSM8K_PAPER_NEEDS


def test_searchers_go_to_the_gpus_no_rank_trains_on():
    one = launch.gpu_placement(4, 80.0, ranks=1)
    assert one["searcher_devices"] == "cuda:1,cuda:2,cuda:3" and one["num_searchers"] == 3
    two = launch.gpu_placement(4, 80.0, ranks=2)
    assert (two["trainer_device"], two["searcher_devices"]) == ("cuda:0", "cuda:2,cuda:3")
    assert two["num_searchers"] == 2
    with pytest.raises(ConfigError, match=r"4 ranks train on 4 GPU\(s\).*--nproc-per-node 3"):
        launch.gpu_placement(4, 80.0, ranks=4)


def test_placement_reads_torchruns_ranks(monkeypatch):
    """Under torchrun (LOCAL_WORLD_SIZE), as the presets call it: searchers on cuda:1-3 with 4
    ranks on cuda:0-3 was the placement before it knew the ranks."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch.gpu_placement(4, 80.0)["searcher_devices"] == "cuda:2,cuda:3"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="leaves none for a searcher"):
        launch.gpu_placement(4, 80.0)


def test_a_searcher_on_a_ranks_gpu_is_refused_in_one_line_before_anything_starts(
    capsys, monkeypatch
):
    """torchrun's 4 ranks on cuda:0-3 and searchers on cuda:1-3 (the flags a person might copy
    from the single-process layout): refused on every rank before the ranks join, naming the
    flags; on the CPU, and with other GPUs, the ranks go on."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    argv = [
        "--preset",
        "paper",
        "--trainer_device",
        "cuda:0",
        "--searcher_devices",
        "cuda:1,cuda:2,cuda:3",
    ]
    joined = []
    monkeypatch.setattr(
        launch.data_parallel.Ranks, "from_env", lambda *a: joined.append(a) or 1 / 0
    )
    assert run_cli(run_gsm8k.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and joined == []
    assert (
        "--searcher_devices cuda:1,cuda:2,cuda:3: cuda:1 is also the GPU of trainer rank 1"
        in (err[0])
    )
    assert "from cuda:4 on" in err[0]
    other_gpus = ["--trainer_device", "cuda:0", "--searcher_devices", "cuda:4,cuda:5"]
    launch.check_devices(configs_of([*other_gpus, "--num_searchers", "2"]))  # nothing raised
    launch.check_devices(configs_of(["--trainer_device", "cpu", "--searcher_devices", "cpu"]))


def configs_of(argv: list[str]) -> launch.Configs:
    """The GSM8K job's configs of ``argv`` over the paper preset without a placement."""
    tasks = (run_gsm8k.EvalConfig, run_gsm8k.GSM8KConfig)
    return launch.parse(launch.argparser("", ["paper"], *tasks).parse_args(argv), {}, *tasks)


@pytest.mark.parametrize(
    "gpus, memory_gb, searcher_share, eval_share, checkpointed",
    [
        (4, 80.0, 0.85, 0.1, False),  # the released shares fit (the evaluator needs less)
        (4, 40.0, 0.75, 0.2, True),  # A100-40GB: 0.85 and a trainer without it do not
        (1, 80.0, 0.2, 0.1, False),  # one GPU: the searcher's share is what the trainer leaves
    ],
)
def test_memory_shares_come_from_the_gpus_memory(
    gpus, memory_gb, searcher_share, eval_share, checkpointed
):
    values = launch.gpu_placement(gpus, memory_gb, ranks=1, needs=NEEDS)
    assert values["vllm_gpu_memory_utilization"] == searcher_share
    assert values["vllm_eval_memory_utilization"] == eval_share
    assert values.get("gradient_checkpointing", False) == checkpointed
    # What the plan counts fits: the trainer and the evaluator's engine on GPU 0, with a
    # searcher's engine and reference model when it shares that GPU.
    trainer = NEEDS.trainer_checkpointed_gb if checkpointed else NEEDS.trainer_gb
    used = trainer + eval_share * memory_gb
    if gpus == 1:
        used += searcher_share * memory_gb + NEEDS.searcher_gb
    else:
        assert searcher_share * memory_gb + NEEDS.searcher_gb <= memory_gb * launch.HEADROOM
    assert used <= memory_gb * launch.HEADROOM


def test_gpus_too_small_for_the_paper_run_are_refused_naming_what_it_needs():
    with pytest.raises(ConfigError, match=r"does not fit GPUs of 24 GB.*GPUs of about 35 GB"):
        launch.gpu_placement(4, 24.0, ranks=1, needs=NEEDS)
    launch.gpu_placement(4, 35.0, ranks=1, needs=NEEDS)  # the least it names fits
    with pytest.raises(ConfigError, match=r"about 54 GB \(one GPU, shared by the trainer"):
        launch.gpu_placement(1, 40.0, ranks=1, needs=NEEDS)


def test_the_gsm8k_paper_preset_on_40_gb_gpus(monkeypatch, capsys):
    """--preset paper on 4 GPUs of 40 GB: the shares chosen, said in one line, and the values
    parse (the evaluator's share is EvalConfig's)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=40e9)
    )
    _, values = run_gsm8k.choose_preset("paper")
    line = capsys.readouterr().out.strip()
    assert "--vllm_gpu_memory_utilization 0.75" in line and "--gradient_checkpointing" in line
    tasks = (run_gsm8k.EvalConfig, run_gsm8k.GSM8KConfig)
    configs = launch.parse(launch.argparser("", ["paper"], *tasks).parse_args([]), values, *tasks)
    assert (
        configs.tba.gradient_checkpointing and configs.task[0].vllm_eval_memory_utilization == 0.2
    )


def test_auto_says_in_one_line_why_it_found_no_gpu(monkeypatch, capsys, tmp_path):
    """A torch built for CUDA 13 beside an older driver finds no GPU; --preset auto then trains
    the tiny preset, and says why (it used to say only "no CUDA GPU found")."""
    driver = tmp_path / "version"
    driver.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
    )
    monkeypatch.setattr(launch, "NVIDIA_DRIVER_FILE", str(driver))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert launch.auto_preset(0) == "tiny"
    line = capsys.readouterr().out.strip()
    assert line.startswith("preset: tiny (no usable CUDA GPU: NVIDIA driver 550.54.14 is here")
    assert "built for CUDA 13.0, which needs driver R580 or newer" in line
    monkeypatch.setattr(torch.version, "cuda", None)
    launch.auto_preset(0)
    assert "is a CPU build" in capsys.readouterr().out
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(launch, "NVIDIA_DRIVER_FILE", str(tmp_path / "none"))
    launch.auto_preset(0)
    assert "(no CUDA GPU found)" in capsys.readouterr().out
    assert launch.auto_preset(2) == "paper"
