"""Rewards for TBA: a GSM8K exact-answer reward and a reward-model reward.

This file imports nothing from the project, so it can be copied out alone.

The plug-in point
-----------------
A reward is any picklable callable ``reward(completion: str, example: dict) -> float``:

* ``completion`` is the decoded response only (no prompt), special tokens stripped;
* ``example`` is the dataset row the prompt came from (for GSM8K: ``question``, ``answer``...);
* it returns a finite float. The searcher raises a clear error naming the prompt when a reward
  is NaN, infinite or not a number, because a silent bad reward poisons ``r / beta`` in the loss.

It must be picklable (a module-level function, or an object whose state is picklable) because
searchers are started with the ``spawn`` method and receive the reward by pickling.

A reward that runs models (a reward model, a victim and a classifier) should score a whole
generate call at once: give it a method ``batch(completions: list[str], examples: list[dict])
-> list[float]`` (one example per completion, in order), and the searcher calls that once per
batch instead of the callable once per completion. Both must give the same numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number as people write it in math answers: optional sign, digits with optional thousands
# commas ("1,000"), optional decimals. A leading "$" is skipped by the search, so "$18" -> 18.
# Unicode minus (U+2212) appears in some generations; it is normalised before matching.
_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# Final-answer forms, tried in this order; the last match in the text wins within a form.
_FINAL_FORMS = (
    re.compile(r"####\s*\$?\s*(" + _NUMBER + ")"),  # GSM8K's own marker
    re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}"),  # LaTeX answers
    re.compile(r"[Tt]he (?:final )?answer is:?\s*\$?\s*(" + _NUMBER + ")"),
    re.compile(r"(?:^|\n)\s*A:\s*\$?\s*(" + _NUMBER + ")"),
)
# Longest numeral we try to compare; longer digit runs are garbage, not answers (and Decimal of
# a megabyte of digits is slow). GSM8K answers have at most 8 digits.
_MAX_NUMBER_CHARS = 100


def parse_number(text: str) -> Decimal | None:
    """ "1,000" -> 1000, "18.00" -> 18, "-3" -> -3; None when ``text`` is not such a number."""
    text = text.replace(",", "").strip()
    if not text or len(text) > _MAX_NUMBER_CHARS:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_answer(completion: str) -> Decimal | None:
    """The predicted final answer of a completion, or None.

    ``#### N`` when present, else ``\\boxed{N}``, ``The answer is N``, ``A: N``, else the last
    number in the text (the rule of the official TBA GSM8K reward).
    """
    if not isinstance(completion, str):
        return None
    text = completion.replace("\u2212", "-")
    for form in _FINAL_FORMS:
        matches = form.findall(text)
        if matches:
            return parse_number(matches[-1])
    numbers = _NUMBER_RE.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def gsm8k_gold(example: dict) -> Decimal:
    """The gold number of a GSM8K row (``answer`` ends with ``#### N``); raises on a bad row."""
    answer = example.get("answer") if isinstance(example, dict) else None
    if not isinstance(answer, str) or "####" not in answer:
        raise ValueError(f"GSM8K example has no '#### N' gold answer: {str(example)[:200]!r}")
    gold = parse_number(answer.rsplit("####", 1)[1].replace("$", ""))
    if gold is None:
        raise ValueError(f"GSM8K gold answer is not a number: {answer.rsplit('####', 1)[1]!r}")
    return gold


def gsm8k_reward(completion: str, example: dict) -> float:
    """1.0 when the completion's final answer equals the example's gold number, else 0.0.

    Numbers are compared as numbers (``1,000 == 1000``, ``18.00 == 18``, ``$18 == 18``). Never
    raises on any completion string; raises ValueError only for an example with no gold number,
    which is a data error that should stop the run.
    """
    gold = gsm8k_gold(example)
    pred = extract_answer(completion)
    return 1.0 if pred is not None and pred == gold else 0.0


class RewardModelReward:
    """Reward from a transformers sequence classifier scoring prompt + completion.

    This is the plug-in for preference tuning (the paper's TL;DR task scores summaries with a
    reward model). The model loads lazily in the process that first calls it, so the object
    pickles cheaply into spawned searchers. ``example[prompt_key]`` is the prompt text; the score
    is logit ``label_index`` of the classifier on prompt + completion + ``completion_suffix``.
    The suffix restores what decoding stripped: TL;DR reward models were trained, and are
    evaluated, on summaries that end in the EOS text (``<|endoftext|>``). ``tokenizer_path``
    names the tokenizer when the model's repository has none (empty: ``model_path``); a
    tokenizer without a pad token pads with EOS, as the released TL;DR evaluation does.
    """

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

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_model"] = state["_tokenizer"] = None  # never pickle weights into a child
        return state

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(
            self.tokenizer_path or self.model_path, trust_remote_code=self.trust_remote_code
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
        import torch

        if self._model is None:
            self._load()
        texts = [
            ex[self.prompt_key] + c + self.completion_suffix
            for c, ex in zip(completions, examples, strict=True)
        ]
        batch = self._tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        ).to(self.device)
        with torch.no_grad():
            logits = self._model(**batch).logits
        return logits[:, self.label_index].float().tolist()
