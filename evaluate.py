"""GSM8K-format prompts and their evaluation: greedy accuracy, and pass@n with the diversity of
n sampled answers. The GSM8K job, the tiny task (GSM8K-format sums), the TL;DR job (whose
evaluator generates the same way), the bench and the tests share it.

On CUDA with vLLM installed the evaluator keeps a small vLLM engine beside the trainer and loads
the trainer's weights into it before each evaluation; otherwise it wraps the trainer's model in
the transformers engine (no copy, nothing to load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from rewards import gsm8k_reward
from searcher import HFEngine, VLLMEngine, wants_vllm
from tba import TBAConfig, knob, need, pad_token_id

PROMPT_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"  # official TBA/VinePPO format


def to_examples(rows: list[dict]) -> list[dict]:
    """Rows with a ``question`` -> examples: ``id`` and the formatted ``prompt`` added (what
    searchers need)."""
    return [
        {"id": i, "prompt": PROMPT_TEMPLATE.format(question=r["question"]), **r}
        for i, r in enumerate(rows)
    ]


@dataclass
class EvalConfig:
    """How a job evaluates the policy (evaluate.py)."""

    eval_every: int = knob(
        0, "evaluate on the fixed subset every this many steps (0: before and after only)"
    )
    eval_subset: int = knob(200, "size of the fixed evaluation subset (also pass@n and diversity)")
    eval_test_size: int = knob(0, "test problems scored before and after training (0: all)")
    eval_samples: int = knob(8, "n of pass@n: sampled answers per subset problem, before and after")
    eval_batch_size: int = knob(64, "prompts per generate call during evaluation")
    vllm_eval_memory_utilization: float = knob(
        0.2, "GPU fraction of the vLLM evaluation engine beside the trainer"
    )

    def __post_init__(self) -> None:
        for name in ("eval_every", "eval_subset", "eval_test_size", "eval_samples"):
            need(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        need(
            self.eval_batch_size >= 1, f"--eval_batch_size must be >= 1, got {self.eval_batch_size}"
        )


def distinct_n(texts: list[str], n: int) -> float:
    """Unique word n-grams / all word n-grams over a prompt's sampled answers (diversity)."""
    grams = [tuple(w[i : i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


class Evaluator:
    """Greedy pass@1, and pass@n with distinct-n of n sampled answers, on GSM8K-format examples.

    ``probe`` (checks.ParityProbe, with --parity_check): after each load into the vLLM engine,
    its log-prob of the probe must match the trainer model's, as a searcher's must."""

    def __init__(self, cfg: TBAConfig, eval_cfg: EvalConfig, tokenizer, probe=None):
        self.cfg, self.eval_cfg, self.tokenizer, self.probe = cfg, eval_cfg, tokenizer, probe
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
                memory_utilization=eval_cfg.vllm_eval_memory_utilization,
            )
            if wants_vllm(cfg, self.device)
            else None
        )

    def _engine(self, model: torch.nn.Module):
        if self.vllm is None:
            return HFEngine(self.cfg, self.device, self.eos_id, self.pad_id, model=model)
        self.vllm.load_weights(list(model.named_parameters()))
        if self.probe is not None:
            # Scored as the trainer scores its publishes: in `dtype` when its weights are fp32.
            mixed = model.dtype != self.cfg.torch_dtype()
            with torch.autocast(self.device.type, self.cfg.torch_dtype(), enabled=mixed):
                expected = self.probe.logprob(model, self.pad_id, self.device)
            self.probe.check(self.vllm, expected, "evaluator")
            self.checked_loads += 1
        return self.vllm

    @torch.no_grad()
    def answers(
        self, model: torch.nn.Module, examples: list[dict], n: int, greedy: bool, desc: str
    ) -> list[list[str]]:
        """n decoded answers to each example's prompt (greedy, or sampled at temperature T)."""
        was_training = model.training
        model.eval()
        engine = self._engine(model)
        size = len(examples) if self.vllm is not None else self.eval_cfg.eval_batch_size
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
        """Greedy pass@1: the share of examples whose greedy answer scores 1."""
        answers = self.answers(model, examples, 1, True, desc)
        correct = [gsm8k_reward(a[0], ex) for a, ex in zip(answers, examples, strict=True)]
        return sum(correct) / len(examples)

    def diversity(self, model: torch.nn.Module, examples: list[dict], desc: str = "sample") -> dict:
        """pass@n, mean sample accuracy, distinct-1/2 and distinct answers per problem."""
        n = self.eval_cfg.eval_samples
        if n < 1:
            return {}
        answers = self.answers(model, examples, n, False, desc)
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
