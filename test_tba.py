"""The learner's tests: TBA's equations against slow loops and closed forms, its components on
tiny models built in code, and one run of the whole system. ``python -m pytest -q test_tba.py``
runs in under a minute; tests/ holds the rest (one file per component), and CI runs both.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    get_wsd_schedule,
)

from buffer import ReplayBuffer, Trajectory
from engines import WeightStore
from extensions.checks import sequence_logprobs
from extensions.evaluate import to_examples
from extensions.tiny import cpu_config, save_tiny_model, synthetic_problems
from plumbing.logprobs import distinct_responses, pad_sequences
from rewards import gsm8k_reward
from tba import (
    TBAConfig,
    beta_at,
    group_logprobs,
    group_token_logprobs,
    scored_tokens,
    target_logprobs,
    tb_clipped,
    tb_log_z,
    tb_loss,
    wsd_lr_factor,
)
from trainer import Parts, Trainer, run_tba

REPO = Path(__file__).resolve().parent


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


def test_tb_clip_keeps_the_loss_and_drops_exactly_the_items_moved_past_eps():
    """The trust region changes only the gradient: the loss's value is the plain one, an item
    the policy moved more than eps beyond its behaviour log-prob in the direction its residual
    pushes (u = -sign(e) rho > eps) gets none, and every other item its plain 2 e / (P K)."""
    gen = torch.Generator().manual_seed(4)
    p, k, beta, eps = 3, 6, 0.5, 0.3
    logp = (torch.randn(p, k, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ref = torch.randn(p, k, generator=gen, dtype=torch.float64)
    reward = torch.rand(p, k, generator=gen, dtype=torch.float64)
    rho = torch.randn(p, k, generator=gen, dtype=torch.float64)  # log pi - log pi_b
    behaviour = logp.detach() - rho
    loss = tb_loss(logp, ref, reward, beta, behaviour, clip_eps=eps)
    assert loss.item() == pytest.approx(tb_loss(logp, ref, reward, beta).item(), rel=1e-12)
    loss.backward()
    rows = (logp - ref - reward / beta).detach().tolist()
    dropped = 0
    for i, row in enumerate(rows):
        log_z = -sum(row) / k
        for j, dj in enumerate(row):
            e = log_z + dj
            u = -(1 if e > 0 else -1) * rho[i, j].item()
            want = 0.0 if u > eps else 2 * e / (p * k)
            dropped += u > eps
            assert logp.grad[i, j].item() == pytest.approx(want, abs=1e-12)
    assert 0 < dropped < p * k  # both kinds of item were there
    clipped = tb_clipped(logp, ref, reward, beta, behaviour, eps)
    assert clipped.sum().item() == dropped


def test_tb_clip_on_policy_is_plain_tb():
    """With the behaviour policy the current one (rho = 0), nothing is clipped: the gradient is
    plain TB's exactly."""
    gen = torch.Generator().manual_seed(5)
    logp = (torch.randn(4, 5, generator=gen, dtype=torch.float64) * 10).requires_grad_()
    ref = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    reward = torch.rand(4, 5, generator=gen, dtype=torch.float64)
    (plain,) = torch.autograd.grad(tb_loss(logp, ref, reward, 0.1), logp)
    clipped = tb_loss(logp, ref, reward, 0.1, behaviour_logp=logp.detach(), clip_eps=1e-9)
    (robust,) = torch.autograd.grad(clipped, logp)
    torch.testing.assert_close(robust, plain, rtol=0, atol=0)


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
    with pytest.raises(ValueError, match="clip_eps must be >= 0"):
        tb_loss(x, x, x, 1.0, x, clip_eps=-0.1)
    with pytest.raises(ValueError, match="clip_eps needs behaviour_logp of logp's shape"):
        tb_loss(x, x, x, 1.0, clip_eps=0.3)


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


def tabular_tb_run(clip_eps: float, lag: int | None, steps: int = 400, drop=None):
    """Train a tabular policy by TB on data of the policy ``lag`` steps before (None: of a fixed
    behaviour policy far from the target); returns the total variation from p_ref exp(r/beta)/Z
    and the largest fraction of items a step clipped. ``drop(logp, ref_logp, reward, beta,
    behaviour_logp)``, when given, names the items that give no gradient (a mask such as
    extensions/offpolicy.py's; tests/test_offpolicy.py)."""
    vocab, length, beta, p, k = 3, 3, 0.5, 8, 8
    policy = TabularPolicy(vocab, length, scale=0.0)
    ref = TabularPolicy(vocab, length, scale=1.0, seed=11)
    behaviour = TabularPolicy(vocab, length, scale=1.5, seed=12)
    gen = torch.Generator().manual_seed(13)
    rewards = torch.rand(len(policy.sequences), generator=gen, dtype=torch.float64)
    reward_of = dict(zip(policy.sequences, rewards.tolist(), strict=True))
    with torch.no_grad():
        target = (ref.log_prob(policy.sequences) + rewards / beta).softmax(0)
    opt = torch.optim.Adam(policy.parameters(), lr=0.1)
    past = [policy.logits.detach().clone()]
    most_clipped = 0.0
    for _ in range(steps):
        if lag is not None:
            with torch.no_grad():
                behaviour.logits.copy_(past[max(0, len(past) - 1 - lag)])
        flat = [s for _ in range(p) for s in behaviour.sample(k, gen)]
        logp = policy.log_prob(flat).view(p, k)
        ref_logp = ref.log_prob(flat).view(p, k).detach()
        behaviour_logp = behaviour.log_prob(flat).view(p, k).detach()
        reward = torch.tensor([reward_of[s] for s in flat], dtype=torch.float64).view(p, k)
        clipped = tb_clipped(logp, ref_logp, reward, beta, behaviour_logp, clip_eps)
        most_clipped = max(most_clipped, clipped.double().mean().item())
        if drop is not None:
            dropped = drop(logp, ref_logp, reward, beta, behaviour_logp)
            logp = torch.where(dropped, logp.detach(), logp)
        loss = tb_loss(logp, ref_logp, reward, beta, behaviour_logp, clip_eps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        past.append(policy.logits.detach().clone())
    with torch.no_grad():
        learned = policy.log_prob(policy.sequences).exp()
    return 0.5 * (learned - target).abs().sum().item(), most_clipped


def test_tb_clip_reaches_the_target_from_stale_data():
    """Data 8 steps stale, the clip binding on up to half the items of a step: the policy still
    reaches p_ref exp(r/beta)/Z (the fixed point is the plain one, and the sampler follows the
    policy). Data from a fixed policy far from the target is the case it is not for: every
    item is soon past eps and the policy stops short (plain TB reaches it,
    test_tb_off_policy_converges_to_closed_form_target)."""
    tv, most_clipped = tabular_tb_run(clip_eps=0.3, lag=8)
    assert tv < 1e-3, f"total variation {tv:.4f} from the target"
    assert most_clipped > 0.3
    tv, most_clipped = tabular_tb_run(clip_eps=0.3, lag=None)
    assert tv > 0.3 and most_clipped == 1.0


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
        logprob_temperature=0.7,
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
            logprob_temperature=0.7,
            include_eos=include_eos,
            share_prompt=share,
        )
        results.append((logp, torch.autograd.grad(logp.sum(), list(model.parameters()))))
    (shared, shared_grads), (plain, plain_grads) = results
    assert shared.shape == (3, 3)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-4)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def row_by_row(model, prompts, groups, *, pad_id, eos_id, logprob_temperature, include_eos):
    """Slow reference of ``group_token_logprobs``: each response alone, one forward of prompt +
    response, no shared prefill, no de-duplication; rows padded with 0 as it pads them."""
    rows = []
    for prompt, group in zip(prompts, groups, strict=True):
        for response in group:
            tokens = scored_tokens(response, eos_id, include_eos)
            logits = model(torch.tensor([prompt + tokens])).logits[:, len(prompt) - 1 : -1]
            rows.append(target_logprobs(logits, torch.tensor([tokens]), logprob_temperature)[0])
    width = max(1, max(len(row) for row in rows))
    token_logp = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])
    mask = torch.tensor([[int(c < len(row)) for c in range(width)] for row in rows])
    return token_logp, mask


def test_repeated_responses_are_scored_once_with_the_same_values_and_gradient(tiny_model_dir):
    """A group that holds a response twice or more (drawn with replacement) scores it once and
    copies its row: the log-probs, per token and summed, and the gradient through them equal
    scoring every row alone (``row_by_row``), whose weights then count each copy."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = [[5, 6, 7], [8, 9]]
    groups = [[[20, 1], [21, 22, 1], [20, 1], [20, 1]], [[23, 1], [23, 1], [24], [25, 26, 1]]]
    rule = dict(pad_id=0, eos_id=1, logprob_temperature=0.7, include_eos=False)
    distinct, rows = distinct_responses(groups)
    assert distinct == [[[20, 1], [21, 22, 1], [20, 1]], [[23, 1], [24], [25, 26, 1]]]
    assert rows.tolist() == [0, 1, 0, 0, 3, 3, 4, 5]
    results = []
    for scorer in (group_token_logprobs, row_by_row):
        token_logp, mask = scorer(model, prompts, groups, **rule)
        weights = torch.autograd.grad((token_logp * 1.5).sum(), list(model.parameters()))
        results.append((token_logp, mask, weights))
    (once, once_mask, once_grads), (every, every_mask, every_grads) = results
    assert torch.equal(once_mask, every_mask) and once.shape == (8, 2)
    torch.testing.assert_close(once, every, rtol=1e-5, atol=1e-5)
    for a, b in zip(once_grads, every_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


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
    assert (cfg.mop_prob, cfg.publish_every, cfg.inv_temp) == (0.95, 2, 0.0)
    assert (cfg.initial_samples, cfg.buffer_capacity) == (500, 100)
    assert cfg.total_steps // cfg.checkpoint_every == 4
    # Each variant of the paper's equations is one flag away.
    variant = TBAConfig(
        tempered_logprobs=False, eos_in_logprob=True, fp32_master_weights=True, max_grad_norm=1.0
    )
    assert variant.logprob_temperature() == 1.0


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
    assert (buf.by_prompt["a"][0].reward, buf.by_prompt["a"][0].version) == (1.0, 3)
    for v in range(10):
        buf.add(traj("b", [v], version=v))
    assert [t.version for t in buf.by_prompt["b"]] == [6, 7, 8, 9]
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
    buf.mark_published()
    for pid in (0, 4, 5, 11):  # refreshed after the publish, two of them with old items only
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


def test_buffer_mop_prompts_are_those_refreshed_since_the_latest_sync():
    m = 0.7
    buf = ReplayBuffer(capacity=50, mop_prob=m, seed=1)
    for pid in range(40):
        for j in range(6):
            buf.add(traj(pid, [pid, j], version=0))
    buf.mark_published()
    for pid in range(30, 40):  # ten prompts refreshed after the publish, by version 2
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
    buf.mark_published()
    buf.add(traj(5, [5, 99], version=4))
    buf.mop_prob = 1.0
    groups, is_mop = buf.sample(3, 2)
    assert all(is_mop) and {g[0].prompt_id for g in groups} == {5, 38, 39}


def test_weight_store_seqlock_round_trip_cpu():
    src = torch.nn.Linear(4, 3)
    store = WeightStore(list(src.named_parameters()), torch.float32, torch.device("cpu"))
    assert store.version() == -1
    store.publish(list(src.named_parameters()), version=5, probe=-1.5)
    dst = torch.nn.Linear(4, 3)
    params = dict(dst.named_parameters())

    def load(named):
        with torch.no_grad():
            for name, t in named:
                params[name].copy_(t)

    assert store.load_into(load) == (5, -1.5)
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    store.header[WeightStore.SEQ] += 1  # a writer in the middle of a publish: never returns
    with pytest.raises(TimeoutError):
        store.load_into(load, timeout_s=0.2)


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


def digit_reward(completion: str, example: dict) -> float:
    """A dense toy reward (fraction of digits), so an untrained model gets a gradient."""
    return sum(ch.isdigit() for ch in completion) / (len(completion) + 1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama and character tokenizer, built in code, untrained."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden=32, layers=2, heads=2)


def tiny_examples(n: int = 24) -> list[dict]:
    return to_examples(synthetic_problems(n, seed=0))


def tiny_cfg(model_dir: str, out: Path, **overrides) -> TBAConfig:
    """Two searchers and a trainer on the CPU, small enough for a test. Every wait's timeout is
    3 minutes: a hang, where two searchers' start took over a minute at a load of 20 on two
    cores."""
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
        publish_every=2,
        beta_start=1.0,
        beta_end=1.0,
        output_dir=str(out),
        timeout_s=180,
        max_searcher_restarts=0,
    )
    values.update(overrides)
    return cpu_config(model_dir, **values)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def pace(trainer, metrics):
    """On this CPU a trainer step is ~10x faster than a searcher batch, so in 24 steps one
    searcher may deliver nothing. From step 12 on, hold the trainer (as a slow GPU step would)
    until both searchers have delivered data made with trained weights."""
    if trainer.step >= 12 and min(metrics.get(f"searcher{k}/version", 0) for k in (0, 1)) == 0:
        time.sleep(1.0)


class ReadsBackTrainer(Trainer):
    """The core's trainer that, after each publish, reads the store back as a searcher does:
    ``published[version]`` holds the weights that version sent out, flattened."""

    def publish(self, store: WeightStore) -> float:
        seconds = super().publish(store)
        read = {}
        version, _ = store.load_into(lambda named: read.update(weights=flat_weights(named)))
        self.published = {**getattr(self, "published", {}), version: read["weights"]}
        return seconds


def flat_weights(named) -> torch.Tensor:
    """(name, tensor) pairs as one flat fp32 copy."""
    return torch.cat([t.detach().flatten().float() for _, t in named]).clone()


def test_system_async_two_searchers(tiny_model_dir, tmp_path):
    """The whole system: two searcher processes and the trainer, 24 steps, publishing every 2.
    It trains: the loss is finite at every step, and the weights published (read back from the
    store the searchers load) move away from the model the run started from."""
    cfg = tiny_cfg(tiny_model_dir, tmp_path)
    trainer = run_tba(
        cfg,
        tiny_examples(),
        digit_reward,
        parts=Parts(trainer=ReadsBackTrainer),
        on_step=pace,
        show_progress=False,
    )
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 25)) and trainer.step == 24
    assert all(math.isfinite(r["loss/tb"]) for r in rows)
    start = flat_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert sorted(trainer.published) == list(range(0, 25, 2))
    assert torch.equal(trainer.published[0], start)
    assert torch.equal(trainer.published[24], flat_weights(trainer.model.named_parameters()))
    moved = [(trainer.published[v] - start).norm().item() for v in (2, 24)]
    assert moved[1] > moved[0] > 0, f"published weights moved {moved} from the start"
    # Trajectories arrived from both searchers, and both moved on to newer weights.
    last = rows[-1]
    assert last["searcher0/version"] > 0 and last["searcher1/version"] > 0
    # Staleness. Searchers only ever hold published versions (multiples of k = 2); no step
    # trains on data fresher than the newest any searcher delivered; and the trainer never ran
    # more than barrier_lag = 3 versions ahead of its newest data (it waited instead).
    for r in rows:
        versions = [r[f"searcher{k}/version"] for k in (0, 1) if f"searcher{k}/version" in r]
        assert all(v % 2 == 0 for v in versions)
        assert r["async/lag_min"] >= r["step"] - 1 - max(versions)
        assert r["step"] - 1 - max(versions) <= cfg.barrier_lag
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
    assert multiprocessing.active_children() == []  # every searcher process is gone
