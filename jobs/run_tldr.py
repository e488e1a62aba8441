"""TBA on TL;DR summarisation (preference tuning): the paper preset on GPUs, or a tiny preset on
a CPU with every piece built in code.

    python -m jobs.run_tldr                        # auto: paper preset with CUDA GPUs, else tiny
    python -m jobs.run_tldr --preset tiny          # offline, CPU, synthetic posts, a few minutes
    python -m jobs.run_tldr --preset paper --size 2.8b --data_dir data/tldr
    python -m jobs.run_tldr --help                 # every TBAConfig field is a flag

The paper's task (Sec. 5, App. B; bbartoldson/TBA launch_training_tldr.sh): a Pythia policy
warm-started by supervised fine-tuning on Reddit TL;DR summaries is tuned against a reward model
trained on human preferences; the evaluation is the win rate of its greedy summaries against the
human reference summaries, judged by a larger "gold" reward model, and the perplexity of its
summaries under the SFT reference (the paper's KL axis: the further the policy moves from the
reference, the higher).

Data (paper preset): ``--data_dir`` holds train.jsonl and validation.jsonl, one JSON object a
line with ``query`` (the formatted post, ending in "TL;DR:") and ``reference_response`` (the
human summary), the fields of the hub dataset DATASET. Without them the hub dataset is read when
the ``datasets`` package is installed and the machine is online; otherwise the run stops with an
error naming the missing files.

The tiny preset (``tiny_task``): a post is a handful of distinct made-up words ("facts"), each
with a hidden importance. The hidden gold scorer pays a summary the importance of each distinct
post word it names, charges every word it spends (brevity) and more for a word not in the post.
Reference ("human") summaries keep important words, but also the first words of a post whatever
their importance (a lead bias), and are noisy. A reward model (the proxy) is fitted to
preference pairs labelled by the gold scorer; it counts words rather than distinct words, so a
summary that repeats a good word pleases the proxy and not the gold scorer: the proxy can be
over-optimised, as a learned reward model can in the real task. A tiny char-level Llama is
warm-started on the reference summaries (SFT), then tuned by TBA on the proxy.

How summaries are scored (the hub reward model, the win rate and perplexity of the evaluation):
jobs/tldr_scoring.py.

Outputs in output_dir: metrics.jsonl, results.json (``win_rate_before``, ``win_rate_after``,
``perplexity_after``...), checkpoint.pt and final/ (jobs/outputs.py: each written whole or not
at all). A launch into a directory that holds a run is refused unless --resume or
--existing_run says what to do (plumbing/checkpoint.py, ``claimed``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from extensions import launch, report
from extensions.checks import print_summary, run_summary
from extensions.cli import run_cli
from extensions.evaluate import EvalConfig
from extensions.tiny import (
    TINY_CHECKS,
    answer_rows,
    build_char_tokenizer,
    supervised_warm_start,
    tiny_evaluator,
)
from extensions.tiny import TINY_PRESET as GSM8K_TINY_PRESET
from jobs.tldr_scoring import RewardModelReward, SummaryEvaluator
from plumbing.checkpoint import claimed, save_final, write_atomic, write_results
from plumbing.config import RunError, knob, need
from plumbing.models import load_causal_lm
from tba import beta_at, wsd_lr_factor
from trainer import Parts, Trainer, run_tba

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- paper preset

# The filtered TL;DR dataset of the released run (configs/tba_pythia2.8b_tldr.yml): the train
# split trains, the validation split evaluates (configs/generate_tldr.yml).
DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
SPLITS = ("train", "validation")
EOS_TEXT = "<|endoftext|>"  # Pythia's EOS; the dataset's references end with it
MAX_PROMPT_TOKENS = 512  # tba_tldr.py drops posts longer than this (max_length)
SIZES = ("410m", "1b", "2.8b")
DEFAULT_SIZE = "1b"  # launch_training_tldr.sh
# The gold judge of the released evaluation (eval_tldr/run.sh, configs/evaluate_tldr.yml).
GOLD_MODEL = "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"
GOLD_TOKENIZER = "EleutherAI/pythia-6.9b-deduped"
# Prompts per searcher generate call: launch_training_tldr.sh's local_rollout_forward_batch_size
# (sequences) over N = 20, at least one (tba_trainer_tldr.py: ceil(batch / N)).
SEARCHER_PROMPTS = {"410m": 2, "1b": 1, "2.8b": 1}


@dataclass
class TLDRConfig:
    """The TL;DR job's data and models (jobs/run_tldr.py)."""

    data_dir: str = knob("data/tldr", "paper: train.jsonl and validation.jsonl (module docstring)")
    size: str = knob(DEFAULT_SIZE, f"paper: the Pythia size, one of {', '.join(SIZES)}")
    reward_model: str = knob("", "paper: the training reward model (empty: the one of --size)")
    gold_model: str = knob(GOLD_MODEL, "paper: the judge of win rates")
    gold_tokenizer: str = knob(GOLD_TOKENIZER, "paper: the judge's tokenizer")
    # The released TL;DR run's schedules, which the GSM8K run has not (``TLDRTrainer``).
    beta_cut_step: int = knob(
        0,
        "from this step on beta is beta_end, wherever the anneal has reached (released TL;DR "
        "run: 31); 0: no cut",
    )
    decay_shape: str = knob(
        "cosine", "shape of the lr decay: cosine (released GSM8K run) | linear (released TL;DR run)"
    )

    def __post_init__(self) -> None:
        need(self.size in SIZES, f"--size {self.size!r} is not one of {', '.join(SIZES)}")
        need(self.beta_cut_step >= 0, f"--beta_cut_step must be >= 0, got {self.beta_cut_step}")
        need(
            self.decay_shape in ("cosine", "linear"),
            f"--decay_shape {self.decay_shape!r} is not one of cosine, linear",
        )

    def install(self, parts: Parts) -> Parts:
        """``parts`` with the TL;DR schedules in the trainer (``launch.parts`` calls this for a
        job's config that has it), when they differ from the core's."""
        if self.beta_cut_step == 0 and self.decay_shape == "cosine":
            return parts
        name = f"TLDR{parts.trainer.__name__}"
        return dataclasses.replace(
            parts, trainer=type(name, (TLDRTrainer, parts.trainer), {"tldr": self})
        )


def beta_with_cut(step: int, start: float, end: float, anneal_steps: int, cut_step: int) -> float:
    """``tba.beta_at``, and with ``cut_step`` > 0 ``end`` from that step on, wherever the line
    has reached (the released TL;DR run anneals 1.0 -> 0.05 over 128 updates and cuts to 0.05
    at update 32)."""
    if 0 < cut_step <= step:
        return end
    return beta_at(step, start, end, anneal_steps)


def lr_factor(step: int, warmup: int, stable: int, decay: int, shape: str) -> float:
    """``tba.wsd_lr_factor``, whose decay is a cosine, or with ``shape="linear"`` a line (with
    no warmup and no stable phase, transformers' default linear schedule, the released TL;DR
    run's)."""
    decaying = step - warmup - stable
    if shape == "linear" and step >= warmup and 0 <= decaying < decay:
        return 1.0 - decaying / decay
    return wsd_lr_factor(step, warmup, stable, decay)


class TLDRTrainer(Trainer):
    """The trainer with the released TL;DR run's schedules (``tldr``, set by
    ``TLDRConfig.install``): beta cut short, the lr decayed by a line."""

    tldr: TLDRConfig

    def beta(self) -> float:
        cfg = self.cfg
        return beta_with_cut(
            self.step, cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps, self.tldr.beta_cut_step
        )

    def lr_factor(self, update: int) -> float:
        cfg = self.cfg
        shape = self.tldr.decay_shape
        return lr_factor(update, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, shape)


# Row by row from bbartoldson/TBA: launch_training_tldr.sh (L), configs/tba_pythia2.8b_tldr.yml
# (Y), the defaults of TBAConfigTLDR in src/tba_trainer_tldr.py (C) and of TRL's RLOOConfig and
# transformers' TrainingArguments it extends (T). test_tba.py checks each row.
PAPER_PRESET: dict = dict(
    model=f"mnoukhov/pythia{DEFAULT_SIZE}-sft-tldr",  # L: model_name_or_path = sft_model_path
    ref_model=f"mnoukhov/pythia{DEFAULT_SIZE}-sft-tldr",  # L: the SFT model is the reference
    # Y: fp16 generation (vLLM in float16); the trainer's Accelerator gets no mixed precision,
    # so it trains the fp32 weights from_pretrained loads, in fp32. One dtype serves both sides
    # here: fp32 weights and moments, fp16 autocast compute.
    dtype="float16",
    fp32_master_weights=True,
    num_generations=20,  # C: rloo_k 20 x rloo_k_buffer_multiplier 1
    responses_per_prompt=20,  # C: rloo_k (the TB group size, logZ_k_size)
    prompts_per_step=8,  # Y: per_device_train_batch_size 20 x gradient_accumulation_steps 8 / 20
    searcher_batch_prompts=SEARCHER_PROMPTS[DEFAULT_SIZE],
    temperature=0.7,  # T: RLOOConfig temperature
    max_new_tokens=128,  # Y: response_length
    lr=3e-6,  # Y: learning_rate
    warmup_steps=0,  # T: warmup_steps 0
    stable_steps=0,
    decay_steps=256,  # T: lr_scheduler_type linear, to 0 at the last update
    decay_shape="linear",
    total_steps=256,  # Y: total_episodes 40,960 / 160 per update
    weight_decay=0.0,  # T
    max_grad_norm=0.0,  # the trainer loop steps the optimizer without clipping
    tempered_logprobs=True,  # C: logits /= temperature + 1e-7 on both sides
    # The logprobs cover the response up to and including its EOS (padding_mask is
    # idx > sequence_length, the EOS's index): the EOS is scored.
    eos_in_logprob=True,
    beta_start=1.0,  # C: kl_coef
    beta_end=0.05,  # C: kl_coef_final
    beta_anneal_steps=128,  # C: kl_coef_decay_target_iter
    beta_cut_step=31,  # C: kl_coef_decay_stop_iter 32 (update u = step + 1; u < 32 anneals)
    mop_prob=0.5,  # C: on_policy_prob
    publish_every=10,  # C: sync_interval
    barrier_lag=19,  # the barrier of a publish every k steps keeps the newest data 2k - 1 old
    inv_temp=1.0,  # CommentBuffersManager's default: replay by softmax(score)
    buffer_capacity=100,  # max_capacity_per_query
    initial_samples=10_000,  # C: initial_buffer_samples
    micro_batch_size=20,  # Y: per_device_train_batch_size (one prompt group per pass)
    checkpoint_every=64,  # Y: save_steps 0.25 (four a run)
    eval_every=0,
    eval_samples=0,  # the paper evaluates greedy summaries only
    eval_subset=200,
    eval_test_size=0,  # the whole validation split
    output_dir="runs/tldr",
    data_dir="data/tldr",
)


def paper_models(size: str) -> dict:
    """Policy, reference and reward model of one Pythia size (launch_training_tldr.sh); the
    2.8b model trains with gradient checkpointing, as the released trainer switches it on."""
    sft = f"mnoukhov/pythia{size}-sft-tldr"
    return dict(
        model=sft,
        ref_model=sft,
        searcher_batch_prompts=SEARCHER_PROMPTS[size],
        gradient_checkpointing=size == "2.8b",
    )


def paper_reward_model(size: str) -> str:
    return f"mnoukhov/pythia{size}-rm-tldr6.9b"


def read_tldr_jsonl(path: Path) -> list[dict]:
    """TL;DR rows (``query``, ``reference_response``); a bad row is a RunError naming the file
    and line. A reference's trailing EOS text is dropped (judges add it back)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise RunError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in ("query", "reference_response"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise RunError(f"{path}:{lineno}: missing or empty field {key!r}")
            reference = row["reference_response"].removesuffix(EOS_TEXT)
            rows.append({"query": row["query"], "reference": reference})
    if not rows:
        raise RunError(f"{path}: no examples")
    return rows


def load_tldr(data_dir: str) -> tuple[list[dict], list[dict]]:
    """(train, validation) examples from ``data_dir``/{train,validation}.jsonl; missing files
    are fetched from the hub with the ``datasets`` package when it is installed, else a RunError
    names them and the dataset."""
    path = Path(data_dir)
    if not path.is_absolute() and not path.exists():
        path = REPO / path
    files = [path / f"{split}.jsonl" for split in SPLITS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        _download_tldr(path, missing)
    train, test = (to_examples(read_tldr_jsonl(f)) for f in files)
    return train, test


def _download_tldr(path: Path, missing: list[str]) -> None:
    how = (
        f"TL;DR data not found: {', '.join(missing)}. Write train.jsonl and validation.jsonl "
        f"(fields 'query' and 'reference_response') from the hub dataset {DATASET}, or point "
        "--data_dir at a directory that holds them"
    )
    try:
        import datasets
    except ImportError:
        raise RunError(
            f"{how} (the 'datasets' package, which can fetch it, is not installed)"
        ) from None
    try:
        hub = datasets.load_dataset(DATASET)
    except Exception as exc:  # offline, or the hub refused: say what is missing, and why
        raise RunError(f"{how} (fetching it failed: {exc})") from exc
    path.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        keep = (
            {"query": r["query"], "reference_response": r["reference_response"]} for r in hub[split]
        )
        text = "".join(json.dumps(row) + "\n" for row in keep)
        write_atomic(path / f"{split}.jsonl", text)  # a cut download leaves no file, not half


def to_examples(rows: list[dict]) -> list[dict]:
    """Rows -> examples with ``id``, ``prompt`` (the query) and ``reference`` (its summary)."""
    return [{"id": i, "prompt": r["query"], **r} for i, r in enumerate(rows)]


def drop_long_prompts(examples: list[dict], tokenizer, limit: int, name: str) -> list[dict]:
    """The released run filters, not truncates, posts over ``limit`` tokens (tba_tldr.py)."""
    kept = [ex for ex in examples if len(tokenizer(ex["prompt"])["input_ids"]) <= limit]
    if len(kept) < len(examples):
        print(f"{name}: {len(examples) - len(kept)} posts over {limit} tokens dropped")
    return kept


# ----------------------------------------------------------------------------- tiny task

TINY_TASK = dict(
    vocabulary=24,  # made-up words, each a "fact" with a hidden importance
    post_words=6,
    train=2000,
    test=200,
    val=100,
    preference_pairs=1000,  # labelled pairs the proxy reward model is fitted to
    heldout_pairs=400,  # pairs that measure its agreement with the gold scorer
)
# The hidden gold scorer: importance of each distinct post word named, minus a cost per word
# spent, minus more for a word that is not in the post.
GOLD_COSTS = dict(per_word=0.5, not_in_post=1.0)
# Human references: word i is kept with probability sigmoid((w_i + lead_i - per_word) / noise),
# lead_i = lead_bonus for the first lead_words words of the post (the lead bias).
HUMAN = dict(lead_words=2, lead_bonus=0.5, noise=0.05)
LABEL_NOISE = 0.1  # labellers prefer a with probability sigmoid((gold_a - gold_b) / noise)
TINY_SFT = dict(max_steps=1200, lr=3e-3, batch=32, check_every=100, target=0.9, val=100)

# The GSM8K tiny preset's system (one searcher, publish every step, data at most one version
# old) with a higher lr (5e-4: 2e-4 moved the greedy summaries too little in 250 steps) and the
# beta of the three tried (0.03, 0.1, 0.3) that raised the win rate (docs/tldr.md, "TL;DR tiny").
TINY_PRESET: dict = dict(
    GSM8K_TINY_PRESET,
    max_new_tokens=32,
    lr=5e-4,
    total_steps=250,
    beta_start=0.03,
    beta_end=0.03,
    # The bounds on age that docs/tldr.md measured (the GSM8K preset's later 2 and 1 step per
    # batch were measured on sums only).
    barrier_lag=1,
    max_train_lag=1,
    replay_ratio=0.0,
    output_dir="runs/tldr_tiny",
    eval_every=25,
    eval_subset=100,
    eval_samples=0,
    checkpoint_every=125,
)


def tiny_words(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct consonant-vowel-consonant words."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < count:
        word = rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") + rng.choice("bdfgklmnprstvz")
        if word not in words:
            words.append(word)
    return words


def gold_importance(words: list[str], seed: int = 0) -> dict[str, float]:
    """The hidden importance of every word, uniform in [0, 1)."""
    rng = random.Random(seed + 1000)
    return {w: rng.random() for w in words}


class GoldScorer:
    """The hidden judge of TL;DR tiny (a reward plug-in, rewards.py's contract): the summed
    importance of the distinct post words a summary names, minus ``per_word`` for every word it
    spends and ``not_in_post`` more for each word the post does not hold."""

    def __init__(self, importance: dict[str, float], per_word: float, not_in_post: float):
        self.importance = dict(importance)
        self.per_word = per_word
        self.not_in_post = not_in_post

    def __call__(self, completion: str, example: dict) -> float:
        post = set(example["post_words"])
        words = completion.split()
        named = {w for w in words if w in post}
        strangers = sum(w not in post for w in words)
        return (
            sum(self.importance[w] for w in named)
            - self.per_word * len(words)
            - self.not_in_post * strangers
        )

    def batch(self, completions: list[str], examples: list[dict]) -> list[float]:
        return [self(c, ex) for c, ex in zip(completions, examples, strict=True)]


def human_summary(words: list[str], importance: dict[str, float], rng: random.Random) -> str:
    """A reference summary: important words, the lead words, noise (HUMAN); never empty."""
    kept = []
    for i, word in enumerate(words):
        lead = HUMAN["lead_bonus"] if i < HUMAN["lead_words"] else 0.0
        logit = (importance[word] + lead - GOLD_COSTS["per_word"]) / HUMAN["noise"]
        if rng.random() < 1.0 / (1.0 + math.exp(-logit)):
            kept.append(word)
    return " " + " ".join(kept or words[:1])


def tiny_posts(count: int, seed: int) -> list[dict]:
    """Posts of TINY_TASK["post_words"] distinct words, each with a human reference summary."""
    vocabulary = tiny_words(TINY_TASK["vocabulary"])
    importance = gold_importance(vocabulary)
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = rng.sample(vocabulary, TINY_TASK["post_words"])
        rows.append(
            {
                "query": f"post: {' '.join(words)}\ntl;dr:",
                "reference": human_summary(words, importance, rng),
                "post_words": words,
            }
        )
    return rows


def tiny_task() -> tuple[list[dict], list[dict], list[dict]]:
    """TL;DR tiny's (train, test, validation) examples: disjoint seeds."""
    return (
        to_examples(tiny_posts(TINY_TASK["train"], seed=1)),
        to_examples(tiny_posts(TINY_TASK["test"], seed=2)),
        to_examples(tiny_posts(TINY_TASK["val"], seed=3)),
    )


def tiny_gold() -> GoldScorer:
    return GoldScorer(gold_importance(tiny_words(TINY_TASK["vocabulary"])), **GOLD_COSTS)


@dataclasses.dataclass
class ProxyRewardModel:
    """The learned reward of TL;DR tiny (a reward plug-in with ``batch``): a linear
    Bradley-Terry model, ``sum_v weight_v * count_v`` over the post words v a summary names,
    plus ``stranger_weight`` per word not in the post and ``repeat_weight`` per repeated word.
    Fitted to a few hundred noisy labels, its word weights are off, and a repeat of a word it
    overrates can still pay: it can be over-optimised."""

    words: list[str]
    weights: list[float]
    stranger_weight: float
    repeat_weight: float

    def __call__(self, completion: str, example: dict) -> float:
        post = set(example["post_words"])
        weight = dict(zip(self.words, self.weights, strict=True))
        said = completion.split()
        named = sum(weight[w] if w in post else self.stranger_weight for w in said)
        return named + self.repeat_weight * (len(said) - len(set(said)))

    def batch(self, completions: list[str], examples: list[dict]) -> list[float]:
        return [self(c, ex) for c, ex in zip(completions, examples, strict=True)]


def labeller_pair(row: dict, importance: dict, vocabulary: list[str], rng: random.Random):
    """Two candidate summaries of a post as a labeller would see them: human summaries, each
    edited with some probability (a word dropped, a post word added, a stranger added), so the
    pairs cover more than the references do (a word repeated now and then)."""
    out = []
    for _ in range(2):
        words = human_summary(row["post_words"], importance, rng).split()
        edit = rng.random()
        if edit < 0.2 and len(words) > 1:
            words.pop(rng.randrange(len(words)))
        elif edit < 0.4:
            unused = [w for w in row["post_words"] if w not in words]
            if unused:
                words.insert(rng.randrange(len(words) + 1), rng.choice(unused))
        elif edit < 0.5:
            strangers = [w for w in vocabulary if w not in row["post_words"]]
            words.insert(rng.randrange(len(words) + 1), rng.choice(strangers))
        elif edit < 0.55:
            words.insert(rng.randrange(len(words) + 1), rng.choice(words))
        out.append(" " + " ".join(words))
    return out


def preference_pairs(count: int, seed: int) -> list[tuple[dict, str, str]]:
    """(example, preferred, rejected) labelled by the gold scorer with label noise."""
    vocabulary = tiny_words(TINY_TASK["vocabulary"])
    importance = gold_importance(vocabulary)
    gold = tiny_gold()
    rng = random.Random(seed)
    pairs = []
    for row in tiny_posts(count, seed=seed + 100):
        a, b = labeller_pair(row, importance, vocabulary, rng)
        margin = (gold(a, row) - gold(b, row)) / LABEL_NOISE
        prefer_a = rng.random() < 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, margin))))
        pairs.append((row, a, b) if prefer_a else (row, b, a))
    return pairs


def proxy_features(summary: str, row: dict, words: list[str]) -> list[float]:
    """Counts of each vocabulary word named from the post, the count of strangers, and the
    count of repeats (words minus distinct words)."""
    post = set(row["post_words"])
    said = summary.split()
    counts = [0.0] * (len(words) + 2)
    index = {w: i for i, w in enumerate(words)}
    for w in said:
        counts[index[w] if w in post else len(words)] += 1.0
    counts[-1] = float(len(said) - len(set(said)))
    return counts


def train_proxy_reward(
    pairs: list[tuple[dict, str, str]], steps: int = 300, l2: float = 1e-3
) -> ProxyRewardModel:
    """Fit the proxy by the Bradley-Terry likelihood of the preferences (full-batch Adam):
    maximise mean log sigmoid(score(preferred) - score(rejected))."""
    words = tiny_words(TINY_TASK["vocabulary"])
    diff = torch.tensor(
        [
            [
                a - b
                for a, b in zip(
                    proxy_features(good, row, words),
                    proxy_features(bad, row, words),
                    strict=True,
                )
            ]
            for row, good, bad in pairs
        ]
    )
    theta = torch.zeros(diff.shape[1], requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.05)
    for _ in range(steps):
        loss = -torch.nn.functional.logsigmoid(diff @ theta).mean() + l2 * theta.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = theta.detach().tolist()
    return ProxyRewardModel(words, weights[:-2], weights[-2], weights[-1])


def agreement(judge, pairs: list[tuple[dict, str, str]]) -> float:
    """Share of pairs, gold ties left out, that ``judge`` orders as the gold scorer does."""
    gold = tiny_gold()
    hits = 0
    counted = 0
    for row, a, b in pairs:
        truth = gold(a, row) - gold(b, row)
        if truth == 0:
            continue
        counted += 1
        hits += (judge(a, row) - judge(b, row)) * truth > 0
    return hits / counted


# ----------------------------------------------------------------------------- tiny set-up


def tiny_sft(out_dir: Path, train: list[dict], val: list[dict], seed: int) -> str:
    """The SFT warm start of TL;DR tiny: the tiny char-level Llama trained on the reference
    summaries until nearly all its greedy validation summaries name only post words; saved to
    ``out_dir/sft`` (cached: a rerun loads)."""
    tokenizer = build_char_tokenizer()
    evaluator = tiny_evaluator(tokenizer, TINY_PRESET)  # TL;DR's summary length

    def valid(model) -> float:  # the share of greedy summaries made only of post words
        answers = evaluator.answers(model, val, 1, True, "SFT validation")
        return sum(
            bool(a[0].split()) and all(w in ex["post_words"] for w in a[0].split())
            for a, ex in zip(answers, val, strict=True)
        ) / len(val)

    return supervised_warm_start(
        out_dir / "sft",
        tokenizer,
        answer_rows(tokenizer, train, "reference"),
        TINY_SFT,
        seed,
        "SFT warm start",
        check=valid,
    )


def tiny_reward_model(out_dir: Path) -> tuple[ProxyRewardModel, float]:
    """The proxy fitted to TINY_TASK["preference_pairs"] gold-labelled pairs, and its agreement
    with the gold scorer on fresh pairs; cached in ``out_dir/reward_model.json``."""
    path = out_dir / "reward_model.json"
    if path.exists():
        state = json.loads(path.read_text())
        return ProxyRewardModel(**state["model"]), state["agreement"]
    proxy = train_proxy_reward(preference_pairs(TINY_TASK["preference_pairs"], seed=11))
    agree = agreement(proxy, preference_pairs(TINY_TASK["heldout_pairs"], seed=12))
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {"model": dataclasses.asdict(proxy), "agreement": agree}
    write_atomic(path, json.dumps(state, indent=2))  # whole or not at all: the file is the cache
    return proxy, agree


def tiny_setup(out_dir: Path, seed: int = 0, model: str = "") -> dict:
    """Everything TBA needs for TL;DR tiny: examples, the SFT model's path (``model``, else
    trained), the proxy reward, its agreement with the gold scorer, and the gold scorer."""
    train, test, val = tiny_task()
    proxy, agree = tiny_reward_model(out_dir)
    return {
        "train": train,
        "test": test,
        "model": model or tiny_sft(out_dir, train, val, seed),
        "reward": proxy,
        "reward_model_agreement": agree,
        "judge": tiny_gold(),
    }


# ----------------------------------------------------------------------------- main


def choose_preset(name: str) -> tuple[str, dict]:
    """``auto``: paper with CUDA GPUs (GPU 0 trains, the rest search), else tiny."""
    gpus = torch.cuda.device_count()
    if name == "auto":
        name = launch.auto_preset(gpus)
    if name == "tiny":
        return name, dict(TINY_PRESET, **TINY_CHECKS)
    return name, dict(PAPER_PRESET, **launch.gpu_placement(gpus))


def main(argv: list[str] | None = None) -> dict:
    parser = launch.argparser(
        "TBA on TL;DR summarisation. Every config field is a flag; --preset sets the base.",
        ["auto", "paper", "tiny"],
        EvalConfig,
        TLDRConfig,
    )
    args = parser.parse_args(argv)
    preset, base = choose_preset(args.preset)
    wall_start = time.time()
    configs = launch.parse(args, base, EvalConfig, TLDRConfig)
    cfg = configs.tba
    torch.set_num_threads(cfg.torch_threads or torch.get_num_threads())
    ranks = launch.torchrun(configs)  # under torchrun, ranks > 0 train in here, then return
    if ranks is not None and ranks.rank > 0:
        return {}
    with claimed(cfg):  # output_dir: refused if it holds another run, before any write there
        return train_and_evaluate(configs, preset, vars(args), ranks, wall_start)


def train_and_evaluate(configs, preset: str, flags: dict, ranks, wall_start: float) -> dict:
    """The task (tiny: its SFT model and proxy; paper: data, reward model, judge; ``flags`` the
    command line's values), evaluate, run TBA, save, evaluate again, and write results.json."""
    eval_cfg, tldr = configs.task
    cfg = configs.tba
    extra: dict = {}
    out_dir = Path(cfg.output_dir)
    if preset == "tiny":
        setup = tiny_setup(out_dir, seed=cfg.seed, model=cfg.model)
        cfg = dataclasses.replace(cfg, model=setup["model"])
        train, test = setup["train"], setup["test"]
        reward, judge = setup["reward"], setup["judge"]
        extra["reward_model_agreement"] = setup["reward_model_agreement"]
        print(f"reward model agrees with the gold scorer on {setup['reward_model_agreement']:.3f}")
    else:
        # The paper's models of --size, unless given by flag.
        sized = paper_models(tldr.size)
        given = {k: v for k, v in flags.items() if k in sized and v is not None}
        cfg = dataclasses.replace(cfg, **{**sized, **given})
        reward = RewardModelReward(
            tldr.reward_model or paper_reward_model(tldr.size),
            device="cuda" if torch.cuda.is_available() else "cpu",  # a searcher's own GPU
            max_length=MAX_PROMPT_TOKENS + cfg.max_new_tokens + 1,
            completion_suffix=EOS_TEXT,
        )
    configs = dataclasses.replace(configs, tba=cfg)
    if preset != "tiny":  # the data first: missing files are named before any model loads
        train, test = load_tldr(tldr.data_dir)
    tokenizer = launch.tokenizer(cfg)
    if preset != "tiny":
        train = drop_long_prompts(train, tokenizer, MAX_PROMPT_TOKENS, "train")
        test = drop_long_prompts(test, tokenizer, MAX_PROMPT_TOKENS, "validation")
        judge = RewardModelReward(
            tldr.gold_model,
            device=cfg.trainer_device,
            max_length=2 * (MAX_PROMPT_TOKENS + cfg.max_new_tokens),
            completion_suffix=EOS_TEXT,
            tokenizer_path=tldr.gold_tokenizer,
        )
    test = test[: eval_cfg.eval_test_size or None]
    subset = test[: eval_cfg.eval_subset]
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.trainer_device)
    reference = load_causal_lm(
        cfg.ref_model or cfg.model, cfg.torch_dtype(), device, cfg.trust_remote_code
    ).eval()
    evaluator = SummaryEvaluator(cfg, eval_cfg, tokenizer, judge, reference)
    before = evaluator.evaluate(reference, test, "eval before")
    print(
        f"before RL: win rate {before['win_rate']:.3f}, perplexity {before['perplexity']:.3f} "
        f"on {len(test)} posts"
    )

    def on_step(trainer, metrics):
        if eval_cfg.eval_every and trainer.step % eval_cfg.eval_every == 0:
            res = evaluator.evaluate(trainer.whole_model(), subset, "eval (subset)")
            metrics["eval/win_rate"] = res["win_rate"]
            metrics["eval/perplexity"] = res["perplexity"]
            metrics["eval/judge_score"] = res["judge_score"]

    rl_start = time.time()
    with launch.extensions(configs, ranks, on_step) as (cfg, parts, on_step):
        trainer = run_tba(cfg, train, reward, parts=parts, on_step=on_step)
    rl_seconds = time.time() - rl_start
    final = save_final(out_dir, trainer.model, tokenizer)
    after = evaluator.evaluate(trainer.model, test, "eval after")
    evaluator.close()  # its vLLM engine's process, if any
    results = {
        "win_rate_before": before["win_rate"],
        "win_rate_after": after["win_rate"],
        "perplexity_before": before["perplexity"],
        "perplexity_after": after["perplexity"],
        "before": before,
        "after": after,
        **extra,
        "rl_seconds": rl_seconds,
        "wall_seconds": time.time() - wall_start,
        "steps": trainer.step,
        "preset": preset,
        "test_size": len(test),
        "checkpoint": str(final),
        "summary": run_summary(out_dir, cfg.mop_prob),
        "config": launch.config_dict(configs),
    }
    results_path = write_results(out_dir, results)
    print(f"curves: {report.plot_run(out_dir)}")
    print_summary(results["summary"])
    print(
        f"win rate against the references: {results['win_rate_before']:.3f} -> "
        f"{results['win_rate_after']:.3f}; perplexity under the reference: "
        f"{results['perplexity_before']:.3f} -> {results['perplexity_after']:.3f} after "
        f"{trainer.step} steps ({rl_seconds:.0f} s of RL); see {results_path}"
    )
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
