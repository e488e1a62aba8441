"""The TL;DR job (jobs/run_tldr.py): its preset, data, reward model, evaluator, and a tiny run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import sys
import types

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    get_linear_schedule_with_warmup,
)

from extensions.cli import configs_from_args
from extensions.evaluate import EvalConfig
from extensions.grpo import GRPOConfig
from extensions.tiny import build_char_tokenizer, cpu_config
from helpers import child_pids, time_limit
from jobs import run_tldr
from jobs.tldr_scoring import RewardModelReward, SummaryEvaluator, win_rate
from plumbing.config import RunError
from tba import TBAConfig
from test_tba import read_metrics
from trainer import Parts, Trainer


def test_reward_model_reward_with_tiny_classifier(tmp_path):

    tok = build_char_tokenizer()
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=128,
        n_embd=16,
        n_layer=1,
        n_head=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    GPT2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reward = pickle.loads(
        pickle.dumps(RewardModelReward(str(tmp_path)))
    )  # as a spawned searcher gets it
    a = reward(" 12 + 3 = 15", {"prompt": "Q: 12 + 3?"})
    b = reward(" 12 + 3 = 16", {"prompt": "Q: 12 + 3?"})
    assert isinstance(a, float) and math.isfinite(a) and a != b
    assert reward(" 12 + 3 = 15", {"prompt": "Q: 12 + 3?"}) == a
    both = reward.batch([" 12 + 3 = 15", " 1"], [{"prompt": "Q: 12 + 3?"}] * 2)
    assert both[0] == pytest.approx(a, abs=1e-5)  # padded in a batch, the same score
    assert pickle.loads(pickle.dumps(reward))._model is None  # weights never pickled
    # A suffix restores what decoding stripped (TL;DR's EOS text); a separate tokenizer path.
    model_only = tmp_path / "model_only"
    GPT2ForSequenceClassification.from_pretrained(tmp_path).save_pretrained(model_only)
    suffixed = RewardModelReward(
        str(model_only), completion_suffix="5", tokenizer_path=str(tmp_path)
    )
    assert suffixed(" 12 + 3 = 1", {"prompt": "Q: 12 + 3?"}) == pytest.approx(a, abs=1e-5)


def test_tldr_paper_preset_is_the_released_run():
    """run_tldr's paper preset, row by row, against the values read from bbartoldson/TBA:
    launch_training_tldr.sh, configs/tba_pythia2.8b_tldr.yml, TBAConfigTLDR's defaults in
    src/tba_trainer_tldr.py, and those of TRL's RLOOConfig / TrainingArguments it extends."""
    released = {
        "model": "mnoukhov/pythia1b-sft-tldr",  # launch script: model_size=1b
        "ref_model": "mnoukhov/pythia1b-sft-tldr",  # sft_model_path
        "num_generations": 20,  # rloo_k 20 x rloo_k_buffer_multiplier 1
        "responses_per_prompt": 20,  # rloo_k
        "prompts_per_step": 8,  # 20 x gradient_accumulation_steps 8 = 160 episodes / 20
        "searcher_batch_prompts": 1,  # ceil(local_rollout_forward_batch_size 20 / 20)
        "temperature": 0.7,
        "max_new_tokens": 128,  # response_length
        "lr": 3e-6,
        "warmup_steps": 0,
        "stable_steps": 0,
        "decay_steps": 256,
        "decay_shape": "linear",
        "total_steps": 256,  # total_episodes 40,960 / 160
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "tempered_logprobs": True,
        "eos_in_logprob": True,
        "beta_start": 1.0,  # kl_coef
        "beta_end": 0.05,  # kl_coef_final
        "beta_anneal_steps": 128,  # kl_coef_decay_target_iter
        "beta_cut_step": 31,  # kl_coef_decay_stop_iter 32, updates counted from 1
        "mop_prob": 0.5,  # on_policy_prob
        "publish_every": 10,  # sync_interval
        "inv_temp": 1.0,  # CommentBuffersManager default
        "buffer_capacity": 100,  # max_capacity_per_query
        "initial_samples": 10_000,  # initial_buffer_samples
        "dtype": "float16",  # fp16 generation
        "fp32_master_weights": True,  # the trainer's fp32 weights
        "micro_batch_size": 20,  # per_device_train_batch_size
    }
    cfg, eval_cfg, tldr, grpo_cfg = configs_from_args(
        argparse.Namespace(),
        run_tldr.PAPER_PRESET,
        TBAConfig,
        EvalConfig,
        run_tldr.TLDRConfig,
        GRPOConfig,
    )
    assert grpo_cfg.loss == "tb" and tldr.data_dir == "data/tldr"
    assert (eval_cfg.eval_samples, eval_cfg.eval_test_size) == (0, 0)  # greedy, all of it
    for name, value in released.items():
        owner = tldr if name in ("decay_shape", "beta_cut_step") else cfg  # the job's schedules
        assert getattr(owner, name) == value, f"{name}: {getattr(owner, name)!r} != {value!r}"
    assert issubclass(tldr.install(Parts()).trainer, run_tldr.TLDRTrainer)
    assert run_tldr.TLDRConfig().install(Parts()).trainer is Trainer  # nothing to change
    assert cfg.barrier_lag == 2 * cfg.publish_every - 1
    assert cfg.total_steps // cfg.checkpoint_every == 4  # save_steps 0.25
    assert cfg.logprob_temperature() == 0.7
    assert run_tldr.DATASET.startswith("vwxyzjn/summarize_from_feedback_tldr_3_filtered")
    assert run_tldr.GOLD_MODEL == "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"
    for size, prompts in (("410m", 2), ("1b", 1), ("2.8b", 1)):
        models = run_tldr.paper_models(size)
        assert models["model"] == models["ref_model"] == f"mnoukhov/pythia{size}-sft-tldr"
        assert models["searcher_batch_prompts"] == prompts
        assert models["gradient_checkpointing"] == (size == "2.8b")
        assert run_tldr.paper_reward_model(size) == f"mnoukhov/pythia{size}-rm-tldr6.9b"
    # The released beta: 1.0 at update 1, linear towards 0.05 over 128 updates, cut to 0.05 at
    # update 32 (step 31 here); kl_coef = final (u - 1) / 128 + start (1 - (u - 1) / 128).
    for step in (0, 10, 30, 31, 100):
        u = step + 1
        want = 0.05 * (u - 1) / 128 + 1.0 * (1 - (u - 1) / 128) if u < 32 else 0.05
        got = run_tldr.beta_with_cut(
            step, cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps, tldr.beta_cut_step
        )
        assert got == pytest.approx(want)
    # The released lr: transformers' linear schedule with no warmup, stepped before each update.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_linear_schedule_with_warmup(opt, 0, 256)
    for t in range(258):
        want = reference.lr_lambdas[0](t)
        assert run_tldr.lr_factor(t, 0, 0, 256, tldr.decay_shape) == pytest.approx(want, abs=1e-12)


def test_tldr_trainer_runs_the_released_schedules(tiny_model_dir):
    """The trainer TLDRConfig installs: beta cut to beta_end at beta_cut_step, and the lr
    decayed by a line, where the core's trainer anneals on and decays by a cosine."""
    schedule = dict(beta_start=1.0, beta_end=0.05, beta_anneal_steps=128, warmup_steps=0)
    cfg = cpu_config(tiny_model_dir, **schedule, stable_steps=0, decay_steps=256)
    tldr = run_tldr.TLDRConfig(beta_cut_step=31, decay_shape="linear")
    trainer = tldr.install(Parts()).trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    plain = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    for step, cut in ((30, False), (31, True), (100, True)):
        trainer.step = plain.step = step
        assert (trainer.beta() == 0.05) == cut and plain.beta() > 0.05
    # Update 1 runs at 1 - 1/256 on the line (and 0.99996 on the cosine).
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(cfg.lr * (1 - 1 / 256))
    assert plain.scheduler.get_last_lr()[0] > cfg.lr * (1 - 1 / 256)


def test_tldr_data_loader_and_missing_data_error(tmp_path):
    rows = [
        {"query": "SUBREDDIT: r/a\nPOST: one\nTL;DR:", "reference_response": " short<|endoftext|>"},
        {"query": "SUBREDDIT: r/b\nPOST: two\nTL;DR:", "reference_response": " other"},
    ]
    for split in ("train", "validation"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, test = run_tldr.load_tldr(str(tmp_path))
    assert [ex["id"] for ex in train] == [0, 1]
    assert train[0]["prompt"] == rows[0]["query"] and train[0]["reference"] == " short"
    assert test[1]["reference"] == " other"
    (tmp_path / "train.jsonl").write_text('{"query": "x"}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:1: missing or empty field 'reference_resp"):
        run_tldr.load_tldr(str(tmp_path))


def test_tldr_missing_data_is_named_or_fetched_whatever_is_installed(tmp_path, monkeypatch):
    """Missing files are named with the dataset to fetch them from, and why they were not:
    without the ``datasets`` package, or when the hub refuses; with it, they are fetched and
    written as the loader reads them. ``datasets`` is stood in for, installed or not."""
    empty = tmp_path / "empty"
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets: ImportError
    with pytest.raises(RunError, match=r"empty/train.jsonl.*vwxyzjn/summarize.*not installed"):
        run_tldr.load_tldr(str(empty))
    hub = types.ModuleType("datasets")

    def offline(name):
        raise ConnectionError(f"cannot reach the hub for {name}")

    hub.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", hub)
    with pytest.raises(RunError, match=r"validation.jsonl.*fetching it failed: cannot reach"):
        run_tldr.load_tldr(str(empty))
    assert not empty.exists() or list(empty.iterdir()) == []
    row = {"query": "POST: p\nTL;DR:", "reference_response": " s<|endoftext|>", "extra": 1}
    hub.load_dataset = lambda name: {"train": [row] * 3, "validation": [row] * 2}
    train, test = run_tldr.load_tldr(str(empty))
    assert (len(train), len(test)) == (3, 2) and test[1]["reference"] == " s"
    assert json.loads((empty / "train.jsonl").read_text().splitlines()[0]) == {
        "query": row["query"],
        "reference_response": row["reference_response"],
    }


def test_tldr_tiny_reward_model_and_win_rate():
    """The proxy fitted to gold-labelled preferences orders fresh pairs as the gold scorer
    does, well above chance, yet its optimum is not the gold scorer's; win_rate on known
    inputs."""
    assert win_rate([1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 2.0, 0.5]) == pytest.approx(
        (1 + 0 + 0.5 + 1) / 4
    )
    with pytest.raises(ValueError):
        win_rate([1.0], [])
    gold = run_tldr.tiny_gold()
    proxy = run_tldr.train_proxy_reward(run_tldr.preference_pairs(400, seed=11))
    heldout = run_tldr.preference_pairs(300, seed=12)
    assert run_tldr.agreement(proxy, heldout) > 0.75
    chance = run_tldr.ProxyRewardModel(proxy.words, [0.0] * len(proxy.words), 0.0, 0.0)
    assert run_tldr.agreement(chance, heldout) == 0.0  # all ties: never agrees
    # Over-optimisable: some word the gold scorer charges for (importance < its cost) the
    # proxy pays for.
    weights = dict(zip(proxy.words, proxy.weights, strict=True))
    overrated = [w for w, x in weights.items() if x > 0 > gold.importance[w] - 0.5]
    assert overrated
    row = run_tldr.tiny_posts(1, seed=5)[0]
    best = max(row["post_words"], key=gold.importance.get)
    once, twice = f" {best}", f" {best} {best}"
    assert gold(twice, row) == pytest.approx(gold(once, row) - 0.5)  # a repeat pays nothing
    assert proxy(twice, row) < proxy(once, row)  # labelled pairs held repeats
    assert gold(" zzz", row) == pytest.approx(-1.5)  # a stranger: a word and a hallucination
    assert proxy.batch([once, twice], [row, row]) == [proxy(once, row), proxy(twice, row)]
    clone = pickle.loads(pickle.dumps(run_tldr.ProxyRewardModel(**dataclasses.asdict(proxy))))
    assert clone(twice, row) == proxy(twice, row)


def test_tldr_summary_evaluator_on_a_tiny_model(tiny_model_dir):
    """Win rate against the references by a judge, and perplexity under a reference model
    (exp of the mean token NLL), on an untrained model: the numbers are what they must be."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():  # sharper logits (the head is tied to the embedding, a norm between):
        model.get_input_embeddings().weight.mul_(5.0)  # summaries' perplexities then differ
    examples = run_tldr.to_examples(run_tldr.tiny_posts(4, seed=3))
    cfg = cpu_config(tiny_model_dir, max_new_tokens=6)

    class Judge:  # scores a summary by its length: references of 0 chars lose to anything
        def batch(self, completions, examples):
            return [float(len(c)) for c in completions]

    for ex in examples:
        ex["reference"] = ""
    evaluator = SummaryEvaluator(cfg, EvalConfig(eval_batch_size=3), tokenizer, Judge(), model)
    res = evaluator.evaluate(model, examples)
    responses = evaluator.summaries(model, examples)
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    want = win_rate([float(len(t)) for t in texts], [0.0] * 4)
    assert res["win_rate"] == want
    # Perplexity of one summary by hand: the mean NLL of its tokens given the prompt.
    prompt = tokenizer(examples[0]["prompt"])["input_ids"]
    ids = torch.tensor([prompt + responses[0]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    nll = -sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(responses[0])) / len(responses[0])
    alone = evaluator.perplexity(examples[:1], responses[:1])
    assert alone == pytest.approx(math.exp(nll), rel=1e-4)
    assert res["perplexity"] == pytest.approx(evaluator.perplexity(examples, responses), rel=1e-4)
    # The mean over posts of each post's perplexity (eval_tldr/eval_ppl.py), in batches of 3, of
    # summaries whose perplexities differ (so that one over all tokens would not be the same).
    texts = (" a", " qqqqqqqq", " the cat", " 7")
    summaries = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    each = [evaluator.perplexity(examples[i : i + 1], summaries[i : i + 1]) for i in range(4)]
    assert max(each) > 2 * min(each)
    assert evaluator.perplexity(examples, summaries) == pytest.approx(sum(each) / 4, rel=1e-4)


@pytest.mark.slow
def test_tldr_tiny_learns_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    """run_tldr's tiny preset through the whole multi-process system, from an untrained policy
    (the tests' tiny model as --model: the SFT warm start takes minutes), 15 steps at lr 3e-3:
    the job's own measures rise. Untrained, every greedy summary is 32 characters of one word
    the post does not hold (gold score -1.5, win rate 0); the proxy pays an empty summary more
    (0), and TB finds it: the greedy summary becomes the EOS alone, the gold judge's mean score
    rises to 0, the win rate to the share of posts whose reference the gold scorer puts below 0
    (0.2 of these 50). In 6 runs (4 with the evaluation every 5 steps, seeds 0-3, where the
    greedy summary had turned by step 10; 2 of this test) 15 steps ended at -1.5 -> 0.0, 0.0 ->
    0.2 and 32 -> 1 token every time; at lr 5e-4 (the preset's) it turned between steps 15 and
    20 (seed 2), or later (seed 1: not by step 15)."""
    monkeypatch.setattr(run_tldr, "TINY_TASK", dict(run_tldr.TINY_TASK, train=200, test=50))
    out = tmp_path / "tldr"
    args = ["--preset", "tiny", "--model", tiny_model_dir, "--output_dir", str(out)]
    args += ["--total_steps", "15", "--lr", "3e-3", "--eval_every", "15", "--eval_subset", "10"]
    with time_limit(600):  # a hang detector: under a minute on the loaded 2-core machine
        results = run_tldr.main(args)
    before, after = results["before"], results["after"]
    assert after["judge_score"] > before["judge_score"] + 1.0, (before, after)
    assert results["win_rate_after"] > results["win_rate_before"] + 0.1, (before, after)
    # Stopping, which the proxy pays for: 32 tokens -> the EOS alone. (Whitespace also scores
    # 0 with the gold scorer, and is what the proxy negated teaches: 32 newlines, no shorter.)
    assert after["length"] < before["length"] / 2, (before, after)
    assert results["reward_model_agreement"] > 0.75  # the proxy orders pairs as the gold scorer
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 16))
    assert "eval/win_rate" in rows[-1] and "eval/perplexity" in rows[-1]
    assert "eval/win_rate" not in rows[0]
    saved = json.loads((out / "results.json").read_text())
    assert saved["win_rate_after"] == pytest.approx(results["win_rate_after"])
    assert child_pids() == []
