"""The trust region in the synchronous mode, both ways: the core's rule, anchored on on-policy
data at the previous update's weights (trainer.py), and two updates a batch, the second
against the sampler (extensions/sync_region.py). At a radius of 0 the first is plain
synchronous TB exactly and the second plain TB's update taken twice on each batch; at a radius
above 0 each region acts, and its gradient is tb_loss's with the region's anchor."""

from __future__ import annotations

import random

import pytest
import torch

from buffer import Trajectory
from extensions import grpo, offpolicy, sync_region
from extensions.offpolicy import OffPolicyConfig
from extensions.tiny import cpu_config
from plumbing.config import ConfigError
from tba import group_logprobs, tb_clipped, tb_loss
from trainer import Parts, Trainer

SIZES = dict(
    num_generations=4, responses_per_prompt=4, prompts_per_step=4, searcher_batch_prompts=4
)
# A constant lr and beta (no warmup, no anneal): two updates of the core's then take the lr and
# beta of one step of two passes.
STEADY = dict(lr=3e-2, warmup_steps=0, beta_start=0.05, beta_end=0.05, max_grad_norm=1.0)


def config(model_dir: str, eps: float, synchronous: bool = True):
    return cpu_config(model_dir, synchronous=synchronous, tb_clip_eps=eps, **SIZES, **STEADY)


def trainer_of(mode: str, cfg) -> Trainer:
    """The core trainer ("core") or the two-pass one ("two_pass")."""
    parts = offpolicy.install(Parts(), OffPolicyConfig(sync_two_pass=mode == "two_pass"))
    torch.manual_seed(0)
    return parts.trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)


def rule(trainer: Trainer) -> dict:
    return trainer.cfg.scoring_rule(0, 1, "cpu")


def on_policy_batch(trainer: Trainer, seed: int) -> list[list[Trajectory]]:
    """P groups of K random responses generated, as the synchronous mode's searcher would, by the
    trainer's current weights: version = its step, log pi_b = its log-probs by the scoring rule."""
    rng = random.Random(seed)
    groups = [
        [
            Trajectory(
                p,
                [5, 6, 7 + p],
                [rng.randrange(4, 60) for _ in range(rng.randint(1, 6))] + [1],
                float(rng.random() < 0.5),
                -rng.uniform(5, 20),
                trainer.step,
            )
            for _ in range(SIZES["responses_per_prompt"])
        ]
        for p in range(SIZES["prompts_per_step"])
    ]
    with torch.no_grad():
        logp = logprobs(trainer.model, groups, rule(trainer))
    for row, group in zip(logp.tolist(), groups, strict=True):
        for value, t in zip(row, group, strict=True):
            t.behaviour_logprob = value
    return groups


def logprobs(model, groups, scoring) -> torch.Tensor:
    prompts = [g[0].prompt_tokens for g in groups]
    responses = [[t.response_tokens for t in g] for g in groups]
    return group_logprobs(model, prompts, responses, **scoring)


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def plain_update(trainer: Trainer, groups) -> None:
    """Plain TB's AdamW step, as written out here (no trust region): the reference."""
    cfg = trainer.cfg
    logp = logprobs(trainer.model, groups, rule(trainer))
    ref = torch.tensor([[t.ref_logprob for t in g] for g in groups])
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    trainer.optimizer.zero_grad(set_to_none=True)
    tb_loss(logp, ref, reward, trainer.beta()).backward()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.max_grad_norm)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.step += 1


def test_at_radius_0_the_synchronous_mode_is_plain_tb_exactly(tiny_model_dir):
    """--synchronous at --tb_clip_eps 0: the trainer keeps no previous weights, and three steps
    give the weights of plain TB's steps written out."""
    mine = trainer_of("core", config(tiny_model_dir, 0.0))
    plain = trainer_of("core", config(tiny_model_dir, 0.0))
    assert type(mine) is Trainer and mine.previous is None
    for step in range(3):
        groups = on_policy_batch(plain, step)
        metrics = mine.update(groups)
        plain_update(plain, groups)
        assert metrics["offpolicy/clip_frac"] == 0
        for a, b in zip(weights(mine), weights(plain), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_at_radius_0_two_passes_are_plain_tb_taken_twice_on_each_batch(tiny_model_dir):
    """--sync_region two_pass at --tb_clip_eps 0: each step is two of the core's updates on its
    batch (the same lr and beta), and the step count goes up by one a batch."""
    mine = trainer_of("two_pass", config(tiny_model_dir, 0.0))
    core = trainer_of("core", config(tiny_model_dir, 0.0))
    assert isinstance(mine, sync_region.TwoPassTrainer) and mine.previous is None
    for step in range(2):
        groups = on_policy_batch(core, step)
        metrics = mine.update(groups)
        first = core.update(groups)
        core.update(groups)
        assert mine.step == step + 1
        assert metrics["two_pass/first_loss"] == pytest.approx(first["loss/tb"], rel=1e-6)
        for a, b in zip(weights(mine), weights(core), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
        for t in (t for g in groups for t in g):  # the next batch: the core's version
            t.version = mine.step


def test_proximal_region_acts_against_the_previous_updates_weights(tiny_model_dir):
    """At eps 0.02 the core's rule on on-policy data clips nothing at step 0 (the previous
    weights are the current ones) and some items after it; the gradient is tb_loss's with the
    previous update's log-probs as proximal_logp, which the trainer keeps as a copy of those
    weights."""
    eps = 0.02
    trainer = trainer_of("core", config(tiny_model_dir, eps))
    shares = []
    for step in range(3):
        groups = on_policy_batch(trainer, step)
        before = weights(trainer)
        previous = [p.detach().clone() for p in trainer.previous.parameters()]
        if step > 0:  # the previous update's weights, not the current ones
            assert not all(torch.equal(a, b) for a, b in zip(previous, before, strict=True))
        anchor = logprobs(trainer.previous, groups, rule(trainer)).detach().double()
        logp = logprobs(trainer.model, groups, rule(trainer))
        ref = torch.tensor([[t.ref_logprob for t in g] for g in groups])
        reward = torch.tensor([[t.reward for t in g] for g in groups])
        beta = trainer.beta()
        behaviour = [[t.behaviour_logprob for t in g] for g in groups]
        behaviour = torch.tensor(behaviour, dtype=torch.float64)
        lags = torch.zeros(behaviour.shape)
        want = tb_loss(logp, ref, reward, beta, behaviour, eps, lags, anchor)
        clipped = tb_clipped(logp, ref, reward, beta, behaviour, eps, lags, anchor)
        assert torch.equal(clipped, tb_clipped(logp, ref, reward, beta, anchor, eps))
        want_grads = torch.autograd.grad(want, list(trainer.model.parameters()))
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics = trainer.backward(groups, beta)
        assert metrics["loss/tb"] == pytest.approx(want.item(), rel=1e-5)
        assert metrics["offpolicy/clip_frac"] == clipped.double().mean().item()
        for g, p in zip(want_grads, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
        shares.append(trainer.update(groups)["offpolicy/clip_frac"])
        for kept, w in zip(trainer.previous.parameters(), before, strict=True):
            assert torch.equal(kept, w)  # the anchor is now the weights this step started from
    assert shares[0] == 0 and min(shares[1:]) > 0, shares


def test_two_pass_region_acts_at_the_second_pass_against_the_sampler(tiny_model_dir):
    """At eps 0.02 the second pass, one update from the sampler, clips some items, and its
    gradient is tb_loss's against the sampler's log pi_b after the first pass's update."""
    eps = 0.02
    trainer = trainer_of("two_pass", config(tiny_model_dir, eps))
    core = trainer_of("core", config(tiny_model_dir, eps))
    groups = on_policy_batch(trainer, 0)
    core.update(groups)  # the first pass: plain TB on-policy (nothing clipped at step 0)
    logp = logprobs(core.model, groups, rule(core))
    ref = torch.tensor([[t.ref_logprob for t in g] for g in groups])
    reward = torch.tensor([[t.reward for t in g] for g in groups])
    behaviour = [[t.behaviour_logprob for t in g] for g in groups]
    behaviour = torch.tensor(behaviour, dtype=torch.float64)
    beta = trainer.beta()
    want = tb_loss(logp, ref, reward, beta, behaviour, eps)
    clipped = tb_clipped(logp, ref, reward, beta, behaviour, eps)
    want_grads = torch.autograd.grad(want, list(core.model.parameters()))
    trainer.optimizer.zero_grad(set_to_none=True)
    metrics = trainer.backward(groups, beta)
    assert metrics["loss/tb"] == pytest.approx(want.item(), rel=1e-5)
    assert metrics["offpolicy/clip_frac"] == clipped.double().mean().item() > 0
    for g, p in zip(want_grads, trainer.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_two_passes_are_a_synchronous_tb_option(tiny_model_dir):
    with pytest.raises(ConfigError, match="--synchronous"):
        trainer_of("two_pass", config(tiny_model_dir, 0.05, synchronous=False))
    with pytest.raises(ConfigError, match="--sync_two_pass"):
        OffPolicyConfig(sync_two_pass=True, tb_m2_tau=0.1)
    with pytest.raises(ConfigError, match="--loss tb"):
        offpolicy.install(
            grpo.install(Parts(), grpo.GRPOConfig(loss="grpo")), OffPolicyConfig(sync_two_pass=True)
        )
    assert offpolicy.install(Parts(), OffPolicyConfig()) == Parts()
