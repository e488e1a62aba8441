"""How the TL;DR job scores summaries (jobs/run_tldr.py): a reward model of the hub
(``RewardModelReward``, the paper's training reward and its gold judge), and the evaluator
(``SummaryEvaluator``: the win rate of greedy summaries against the human references by a judge,
and their perplexity under the reference model)."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from extensions.checks import sequence_logprobs
from extensions.evaluate import EvalConfig, Evaluator
from plumbing.logprobs import pad_sequences
from rewards import LazyModels
from tba import TBAConfig


def win_rate(policy_scores: list[float], reference_scores: list[float]) -> float:
    """Share of posts whose policy summary the judge scores above the reference's; a tie
    counts half (in TL;DR tiny equal summaries score equal, and they are frequent)."""
    if len(policy_scores) != len(reference_scores) or not policy_scores:
        raise ValueError("win_rate: needs two equally long, non-empty lists of scores")
    wins = sum(
        1.0 if p > r else 0.5 if p == r else 0.0
        for p, r in zip(policy_scores, reference_scores, strict=True)
    )
    return wins / len(policy_scores)


class RewardModelReward(LazyModels):
    """Reward from a transformers sequence classifier scoring prompt + completion.

    The paper's TL;DR task scores summaries with a reward model. The model loads in the process
    that first calls it (``rewards.LazyModels``), so the object pickles cheaply into searchers.
    ``example[prompt_key]`` is the prompt text; the score is logit ``label_index`` of the
    classifier on prompt + completion + ``completion_suffix``.
    The suffix restores what decoding stripped: TL;DR reward models were trained, and are
    evaluated, on summaries that end in the EOS text (``<|endoftext|>``). ``tokenizer_path``
    names the tokenizer when the model's repository has none (empty: ``model_path``); a
    tokenizer without a pad token pads with EOS, as the released TL;DR evaluation does.
    """

    _models = ("_model", "_tokenizer")

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        prompt_key: str = "prompt",
        label_index: int = 0,
        max_length: int = 1024,
        trust_remote_code: bool = False,
        completion_suffix: str = "",
        tokenizer_path: str = "",
    ):
        self.model_path = model_path
        self.device = device
        self.prompt_key = prompt_key
        self.label_index = label_index
        self.max_length = max_length
        self.trust_remote_code = trust_remote_code
        self.completion_suffix = completion_suffix
        self.tokenizer_path = tokenizer_path
        self._model = None
        self._tokenizer = None

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self._tokenizer = AutoTokenizer.from_pretrained(
            self.tokenizer_path or self.model_path,
            trust_remote_code=self.trust_remote_code,
        )
        self._model = (
            AutoModelForSequenceClassification.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code
            )
            .to(self.device)
            .eval()
        )
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
            self._model.config.pad_token_id = self._tokenizer.eos_token_id

    def __call__(self, completion: str, example: dict) -> float:
        return self.batch([completion], [example])[0]

    def batch(self, completions: list[str], examples: list[dict]) -> list[float]:
        """Scores of many completions in one padded forward pass (the batched plug-in)."""
        self.loaded()
        texts = [
            ex[self.prompt_key] + c + self.completion_suffix
            for c, ex in zip(completions, examples, strict=True)
        ]
        batch = self._tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_length,
        ).to(self.device)
        with torch.no_grad():
            logits = self._model(**batch).logits
        return logits[:, self.label_index].float().tolist()


class SummaryEvaluator(Evaluator):
    """Greedy summaries of the policy, judged against the references by ``judge`` (a reward
    plug-in with ``batch``: the gold reward model, or TL;DR tiny's gold scorer), and their
    perplexity under ``reference_model``: exp of the mean token NLL of each summary, EOS
    included when generated, averaged over posts (eval_tldr/eval_ppl.py's measure). The
    references' scores are computed once."""

    def __init__(
        self,
        cfg: TBAConfig,
        eval_cfg: EvalConfig,
        tokenizer,
        judge,
        reference_model: torch.nn.Module,
    ):
        super().__init__(cfg, eval_cfg, tokenizer)
        self.judge = judge
        self.reference_model = reference_model
        self._reference_scores: dict[int, float] = {}

    @torch.no_grad()
    def summaries(self, model: torch.nn.Module, examples: list[dict]) -> list[list[int]]:
        was_training = model.training
        model.eval()
        engine = self._engine(model)
        size = len(examples) if self.vllm is not None else self.eval_cfg.eval_batch_size
        out = []
        try:
            for i in range(0, len(examples), size):
                batch = examples[i : i + size]
                prompts = [self.tokenizer(ex["prompt"])["input_ids"] for ex in batch]
                out += [o[0] for o in engine.generate(prompts, 1, greedy=True)]
        finally:
            model.train(was_training)
        return out

    @torch.no_grad()
    def perplexity(self, examples: list[dict], responses: list[list[int]]) -> float:
        model = self.reference_model
        values = []
        size = self.eval_cfg.eval_batch_size
        for i in range(0, len(examples), size):
            prompts = [self.tokenizer(ex["prompt"])["input_ids"] for ex in examples[i : i + size]]
            rows = [r or [self.eos_id] for r in responses[i : i + size]]
            ids, attn, resp = pad_sequences(prompts, rows, self.pad_id, self.device)
            logp = sequence_logprobs(model, ids, attn, resp).float()
            values += torch.exp(-logp / resp[:, 1:].sum(1)).tolist()
        return sum(values) / len(values)

    def evaluate(self, model: torch.nn.Module, examples: list[dict], desc: str = "eval") -> dict:
        """win_rate, tie_rate, mean judge score of policy and references, perplexity, mean
        summary length in tokens."""
        responses = self.summaries(model, examples)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        scores = self.judge.batch(texts, examples)
        todo = [ex for ex in examples if ex["id"] not in self._reference_scores]
        if todo:
            refs = self.judge.batch([ex["reference"] for ex in todo], todo)
            self._reference_scores.update({ex["id"]: s for ex, s in zip(todo, refs, strict=True)})
        ref_scores = [self._reference_scores[ex["id"]] for ex in examples]
        return {
            "win_rate": win_rate(scores, ref_scores),
            "tie_rate": sum(s == r for s, r in zip(scores, ref_scores, strict=True)) / len(scores),
            "judge_score": sum(scores) / len(scores),
            "reference_judge_score": sum(ref_scores) / len(ref_scores),
            "perplexity": self.perplexity(examples, responses),
            "length": sum(map(len, responses)) / len(responses),
            "samples": [
                {"post": ex["prompt"], "summary": t, "reference": ex["reference"]}
                for ex, t in zip(examples[:3], texts[:3], strict=True)
            ],
        }
