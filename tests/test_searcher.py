"""The searcher's pieces: per-token log-probs, rewards, and the behaviour log-probs the
transformers engine records."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
)

from extensions.tiny import build_char_tokenizer
from rewards import gsm8k_reward
from searcher import Searcher
from tba import group_logprobs, group_token_logprobs, scored_tokens
from test_tba import CumsumLM, loop_logprob


@pytest.mark.parametrize("include_eos", [True, False])
def test_group_token_logprobs_align_with_scored_tokens_and_sum_to_group_logprobs(
    tiny_model_dir, include_eos
):
    """GRPO's per-token log-probs: row b holds log softmax(logits / T) of scored_tokens of its
    response, token by token from column 0 (a loop checks each), padding 0 and masked; rows sum
    to group_logprobs; the shared prompt gives the same tokens."""
    model, eos = CumsumLM(), 10
    prompts, groups = [[1, 2, 3], [4, 5]], [[[6, 7, eos], [8, 9]], [[eos], [3, eos]]]
    kwargs = dict(pad_id=0, eos_id=eos, logprob_temperature=0.7, include_eos=include_eos)
    token_logp, mask = group_token_logprobs(model, prompts, groups, share_prompt=False, **kwargs)
    flat = [(p, r) for p, g in zip(prompts, groups, strict=True) for r in g]
    assert token_logp.shape == mask.shape == (4, 3 if include_eos else 2)
    for row, (p, r) in enumerate(flat):
        scored = scored_tokens(r, eos, include_eos)
        assert mask[row].tolist() == [1] * len(scored) + [0] * (mask.shape[1] - len(scored))
        for j in range(len(scored)):
            want = loop_logprob(model, p + scored[:j], scored[j : j + 1], 0.7)
            assert token_logp[row, j].item() == pytest.approx(want, abs=1e-5)
        assert (token_logp[row, len(scored) :] == 0).all()
    summed = group_logprobs(model, prompts, groups, share_prompt=False, **kwargs)
    torch.testing.assert_close(token_logp.sum(1).view(2, 2), summed)

    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    groups = [[[20, 21, 1], [22, 1], [23, 24, 25, 26]], [[1], [28, 29, 30, 1], [31]]]
    kwargs = dict(pad_id=0, eos_id=1, logprob_temperature=0.7, include_eos=include_eos)
    shared, shared_mask = group_token_logprobs(tiny, prompts, groups, **kwargs)
    plain, plain_mask = group_token_logprobs(tiny, prompts, groups, share_prompt=False, **kwargs)
    assert torch.equal(shared_mask, plain_mask)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
    summed = group_logprobs(tiny, prompts, groups, **kwargs)
    assert torch.equal(shared.sum(1).view(2, 3), summed)  # the very same arithmetic


def test_searcher_takes_any_real_number_as_a_reward_and_names_the_prompt_of_a_bad_one():
    """A user's ``return pred == gold`` (a bool) and numpy-style numbers are rewards; NaN,
    infinities and non-numbers stop the run with the prompt's id."""
    tok = build_char_tokenizer()
    for value, want in ((True, 1.0), (False, 0.0), (3, 3.0), (torch.tensor(0.5).item(), 0.5)):
        stub = types.SimpleNamespace(
            examples=[{"id": 7}], tokenizer=tok, rank=0, reward_fn=lambda c, ex, v=value: v
        )
        assert Searcher.rewards(stub, [0], [[[10, 11]]]) == [[want]]
    for bad in (float("nan"), float("inf"), "1", None):
        stub = types.SimpleNamespace(
            examples=[{"id": 7}], tokenizer=tok, rank=0, reward_fn=lambda c, ex, v=bad: v
        )
        with pytest.raises(ValueError, match=r"reward .* for prompt id 7 is not a finite number"):
            Searcher.rewards(stub, [0], [[[10, 11]]])


class CountingBatchReward:
    """A batched reward: the length of each completion, plus a count of calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, completion, example):
        raise AssertionError("a reward with .batch must be called once per generate call")

    def batch(self, completions, examples):
        self.calls += 1
        return [len(c) + ex["id"] for c, ex in zip(completions, examples, strict=True)]


def test_searcher_scores_a_batched_reward_in_one_call_in_order():
    tok = build_char_tokenizer()
    ids = tok("12")["input_ids"], tok("345")["input_ids"], tok("6")["input_ids"]
    reward = CountingBatchReward()
    stub = types.SimpleNamespace(
        examples=[{"id": 0}, {"id": 100}], tokenizer=tok, rank=0, reward_fn=reward
    )
    got = Searcher.rewards(stub, [1, 0], [[ids[0], ids[1]], [ids[2]]])
    assert got == [[102.0, 103.0], [1.0]]
    assert reward.calls == 1
    reward.batch = lambda completions, examples: [0.0]  # one short: loud
    with pytest.raises(ValueError, match="returned 1 rewards for 3 completions"):
        Searcher.rewards(stub, [1, 0], [[ids[0], ids[1]], [ids[2]]])


@pytest.mark.parametrize("share_prompt", [True, False])
def test_empty_response_has_zero_logprob_and_zero_reward(tiny_model_dir, share_prompt):
    """A response of only its EOS (not scored, the released rule) or of no token at all scores
    no token: log-prob exactly 0, no gradient, a mask row of 0, and the other responses of its
    group score as they do alone (a shared prompt's cache included). Its completion decodes to
    the empty text, whose GSM8K reward is 0, for a gold answer of 0 too."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts, groups = [[5, 6, 7], [8, 9]], [[[1], [20, 21, 1]], [[22, 23, 1], []]]
    rule = dict(pad_id=0, eos_id=1, logprob_temperature=0.7, include_eos=False)
    token_logp, mask = group_token_logprobs(
        model, prompts, groups, share_prompt=share_prompt, **rule
    )
    assert mask.tolist() == [[0, 0], [1, 1], [1, 1], [0, 0]]
    logp = token_logp.sum(1)
    assert logp[0].item() == 0.0 and logp[3].item() == 0.0
    grads = torch.autograd.grad(logp[0] + logp[3], list(model.parameters()), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)
    for row, (prompt, response) in ((1, (prompts[0], [20, 21, 1])), (2, (prompts[1], [22, 23, 1]))):
        alone = group_logprobs(model, [prompt], [[response]], share_prompt=False, **rule)
        assert logp[row].item() == pytest.approx(alone.item(), abs=1e-5)
        assert logp[row].item() < -0.1  # a scored response has a log-prob
    tok = build_char_tokenizer()
    stub = types.SimpleNamespace(
        examples=[{"id": 7, "answer": "#### 0"}], tokenizer=tok, rank=0, reward_fn=gsm8k_reward
    )
    empty = [tok.eos_token_id]
    assert Searcher.rewards(stub, [0], [[empty, [], tok("0")["input_ids"]]]) == [[0.0, 0.0, 1.0]]
