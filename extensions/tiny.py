"""The tiny task: GSM8K-format sums made in code, a character tokenizer and a tiny Llama built
in code, a supervised warm start, and the preset that runs TBA on them on a CPU in minutes.
Every job's tiny preset, the bench and the tests start from here; nothing is downloaded.

    python run_gsm8k.py --preset tiny        # the whole system on this task (docs/tiny.md)
"""

from __future__ import annotations

import argparse
import random
import string
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from extensions.checks import sequence_logprobs
from extensions.cli import configs_from_args
from extensions.evaluate import EvalConfig, Evaluator, to_examples
from plumbing.checkpoint import write_dir_atomic
from plumbing.logprobs import pad_sequences
from tba import TBAConfig

# Offline CPU run: a tiny Llama warm-started on synthetic sums, then TBA with 1 searcher. Tuned
# for time to accuracy on a 2-core CPU (docs/tiny.md, "How the tiny preset was tuned"):
# publishing every step, training on data at most two versions old, and at most one step per
# batch generated (docs/tiny.md, "Which data a step picks": with a bound of one version the
# trainer, twice the searcher's speed, fell in two seeds of five into a schedule that trained
# each batch twice and wasted every other one).
# One CPU: fp32, trainer and searcher on ``cpu``, the transformers engine (vLLM eager where it
# is chosen: compiling costs start-up and gains a CPU no speed), shared-memory weights, and one
# torch thread per process (tiny ops: a 2nd thread only spins, and slows badly when a core is busy).
CPU_VALUES: dict = dict(
    dtype="float32",
    trainer_device="cpu",
    searcher_devices="cpu",
    engine="hf",
    vllm_compile=False,
    weight_store="shared_memory",
    num_searchers=1,
    torch_threads=1,
)
TINY_PRESET: dict = dict(
    CPU_VALUES,
    model="",
    num_generations=8,
    responses_per_prompt=8,
    prompts_per_step=16,
    searcher_batch_prompts=16,
    temperature=0.7,
    max_new_tokens=24,
    lr=2e-4,
    warmup_steps=5,
    stable_steps=10_000,
    decay_steps=0,
    total_steps=400,
    beta_start=0.05,
    beta_end=0.05,
    beta_anneal_steps=0,
    mop_prob=0.95,
    publish_every=1,
    barrier_lag=2,
    max_train_lag=2,
    replay_ratio=1.0,
    buffer_capacity=32,
    initial_samples=128,
    queue_size=4,
    seed=0,
    output_dir="runs/tiny",
    tempered_logprobs=False,
    eos_in_logprob=True,
    max_grad_norm=1.0,
    micro_batch_size=0,  # one forward pass a step: sixteen groups of short sums fit at once
    # TB's trust region by the core's rule (tba.tb_loss) at 0.05 nats: it drops the gradient of
    # the items the previous update already moved in the direction they are pushed, so a step
    # teaches more than a plain one, and widens with the data's lag, so data up to 256 versions
    # old keeps teaching (docs/staleness.md, "One rule for every age").
    tb_clip_eps=0.05,
    eval_every=50,
    eval_subset=200,
    eval_samples=8,
    eval_batch_size=100,
    checkpoint_every=100,  # four a run: a checkpoint costs several steps' time here
    timeout_s=300.0,
)
# The jobs' tiny presets also check that every weight load arrived (extensions/checks.py): the probe
# costs nothing measurable here (0.11 s a step with and without it, 150 steps of GSM8K tiny).
TINY_CHECKS: dict = dict(parity_check=True)
TINY_DATA = dict(train=4000, test=200, digits=2)  # synthetic problems (train / held-out test)
TINY_MODEL = dict(hidden=64, layers=2, heads=2)  # tiny Llama over the char vocabulary
# Supervised warm start: stop once greedy accuracy on a validation set (not the test set)
# reaches `target`, so RL starts from a model that is clearly imperfect but not hopeless.
# Addition is learned abruptly (0.4 -> 0.8 within 50 steps), so validation gets frequent near it.
TINY_WARM_START = dict(
    max_steps=4000,
    lr=3e-3,
    batch=32,
    target=0.6,
    check_every=50,
    check_every_near=10,
    near=0.2,
    val=100,
)


# The harder tiny task, tools/bench.py's second time-to-accuracy task: three-digit sums,
# warm-started only to 0.4 on validation (0.335 on the test sums), from where on-policy TB lifts
# greedy accuracy slowly, to 0.42-0.44 after 600-1000 steps (lr 2e-4 and 5e-4 alike, one seed each):
# room to learn for a thousand steps and more, where the tiny task is near its plateau of
# 0.88-0.91 within a few hundred. 400 test sums: its gains are small beside the evaluation's
# noise, which falls as 1 / sqrt(sums).
HARD_DATA = dict(TINY_DATA, digits=3, test=400)
HARD_WARM_START = dict(TINY_WARM_START, target=0.4)
# Its preset: the tiny one's with 32 prompts of 4 responses a step (the same 128 samples): to
# 0.40 1.66x sooner than with 16 x 8 and 0.021 higher over the last minute (five seeds, 120 s;
# docs/tiny.md, "The harder preset's sweep", which also says what it does not explain).
HARD_PRESET = dict(
    TINY_PRESET,
    prompts_per_step=32,
    searcher_batch_prompts=32,
    num_generations=4,
    responses_per_prompt=4,
    max_new_tokens=32,
    output_dir="runs/tiny_hard",
)


# ----------------------------------------------------------------------------- the task


def build_char_tokenizer():
    """A character-level tokenizer built in code (no hub): specials <pad> <eos> <bos> <unk>,
    then digits, letters, punctuation, space and newline. Saves and loads with transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = sorted(set(string.digits + string.ascii_letters + string.punctuation + " \n"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )


def synthetic_problems(count: int, seed: int, digits: int = 2) -> list[dict]:
    """GSM8K-format sums made in code: a question and a worked answer ending in ``#### N``."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(count):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append(
            {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        )
    return rows


def build_tiny_model(
    tokenizer, hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0, tied: bool = True
):
    """A tiny Llama-architecture causal LM from a transformers config (no download). vLLM's CPU
    attention needs a head dimension hidden / heads of at least 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def save_tiny_model(
    path: str | Path, hidden: int = 64, layers: int = 2, heads: int = 2, tied: bool = True
) -> str:
    """Build the character tokenizer and a tiny Llama over it and save both to ``path`` (for
    tests, benchmarks and ``--model``); returns the path as a string."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden=hidden, layers=layers, heads=heads, tied=tied)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_task(data: dict | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """The (train, test, validation) examples of a tiny task (``TINY_DATA`` by default, read
    at the call so that a test can shorten it; ``HARD_DATA``): disjoint seeds, the same
    digits."""
    if data is None:
        data = TINY_DATA
    digits = data["digits"]
    train = to_examples(synthetic_problems(data["train"], seed=1, digits=digits))
    test = to_examples(synthetic_problems(data["test"], seed=2, digits=digits))
    val = to_examples(synthetic_problems(TINY_WARM_START["val"], seed=3, digits=digits))
    return train, test, val


def tiny_configs(
    model: str, preset: dict = TINY_PRESET, **overrides
) -> tuple[TBAConfig, EvalConfig]:
    """The TBAConfig and EvalConfig of ``preset`` (a tiny preset: its keys are fields of the
    two) for ``model``, with ``overrides``: what the bench and the tests run without a command
    line."""
    values = {**preset, "model": model, **overrides}
    cfg, eval_cfg = configs_from_args(argparse.Namespace(), values, TBAConfig, EvalConfig)
    return cfg, eval_cfg


def cpu_config(model: str, **overrides) -> TBAConfig:
    """A TBAConfig of ``CPU_VALUES`` for ``model``; ``overrides`` set any other field."""
    values = dict(CPU_VALUES, model=model)
    values.update(overrides)
    return TBAConfig(**values)


# ----------------------------------------------------------------------------- warm start

# Written last into a cached model's directory: without it the directory is no cache (a save
# that died part-way, or one of an older version of this code), and is written again.
CACHE_MARKER = "cache_complete"


def is_cached(path: Path) -> bool:
    """Whether ``path`` holds a model ``save_cached`` finished (its marker is there)."""
    return (Path(path) / CACHE_MARKER).is_file()


def save_cached(path: Path, model, tokenizer) -> str:
    """``model`` and ``tokenizer`` saved to ``path`` as a cache: whole or not at all
    (``plumbing.checkpoint.write_dir_atomic``), with ``CACHE_MARKER`` written last; returns the
    path as a string."""

    def fill(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        (directory / CACHE_MARKER).write_text("saved whole\n")

    write_dir_atomic(path, fill)
    return str(path)


def supervised_warm_start(
    path: Path,
    tokenizer,
    rows: list[tuple[list[int], list[int]]],
    spec: dict,
    seed: int,
    desc: str,
    check: Callable[[torch.nn.Module], float] | None = None,
) -> str:
    """The tiny Llama over ``tokenizer`` trained supervised on ``rows`` (prompt ids, response ids
    ending in EOS): token-mean NLL of ``spec["batch"]`` rows a step, AdamW at ``spec["lr"]``,
    gradients clipped to 1.0, for at most ``spec["max_steps"]`` steps. With ``check`` (the
    model -> a validation score), every ``spec["check_every"]`` steps (``check_every_near`` once
    the score reaches ``near``) until the score reaches ``spec["target"]``. Saved to ``path`` --
    cached (``save_cached``): a rerun loads instead of training again. Every tiny job's warm
    start is this."""
    if is_cached(path):
        print(f"{desc}: cached at {path}")
        return str(path)
    model = build_tiny_model(tokenizer, seed=seed, **TINY_MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(range(spec["max_steps"]), desc=desc, dynamic_ncols=True)
    score = 0.0
    for step in bar:
        idx = torch.randint(len(rows), (spec["batch"],), generator=gen).tolist()
        ids, attn, resp = pad_sequences(
            [rows[i][0] for i in idx], [rows[i][1] for i in idx], tokenizer.pad_token_id
        )
        model.train()  # check() evaluates in eval mode
        loss = -sequence_logprobs(model, ids, attn, resp).sum() / resp.sum()  # token-mean NLL
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(nll=f"{loss.item():.3f}", check=f"{score:.2f}")
        if check is None:
            continue
        near = score >= spec.get("near", float("inf"))
        if (step + 1) % (spec["check_every_near"] if near else spec["check_every"]) == 0:
            score = check(model)
            if score >= spec["target"]:
                break
    bar.close()
    return save_cached(path, model, tokenizer)


def answer_rows(tokenizer, examples: list[dict], key: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, ids of ``example[key]`` + EOS) of each example: supervised_warm_start's rows."""
    return [
        (
            tokenizer(ex["prompt"])["input_ids"],
            tokenizer(ex[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
        )
        for ex in examples
    ]


def tiny_evaluator(tokenizer, preset: dict = TINY_PRESET) -> Evaluator:
    """The evaluator of a tiny preset's greedy answers (its answer length and batch)."""
    cfg = cpu_config("", max_new_tokens=preset["max_new_tokens"])
    return Evaluator(cfg, EvalConfig(eval_batch_size=preset["eval_batch_size"]), tokenizer)


def tiny_warm_start(
    out_dir: Path,
    train: list[dict],
    val: list[dict],
    seed: int,
    spec: dict = TINY_WARM_START,
    preset: dict = TINY_PRESET,
) -> str:
    """The GSM8K tiny warm start: supervised on worked answers until greedy accuracy on ``val``
    (answers as long as ``preset``'s) reaches ``spec["target"]``; in ``out_dir/warm_start``
    (cached)."""
    tokenizer = build_char_tokenizer()
    evaluator = tiny_evaluator(tokenizer, preset)
    return supervised_warm_start(
        out_dir / "warm_start",
        tokenizer,
        answer_rows(tokenizer, train, "answer"),
        spec,
        seed,
        "warm start",
        check=lambda model: evaluator.accuracy(model, val, "warm start validation"),
    )
