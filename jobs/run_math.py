"""TBA′ on MATH: the paper's last experiment, Qwen2.5-7B at ten steps off-policy, as a job.

    python -m jobs.run_math --preset dry_run           # CPU: the recipe's code paths, tiny model
    python -m jobs.run_math --preset paper --data_dir DIR ...  # 2 nodes x 4 GPUs, docs/tba_prime.md
    python -m jobs.run_math --eval_only runs/math/final --data_dir DIR   # a saved model's accuracy

The released config (bbartoldson/tba-prime, MATH_experiments/TBA_qwen_b005_async10_reset50_IS;
its launcher multinode_launch.sh and configs/training/MATH.toml), row by row in ``PAPER_PRESET``:
Qwen/Qwen2.5-7B, AdamW at lr 1e-6 (weight decay 0.01, gradients clipped at 1), 512 sequences a
step (32 prompts x 16 responses, each sampled and trained), temperature 1, 4,096-token sequences,
420 steps, TBA′'s loss at beta 0.005 with importance sampling, async level 10, the reference
reset every 50 steps (extensions/tba_prime.py); one node of 4 GPUs trains (FSDP, one sequence per
pass, activation checkpointing), the other's 4 GPUs generate with vLLM. Here: the trainer under
torchrun with FSDP2 on one node (extensions/data_parallel.py), four vLLM searchers as Ray actors on
the other (extensions/ray_searchers.py). Where this departs from the released run:
extensions/tba_prime.py's docstring
(the loss), and ``PAPER_PRESET``'s comments (fp32 master weights).

Data: ``--data_dir`` holds ``train.jsonl`` and ``test.jsonl`` in the Hendrycks MATH format,
one problem a line: ``problem``, and ``solution`` whose last ``\\boxed{...}`` is the answer (or
an ``answer`` field, as MATH-500 has); ``level`` and ``type`` are kept. Nothing is downloaded:
the MATH dataset (Hendrycks et al. 2021, MIT licence) is the user's to fetch, and
docs/tba_prime.md shows how to write its per-problem JSON files as these JSONL files.
``data/math/sample.jsonl`` is a 20-problem sample in that format, written for this repository,
which the tests and the dry run use.

The reward (``math_reward``): 1 when the completion's last ``\\boxed{...}`` equals the gold
answer after the normalisation of the MATH paper's own checker (``normalize_answer``: the
Hendrycks rules), else 0.

Outputs in output_dir: metrics.jsonl, results.json, checkpoint.pt, final/.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from extensions import launch, report
from extensions.checks import print_summary, run_summary
from extensions.cli import run_cli
from extensions.evaluate import EvalConfig, Evaluator
from extensions.tba_prime import PRIME_VALUES
from extensions.tiny import CPU_VALUES, build_char_tokenizer, is_cached, save_cached
from plumbing.checkpoint import claimed, save_final, write_results
from plumbing.config import ConfigError, RunError, knob, need
from plumbing.models import load_causal_lm
from tba import TBAConfig
from trainer import run_tba

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- the reward


def last_boxed(text: str) -> str | None:
    """What the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text`` holds, its braces
    matched, or what follows ``\\boxed `` up to a ``$``; None without one (or unclosed)."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):
        return rest[len("\\boxed ") :].split("$")[0].strip()
    opening = rest.find("{")
    if opening < 0:
        return None
    depth = 0
    for i in range(opening, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[opening + 1 : i]
    return None


def normalize_answer(answer: str) -> str:
    """An answer in the normal form of the MATH paper's checker (Hendrycks et al. 2021,
    math_equivalence.py), which compares these strings for equality: line breaks, ``\\!``,
    ``\\left`` / ``\\right``, degrees, ``\\$`` and ``%`` removed; units after ``\\text{ ``
    dropped; ``tfrac`` / ``dfrac`` as ``frac``; a leading ``.`` given its 0; ``x = `` dropped
    before the answer when the name is at most two characters; ``\\sqrt3`` braced; spaces
    removed; ``\\frac12`` braced; ``0.5`` as ``\\frac{1}{2}``; an integer ratio ``a/b`` as
    ``\\frac{a}{b}``. No algebra: 0.875 and 7/8 stay different answers, as in the paper."""
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # units: "5\\text{ inches}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5", "k=2"
        s = sides[1]
    s = _braced_sqrt(s)
    s = s.replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character after an unbraced ``\\sqrt``)."""
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if part and part[0] != "{":
            part = "{" + part[0] + "}" + part[1:]
        out += "\\sqrt" + part
    return out


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}`` (single-character
    arguments); a ``\\frac`` with fewer than two characters after it is left as it is."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        if part and part[0] != "{":
            if len(part) < 2:
                return s
            first, second, rest = part[0], part[1], part[2:]
            part = (
                "{" + first + "}" + (second + rest if second == "{" else "{" + second + "}" + rest)
            )
        out += "\\frac" + part
    return out


def _slash_as_frac(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are integers written plainly."""
    sides = s.split("/")
    if len(sides) != 2:
        return s
    try:
        numerator, denominator = int(sides[0]), int(sides[1])
    except ValueError:
        return s
    if s != f"{numerator}/{denominator}":
        return s
    return f"\\frac{{{numerator}}}{{{denominator}}}"


def is_equiv(predicted: str | None, gold: str | None) -> bool:
    """The MATH checker's equivalence: equal normal forms (``normalize_answer``); no answer is
    never right."""
    if predicted is None or gold is None:
        return False
    return normalize_answer(predicted) == normalize_answer(gold)


def math_gold(example: dict) -> str:
    """The gold answer of a row: its ``answer``, else the last ``\\boxed{}`` of its
    ``solution``; a row with neither is a ValueError (bad data)."""
    answer = example.get("answer")
    if isinstance(answer, str) and answer.strip():
        return answer
    boxed = last_boxed(example.get("solution", ""))
    if boxed is None:
        raise ValueError(f"MATH row has no answer and no \\boxed{{}} solution: {example!r:.200}")
    return boxed


def math_reward(completion: str, example: dict) -> float:
    """1.0 when the completion's last ``\\boxed{...}`` is equivalent to the row's gold answer
    (``is_equiv``), else 0.0. Never raises on a completion."""
    return 1.0 if is_equiv(last_boxed(completion), math_gold(example)) else 0.0


class MathEvaluator(Evaluator):
    """Greedy accuracy and pass@n on MATH problems, by ``math_reward``."""

    answer_reward = staticmethod(math_reward)


# ----------------------------------------------------------------------------- data

PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.\n"
SAMPLE = REPO / "data" / "math" / "sample.jsonl"


def read_math_jsonl(path: Path) -> list[dict]:
    """Rows of a Hendrycks-format MATH JSONL file (module docstring), each with its gold
    ``answer`` filled in; a missing file or a bad row is a RunError naming the file and line."""
    if not path.is_file():
        raise RunError(
            f"MATH file not found: {path} (--data_dir names a directory holding train.jsonl and "
            "test.jsonl in the Hendrycks format; docs/tba_prime.md)"
        )
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not str(row.get("problem", "")).strip():
                raise RunError(f"{path}:{lineno}: expected an object with a 'problem'")
            try:
                row["answer"] = math_gold(row)
            except ValueError:
                raise RunError(
                    f"{path}:{lineno}: no 'answer' and no \\boxed{{}} in 'solution'"
                ) from None
            rows.append(row)
    if not rows:
        raise RunError(f"{path}: no problems")
    return rows


def to_examples(rows: list[dict]) -> list[dict]:
    """Rows -> examples: ``id`` and the ``prompt`` added."""
    return [
        {"id": i, "prompt": PROMPT.format(problem=r["problem"]), **r} for i, r in enumerate(rows)
    ]


def load_math(data_dir: str) -> tuple[list[dict], list[dict]]:
    """(train, test) examples of ``data_dir``; ``sample``: the shipped sample, as both."""
    if data_dir == "sample":
        rows = read_math_jsonl(SAMPLE)
        return to_examples(rows), to_examples(rows)
    path = Path(data_dir)
    return (
        to_examples(read_math_jsonl(path / "train.jsonl")),
        to_examples(read_math_jsonl(path / "test.jsonl")),
    )


def drop_long(examples: list[dict], tokenizer, max_seq_len: int, max_new_tokens: int) -> list:
    """The examples whose prompt leaves ``max_new_tokens`` within ``max_seq_len`` tokens (the
    released run's 4,096-token sequences); says how many were dropped."""
    kept = [
        ex
        for ex in examples
        if len(tokenizer(ex["prompt"])["input_ids"]) + max_new_tokens <= max_seq_len
    ]
    if len(kept) < len(examples):
        print(f"dropped {len(examples) - len(kept)} problems longer than the sequence budget")
    if not kept:
        raise RunError(f"no problem fits --max_seq_len {max_seq_len}")
    return kept


@dataclass
class MathConfig:
    """The MATH job's data and budget (jobs/run_math.py)."""

    data_dir: str = knob("sample", "train.jsonl and test.jsonl, Hendrycks format; sample: ours")
    max_seq_len: int = knob(
        4096, "prompt + response tokens at most (released: 4,096); longer prompts are dropped"
    )
    evaluate: bool = knob(
        True,
        "greedy accuracy on the test set before and after training, in this process (off in "
        "the paper preset: its evaluator would share rank 0's GPU; --eval_only afterwards)",
    )
    eval_only: str = knob("", "a saved model to evaluate on the test set, and nothing else")

    def __post_init__(self) -> None:
        need(self.max_seq_len >= 2, f"--max_seq_len must be >= 2, got {self.max_seq_len}")


# ----------------------------------------------------------------------------- presets

# Qwen/Qwen2.5-7B's config.json, the shapes the memory plan counts (transformers' meta model of
# this config holds 7,615,616,512 parameters, as ``parameters`` counts).
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
# The released TBA′ MATH run (module docstring) as this job's flags, on two nodes of 4 GPUs:
# torchrun's 4 ranks train with FSDP2 on node 1 (cuda:0-3), four vLLM searchers run as Ray
# actors on node 2 (docs/tba_prime.md has the launch, and the memory plan behind each value).
PAPER_PRESET: dict = dict(
    PRIME_VALUES,  # TBA′'s loss as released, AdamW's betas, async level 10, reset every 50
    model="Qwen/Qwen2.5-7B",
    num_generations=16,
    responses_per_prompt=16,
    prompts_per_step=32,  # 512 sequences a step (bs=512)
    searcher_batch_prompts=8,  # 4 searchers x 8 prompts: one step's batch a round
    temperature=1.0,  # PRIME-RL's sampling default
    max_new_tokens=3584,  # 4,096-token sequences; prompts over 512 tokens are dropped
    beta_start=0.005,
    beta_end=0.005,
    beta_anneal_steps=0,
    lr=1e-6,
    weight_decay=0.01,  # PRIME-RL's AdamW (its betas, 0.9 and 0.99: PRIME_VALUES)
    max_grad_norm=1.0,
    warmup_steps=0,
    stable_steps=420,
    decay_steps=0,
    total_steps=420,
    # lr 1e-6 moves a bf16 weight only below |w| ~ 4e-4 (tba.py, fp32_master_weights): fp32
    # weights and moments, sharded, with bf16 compute
    fp32_master_weights=True,
    dtype="bfloat16",
    gradient_checkpointing=True,  # the released ac_ckpt
    micro_batch_size=1,  # one response a pass (micro_bs = 1), a prompt's 16 split over passes
    prime_kl_from="asymmetric",  # as released; a prompt's responses may be split over passes
    fsdp=True,
    trainer_device="cuda:0",  # local rank r on cuda:r
    num_searchers=4,
    searcher_devices="cuda",  # each Ray actor sees its own GPU as cuda
    ray_resources="searcher=1",  # offered by node 2 only (docs/tba_prime.md)
    engine="vllm",
    vllm_gpu_memory_utilization=0.6,  # what the searcher's GPU has beside the reference
    weight_store="shared_memory",  # publishes gathered to rank 0's CPU, then Ray's store
    barrier_lag=-1,
    max_train_lag=-1,
    checkpoint_every=50,
    timeout_s=3600.0,  # a step of 512 sequences of up to 4,096 tokens takes minutes
    evaluate=False,
    eval_every=0,
    output_dir="runs/math",
)
# The recipe's code paths on a CPU (tests/test_math.py runs it): a random Qwen2-architecture
# model of a few thousand parameters over the character tokenizer, the paper preset's algorithm
# (TBA′'s loss as released, one response a pass, importance sampling, the async level,
# the reference reset, here every 2 steps so that a run of 4 sees one) at a CPU's size.
DRY_RUN_PRESET: dict = dict(
    {k: v for k, v in PAPER_PRESET.items() if k not in ("fsdp", "ray_resources")},
    **CPU_VALUES,
    model="",  # built in output_dir/dry_run_model
    prompts_per_step=4,
    searcher_batch_prompts=4,
    max_new_tokens=32,
    total_steps=4,
    ref_reset_every=2,
    lr=1e-3,
    evaluate=True,
    eval_test_size=8,
    eval_subset=8,
    eval_samples=0,
    eval_batch_size=8,
    timeout_s=300.0,
    checkpoint_every=0,
    output_dir="runs/math_dry_run",
)
DRY_RUN_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, as Qwen2.5-7B's 28 heads over 4
    tie_word_embeddings=False,
)


def dry_run_model(path: Path) -> str:
    """A random Qwen2-architecture model of ``DRY_RUN_MODEL``'s shapes over the character
    tokenizer, saved to ``path`` (cached)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if is_cached(path):
        return str(path)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=PAPER_PRESET["max_new_tokens"] + 512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **DRY_RUN_MODEL,
    )
    return save_cached(path, Qwen2ForCausalLM(config), tokenizer)


# ----------------------------------------------------------------------------- memory plan

GPU_GB = 80.0  # an A100 or H100 of 80 GB
HEADROOM = 0.95  # of a GPU's memory, planned (launch.HEADROOM: the allocator's fragmentation)
CUDA_CONTEXT_GB = 3.0  # the CUDA context, NCCL's buffers and kernels' workspaces, per process


def parameters(shape: dict) -> dict[str, int]:
    """Parameter counts of a Qwen2 model of ``shape`` (QWEN25_7B's keys): each decoder layer
    (attention with q, k, v biases; the gated MLP; two norms), the embedding, the head."""
    h, inner = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    layer = attention + 3 * h * inner + 2 * h
    embedding = shape["vocab_size"] * h
    head = 0 if shape["tie_word_embeddings"] else embedding
    total = shape["num_hidden_layers"] * layer + embedding + head + h  # + the final norm
    return {"layer": layer, "embedding": embedding, "head": head, "total": total}


def memory_plan(
    shape: dict = QWEN25_7B,
    ranks: int = 4,
    rows: int = 1,
    seq_len: int = 4096,
    vllm_share: float = PAPER_PRESET["vllm_gpu_memory_utilization"],
    gpu_gb: float = GPU_GB,
) -> dict[str, dict[str, float]]:
    """GB per GPU of the paper preset, worst case (every sequence at ``seq_len`` tokens), for a
    trainer rank and a searcher. A trainer rank under FSDP2 over ``ranks``, fp32 master weights:
      * sharded state: fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter;
      * units gathered while training: the root (embedding, head) and two decoder layers
        (the one computing, the next prefetched), fp32, and their unsharded gradients;
      * the reference, bf16, sharded as the policy (tba_prime.ResetTrainer);
      * a pass of ``rows`` sequences, activation checkpointing: the fp32 residual stream at
        every layer boundary, one layer recomputed (its MLP and attention inputs, bf16, and
        their gradients), the logits (bf16 under autocast, their fp32 copy and its exp for
        the log-softmax, and the fp32 and bf16 gradients: 16 bytes a token a vocabulary entry);
      * the CUDA context.
    A searcher: vLLM's share (``vllm_share``: weights, CUDA graphs, KV cache); the reference
    model, bf16, whole; a reference pass of ``rows`` sequences without gradients (bf16 logits,
    their fp32 copy and exp: 10 bytes a token a vocabulary entry); the CUDA context.
    Publishes go to rank 0's CPU (``--weight_store shared_memory``) and Ray's object store,
    not to a GPU; there is no evaluator during training."""
    gb = 1e9
    n = parameters(shape)
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    layers, inner = shape["num_hidden_layers"], shape["intermediate_size"]
    tokens = rows * seq_len
    root = n["embedding"] + n["head"]
    trainer = {
        "sharded fp32 weights, gradients, AdamW moments": 16 * n["total"] / ranks / gb,
        "gathered units (root + 2 layers) and their gradients": 2
        * 4
        * (root + 2 * n["layer"])
        / gb,
        "reference, bf16, sharded": 2 * n["total"] / ranks / gb,
        "activations at layer boundaries (fp32)": 4 * tokens * h * layers / gb,
        "one layer recomputed, and its gradients": 2 * 2 * tokens * (3 * inner + 8 * h) / gb,
        "logits, log-softmax and their gradients": 16 * tokens * vocab / gb,
        "CUDA context": CUDA_CONTEXT_GB,
    }
    searcher = {
        "vLLM (weights, CUDA graphs, KV cache)": vllm_share * gpu_gb,
        "reference, bf16, whole": 2 * n["total"] / gb,
        "reference pass: logits and log-softmax": 10 * tokens * vocab / gb,
        "CUDA context": CUDA_CONTEXT_GB,
    }
    plan = {"trainer rank": trainer, "searcher": searcher}
    for side in plan.values():
        side["total"] = sum(side.values())
    return plan


def check_memory_plan(plan: dict, gpu_gb: float = GPU_GB) -> None:
    """A ConfigError naming the side that does not fit ``HEADROOM`` of the GPU."""
    for side, parts in plan.items():
        need(
            parts["total"] <= HEADROOM * gpu_gb,
            f"the {side} needs {parts['total']:.1f} GB, over {HEADROOM:.0%} of a "
            f"{gpu_gb:.0f} GB GPU",
        )


# ----------------------------------------------------------------------------- main


def choose_preset(name: str) -> dict:
    return {"paper": PAPER_PRESET, "dry_run": DRY_RUN_PRESET}[name]


def main(argv: list[str] | None = None) -> dict:
    parser = launch.argparser(
        "TBA′ on MATH. Every config field is a flag; --preset sets the base.",
        ["dry_run", "paper"],
        EvalConfig,
        MathConfig,
    )
    args = parser.parse_args(argv)
    preset = args.preset
    wall_start = time.time()
    configs = launch.parse(args, choose_preset(preset), EvalConfig, MathConfig)
    cfg: TBAConfig = configs.tba
    eval_cfg, math_cfg = configs.task
    torch.set_num_threads(cfg.torch_threads or torch.get_num_threads())
    if preset == "paper":
        check_memory_plan(memory_plan(rows=cfg.micro_batch_size or cfg.responses_per_prompt))
    if not cfg.model and preset != "dry_run" and not math_cfg.eval_only:
        raise ConfigError("--model: the paper preset names Qwen/Qwen2.5-7B")
    ranks = launch.torchrun(configs)  # under torchrun, ranks > 0 train in here, then return
    if ranks is not None and ranks.rank > 0:
        return {}
    if math_cfg.eval_only:  # writes nothing: the run it evaluates may be in output_dir
        return evaluate_only(cfg, eval_cfg, math_cfg)
    with claimed(cfg):  # output_dir: refused if it holds another run, before any write there
        return train_and_evaluate(configs, preset, ranks, wall_start)


def problems(cfg: TBAConfig, eval_cfg: EvalConfig, math_cfg: MathConfig, tokenizer):
    """(train, test, subset): the problems of --data_dir within the sequence budget, the test
    problems cut to --eval_test_size and the subset evaluated during training."""
    train, test = load_math(math_cfg.data_dir)
    budget = dict(max_seq_len=math_cfg.max_seq_len, max_new_tokens=cfg.max_new_tokens)
    train, test = (drop_long(rows, tokenizer, **budget) for rows in (train, test))
    test = test[: eval_cfg.eval_test_size or None]
    return train, test, test[: eval_cfg.eval_subset]


def evaluate_only(cfg: TBAConfig, eval_cfg: EvalConfig, math_cfg: MathConfig) -> dict:
    """--eval_only: the greedy accuracy of a saved model on the test problems (the tokenizer
    of --model, else the saved model's)."""
    tokenizer = launch.tokenizer(dataclasses.replace(cfg, model=cfg.model or math_cfg.eval_only))
    _, test, _ = problems(cfg, eval_cfg, math_cfg, tokenizer)
    evaluator = MathEvaluator(
        dataclasses.replace(cfg, model=math_cfg.eval_only), eval_cfg, tokenizer
    )
    # a vLLM evaluator takes the weights from the CPU (its engine holds the GPU's copy)
    where = torch.device("cpu") if evaluator.vllm is not None else evaluator.device
    model = load_causal_lm(math_cfg.eval_only, cfg.torch_dtype(), where, cfg.trust_remote_code)
    accuracy = evaluator.accuracy(model, test, "eval (greedy)")
    evaluator.close()
    print(f"greedy accuracy of {math_cfg.eval_only}: {accuracy:.4f} on {len(test)} problems")
    return {"accuracy": accuracy, "test_size": len(test)}


def train_and_evaluate(configs, preset: str, ranks, wall_start: float) -> dict:
    """The dry run's model (unless --model), evaluate, run TBA′, save, evaluate again, and
    write results.json."""
    cfg: TBAConfig = configs.tba
    eval_cfg, math_cfg = configs.task
    out_dir = Path(cfg.output_dir)
    if not cfg.model:  # the dry run's: main refuses the paper preset without one
        cfg = dataclasses.replace(cfg, model=dry_run_model(out_dir / "dry_run_model"))
        configs = dataclasses.replace(configs, tba=cfg)
    tokenizer = launch.tokenizer(cfg)
    train, test, subset = problems(cfg, eval_cfg, math_cfg, tokenizer)
    evaluator = None
    before = {}
    if math_cfg.evaluate:
        evaluator = MathEvaluator(cfg, eval_cfg, tokenizer, probe=launch.parity_probe(configs))
        initial = load_causal_lm(
            cfg.model, cfg.torch_dtype(), torch.device(cfg.trainer_device), cfg.trust_remote_code
        )
        before["accuracy_before"] = evaluator.accuracy(initial, test, "eval before (greedy)")
        del initial
        print(f"greedy accuracy before RL: {before['accuracy_before']:.4f} on {len(test)}")

    def on_step(trainer, metrics):
        if (
            evaluator is not None
            and eval_cfg.eval_every
            and trainer.step % eval_cfg.eval_every == 0
        ):
            metrics["eval/accuracy"] = evaluator.accuracy(trainer.whole_model(), subset, "eval")

    rl_start = time.time()
    with launch.extensions(configs, ranks, on_step) as (run_cfg, parts, on_step):
        trainer = run_tba(run_cfg, train, math_reward, parts=parts, on_step=on_step)
    rl_seconds = time.time() - rl_start
    final = save_final(out_dir, trainer.model, tokenizer)
    after = {}
    if evaluator is not None:
        after["accuracy_after"] = evaluator.accuracy(trainer.model, test, "eval after (greedy)")
        evaluator.close()
    summary = run_summary(out_dir, cfg.mop_prob)
    results = {
        **before,
        **after,
        "rl_seconds": rl_seconds,
        "wall_seconds": time.time() - wall_start,
        "steps": trainer.step,
        "preset": preset,
        "test_size": len(test),
        "checkpoint": str(final),
        "summary": summary,
        "config": launch.config_dict(configs),
    }
    write_results(out_dir, results)
    print(f"curves: {report.plot_run(out_dir)}")
    if after:
        print(
            f"greedy accuracy: {results['accuracy_before']:.4f} -> {results['accuracy_after']:.4f}"
            f" after {trainer.step} steps ({rl_seconds:.0f} s of RL)"
        )
    print_summary(summary)
    return results


if __name__ == "__main__":
    sys.exit(run_cli(main))
