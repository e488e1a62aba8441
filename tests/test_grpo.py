"""The GRPO baseline and TBA′'s released one, the ratio loss (extensions/grpo.py): their losses
against slow loops and REINFORCE; through the system, where GRPO learns."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from buffer import ReplayBuffer, StoredTrajectory, Trajectory
from extensions import offpolicy
from extensions.evaluate import EvalHFEngine, to_examples
from extensions.grpo import (
    GRPOConfig,
    GRPOTrainer,
    RatioTrainer,
    grpo_advantages,
    grpo_loss,
    grpo_metrics,
    install,
    k3_kl,
    padded,
    ratio_loss,
)
from extensions.tiny import TINY_PRESET, cpu_config, synthetic_problems
from helpers import checked, child_pids, grpo_parts, time_limit
from plumbing.checkpoint import load_buffer_state
from plumbing.models import load_causal_lm
from tba import group_token_logprobs, scored_tokens
from test_tba import digit_reward, read_metrics, tiny_cfg, tiny_examples
from trainer import Parts, Trainer, run_tba


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
        # Dr. GRPO's constant denominator in place of the token count: the same sums over it
        tokens = int(mask.sum())
        dr = grpo_loss(x, old_g, ref_g, mask, adv, clip_eps, kl_coef, normalizer=50.0)
        (dr_grad,) = torch.autograd.grad(dr, x)
        assert dr.item() == pytest.approx(want * tokens / 50.0, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(dr_grad, want_grad * tokens / 50.0, rtol=1e-5, atol=1e-7)


def slow_ratio(logp, old, mask, adv, cap, denominators):
    """Reference: the ratio loss by loops over tokens in Python floats, row i's sum over
    ``denominators[i]``; its d loss / d logp derived by hand (0 above the cap)."""
    total = 0.0
    grad = [[0.0] * len(logp[0]) for _ in logp]
    for i, row in enumerate(logp):
        for j, lp in enumerate(row):
            if not mask[i][j]:
                continue
            ratio = math.exp(lp - old[i][j])
            total += -min(ratio, cap) * adv[i] / denominators[i]
            grad[i][j] = -ratio * adv[i] / denominators[i] if ratio < cap else 0.0
    return total, grad


@pytest.mark.parametrize("normalizer", ["tokens", "number", "per_row"])
def test_ratio_loss_matches_slow_loop(normalizer):
    """TBA′'s released baseline, value and gradient: min(pi / pi_b, cap) (r - mean r) in a token
    mean, over a number, or each row over its own denominator (the released per-sequence
    mean); ratios over the cap give no gradient; masked slots hold -inf and NaN."""
    cap = 1.5
    for seed in range(3):
        logp, old, _, mask, adv = random_grpo_batch(seed)
        assert (torch.exp(logp - old)[mask] > cap).any()
        tokens = int(mask.sum())
        rows = torch.arange(1, len(logp) + 1, dtype=torch.float32) * 3.0
        given = {"tokens": None, "number": 40.0, "per_row": rows}[normalizer]
        denominators = {"tokens": [tokens] * len(logp), "number": [40.0] * len(logp)}
        want, want_grad = slow_ratio(
            logp.tolist(),
            old.tolist(),
            mask.tolist(),
            adv.tolist(),
            cap,
            denominators.get(normalizer, rows.tolist()),
        )
        x = logp.masked_fill(~mask, -math.inf).requires_grad_()
        loss = ratio_loss(x, old.masked_fill(~mask, math.nan), mask.long(), adv, cap, given)
        (grad,) = torch.autograd.grad(loss, x)
        assert loss.dtype == torch.float32
        assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))
    with pytest.raises(ValueError, match="normalizer tensor"):
        ratio_loss(logp, old, mask, adv, cap, torch.ones(2))
    with pytest.raises(ValueError, match="advantages must be"):
        ratio_loss(logp, old, mask, adv[:-1])


def test_ratio_loss_on_policy_is_reinforce_with_the_group_mean():
    """On-policy (pi_b = pi) the ratio loss's gradient is Dr. GRPO's REINFORCE: -(1/N) sum_i
    (r_i - mean r) grad log pi(y_i), equal to grpo_loss's with unscaled advantages (no clip
    acts at ratio 1)."""
    logp, _, _, mask, _ = random_grpo_batch(4, b=6)
    reward = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    adv = grpo_advantages(reward, scale=False).reshape(-1)
    x = logp.clone().requires_grad_()
    (got,) = torch.autograd.grad(ratio_loss(x, x.detach(), mask, adv), x)
    (want,) = torch.autograd.grad(grpo_loss(x, x.detach(), None, mask, adv), x)
    torch.testing.assert_close(got, want)
    assert got.abs().max() > 1e-3


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
    assert kl.min().item() == 0.0 == kl[2000].item()  # >= 0 everywhere, 0 at the reference
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
    centred = grpo_advantages(reward, scale=False)  # Dr. GRPO's
    assert got.dtype == torch.float32 and got.shape == reward.shape
    for row, got_row, dr_row in zip(reward.tolist(), got.tolist(), centred.tolist(), strict=True):
        mean, std = statistics.fmean(row), statistics.stdev(row)  # sample std, as TRL
        assert got_row == pytest.approx([(r - mean) / (std + 1e-4) for r in row], rel=1e-5)
        assert dr_row == pytest.approx([r - mean for r in row], rel=1e-5)
    # Equal rewards give exactly 0: in fp32 the mean of 8 copies of 0.9 or 1000.3 is an ulp
    # off, which (r - mean) / (std + 1e-4) would blow up to ~6e-4 and ~0.37.
    reward = torch.tensor([[0.9] * 8, [1000.3] * 8, [1.0] * 8, [0.0, 1.0] * 4, [0.7] * 8])
    adv = grpo_advantages(reward)
    assert (adv[[0, 1, 2, 4]] == 0).all() and (adv[3] != 0).all()
    with pytest.raises(ValueError, match="K must be >= 2"):
        grpo_advantages(torch.ones(4, 1))
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([[0.0, math.nan]]))


def check_grpo_run(out: Path, steps: int, synchronous: bool) -> None:
    """The metrics of a --loss grpo run, and its checkpoint's per-token lists. A step that
    trains only on its own weights' samples (every one, synchronous) sees ratio 1 and nothing
    clipped: the searchers' log pi_old are the trainer's scoring; asynchronous, some step on
    older samples sees another ratio: they are the sampler's, not the trainer's."""
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert "loss/tb" not in r and "train/beta" not in r
        assert math.isfinite(r["loss/grpo"]) and r["train/grad_norm"] > 0
        if r["async/lag_max"] == 0:
            assert r["grpo/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
            assert r["grpo/clip_frac"] == 0
    stale = [r["grpo/ratio_mean"] for r in rows if r["async/lag_max"] > 0]
    if synchronous:
        assert not stale, "a synchronous step trained on samples of older weights"
    else:
        assert any(abs(ratio - 1) > 1e-3 for ratio in stale), f"ratio 1 on older samples: {stale}"
    assert rows[0]["grpo/kl"] < 1e-6 and rows[-1]["grpo/kl"] > rows[0]["grpo/kl"]
    state = torch.load(out / "checkpoint.pt", weights_only=True)["trainer"]["buffer"]
    buffer = ReplayBuffer()
    load_buffer_state(buffer, state, StoredTrajectory)
    items = [t for group in buffer.by_prompt.values() for t in group]
    lists = [t.token_logprobs for t in items]
    assert items and all(
        len(tl["behaviour"]) == len(tl["reference"]) >= len(t.response_tokens) - 1
        for tl, t in zip(lists, items, strict=True)
    )


# How far 24 synchronous GRPO steps raise the share of digits in sampled completions of 32
# held-out prompts (digit_reward's mean, 4 samples each, one sampling seed): from 0.076 to
# 0.237, 0.249, 0.262, 0.283 and 0.275 in 5 runs (+0.16 to +0.21, 2026-11-28); a trainer that
# does not learn leaves it where it was (the same weights and seed: the same samples).
GRPO_LEARNS_BY = 0.08


def digit_share(model, cfg, tokenizer, seed: int = 0) -> float:
    """digit_reward's mean over 4 sampled completions (the run's sampling) of each of 32
    held-out prompts (synthetic problems of another seed than tiny_examples')."""
    prompts = [tokenizer(ex["prompt"])["input_ids"] for ex in held_out_examples()]
    torch.manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    engine = EvalHFEngine(cfg, torch.device("cpu"), eos, pad, model.eval())
    texts = [
        tokenizer.decode(r, skip_special_tokens=True)
        for o in engine.generate(prompts, 4)
        for r in o
    ]
    return statistics.fmean(digit_reward(text, {}) for text in texts)


def held_out_examples() -> list[dict]:
    return to_examples(synthetic_problems(32, seed=1))


@pytest.mark.slow
@pytest.mark.parametrize("synchronous", [False, True])
def test_system_grpo_on_the_same_searchers_buffer_and_trainer(
    tiny_model_dir, tmp_path, synchronous
):
    """--loss grpo through the whole system (two transformers searchers), asynchronous for 8
    steps and synchronous for 24: the searchers record per-token log pi_old and log p_ref that
    align with the trainer's scoring (ratio 1 on the samples of the weights trained, another
    ratio on older ones), and synchronous GRPO learns: the share of digits in sampled
    completions of held-out prompts rises by GRPO_LEARNS_BY or more."""
    steps = 24 if synchronous else 8
    cfg = tiny_cfg(tiny_model_dir, tmp_path, synchronous=synchronous, total_steps=steps)
    with time_limit(240):
        trainer = run_tba(
            cfg,
            tiny_examples(),
            digit_reward,
            parts=checked(cfg, grpo_parts()),
            show_progress=False,
        )
    check_grpo_run(tmp_path, steps, synchronous)
    assert len(set(trainer.published.values())) > 2  # the weights moved
    assert child_pids() == []
    if synchronous:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        initial = load_causal_lm(tiny_model_dir, torch.float32, torch.device("cpu"), False)
        before = digit_share(initial, cfg, tokenizer)
        assert digit_share(trainer.model, cfg, tokenizer) >= before + GRPO_LEARNS_BY


def grpo_trainer(model_dir: str, dr: bool = False, grpo=None, **overrides) -> Trainer:
    values = dict(num_generations=3, responses_per_prompt=3, prompts_per_step=4)
    values.update(overrides)
    trainer_class = install(Parts(), grpo or GRPOConfig(loss="grpo", grpo_dr=dr)).trainer
    return trainer_class(cpu_config(model_dir, **values), torch.device("cpu"), pad_id=0, eos_id=1)


def off_policy_batch(trainer: Trainer):
    """4 groups of 3 responses that end in EOS (not scored) or are cut, one EOS only, one
    group's rewards all equal; their per-token log-probs under the trainer's model (logp, with
    gradients, and mask), and "behaviour" and "reference" lists off it by N(0, 0.3) a token."""
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
    logp, mask = group_token_logprobs(
        trainer.model,
        [g[0].prompt_tokens for g in groups],
        [[t.response_tokens for t in g] for g in groups],
        pad_id=0,
        eos_id=1,
        logprob_temperature=0.7,
        include_eos=False,
        share_prompt=False,
    )
    gen = torch.Generator().manual_seed(1)
    old = (logp.detach() + torch.randn(logp.shape, generator=gen) * 0.3) * mask
    ref = (logp.detach() + torch.randn(logp.shape, generator=gen) * 0.3) * mask
    for i, t in enumerate(t for g in groups for t in g):
        n = int(mask[i].sum())
        t.token_logprobs = {"behaviour": old[i, :n].tolist(), "reference": ref[i, :n].tolist()}
        t.behaviour_logprob = math.fsum(t.token_logprobs["behaviour"])
    return groups, logp, mask, old, ref


@pytest.mark.parametrize("dr", [False, True])
def test_grpo_micro_batches_leave_loss_and_gradient_unchanged(tiny_model_dir, dr):
    """Trainer.backward under --loss grpo in passes of 1, 2 or all 4 prompt groups gives
    grpo_loss on the whole (P, K) batch, token-level, and its gradient: each pass weighs by its
    share of the scored tokens. Responses end in EOS (not scored) or are cut; one is EOS only;
    one group's rewards are all equal; behaviour log-probs are off-policy, so some clip. Dr.
    GRPO (--grpo_dr): advantages not scaled by the std, each pass's token sum over the whole
    batch's responses x max_new_tokens."""
    trainer = grpo_trainer(tiny_model_dir, dr)
    groups, logp, mask, old, ref = off_policy_batch(trainer)
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    adv = grpo_advantages(reward, scale=not dr).reshape(-1)
    constant = 12 * trainer.cfg.max_new_tokens if dr else None
    want_loss = grpo_loss(logp, old, ref, mask, adv, 0.2, 0.04, normalizer=constant)
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
    groups[2][1].token_logprobs["behaviour"].append(-1.0)
    with pytest.raises(ValueError, match=r"prompt 2: \d+ scored tokens"):
        trainer.backward(groups, 0.05)
    groups[2][1].token_logprobs = None
    with pytest.raises(ValueError, match="prompt 2 has no per-token log-probs"):
        trainer.backward(groups, 0.05)


@pytest.mark.parametrize("norm", ["tokens", "sequence"])
def test_ratio_trainer_is_the_ratio_loss_on_the_batch_in_any_passes(tiny_model_dir, norm):
    """--loss ratio in passes of 1, 2 or all 4 groups, or of one response: ratio_loss on the
    whole batch with advantages r - mean r of each group (no std), the ratio capped at
    --ratio_cap, in a token mean or (--ratio_norm sequence, as released) each response's sum
    over its prompt and response tokens, then a mean over the 12 responses; its gradient; the
    share capped. A pass of part of a group must divide it."""
    cfg = GRPOConfig(loss="ratio", ratio_cap=1.2, ratio_norm=norm)
    trainer = grpo_trainer(tiny_model_dir, grpo=cfg)
    assert isinstance(trainer, RatioTrainer)
    groups, logp, mask, old, _ = off_policy_batch(trainer)
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    adv = (reward - reward.mean(dim=1, keepdim=True)).reshape(-1)
    flat = [t for g in groups for t in g]
    lengths = torch.tensor([len(t.prompt_tokens) + len(t.response_tokens) for t in flat])
    normalizer = lengths.float() * len(flat) if norm == "sequence" else None
    want_loss = ratio_loss(logp, old, mask, adv, 1.2, normalizer)
    want_grads = torch.autograd.grad(want_loss, list(trainer.model.parameters()))
    ratio = torch.exp(logp.detach() - old)[mask.bool()]
    assert 0 < (ratio > 1.2).float().mean() < 0.5
    for size in (3, 7, 12, 0, 1):  # 1: a group's responses over 3 passes (the released run's)
        trainer.cfg = dataclasses.replace(trainer.cfg, micro_batch_size=size)
        trainer.model.zero_grad(set_to_none=True)
        metrics = trainer.backward(groups, 0.05)
        assert metrics["loss/ratio"] == pytest.approx(want_loss.item(), rel=1e-5)
        assert metrics["ratio/capped_frac"] == pytest.approx((ratio > 1.2).float().mean().item())
        assert metrics["ratio/ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
        for want, p in zip(want_grads, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)
    groups[1][2].token_logprobs["behaviour"].pop()
    with pytest.raises(ValueError, match=r"--loss ratio: prompt 1: \d+ scored tokens"):
        trainer.backward(groups, 0.05)
    with pytest.raises(ValueError, match="micro_batch_size 2 must divide"):
        grpo_trainer(tiny_model_dir, grpo=cfg, micro_batch_size=2)


def test_grpo_config_is_the_baselines():
    """TB is the paper's loss in every preset; GRPO is the baseline (--loss grpo) at
    DeepSeekMath's KL weight and TRL's clip."""
    cfg = GRPOConfig()
    assert cfg.loss == "tb" and "loss" not in TINY_PRESET
    assert (cfg.grpo_clip_eps, cfg.grpo_kl_coef) == (0.2, 0.04)
    with pytest.raises(ValueError, match="loss 'ppo' is not one of"):
        GRPOConfig(loss="ppo")
    with pytest.raises(ValueError, match="grpo_clip_eps"):
        GRPOConfig(grpo_clip_eps=1.0)
    with pytest.raises(ValueError, match="grpo_kl_coef"):
        GRPOConfig(grpo_kl_coef=-0.1)
    assert not cfg.grpo_dr
    with pytest.raises(ValueError, match=r"grpo_dr .* needs --loss grpo"):
        GRPOConfig(grpo_dr=True)
    dr_parts = install(Parts(), GRPOConfig(loss="grpo", grpo_dr=True))
    with pytest.raises(ValueError, match="choose one"):  # Dr. GRPO is the clipped objective
        offpolicy.install(dr_parts, offpolicy.OffPolicyConfig(grpo_decoupled=True))
    # the released baseline: its own trainer (not GRPO's clipped one), its cap 8, a token mean
    ratio = GRPOConfig(loss="ratio")
    assert (ratio.ratio_cap, ratio.ratio_norm) == (8.0, "tokens")
    ratio_trainer = install(Parts(), ratio).trainer
    assert issubclass(ratio_trainer, RatioTrainer)
    assert ratio_trainer.backward is not GRPOTrainer.backward
    with pytest.raises(ValueError, match=r"ratio_cap must be > 1\.0"):
        GRPOConfig(loss="ratio", ratio_cap=1.0)
    with pytest.raises(ValueError, match="ratio_norm 'mean' is not one of"):
        GRPOConfig(loss="ratio", ratio_norm="mean")
    with pytest.raises(ValueError, match="grpo_dr"):
        GRPOConfig(loss="ratio", grpo_dr=True)
    with pytest.raises(ValueError, match="need --loss grpo"):  # no PPO-clip correction over it
        offpolicy.install(install(Parts(), ratio), offpolicy.OffPolicyConfig(grpo_decoupled=True))


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
    engine = EvalHFEngine(cfg, torch.device("cpu"), eos_id=1, pad_id=0, model=trainer.model)
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
        logprob_temperature=cfg.logprob_temperature(),
        include_eos=True,
    )
    rows = [lp for o in logps for lp in o]
    assert [len(lp) for lp in rows] == mask.sum(1).tolist()
    torch.testing.assert_close(padded(rows, mask.shape[1], "cpu"), token_logp, atol=1e-5, rtol=0)
    groups = [
        [
            Trajectory(i, p, r, float(len(r)), 0.0, 0, {"behaviour": lp[:n], "reference": lp[:n]})
            for r, lp in zip(o, lps, strict=True)
            for n in [len(scored_tokens(r, eos, eos_in_logprob))]
        ]
        for i, (p, o, lps) in enumerate(zip(prompts, outputs, logps, strict=True))
    ]
    metrics = trainer.backward(groups, 0.05)
    assert metrics["grpo/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["grpo/clip_frac"] == 0 and metrics["grpo/kl"] < 1e-9
    assert metrics["loss/grpo"] != 0
