"""Rewards for TBA: the plug-in contract, and the GSM8K exact-answer reward.

This file imports nothing from the project, so it can be copied out alone. Other tasks'
rewards live with their jobs.

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
batch instead of the callable once per completion. Both must give the same numbers. Such a
reward loads its models in the searcher process, not in the one that builds it: ``LazyModels``.
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


class LazyModels:
    """Base of a reward (or of a part of one) that runs models: they load in the process that
    first uses them (``loaded()`` calls ``load()`` once), and a pickle carries the settings
    only, never the weights, so the reward travels cheaply into spawned searchers. A subclass
    names the attributes that hold what ``load`` builds in ``_models``, and sets them to None
    in its ``__init__``."""

    _models: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in self._models:
            state[name] = None
        return state

    def loaded(self):
        """``self``, its models loaded (on the first call)."""
        if getattr(self, self._models[0]) is None:
            self.load()
        return self

    def load(self) -> None:
        raise NotImplementedError
