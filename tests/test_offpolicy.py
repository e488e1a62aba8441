"""Off-policy corrections (extensions/offpolicy.py): the second-moment mask, M2PO's and the
decoupled PPO losses against slow loops; TB's zero kept; a tabular policy trained to p_ref
exp(r/beta)/Z from data 256 versions old."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
from test_grpo import random_grpo_batch

from buffer import Trajectory
from extensions import grpo, offpolicy
from extensions.offpolicy import (
    OffPolicyConfig,
    decoupled_ppo_loss,
    lag_clip_eps,
    m2po_loss,
    second_moment_keep,
    tb_m2_dropped,
)
from extensions.tiny import cpu_config
from plumbing.config import ConfigError
from tba import group_token_logprobs, tb_clipped, tb_loss
from test_tba import tabular_tb_run
from trainer import Parts, Trainer


def slow_keep(values: list[float], candidates: list[bool], tau: float) -> list[bool]:
    """Drop the candidate of the largest value^2 (the later one of equals) while the mean of the
    kept candidates' value^2 exceeds tau."""
    kept = [i for i, c in enumerate(candidates) if c]
    while kept and sum(values[i] ** 2 for i in kept) / len(kept) > tau:
        kept.remove(max(kept, key=lambda i: (values[i] ** 2, i)))
    return [not c or i in kept for i, c in enumerate(candidates)]


@pytest.mark.parametrize("seed", range(6))
def test_second_moment_keep_matches_slow_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64) * (0.1 + seed / 4)
    x[0, :3] = 0.5  # ties
    candidates = torch.rand(5, 7, generator=gen) < 0.7
    for tau in (0.0, 0.01, 0.04, 0.3, 100.0):
        for cand in (None, candidates):
            flat = cand.flatten().tolist() if cand is not None else [True] * x.numel()
            want = slow_keep(x.flatten().tolist(), flat, tau)
            got = second_moment_keep(x, tau, cand)
            assert got.shape == x.shape
            assert got.flatten().tolist() == want, (tau, cand is None)
    assert second_moment_keep(torch.zeros(4), 0.0).all()  # on-policy: nothing dropped
    with pytest.raises(ValueError):
        second_moment_keep(x, -1.0)


def tb_batch(seed: int, p: int = 4, k: int = 6, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(p, k, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(p, k, generator=gen, dtype=torch.float64) * 5
    reward = torch.rand(p, k, generator=gen, dtype=torch.float64)
    behaviour = logp + torch.randn(p, k, generator=gen, dtype=torch.float64) * spread
    return logp, ref, reward, behaviour


@pytest.mark.parametrize("pushed_only", [False, True])
def test_tb_m2_mask_drops_only_gradient_and_keeps_the_zero(pushed_only):
    beta, tau = 0.5, 0.2
    logp, ref, reward, behaviour = tb_batch(0)
    dropped = tb_m2_dropped(logp, ref, reward, beta, behaviour, tau, pushed_only)
    rho = (logp - behaviour).flatten().tolist()
    cand = [True] * len(rho)
    if pushed_only:
        cand = tb_clipped(logp, ref, reward, beta, behaviour, 0.0).flatten().tolist()
    assert (~dropped).flatten().tolist() == slow_keep(rho, cand, tau)
    assert 0 < dropped.sum() < dropped.numel()
    x = logp.clone().requires_grad_()
    plain = tb_loss(x, ref, reward, beta)
    (g_plain,) = torch.autograd.grad(plain, x)
    masked = tb_loss(torch.where(dropped, x.detach(), x), ref, reward, beta)
    (g_masked,) = torch.autograd.grad(masked, x)
    assert masked.item() == plain.item()  # the value, log Z and the residuals are the plain ones
    torch.testing.assert_close(g_masked, torch.where(dropped, 0.0, g_plain))
    # At the target (d constant in y for each x) every residual is 0: so is the gradient.
    target = (ref + reward / beta + torch.randn(4, 1, dtype=torch.float64)).requires_grad_()
    drop = tb_m2_dropped(target, ref, reward, beta, behaviour, tau, pushed_only)
    loss = tb_loss(torch.where(drop, target.detach(), target), ref, reward, beta)
    (g,) = torch.autograd.grad(loss, target)
    assert loss.item() < 1e-20 and g.abs().max() < 1e-12


def slow_m2po(logp, old, ref, mask, adv, keep, kl_coef):
    """Loss and d loss / d logp in Python floats from m2po_loss's docstring."""
    b, t = len(logp), len(logp[0])
    n = max(1, sum(mask[i][j] for i in range(b) for j in range(t)))
    total, grad = 0.0, [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not mask[i][j]:
                continue
            if keep[i][j]:
                r = math.exp(logp[i][j] - old[i][j])
                total -= r * adv[i]
                grad[i][j] -= r * adv[i]
            x = ref[i][j] - logp[i][j]
            total += kl_coef * (math.exp(x) - x - 1)
            grad[i][j] += kl_coef * (1 - math.exp(x))
    return total / n, [[g / n for g in row] for row in grad]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kl_coef", [0.0, 0.04])
def test_m2po_loss_matches_slow_loop(seed, kl_coef):
    logp, old, ref, mask, adv = random_grpo_batch(seed)
    log_ratio = torch.where(mask, logp - old, 0.0)
    keep = torch.ones_like(mask)
    keep[mask] = second_moment_keep(log_ratio[mask], 0.04)
    assert (mask & ~keep).any()
    x = logp.clone().requires_grad_()
    loss = m2po_loss(x, old, ref, mask, adv, keep, kl_coef)
    (grad,) = torch.autograd.grad(loss, x)
    want, want_grad = slow_m2po(
        logp.tolist(),
        old.tolist(),
        ref.tolist(),
        mask.tolist(),
        adv.tolist(),
        keep.tolist(),
        kl_coef,
    )
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(
        grad.double(), torch.tensor(want_grad, dtype=torch.float64), rtol=1e-4, atol=1e-6
    )


def slow_decoupled(logp, prox, behaviour, ref, mask, adv, clip_eps, kl_coef, cap):
    """Loss and d loss / d logp in Python floats from decoupled_ppo_loss's docstring."""
    b, t = len(logp), len(logp[0])
    n = max(1, sum(mask[i][j] for i in range(b) for j in range(t)))
    total, grad = 0.0, [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not mask[i][j]:
                continue
            w = math.exp(prox[i][j] - behaviour[i][j])
            if cap > 0 and w > cap:
                w = 0.0
            u = math.exp(logp[i][j] - prox[i][j])
            a = adv[i]
            u_clipped = min(max(u, 1 - clip_eps), 1 + clip_eps)
            surr, d_surr = (u * a, u * a) if u * a <= u_clipped * a else (u_clipped * a, 0.0)
            x = ref[i][j] - logp[i][j]
            total += -w * surr + kl_coef * (math.exp(x) - x - 1)
            grad[i][j] = -w * d_surr + kl_coef * (1 - math.exp(x))
    return total / n, [[g / n for g in row] for row in grad]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_decoupled_ppo_loss_matches_slow_loop(seed, cap):
    logp, behaviour, ref, mask, adv = random_grpo_batch(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    prox = logp + torch.randn(logp.shape, generator=gen, dtype=torch.float64) * 0.3
    x = logp.clone().requires_grad_()
    loss = decoupled_ppo_loss(x, prox, behaviour, ref, mask, adv, 0.2, 0.04, cap)
    (grad,) = torch.autograd.grad(loss, x)
    want, want_grad = slow_decoupled(
        logp.tolist(),
        prox.tolist(),
        behaviour.tolist(),
        ref.tolist(),
        mask.tolist(),
        adv.tolist(),
        0.2,
        0.04,
        cap,
    )
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(
        grad.double(), torch.tensor(want_grad, dtype=torch.float64), rtol=1e-4, atol=1e-6
    )


def test_decoupled_with_the_step_start_as_proximal_is_weighted_policy_gradient():
    """prox = logp.detach(): u = 1, nothing clipped; the gradient is -w A / n per token, and with
    pi_b = pi_prox (on-policy) it is grpo_loss's exactly."""
    logp, behaviour, ref, mask, adv = random_grpo_batch(7)
    x = logp.clone().requires_grad_()
    loss = decoupled_ppo_loss(x, x.detach(), behaviour, ref, mask, adv, 0.2, 0.0, 0.0)
    (grad,) = torch.autograd.grad(loss, x)
    w = torch.where(mask, torch.exp(logp - behaviour), 0.0)
    want = -w * adv.unsqueeze(1) / mask.sum()
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-7)
    loss = decoupled_ppo_loss(x, x.detach(), x.detach(), ref, mask, adv, 0.2, 0.04, 5.0)
    (grad,) = torch.autograd.grad(loss, x)
    base = grpo.grpo_loss(x, x.detach(), ref, mask, adv, 0.2, 0.04)
    (want,) = torch.autograd.grad(base, x)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize(
    "correction",
    [
        dict(tau=0.1),
        dict(clip_eps=0.3),
        dict(clip_eps=0.3, horizon=16.0),
        dict(clip_eps=0.075, horizon=1.0),  # the core's rule (tba.tb_loss)
    ],
)
def test_tb_reaches_the_target_from_data_256_versions_old(correction):
    """Data 256 versions old (for the first 256 steps, the uniform first policy's): with the
    second-moment mask on the pushed items, with the trust region, or with the trust region
    widened with the data's age (from a horizon of 16, or by the core's rule from lag 1), the
    policy reaches p_ref exp(r/beta)/Z -- none moves TB's fixed point, and the sampler follows
    the policy. Plain TB reaches it too here, so the test also asserts that the correction
    acted: some step dropped the gradient of at least a tenth of its items."""
    tau = correction.get("tau", 0.0)
    clip_eps = correction.get("clip_eps", 0.0)
    horizon = correction.get("horizon", 0.0)
    shares = []  # per step, the share of items whose gradient the correction dropped

    def pushed_mask(logp, ref_logp, reward, beta, behaviour_logp):
        dropped = tb_m2_dropped(logp, ref_logp, reward, beta, behaviour_logp, tau, True)
        shares.append(dropped.double().mean().item())
        return dropped

    step = itertools.count()

    def widened(logp, ref_logp, reward, beta, behaviour_logp):
        # tabular_tb_run's sampler at step t is the policy of step max(0, t - 256)
        lags = torch.full(logp.shape, min(next(step), 256))
        eps = lag_clip_eps(clip_eps, lags, horizon)
        clipped = tb_clipped(logp, ref_logp, reward, beta, behaviour_logp, eps)
        if horizon == 1.0:  # the core's rule is lag_clip_eps at horizon 1
            assert torch.equal(
                clipped, tb_clipped(logp, ref_logp, reward, beta, behaviour_logp, clip_eps, lags)
            )
        shares.append(clipped.double().mean().item())
        return clipped

    drop = pushed_mask if tau else widened if horizon else None
    torch.set_num_threads(1)
    tv, most_clipped = tabular_tb_run(0.0 if horizon else clip_eps, lag=256, steps=1100, drop=drop)
    assert tv < 1e-3, f"total variation {tv:.5f} from the target ({correction})"
    acted = max(shares) if drop else most_clipped
    assert acted > 0.1, f"the correction dropped at most {acted:.3f} of a step's items"


@pytest.mark.parametrize("horizon", [1.0, 4.0, 16.0])
def test_lag_clip_eps_matches_slow_loop(horizon):
    lags = torch.tensor([[0, 1, 3], [4, 16, 17], [64, 256, 1000]])
    got = lag_clip_eps(0.3, lags, horizon)
    assert got.dtype == torch.float64
    for i, j in itertools.product(range(3), range(3)):
        lag = int(lags[i, j])
        want = 0.3 if lag <= horizon else 0.3 * math.sqrt(lag / horizon)
        assert got[i, j].item() == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError):
        lag_clip_eps(0.3, lags, 0.0)
    with pytest.raises(ValueError):
        lag_clip_eps(0.3, -lags - 1, horizon)


def test_install_and_config_errors():
    tb = offpolicy.install(Parts(), OffPolicyConfig(tb_m2_tau=0.1))
    assert issubclass(tb.trainer, offpolicy.MaskedTBTrainer)
    assert tb.trainer.offpolicy.tb_m2_tau == 0.1
    assert offpolicy.install(Parts(), OffPolicyConfig()) == Parts()
    grpo_parts = grpo.install(Parts(), grpo.GRPOConfig(loss="grpo"))
    both = offpolicy.install(grpo_parts, OffPolicyConfig(grpo_m2po_tau=0.04))
    assert issubclass(both.trainer, offpolicy.OffPolicyGRPOTrainer)
    assert both.searcher is grpo.GRPOSearcher  # it records the per-token log-probs
    with pytest.raises(ConfigError):
        offpolicy.install(Parts(), OffPolicyConfig(grpo_decoupled=True))
    with pytest.raises(ConfigError):
        offpolicy.install(grpo_parts, OffPolicyConfig(tb_m2_tau=0.1))
    for bad in (
        dict(tb_m2_tau=-1.0),
        dict(grpo_m2po_tau=-0.1),
        dict(grpo_is_cap=0.5),
        dict(grpo_decoupled=True, grpo_m2po_tau=0.04),
        dict(m2_pushed_only=True),
        dict(tb_clip_horizon=-1.0),
    ):
        with pytest.raises(ConfigError):
            OffPolicyConfig(**bad)
    widened = OffPolicyConfig(tb_clip_horizon=16.0)
    assert issubclass(offpolicy.install(Parts(), widened).trainer, offpolicy.MaskedTBTrainer)
    offpolicy.check(widened, "tb", 0.3)
    for loss, eps in (("tb", 0.0), ("grpo", 0.3)):
        with pytest.raises(ConfigError):
            offpolicy.check(widened, loss, eps)
    with pytest.raises(ConfigError):
        offpolicy.install(grpo_parts, widened)


def stale_groups(model, gen_seed: int = 1) -> tuple:
    """Four prompt groups of three responses (ragged; one group of equal rewards) whose behaviour
    log-probs, per token and summed, sit N(0, 0.3) per token off the model's; and the model's
    per-token log-probs (with gradient) and mask of them."""
    rng = random.Random(0)
    groups = [
        [
            Trajectory(
                p,
                [5, 6, 7 + p],
                [rng.randrange(4, 60) for _ in range(rng.randint(1, 6))] + [1],
                float(rng.random() < 0.5) if p else 1.0,
                -rng.random() * 10,
                0,
            )
            for _ in range(3)
        ]
        for p in range(4)
    ]
    logp, mask = group_token_logprobs(
        model,
        [g[0].prompt_tokens for g in groups],
        [[t.response_tokens for t in g] for g in groups],
        pad_id=0,
        eos_id=1,
        logprob_temperature=0.7,
        include_eos=False,
        share_prompt=False,
    )
    gen = torch.Generator().manual_seed(gen_seed)
    old = (logp.detach() + torch.randn(logp.shape, generator=gen) * 0.3) * mask
    ref = (logp.detach() + torch.randn(logp.shape, generator=gen) * 0.3) * mask
    for i, t in enumerate(t for g in groups for t in g):
        n = int(mask[i].sum())
        t.token_logprobs = {"behaviour": old[i, :n].tolist(), "reference": ref[i, :n].tolist()}
        t.behaviour_logprob = sum(t.token_logprobs["behaviour"])
    return groups, logp, mask.bool()


@pytest.mark.parametrize(
    "flags",
    [
        dict(tb_m2_tau=0.2),
        dict(tb_m2_tau=0.2, m2_pushed_only=True, tb_clip_eps=0.3),
        dict(loss="grpo", grpo_m2po_tau=0.02),
        dict(loss="grpo", grpo_m2po_tau=0.02, m2_pushed_only=True),
        dict(loss="grpo", grpo_decoupled=True, grpo_is_cap=1.2),
    ],
)
def test_trainers_masks_are_over_the_whole_batch_whatever_the_passes(tiny_model_dir, flags):
    """The trainers' gradient in passes of 1, 2 or all 4 groups is the one of the pure function
    on the whole batch (the mask is the whole batch's), and the masks drop something."""
    flags = dict(flags)
    loss = flags.pop("loss", "tb")
    clip_eps = flags.pop("tb_clip_eps", 0.0)
    cfg = OffPolicyConfig(**flags)
    parts = offpolicy.install(grpo.install(Parts(), grpo.GRPOConfig(loss=loss)), cfg)
    values = dict(num_generations=3, responses_per_prompt=3, prompts_per_step=4)
    config = cpu_config(tiny_model_dir, tb_clip_eps=clip_eps, **values)
    trainer = parts.trainer(config, torch.device("cpu"), pad_id=0, eos_id=1)
    groups, logp, mask = stale_groups(trainer.model)
    ref = grpo.padded(
        [t.token_logprobs["reference"] for g in groups for t in g], logp.shape[1], "cpu"
    )
    old = grpo.padded(
        [t.token_logprobs["behaviour"] for g in groups for t in g], logp.shape[1], "cpu"
    )
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    beta = 0.05
    if loss == "tb":
        seq = (logp * mask).sum(1).view(4, 3)
        seq_ref = torch.tensor([[t.ref_logprob for t in g] for g in groups])
        seq_old = torch.tensor(
            [[t.behaviour_logprob for t in g] for g in groups], dtype=torch.float64
        )
        dropped = tb_m2_dropped(
            seq, seq_ref, reward, beta, seq_old, cfg.tb_m2_tau, cfg.m2_pushed_only
        )
        assert 0 < dropped.sum() < dropped.numel()
        want_loss = tb_loss(
            torch.where(dropped, seq.detach(), seq), seq_ref, reward, beta, seq_old, clip_eps
        )
    else:
        adv = grpo.grpo_advantages(reward).reshape(-1)
        if cfg.grpo_decoupled:
            want_loss = decoupled_ppo_loss(logp, logp.detach(), old, ref, mask, adv, 0.2, 0.04, 1.2)
        else:
            log_ratio = torch.where(mask, logp.detach() - old, 0.0)
            pushed = adv.unsqueeze(1) * log_ratio > 0
            cand = mask & pushed if cfg.m2_pushed_only else mask
            keep = second_moment_keep(log_ratio, cfg.grpo_m2po_tau, cand)
            assert (mask & ~keep).any()
            want_loss = m2po_loss(logp, old, ref, mask, adv, keep, 0.04)
    want_grads = torch.autograd.grad(want_loss, list(trainer.model.parameters()))
    for size in (3, 7, 0):
        trainer.cfg = dataclasses.replace(trainer.cfg, micro_batch_size=size)
        trainer.model.zero_grad(set_to_none=True)
        metrics = trainer.backward(groups, beta)
        key = "loss/tb" if loss == "tb" else "loss/grpo"
        assert metrics[key] == pytest.approx(want_loss.item(), rel=1e-4)
        for want, p in zip(want_grads, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-3, atol=1e-5)
        if loss == "grpo":
            adv = grpo.grpo_advantages(reward).reshape(-1)
            base = grpo.grpo_metrics(logp.detach(), old, ref, mask, adv)
            for key in ("kl", "ratio_mean"):
                assert metrics[f"grpo/{key}"] == pytest.approx(base[key].item(), rel=1e-5)
        masked = metrics.get("offpolicy/m2_mask_frac", metrics.get("offpolicy/is_cap_frac"))
        assert 0 < masked < 1


def test_widened_trust_region_trainer_is_the_pure_functions_and_the_core_at_horizon_1(
    tiny_model_dir,
):
    """--tb_clip_horizon: the trainer's gradient in passes of 1, 2 or all 4 groups is tb_loss's
    with the items ``tb_clipped`` at ``lag_clip_eps``'s radii give no gradient; up to the
    horizon one radius, beyond it fewer items are clipped; at horizon 1 it is the core
    trainer's, whose rule (tba.tb_loss: eps sqrt(max(1, lag))) widens from lag 1; and it needs
    --tb_clip_eps."""
    values = dict(num_generations=3, responses_per_prompt=3, prompts_per_step=4, tb_clip_eps=0.1)
    config = cpu_config(tiny_model_dir, **values)
    parts = offpolicy.install(Parts(), OffPolicyConfig(tb_clip_horizon=2.0))
    trainer = parts.trainer(config, torch.device("cpu"), pad_id=0, eos_id=1)
    at_one = offpolicy.install(Parts(), OffPolicyConfig(tb_clip_horizon=1.0)).trainer(
        config, torch.device("cpu"), pad_id=0, eos_id=1
    )
    core = Trainer(config, torch.device("cpu"), pad_id=0, eos_id=1)
    for other in (at_one, core):
        other.model.load_state_dict(trainer.model.state_dict())
    groups, logp, mask = stale_groups(trainer.model)  # every item of version 0
    seq = (logp * mask).sum(1).view(4, 3)
    seq_ref = torch.tensor([[t.ref_logprob for t in g] for g in groups])
    seq_old = torch.tensor([[t.behaviour_logprob for t in g] for g in groups], dtype=torch.float64)
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    beta = 0.05
    clip_fracs = {}
    for step in (1, 2, 8, 50):  # the items' lag
        trainer.step = at_one.step = core.step = step
        eps = lag_clip_eps(0.1, torch.full((4, 3), step), 2.0)
        clipped = tb_clipped(seq, seq_ref, reward, beta, seq_old, eps)
        want_loss = tb_loss(torch.where(clipped, seq.detach(), seq), seq_ref, reward, beta)
        want_grads = torch.autograd.grad(
            want_loss, list(trainer.model.parameters()), retain_graph=True
        )
        for size in (3, 7, 0):
            trainer.cfg = dataclasses.replace(trainer.cfg, micro_batch_size=size)
            trainer.model.zero_grad(set_to_none=True)
            metrics = trainer.backward(groups, beta)
            assert metrics["loss/tb"] == pytest.approx(want_loss.item(), rel=1e-4)
            for want, p in zip(want_grads, trainer.model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, want, rtol=1e-3, atol=1e-5)
        assert metrics["offpolicy/clip_frac"] == clipped.double().mean().item()
        assert metrics["offpolicy/clip_eps_mean"] == pytest.approx(eps.mean().item())
        clip_fracs[step] = metrics["offpolicy/clip_frac"]
        for other in (at_one, core):
            other.model.zero_grad(set_to_none=True)
        one_metrics = at_one.backward(groups, beta)
        core_metrics = core.backward(groups, beta)
        assert core_metrics["offpolicy/clip_frac"] == one_metrics["offpolicy/clip_frac"]
        for mine, theirs in zip(at_one.model.parameters(), core.model.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6)
    assert clip_fracs[1] == clip_fracs[2] > clip_fracs[8] > clip_fracs[50]
    with pytest.raises(ConfigError):
        parts.trainer(
            dataclasses.replace(config, tb_clip_eps=0.0), torch.device("cpu"), pad_id=0, eos_id=1
        )


@pytest.mark.parametrize("seed", range(4))
def test_the_core_rule_against_a_slow_loop(seed):
    """tba.tb_loss's one rule for every age against a slow loop: an item lag versions behind
    gives no gradient when -sign(logZ + d) (logp - log pi_b) > clip_eps sqrt(max(1, lag)) or,
    with the previous update's log-probs, -sign(logZ + d) (logp - proximal) > clip_eps; without
    lags, one radius; at lag 0 and 1 the same radius."""
    gen = torch.Generator().manual_seed(seed)
    p, k, beta, eps = 5, 4, 0.1, 0.05
    logp = torch.randn(p, k, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(p, k, generator=gen, dtype=torch.float64)
    reward = torch.rand(p, k, generator=gen, dtype=torch.float64)
    behaviour = logp.detach() + 0.3 * torch.randn(p, k, generator=gen, dtype=torch.float64)
    proximal = logp.detach() + 0.05 * torch.randn(p, k, generator=gen, dtype=torch.float64)
    lags = torch.randint(0, 300, (p, k), generator=gen)
    got = tb_clipped(logp, ref, reward, beta, behaviour, eps, lags)
    both = tb_clipped(logp, ref, reward, beta, behaviour, eps, lags, proximal)
    d = (logp.detach() - ref - reward / beta).tolist()
    for i, j in itertools.product(range(p), range(k)):
        sign = -math.copysign(1.0, d[i][j] - sum(d[i]) / k)
        u = sign * (logp[i, j].item() - behaviour[i, j].item())
        u_proximal = sign * (logp[i, j].item() - proximal[i, j].item())
        sampler = u > eps * math.sqrt(max(1, int(lags[i, j])))
        assert got[i, j].item() == sampler, (i, j)
        assert both[i, j].item() == (sampler or u_proximal > eps), (i, j)
    assert (both & ~got).any()  # the second anchor drops items the first keeps
    fixed = tb_clipped(logp, ref, reward, beta, behaviour, eps)
    assert torch.equal(fixed, tb_clipped(logp, ref, reward, beta, behaviour, eps, lags * 0))
    assert torch.equal(fixed, tb_clipped(logp, ref, reward, beta, behaviour, eps, lags * 0 + 1))
    assert got.sum() < fixed.sum()  # older items get wider radii
    loss = tb_loss(logp, ref, reward, beta, behaviour, eps, lags, proximal)
    (grad,) = torch.autograd.grad(loss, logp)
    want = tb_loss(torch.where(both, logp.detach(), logp), ref, reward, beta)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad)
