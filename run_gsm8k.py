"""The main job: TBA on GSM8K -- the paper preset on 4xA100, or an offline tiny preset on a CPU.

    python run_gsm8k.py                      # auto: paper preset with CUDA GPUs, else tiny
    python run_gsm8k.py --preset tiny        # offline, CPU, synthetic GSM8K-format problems
    python run_gsm8k.py --preset smoke       # the paper preset for 10 steps: does it fit?
    python run_gsm8k.py --help               # every TBAConfig field is a flag
    python run_gsm8k.py --join HOST:PORT     # a searcher node of a trainer run with --listen

GSM8K ships in data/gsm8k (OpenAI's JSONL, MIT licence); --data_dir points elsewhere.

Presets are dicts of TBAConfig values; any explicit flag overrides them. Outputs in output_dir:
metrics.jsonl, results.json, checkpoint.pt (resumable) and final/ (model and tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import string
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from rewards import gsm8k_gold, gsm8k_reward
from searcher import HFEngine, ParityProbe, VLLMEngine, wants_vllm
from tba import (
    TBAConfig,
    config_argparser,
    config_from_args,
    load_causal_lm,
    pad_sequences,
    pad_token_id,
    sequence_logprobs,
)
from trainer import NODE_FIELDS, DataParallel, NodeError, node_main, run_tba

PROMPT_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"  # official TBA/VinePPO format

REPO = Path(__file__).resolve().parent

# The paper's GSM8K setup is TBAConfig's defaults; it only needs GPU placement (see main).
PAPER_PRESET: dict = {}
# First contact with a GPU box: the paper preset for ten steps, evaluated on 50 test problems,
# with the parity check after every weight load; then a summary of seconds per step, peak memory
# per process, realised m and lag, and whether the weights reached every engine.
SMOKE_PRESET: dict = dict(
    total_steps=10,
    eval_test_size=50,
    eval_subset=50,
    eval_samples=0,
    parity_check=True,
    output_dir="runs/smoke",
)

# Offline CPU run: a tiny Llama warm-started on synthetic sums, then TBA with 1 searcher. Tuned
# for time to accuracy on a 2-core CPU (README, "How the tiny preset was tuned"): publishing every
# step, and training only on data at most one version old, which the staleness experiment found
# free per step (README, "Why TB for asynchrony, measured"), while searcher and trainer still
# overlap.
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
    sync_every=1,
    max_lag=1,
    max_train_lag=1,
    buffer_capacity=32,
    initial_samples=128,
    queue_size=4,
    seed=0,
    output_dir="runs/tiny",
    tempered_logprobs=False,
    eos_in_logprob=True,
    max_grad_norm=1.0,
    eval_every=50,
    eval_subset=200,
    eval_samples=8,
    eval_batch_size=100,
    checkpoint_every=100,  # four a run: a checkpoint costs several steps' time here
    timeout_s=300.0,
)
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


# ----------------------------------------------------------------------------- data


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


def tiny_task() -> tuple[list[dict], list[dict], list[dict]]:
    """The tiny preset's (train, test, validation) examples: disjoint seeds, the same digits."""
    digits = TINY_DATA["digits"]
    train = to_examples(synthetic_problems(TINY_DATA["train"], seed=1, digits=digits))
    test = to_examples(synthetic_problems(TINY_DATA["test"], seed=2, digits=digits))
    val = to_examples(synthetic_problems(TINY_WARM_START["val"], seed=3, digits=digits))
    return train, test, val


def cpu_config(model: str, **overrides) -> TBAConfig:
    """A TBAConfig of ``CPU_VALUES`` for ``model``; ``overrides`` set any other field."""
    values = dict(CPU_VALUES, model=model)
    values.update(overrides)
    return TBAConfig(**values)


def read_gsm8k_jsonl(path: Path) -> list[dict]:
    """OpenAI's GSM8K JSONL; any bad row is a ValueError naming the file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise ValueError(f"{path}:{lineno}: missing or empty field {key!r}")
            try:
                gsm8k_gold(row)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def load_gsm8k(data_dir: str = "data/gsm8k") -> tuple[list[dict], list[dict]]:
    """(train, test) rows of ``data_dir``; a relative path missing from the working directory is
    read from the repository, which ships GSM8K in data/gsm8k."""
    path = Path(data_dir)
    if not path.is_absolute() and not path.exists():
        path = REPO / path
    return read_gsm8k_jsonl(path / "train.jsonl"), read_gsm8k_jsonl(path / "test.jsonl")


def to_examples(rows: list[dict]) -> list[dict]:
    """Rows -> examples: ``id`` and the formatted ``prompt`` added (what searchers need)."""
    return [
        {"id": i, "prompt": PROMPT_TEMPLATE.format(question=r["question"]), **r}
        for i, r in enumerate(rows)
    ]


def check_prompt_lengths(
    examples: list[dict], tokenizer, max_positions: int | None, max_new_tokens: int, name: str
) -> None:
    """Fail before any process starts if a prompt cannot fit the model's context."""
    if not max_positions:
        return
    for ex in examples:
        n = len(tokenizer(ex["prompt"])["input_ids"])
        if n + max_new_tokens > max_positions:
            raise ValueError(
                f"{name} example {ex['id']}: prompt of {n} tokens + max_new_tokens "
                f"{max_new_tokens} exceeds the model context of {max_positions}"
            )


# ----------------------------------------------------------------------------- evaluation


def distinct_n(texts: list[str], n: int) -> float:
    """Unique word n-grams / all word n-grams over a prompt's sampled answers (diversity)."""
    grams = [tuple(w[i : i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


class Evaluator:
    """Greedy pass@1, and pass@n with distinct-n of n sampled answers, on GSM8K-format examples.

    On CUDA with vLLM installed it keeps a small vLLM engine beside the trainer and loads the
    trainer's weights into it before each evaluation (with ``parity_check``, then compares the
    parity probe's log-prob with the trainer's, as a searcher does); otherwise it wraps the
    trainer's model in the transformers engine (no copy, nothing to check)."""

    def __init__(self, cfg: TBAConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.device = torch.device(cfg.trainer_device)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = pad_token_id(tokenizer)
        self.checked_loads = 0  # weight loads into the vLLM engine that passed the parity check
        self.vllm = (
            VLLMEngine(
                cfg,
                self.device,
                self.eos_id,
                cfg.seed,
                memory_utilization=cfg.vllm_eval_memory_utilization,
            )
            if wants_vllm(cfg, self.device)
            else None
        )

    def _engine(self, model: torch.nn.Module, examples: list[dict]):
        if self.vllm is None:
            return HFEngine(self.cfg, self.device, self.eos_id, self.pad_id, model=model)
        self.vllm.load_weights(list(model.named_parameters()))
        if self.cfg.parity_check:
            tokens = self.tokenizer(examples[0]["prompt"])["input_ids"]
            probe = ParityProbe.from_prompt(tokens, self.cfg.parity_tol)
            # Scored as the trainer scores its publishes: in `dtype` when its weights are fp32.
            mixed = model.dtype != self.cfg.torch_dtype()
            with torch.autocast(self.device.type, self.cfg.torch_dtype(), enabled=mixed):
                expected = probe.logprob(model, self.pad_id, self.device)
            probe.check(self.vllm, expected, "evaluator")
            self.checked_loads += 1
        return self.vllm

    @torch.no_grad()
    def _answers(
        self, model: torch.nn.Module, examples: list[dict], n: int, greedy: bool, desc: str
    ) -> list[list[str]]:
        was_training = model.training
        model.eval()
        engine = self._engine(model, examples)
        size = len(examples) if self.vllm is not None else self.cfg.eval_batch_size
        texts = []
        try:
            for i in tqdm(
                range(0, len(examples), size), desc=desc, leave=False, disable=None
            ):  # None: TTY only
                batch = examples[i : i + size]
                outs = engine.generate(
                    [self.tokenizer(ex["prompt"])["input_ids"] for ex in batch], n, greedy=greedy
                )
                texts += [
                    [self.tokenizer.decode(t, skip_special_tokens=True) for t in o] for o in outs
                ]
        finally:
            model.train(was_training)
        return texts

    def accuracy(self, model: torch.nn.Module, examples: list[dict], desc: str = "eval") -> float:
        answers = self._answers(model, examples, 1, True, desc)
        return sum(gsm8k_reward(a[0], ex) for a, ex in zip(answers, examples, strict=True)) / len(
            examples
        )

    def diversity(self, model: torch.nn.Module, examples: list[dict], desc: str = "sample") -> dict:
        """pass@n, mean sample accuracy, distinct-1/2 and distinct answers per problem."""
        n = self.cfg.eval_samples
        if n < 1:
            return {}
        answers = self._answers(model, examples, n, False, desc)
        correct = [
            [gsm8k_reward(a, ex) for a in ans] for ans, ex in zip(answers, examples, strict=True)
        ]
        return {
            f"pass@{n}": sum(max(c) for c in correct) / len(correct),
            "sample_accuracy": sum(map(sum, correct)) / (n * len(correct)),
            "distinct_1": sum(distinct_n(a, 1) for a in answers) / len(answers),
            "distinct_2": sum(distinct_n(a, 2) for a in answers) / len(answers),
            "distinct_answers": sum(len(set(a)) for a in answers) / len(answers),
        }


# ----------------------------------------------------------------------------- tiny warm start


def tiny_warm_start(out_dir: Path, train: list[dict], val: list[dict], seed: int) -> str:
    """Build the tiny model and tokenizer, train them supervised on worked answers until the
    validation accuracy reaches the target, and save them to ``out_dir/warm_start`` -- cached:
    a rerun loads instead of training again."""
    path = out_dir / "warm_start"
    if (path / "config.json").exists():
        print(f"warm start: cached at {path}")
        return str(path)
    spec = TINY_WARM_START
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **TINY_MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    gen = torch.Generator().manual_seed(seed)
    rows = [
        (
            tokenizer(ex["prompt"])["input_ids"],
            tokenizer(ex["answer"], add_special_tokens=False)["input_ids"]
            + [tokenizer.eos_token_id],
        )
        for ex in train
    ]
    cfg = cpu_config(
        "",
        max_new_tokens=TINY_PRESET["max_new_tokens"],
        eval_batch_size=TINY_PRESET["eval_batch_size"],
    )
    evaluator = Evaluator(cfg, tokenizer)
    bar = tqdm(range(spec["max_steps"]), desc="warm start (supervised)", dynamic_ncols=True)
    acc = 0.0
    for step in bar:
        idx = torch.randint(len(rows), (spec["batch"],), generator=gen).tolist()
        ids, attn, resp = pad_sequences(
            [rows[i][0] for i in idx], [rows[i][1] for i in idx], tokenizer.pad_token_id
        )
        model.train()
        loss = -sequence_logprobs(model, ids, attn, resp).sum() / resp.sum()  # token-mean NLL
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % (
            spec["check_every_near"] if acc >= spec["near"] else spec["check_every"]
        ) == 0:
            acc = evaluator.accuracy(model, val, "warm start validation")
            bar.set_postfix(nll=f"{loss.item():.3f}", val_acc=f"{acc:.2f}")
            if acc >= spec["target"]:
                break
    bar.close()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------- main


def choose_preset(name: str) -> tuple[str, dict]:
    """``auto``: paper with CUDA GPUs (GPU 0 trains, the rest search), else tiny."""
    gpus = torch.cuda.device_count()
    if name == "auto":
        name = "paper" if gpus > 0 else "tiny"
        why = f"{gpus} CUDA GPU(s) found" if gpus else "no CUDA GPU found"
        other = "tiny" if name == "paper" else "paper"
        print(f"preset: {name} ({why}); choose the other with --preset {other}")
    if name == "tiny":
        return name, dict(TINY_PRESET)
    values = dict(PAPER_PRESET, **(SMOKE_PRESET if name == "smoke" else {}))
    values.update(gpu_placement(gpus))
    return name, values


def gpu_placement(gpus: int) -> dict:
    """TBAConfig values that place the processes on ``gpus`` CUDA GPUs: GPU 0 trains, each
    other GPU holds a searcher; one GPU is shared (vLLM takes a slice); none: nothing set."""
    if gpus >= 2:
        return dict(
            num_searchers=gpus - 1,
            trainer_device="cuda:0",
            searcher_devices=",".join(f"cuda:{i}" for i in range(1, gpus)),
        )
    if gpus == 1:
        return dict(
            num_searchers=1,
            trainer_device="cuda:0",
            searcher_devices="cuda:0",
            vllm_gpu_memory_utilization=0.35,
        )
    return {}


def run_summary(out_dir: Path, mop_prob: float) -> dict:
    """What a first run on new hardware must tell: seconds per step, the initial fill, peak
    memory of every process, the realised most-on-policy fraction and the lag (metrics.jsonl)."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    peaks = {"trainer": max(r["memory/trainer_peak_gb"] for r in rows)}
    for key in sorted({k for r in rows for k in r if k.endswith("/peak_mem_gb")}):
        peaks[key.split("/")[0]] = max(r[key] for r in rows if key in r)
    return {
        "steps": len(rows),
        "seconds_per_step_median": statistics.median(r["time/step"] for r in rows),
        "initial_fill_s": rows[0]["time/wait"],
        "peak_memory_gb": peaks,
        "mop_frac": statistics.fmean(r["async/mop_frac"] for r in rows),
        "mop_prob": mop_prob,
        "lag_mean": statistics.fmean(r["async/lag_mean"] for r in rows),
        "lag_max": max(r["async/lag_max"] for r in rows),
    }


def weights_verdict(cfg: TBAConfig, out_dir: Path, evaluator: Evaluator) -> str:
    """One line: did the trainer's weights reach every searcher and the evaluator? With
    ``parity_check`` every load is checked and a mismatch stops the run, so a searcher that
    generated with a version above 0 received trained weights intact; version 0 is what its
    engine started from, and proves nothing."""
    if not cfg.parity_check:
        return "weights: not checked (parity_check is off)"
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    confirmed = []
    missing = []
    for rank in range(cfg.num_searchers):
        key = f"searcher{rank}/version"
        newest = max((r[key] for r in rows if key in r), default=None)
        if newest is None:
            missing.append(f"searcher{rank} (no batch arrived)")
        elif newest <= 0:
            missing.append(f"searcher{rank} (only version 0 checked, the weights it started from)")
        else:
            confirmed.append(f"searcher{rank} up to version {newest:.0f}")
    if evaluator.vllm is None:
        evaluated = "the evaluator (it runs the trainer's model itself)"
    elif evaluator.checked_loads == 0:
        missing.append("the evaluator (no vLLM load checked)")
    else:
        evaluated = f"the evaluator ({evaluator.checked_loads} vLLM loads checked)"
    if missing:
        return "weights NOT confirmed for: " + ", ".join(missing)
    return (
        f"weights reached every searcher ({', '.join(confirmed)}; parity checked after every "
        f"load) and {evaluated}"
    )


def print_summary(summary: dict) -> None:
    peaks = ", ".join(f"{name} {gb:.1f} GB" for name, gb in summary["peak_memory_gb"].items())
    print(
        f"run: {summary['steps']} steps, {summary['seconds_per_step_median']:.2f} s/step (median), "
        f"initial fill {summary['initial_fill_s']:.0f} s\n"
        f"peak memory per process: {peaks}\n"
        f"most-on-policy fraction {summary['mop_frac']:.3f} (m = {summary['mop_prob']}), "
        f"lag mean {summary['lag_mean']:.2f}, max {summary['lag_max']:.0f} versions"
    )


def join_as_node(args) -> dict:
    """``--join``: searchers for a trainer on another node, until its run ends."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TBAConfig)}
    try:
        node_main(args.join, {name: value for name, value in given.items() if value is not None})
    except (NodeError, ValueError) as exc:
        raise SystemExit(f"node: {exc}") from None
    return {}


def main(argv: list[str] | None = None) -> dict:
    parser = config_argparser(
        "TBA on GSM8K. Every TBAConfig field is a flag; --preset sets the base."
    )
    parser.add_argument(
        "--preset",
        choices=["auto", "paper", "smoke", "tiny"],
        default="auto",
        help="base values that explicit flags override (auto: paper with CUDA, else "
        "tiny; smoke: paper for 10 steps)",
    )
    parser.add_argument(
        "--join",
        default="",
        metavar="HOST:PORT",
        help="run as a searcher node of the trainer listening there (its --listen): the config, "
        "prompts and reward come from the trainer; a node sets only " + ", ".join(NODE_FIELDS),
    )
    args = parser.parse_args(argv)
    if args.join:
        return join_as_node(args)
    preset, base = choose_preset(args.preset)
    wall_start = time.time()
    # An explicit thread count applies before any torch work here (warm start, first evaluation);
    # run_tba then sets cfg.threads_per_process(), which is the same number when one was given.
    torch.set_num_threads(
        args.torch_threads or base.get("torch_threads") or torch.get_num_threads()
    )
    # Under torchrun, a data-parallel trainer: rank 0 does all of this job, ranks > 0 only train.
    early = config_from_args(args, base)
    dp = DataParallel.from_env(early.trainer_device, early.timeout_s)
    if preset == "tiny":
        out_dir = Path(args.output_dir or base["output_dir"])
        train, test, val = tiny_task()
        model = args.model
        if not model and (dp is None or dp.rank == 0):
            model = tiny_warm_start(out_dir, train, val, seed=args.seed or 0)
        if not args.model and dp is not None:
            model = dp.share_object(model)  # rank 0's warm start
        base["model"] = model
    cfg = config_from_args(args, base)
    if dp is not None and dp.rank > 0:
        run_tba(cfg, [], gsm8k_reward)  # trains its share of every step rank 0 hands out
        dp.close()
        return {}
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if preset != "tiny":
        train, test = (to_examples(rows) for rows in load_gsm8k(cfg.data_dir))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    model_config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    for name, rows in (("train", train), ("test", test)):
        check_prompt_lengths(
            rows,
            tokenizer,
            getattr(model_config, "max_position_embeddings", None),
            cfg.max_new_tokens,
            name,
        )
    test = test[: cfg.eval_test_size or None]
    subset = test[: cfg.eval_subset]
    torch.manual_seed(cfg.seed)

    evaluator = Evaluator(cfg, tokenizer)
    results_path = out_dir / "results.json"
    previous = json.loads(results_path.read_text()) if cfg.resume and results_path.exists() else {}
    if "accuracy_before" in previous:  # a resumed run keeps its first "before"
        before = {k: previous[k] for k in ("accuracy_before", "diversity_before")}
    else:
        initial = load_causal_lm(
            cfg.model, cfg.torch_dtype(), torch.device(cfg.trainer_device), cfg.trust_remote_code
        )
        before = {
            "accuracy_before": evaluator.accuracy(initial, test, "eval before (greedy)"),
            "diversity_before": evaluator.diversity(initial, subset),
        }
        del initial
        results_path.write_text(json.dumps(before, indent=2))
    print(f"greedy accuracy before RL: {before['accuracy_before']:.4f} on {len(test)} problems")

    def on_step(trainer, metrics):
        if cfg.eval_every and trainer.step % cfg.eval_every == 0:
            model = trainer.full_model()  # under --fsdp, gathered by every rank
            metrics["eval/accuracy"] = evaluator.accuracy(model, subset, "eval (subset)")

    rl_start = time.time()
    trainer = run_tba(cfg, train, gsm8k_reward, on_step=on_step)
    rl_seconds = time.time() - rl_start
    if dp is not None:
        dp.close()

    final = out_dir / "final"
    trainer.model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    after = {
        "accuracy_after": evaluator.accuracy(trainer.model, test, "eval after (greedy)"),
        "diversity_after": evaluator.diversity(trainer.model, subset),
    }
    results = {
        **before,
        **after,
        "rl_seconds": rl_seconds,
        "wall_seconds": time.time() - wall_start,
        "steps": trainer.step,
        "resumed": cfg.resume,
        "preset": preset,
        "test_size": len(test),
        "checkpoint": str(final),
        "summary": {
            **run_summary(out_dir, cfg.mop_prob),
            "weights": weights_verdict(cfg, out_dir, evaluator),
        },
        "config": dataclasses.asdict(cfg),
    }
    results_path.write_text(json.dumps(results, indent=2))
    print_summary(results["summary"])
    print(
        f"greedy accuracy: {results['accuracy_before']:.4f} -> {results['accuracy_after']:.4f} "
        f"after {trainer.step} steps ({rl_seconds:.0f} s of RL this run); see {results_path}"
    )
    print(results["summary"]["weights"])
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
