"""Trajectory Balance with Asynchrony (TBA): the algorithm, its loss, and the config.

Bartoldson et al., "Trajectory Balance with Asynchrony: Decoupling Exploration and Learning for
Fast, Scalable LLM Post-Training", arXiv 2503.18929 (NeurIPS 2025).

Notation: x a prompt, y a response (token ids, ending in EOS unless cut); pi the policy, p_ref
the frozen reference; r(x, y) the reward; beta > 0 the KL strength; N responses generated per
prompt (paper 24); P prompts and K responses per prompt in a trainer step (7 and 20); m the
probability that a step's prompt is most-on-policy (MOP, 0.95); k the publish interval (2); T the
sampling temperature (0.7). The weights after t trainer steps are version t; a trajectory's lag
is how many versions older than the trainer's its generating weights are.
The target is pi*(y|x) = p_ref(y|x) exp(r(x, y) / beta) / Z(x), the KL-regularised optimum.

The algorithm (the main loops in the code are labelled with these numbers)
  1. Each searcher (searcher.py) holds pi at some version and a frozen p_ref. Repeatedly:
     a. between generate calls, load the newest published weights if they are newer;
     b. take the next prompts of its shard and generate N responses each at temperature T;
     c. score r(x, y) and log p_ref(y|x), and keep log pi_b(y|x), the engine's own log-prob of
        what it sampled (pi_b, the behaviour policy: the weights that sampled y);
     d. send the trajectories (x, y, r, log p_ref, log pi_b, version) through a bounded queue.
  2. The trainer (trainer.py) drains the queue into a replay buffer grouped by prompt (buffer.py),
     on a thread of its own, so that intake overlaps the step. It waits for the initial fill,
     then only while its newest data is over max_lag versions old (or, with max_train_lag,
     until P prompts hold data at most that many versions old).
  3. Each step samples P groups of K trajectories. With probability m a group is MOP: a prompt
     refreshed since the latest publish (or one of the P most recently refreshed) with its
     newest items; else any prompt, items drawn by softmax(r * inv_temp). Stale data is fine:
     the TB optimum does not depend on where the samples came from. The path to it does: on
     the tiny task plain TB collapses on data four versions old, and holds at sixteen with
     step 4's trust region (docs/staleness.md); max_train_lag can bound the age of every item
     a step draws.
  4. It recomputes log pi(y|x) with gradients and takes an AdamW step on the VarGrad TB loss
     (Eq. 5): d_i = log pi(y_i|x) - log p_ref(y_i|x) - r(x, y_i) / beta, log Z = -mean_i d_i
     (detached), L = mean over the P prompts and their K responses of (log Z + d_i)^2; with a
     trust region (tb_clip_eps), no gradient from an item the policy has already moved more
     than eps beyond log pi_b in the direction its residual pushes.
  5. Every k steps it publishes its weights as the version equal to its step count.
The synchronous baseline (--synchronous) is the same code on-policy: a searcher generates once
per version, and the trainer trains only on data of its current version and publishes every step.

The paper preset is the released run (bbartoldson/TBA, launch_training_gsm8k.sh: rho-1b from
40.3% to 54.6%). Four of its choices differ from the paper's text; each is one flag:
  * tempered_logprobs (on): log pi and log p_ref are of logits / T, so the target is the
    tempered policy, the one the searchers sample from. Off: the models themselves (Eq. 5).
  * eos_in_logprob (off): the EOS that ends a response is kept but not scored (the released
    code pads with EOS and masks it). On: stopping is part of the response.
  * fp32_master_weights (off): weights and AdamW moments in bf16. An AdamW step moves a weight
    by about lr at most, so at lr 1e-5 a bf16 weight with |w| > ~0.004 (half an ulp > 1e-5)
    does not move. On: fp32 weights and moments, bf16 autocast.
  * max_grad_norm (0): no clipping. With r / beta between 71 and 250, clipping at 1.0 would
    bind nearly every step and change the effective learning rate.

Deviations from the official code, with reasons
  * Processes and queues, no barrier at every sync: the trainer waits only as max_lag says (the
    barrier kept the newest data within 2k - 1 = 3 versions, the default).
  * MOP without barriers: official MOP prompts are those a sync delivered at once; here data
    trickles in, so they are topped up with the most recently refreshed: async/mop_frac is m.
  * Weights travel as shared tensors (CUDA IPC or shared memory) with a version counter, not as
    MPI broadcasts: a sync is a device copy.
  * Log-softmax runs in fp32 (``token_logprobs`` says why); the official code runs it in bf16.
  * A prompt runs once, its KV cache shared by its K responses (``group_logprobs``): exact.
  * Searchers shuffle their prompt shard each pass (seeded); the official ones walk it in order.
  * Searchers start, and size their engines' memory, before the trainer loads its model, and
    generate nothing before the first publish: on one shared GPU vLLM sizes its KV cache from
    the memory free at its start.
Extensions (the GRPO baseline, a data-parallel trainer, searchers on other machines, the
checks) name their own departures in their files; README, "Extensions", lists them.

Options beyond the paper, off in its preset, each one flag (docs/staleness.md):
  * max_train_lag: a bound on the age of everything a step trains on. The released run
    bounds only the newest data (its barrier) and replays from the whole buffer.
  * replay_ratio: a bound on trajectories trained per trajectory generated, so that a trainer
    faster than its searchers replays at a known rate instead of as fast as it can; with
    max_train_lag it spends TB's tolerance for stale data on steps (docs/tiny.md, "the
    accounting"). The released run has no such bound.
  * tb_clip_eps: a trust region for TB on each item's behaviour log-prob (``tb_loss``): an
    item the policy has already moved more than eps nats beyond where the weights that
    sampled it had it, in the direction its residual pushes, gives no gradient. The loss and
    its zero, hence the optimum, do not move; on-policy it is plain TB. Plain TB collapses on
    the tiny task from data four versions old; with the clip it holds at 16. On in the tiny
    presets; off in the paper preset, whose bf16 vLLM log-probs are not the trainer's to
    within eps on long responses without a measurement on GPUs (docs/staleness.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------- 4. the loss


def tb_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    behaviour_logp: torch.Tensor | None = None,
    clip_eps: float = 0.0,
) -> torch.Tensor:
    """VarGrad trajectory-balance loss (paper Eq. 5). Needs only torch; copy it anywhere.

    Shapes: ``logp``, ``ref_logp``, ``reward`` are float tensors (P, K) -- K responses to each
    of P prompts. ``logp`` = log pi_theta(y|x) summed over response tokens (carries the
    gradient), ``ref_logp`` = log p_ref(y|x) likewise, ``reward`` = r(x, y). Returns a scalar
    in fp32.

    Contract for a copier:
      * ``logp`` and ``ref_logp`` must be scored by the same rule: the same temperature (logits
        / T on both sides, or neither) and the same tokens (a final EOS scored on both sides,
        or on neither). Any mismatch adds a per-response offset to d that the loss then trains
        into the policy. ``group_token_logprobs`` below is that rule (``group_logprobs``
        its row sums), used on both sides here.
      * The arithmetic runs in fp32 at least, whatever the input dtype: r / beta reaches 250 in the
        paper preset, where a bf16 number is only good to about 1 (8 bits of mantissa), so a
        bf16 d would lose whole nats of the signal.

        d_ij    = logp_ij - ref_logp_ij - reward_ij / beta
        logZ_i  = -mean_j d_ij                    (detached)
        loss    = mean_ij (logZ_i + d_ij)^2       (= mean over prompts of the variance of d)

    Why log Z is detached: it is the per-prompt VarGrad estimate of the log-partition function
    (the optimal constant for the batch), not a parameter; its gradient through the mean would
    be zero in expectation and only adds noise (Richter et al. 2020, VarGrad).

    Why it works off-policy: the loss is zero exactly when d is constant in y for each x, i.e.
    pi_theta(y|x) proportional to p_ref(y|x) exp(r/beta), whichever distribution the y's came
    from -- so stale, replayed trajectories are fine (paper Sec. 3).

    On-policy link (paper App. A): with R = r - beta log(pi/p_ref), the KL-regularised reward,
    d_ij - mean_j d = -(R_ij - mean_j R)/beta, so
        grad loss = -(2/beta) (1/(PK)) sum_ij (R_ij - mean_j R_ij) grad log pi(y_ij|x_i),
    i.e. REINFORCE with a per-prompt mean baseline on R, scaled by 2/beta.

    Trust region (``clip_eps`` > 0; docs/staleness.md). The optimum does not depend on the
    data, but the path to it does: the gradient 2 e_ij grad logp_ij (e = logZ + d, the
    residual) keeps pushing an item down while e > 0 and up while e < 0 at full strength, even
    after the policy has moved that item far past where the policy that sampled it had it --
    on data several versions old it keeps pushing down answers it already avoids, and the mass
    goes to sequences the data never shows. ``behaviour_logp`` (P, K) is log pi_b(y|x) of the
    weights that sampled each item, scored by the same rule as ``logp``; rho = logp -
    behaviour_logp (detached) is how far the policy has moved on the item, and u = -sign(e) rho
    how far in the direction the step pushes. An item with u > clip_eps gives no gradient
    (``tb_clipped``), as PPO's clip stops pushing a ratio out of [1 - eps, 1 + eps], but on
    the sequence and one-sided: an item the policy has moved the other way keeps its gradient.
    Only the gradient changes: log Z, the residuals and the loss's value are the plain ones.
    At the target every e is 0, so nothing is clipped and the fixed point is the plain one;
    on-policy rho = 0 and the gradient is plain TB's exactly. The region is the sampler's, so
    it suits data whose sampler follows the policy (TBA's searchers, some versions behind):
    from a fixed sampler far from the target (an offline dataset) every item is soon past eps
    and the policy stops short of it. Leave it off for such data.
    """
    if logp.dim() != 2 or logp.shape != ref_logp.shape or logp.shape != reward.shape:
        raise ValueError(
            "tb_loss: logp, ref_logp and reward must share a (P, K) shape, got "
            f"{tuple(logp.shape)}, {tuple(ref_logp.shape)}, {tuple(reward.shape)}"
        )
    if logp.shape[1] < 2:
        raise ValueError("tb_loss: K must be >= 2 (with one response per prompt the loss is 0)")
    if beta <= 0:
        raise ValueError(f"tb_loss: beta must be > 0, got {beta}")
    if clip_eps < 0:
        raise ValueError(f"tb_loss: clip_eps must be >= 0 (0: no trust region), got {clip_eps}")
    d = _tb_residual(logp, ref_logp, reward, beta)
    log_z = -d.mean(dim=1, keepdim=True).detach()
    if clip_eps > 0:  # the trust region: the same values, no gradient from the clipped items
        clipped = tb_clipped(logp, ref_logp, reward, beta, behaviour_logp, clip_eps)
        d = _tb_residual(torch.where(clipped, logp.detach(), logp), ref_logp, reward, beta)
    return (log_z + d).pow(2).mean()


def tb_clipped(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    reward: torch.Tensor,
    beta: float,
    behaviour_logp: torch.Tensor,
    clip_eps: float,
) -> torch.Tensor:
    """The items (P, K, bool) whose gradient ``tb_loss``'s trust region drops: those the
    policy has already moved more than ``clip_eps`` nats beyond the behaviour policy in the
    direction their residual pushes, u = -sign(logZ + d) (logp - behaviour_logp) > clip_eps."""
    if behaviour_logp is None or behaviour_logp.shape != logp.shape:
        shape = None if behaviour_logp is None else tuple(behaviour_logp.shape)
        raise ValueError(f"tb_loss: clip_eps needs behaviour_logp of logp's shape, got {shape}")
    d = _tb_residual(logp.detach(), ref_logp, reward, beta)
    residual = d - d.mean(dim=1, keepdim=True)
    rho = logp.detach().to(d.dtype) - behaviour_logp.to(d.dtype)
    return -torch.sign(residual) * rho > clip_eps


def tb_log_z(
    logp: torch.Tensor, ref_logp: torch.Tensor, reward: torch.Tensor, beta: float
) -> torch.Tensor:
    """The per-prompt VarGrad log Z (P,) used inside ``tb_loss``; for metrics."""
    return -_tb_residual(logp, ref_logp, reward, beta).mean(dim=1).detach()


def _tb_residual(
    logp: torch.Tensor, ref_logp: torch.Tensor, reward: torch.Tensor, beta: float
) -> torch.Tensor:
    """d = logp - ref_logp - reward / beta in fp32 at least (fp64 stays fp64)."""
    wide = torch.promote_types(logp.dtype, torch.float32)
    return logp.to(wide) - ref_logp.to(wide) - reward.to(wide) / beta


# ----------------------------------------------------------------------------- 4. schedules


def beta_at(step: int, start: float, end: float, anneal_steps: int) -> float:
    """Linear anneal of beta from ``start`` (step 0) to ``end`` (step >= anneal_steps). The
    released TL;DR run also cuts the line short (run_tldr.py, ``beta_cut_step``)."""
    if anneal_steps <= 0:
        return end
    return start + (end - start) * min(max(step, 0) / anneal_steps, 1.0)


def wsd_lr_factor(step: int, warmup: int, stable: int, decay: int) -> float:
    """Warmup-stable-decay multiplier of the peak lr, as transformers' ``get_wsd_schedule``:
    linear from 0 over ``warmup`` steps, 1 for ``stable`` steps, then to 0 over ``decay`` steps
    by a cosine (the released GSM8K run's), then 0. The trainer evaluates it at update t >= 1.
    The released TL;DR run decays by a line instead (run_tldr.py, ``decay_shape``)."""
    if step < warmup:
        return step / warmup
    step -= warmup + stable
    if step < 0:
        return 1.0
    if step >= decay:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * step / decay))


# ----------------------------------------------------------------------------- 1c, 4. log-probs


def pad(
    rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu", left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (B, W) of token rows padded on the right, or on the
    left so that every row ends at the last column (where generation, or a response, goes on).
    With left padding, pass ``positions(mask)`` as ``position_ids``."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count a left-padded row's real tokens from 0, as without padding."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def pad_sequences(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt + response rows: ``input_ids``, ``attention_mask`` and
    ``response_mask`` (B, T), the last 1 on response tokens only."""
    ids, attn = pad(
        [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)], pad_id, device
    )
    columns = torch.arange(ids.shape[1], device=ids.device)
    starts = torch.tensor([len(p) for p in prompts], device=ids.device)
    return ids, attn, attn * (columns[None] >= starts[:, None])


def prefill(
    model: torch.nn.Module,
    prompts: list[list[int]],
    repeat: int,
    pad_id: int,
    device: torch.device | str = "cpu",
):
    """Run each prompt once and repeat its KV cache ``repeat`` times, for the ``repeat``
    responses that follow it (rows i * repeat .. of prompt i). Returns the logits at the last
    prompt position (B repeat, V), which predict each response's first token, the cache, and
    the prompts' left-padded attention mask (B repeat, W). Generation (searcher.HFEngine) and
    scoring (``group_token_logprobs``) both start here, so a prompt longer than its answers is
    computed once, not K times."""
    from transformers import DynamicCache

    ids, attn = pad(prompts, pad_id, device, left=True)
    cache = DynamicCache(config=model.config)
    last = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=positions(attn),
        past_key_values=cache,
        use_cache=True,
    ).logits[:, -1]
    cache.batch_repeat_interleave(repeat)
    return last.repeat_interleave(repeat, 0), cache, attn.repeat_interleave(repeat, 0)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits_t / T)[target_t] (B, T) in fp32, for logits (B, T, V) aligned with
    targets (B, T). The one formula of every scored log-prob: the trainer's, the reference's and
    the transformers engine's behaviour log-probs.

    Log-softmax runs in fp32 because bf16 log-probs summed over ~500 tokens drift by whole nats,
    which beta = 0.004 would amplify 250-fold in d. T != 1 scores the tempered policy, as the
    released code does with T = 0.7.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def scored_tokens(response: list[int], eos_id: int, include_eos: bool) -> list[int]:
    """The tokens of a response that the log-probs score: all of them, or without the final EOS
    unless ``include_eos`` (a response cut at max_new_tokens has none and loses nothing). Token t
    of the result is token t of the response, so per-token lists align by prefix."""
    if not include_eos and response and response[-1] == eos_id:
        return response[:-1]
    return response


def group_token_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    groups: list[list[list[int]]],
    **rule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log pi(y_t | x, y_<t) of the K responses ``groups[i]`` to each of P
    ``prompts[i]``, and their mask: two (B, T) tensors, B = P K rows in prompt-major order
    (row i K + k is ``groups[i][k]``), T the longest scored response; row b holds the log-probs
    of ``scored_tokens`` of its response in columns 0.. (fp32, of logits / ``temperature``), 0
    in padding, where the mask (long) is 0. ``group_logprobs`` is its row sum. The keyword
    arguments (the scoring ``rule``) are ``scored_rows``'.

    A response that appears more than once in its group (a group drawn with replacement from
    fewer than K stored responses, or a sampler that repeats itself, as a peaked policy on
    short answers does) is scored once and its rows copied (``distinct_responses``): the same
    values, and the same gradient, which flows back through each copy.
    """
    size = len(groups[0])
    if any(len(g) != size for g in groups):
        raise ValueError(
            f"group_token_logprobs: groups of sizes {sorted({len(g) for g in groups})}"
        )
    distinct, rows = distinct_responses(groups)
    token_logp, mask = scored_rows(model, prompts, distinct, **rule)
    if rows is None:
        return token_logp, mask
    rows = rows.to(token_logp.device)
    return token_logp[rows], mask[rows]


def distinct_responses(
    groups: list[list[list[int]]],
) -> tuple[list[list[list[int]]], torch.Tensor | None]:
    """Each group's distinct responses in order of first appearance, padded with its first to
    the largest count D over the groups (rectangular, for ``prefill``), and the rows of the
    (P D)-row result that hold the P K responses of ``groups`` in order; None when no group
    repeats a response (the result is already in order)."""
    distinct = []
    positions = []
    for group in groups:
        where: dict[tuple[int, ...], int] = {}
        kept = []
        for response in group:
            key = tuple(response)
            if key not in where:
                where[key] = len(kept)
                kept.append(response)
            positions.append(where[key])
        distinct.append(kept)
    width = max(len(kept) for kept in distinct)
    if width == len(groups[0]):
        return groups, None
    padded = [kept + kept[:1] * (width - len(kept)) for kept in distinct]
    size = len(groups[0])
    rows = [i * width + positions[i * size + k] for i in range(len(groups)) for k in range(size)]
    return padded, torch.tensor(rows)


def scored_rows(
    model: torch.nn.Module,
    prompts: list[list[int]],
    groups: list[list[list[int]]],
    *,
    pad_id: int,
    eos_id: int,
    temperature: float = 1.0,
    include_eos: bool = True,
    share_prompt: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_token_logprobs`` of every row of ``groups`` (equal sizes), repeats included.

    ``share_prompt``: each prompt runs once and its KV cache is repeated for its K responses
    (``prefill``), instead of K forwards of prompt + response: faster where prompts are longer
    than answers (OPERATIONS.md has the figure), and equal up to float rounding, gradients
    included. Turn it off under gradient checkpointing, which drops the cache.
    """
    size = len(groups[0])
    flat = [scored_tokens(r, eos_id, include_eos) for g in groups for r in g]
    targets, mask = pad(flat, pad_id, device)
    if not share_prompt:
        rows = [p for p in prompts for _ in range(size)]
        ids, attn, _ = pad_sequences(rows, flat, pad_id, device)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        every = token_logprobs(logits, ids[:, 1:], temperature)  # column c predicts token c + 1
        starts = torch.tensor([len(p) - 1 for p in rows], device=every.device)
        columns = starts[:, None] + torch.arange(mask.shape[1], device=every.device)
        token_logp = every.gather(1, columns.clamp(max=every.shape[1] - 1))
        return token_logp * mask.to(token_logp.dtype), mask
    first, cache, attn = prefill(model, prompts, size, pad_id, device)
    logits = model(
        input_ids=targets,
        attention_mask=torch.cat([attn, mask], dim=1),
        position_ids=attn.sum(1, keepdim=True) + torch.arange(mask.shape[1], device=mask.device),
        past_key_values=cache,
        use_cache=True,
    ).logits[:, :-1]
    logits = torch.cat([first[:, None], logits], dim=1)
    token_logp = token_logprobs(logits, targets, temperature)
    return token_logp * mask.to(token_logp.dtype), mask


def group_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    groups: list[list[list[int]]],
    **rule,
) -> torch.Tensor:
    """log pi(y|x) (P, K) of the K responses ``groups[i]`` to each of P ``prompts[i]``, as the TB
    loss uses it: of logits / ``temperature``, a final EOS left out unless ``include_eos``
    (``scored_tokens``), summed over the tokens of ``group_token_logprobs``, which takes the
    same keyword arguments (the scoring ``rule``). The trainer scores log pi (with gradients)
    by this; the searchers score log p_ref by ``group_token_logprobs`` with the same rule and
    sum the rows as this does, so the two sides of d always match.
    """
    token_logp, _ = group_token_logprobs(model, prompts, groups, **rule)
    return token_logp.sum(dim=1).view(len(prompts), len(groups[0]))


def group_passes(num_groups: int, group_size: int, micro_batch_size: int) -> list[slice]:
    """The forward passes over ``num_groups`` prompt groups of ``group_size`` sequences each:
    ``micro_batch_size`` sequences a pass, rounded down to whole groups (at least one group; the
    trainer's log Z and the shared prompt prefill are per group), or all in one pass when 0."""
    per_pass = max(1, micro_batch_size // group_size) if micro_batch_size else num_groups
    return [slice(i, min(i + per_pass, num_groups)) for i in range(0, num_groups, per_pass)]


# ----------------------------------------------------------------------------- 5. the weight store


class WeightStore:
    """Named tensors mirrored into one flat shared tensor, with a version. Needs only torch;
    this module imports nothing else at import time, so copy the class or import it.

    The storage is a CUDA tensor on the trainer's GPU (opened by CUDA IPC where another process
    unpickles the store) or shared CPU memory: a publish is one device copy, nothing pickled.
    Pass the store to a ``torch.multiprocessing`` child (spawn) as an argument.

    Consistency is a seqlock that never blocks the writer: ``publish`` makes ``seq`` odd,
    copies, then makes it even; ``load_into`` retries when ``seq`` was odd or has changed.
    With the weights goes one float, ``probe``: a check may publish a number computed from
    these weights there (checks.py publishes a log-prob that every reader recomputes).

    Contract of ``load_into(load_fn)`` for a reader:
      * ``load_fn`` receives live views of the shared storage, not copies: it must copy what it
        keeps (``param.copy_(view)``), and must not keep or modify the views.
      * It may run more than once for one call: a publish that overlapped the read makes the
        copy torn, and the read is retried. So it must be idempotent (a plain copy is).
      * What it copied is consistent (one version) only once ``load_into`` has returned.
    One writer at a time (the trainer); any number of readers.
    """

    SEQ = 0  # the slots of ``header``
    VERSION = 1
    PROBE = 2

    def __init__(
        self, named_params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
    ):
        self.layout = []  # (name, offset into flat, shape)
        offset = 0
        for name, param in named_params:
            self.layout.append((name, offset, tuple(param.shape)))
            offset += param.numel()
        self.flat = torch.empty(offset, dtype=dtype, device=device)
        if device.type == "cpu":
            self.flat.share_memory_()
        self.header = torch.zeros(3, dtype=torch.float64).share_memory_()
        self.header[self.VERSION] = -1

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) pairs into the shared storage, in publish order."""
        views = []
        for name, offset, shape in self.layout:
            views.append((name, self.flat[offset : offset + math.prod(shape)].view(shape)))
        return views

    def version(self) -> int:
        """The newest published version, -1 before the first publish."""
        return int(self.header[self.VERSION].item())

    @torch.no_grad()
    def publish(
        self, named_params: list[tuple[str, torch.Tensor]], version: int, probe: float = 0.0
    ) -> None:
        """Copy ``named_params`` (the same names and order as at construction) in as ``version``."""
        seq = self.header[self.SEQ].item()
        self.header[self.SEQ] = seq + 1  # odd: writing
        for (name, view), (param_name, param) in zip(self.views(), named_params, strict=True):
            if name != param_name:
                raise RuntimeError(
                    f"WeightStore.publish: parameter {param_name} where {name} expected"
                )
            view.copy_(param.detach())
        if self.flat.is_cuda:
            torch.cuda.synchronize(self.flat.device)  # bytes land before readers may look
        self.header[self.PROBE] = probe
        self.header[self.VERSION] = version
        self.header[self.SEQ] = seq + 2  # even: stable

    def load_into(
        self,
        load_fn: Callable[[list[tuple[str, torch.Tensor]]], None],
        timeout_s: float = 60.0,
    ) -> tuple[int, float]:
        """Run ``load_fn(views)`` on one consistent version (see the class docstring for what
        ``load_fn`` may do); returns (version, probe)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seq = self.header[self.SEQ].item()
            if seq % 2 == 0:
                version = int(self.header[self.VERSION].item())
                probe = self.header[self.PROBE].item()
                load_fn(self.views())
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    # Our copies (our stream, reading the store's device) must end before seq is
                    # re-checked, or a torn read could pass the check.
                    torch.cuda.synchronize()
                    if self.flat.is_cuda:
                        torch.cuda.synchronize(self.flat.device)
                if self.header[self.SEQ].item() == seq:
                    return version, probe
            time.sleep(0.001)
        raise TimeoutError(f"WeightStore: no consistent read within {timeout_s}s")


# ----------------------------------------------------------------------------- the config


def knob(default, help: str, *, at_least: float | None = None, above: float | None = None):
    """A config field with its help text, which the command line shows (``cli.config_argparser``):
    one source of truth per knob, for this module's config and every extension's. ``at_least``
    and ``above`` are its bounds, which ``TBAConfig.validate`` checks (value >= at_least, value
    > above)."""
    bounds = {"at_least": at_least, "above": above}
    return field(default=default, metadata={"help": help, **bounds})


class RunError(ValueError):
    """Something the person running a job can fix, not a bug: a file missing or malformed, a
    checkpoint that is not one, a model that cannot be found. The message names the flag or
    the file and what to do; the entry scripts print it as one line (``cli.run_cli``)."""


class ConfigError(RunError):
    """A configuration value, or a combination of values, that cannot work; the message names
    the flag. The entry scripts print it as a usage error (one line, exit status 2)."""


def need(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``: the configs' validation reads as a list."""
    if not ok:
        raise ConfigError(message)


@dataclass
class TBAConfig:
    """The knobs of the core: one node, searchers and a TB trainer. Defaults are the released
    GSM8K run (module docstring). The algorithm's knobs come first, by step (N, T; P x K, m;
    beta; k), then the plumbing. Each extension has a config of its own."""

    # ---- the algorithm (module docstring, steps 1-5; the paper's symbols in the help) ----
    # 1. the policy and the frozen reference p_ref
    model: str = knob(
        "realtreetune/rho-1b-sft-GSM8K", "policy to train: a hub name or a local directory"
    )
    ref_model: str = knob("", "frozen reference p_ref; empty: the same as --model")
    # 1b. generation: N responses to each prompt at temperature T
    num_generations: int = knob(24, "N: responses generated per prompt", at_least=1)
    temperature: float = knob(0.7, "sampling temperature T of the searchers", above=0)
    max_new_tokens: int = knob(512, "longest response, in tokens", at_least=1)
    searcher_batch_prompts: int = knob(
        3, "prompts per generate call of a searcher (released run: 3)", at_least=1
    )
    # 2-3. a step trains on P prompts x K responses each (the paper: 7 x 20 = 140 trajectories),
    # most-on-policy with probability m; the trainer waits only as max_lag and the bounds say
    prompts_per_step: int = knob(7, "P: prompts per trainer step", at_least=1)
    responses_per_prompt: int = knob(
        20, "K: responses of each prompt in a trainer step (from the buffer)"
    )
    mop_prob: float = knob(0.95, "m: probability that a step's prompt is most-on-policy")
    inv_temp: float = knob(
        0.0, "other prompts' items are drawn by softmax(reward * inv_temp); 0: uniform", at_least=0
    )
    max_lag: int = knob(
        3,
        "the trainer waits while its newest data is more than this many versions "
        "old (-1: never); the released run's barrier: 2k - 1 = 3",
    )
    max_train_lag: int = knob(
        -1,
        "every trajectory a step trains on is at most this many versions behind the trainer, "
        "most-on-policy and replayed alike; the trainer waits until P prompts hold such data "
        "(-1: no bound, the released run, whose replay reaches the whole buffer)",
    )
    replay_ratio: float = knob(
        0.0,
        "trajectories trained per trajectory generated, at most: the trainer waits rather than "
        "train more than this many times the searchers' output (1: each once on average, as "
        "on-policy; 2: twice); 0: no bound, as in the released run",
        at_least=0,
    )
    buffer_capacity: int = knob(
        100, "trajectories kept per prompt (oldest evicted, dedup by tokens)", at_least=1
    )
    initial_samples: int = knob(500, "trajectories in the buffer before the first step", at_least=0)
    # 4. the TB loss: beta and its anneal, the scoring rule, the trust region
    beta_start: float = knob(0.014, "KL strength beta at step 0", above=0)
    beta_end: float = knob(0.004, "KL strength beta after the anneal", above=0)
    beta_anneal_steps: int = knob(500, "steps of the linear beta anneal", at_least=0)
    tempered_logprobs: bool = knob(
        True, "log pi and log p_ref of logits / T; off: of the models (Eq. 5)"
    )
    eos_in_logprob: bool = knob(False, "score the EOS that ends a response; off: kept, not scored")
    tb_clip_eps: float = knob(
        0.0,
        "TB trust region (tb_loss): no gradient from an item the policy has moved more than "
        "this many nats beyond its behaviour log-prob in the direction its residual pushes; "
        "the optimum does not move. 0: off, as in the paper (tiny presets: 0.3)",
        at_least=0,
    )
    # 4. AdamW and its warmup-stable-decay schedule
    lr: float = knob(1e-5, "peak learning rate of AdamW", above=0)
    warmup_steps: int = knob(
        50, "linear warmup steps of the warmup-stable-decay schedule", at_least=0
    )
    stable_steps: int = knob(350, "constant-lr steps after warmup", at_least=0)
    decay_steps: int = knob(
        600, "cosine decay-to-0 steps (released run: cut at step 700, at half the peak)", at_least=0
    )
    total_steps: int = knob(
        700, "trainer steps (released run: 98,000 episodes / 140 per step)", at_least=1
    )
    weight_decay: float = knob(0.0, "AdamW weight decay", at_least=0)
    max_grad_norm: float = knob(
        0.0, "clip the gradient norm to this; 0: no clipping (released run)", at_least=0
    )
    fp32_master_weights: bool = knob(
        False, "fp32 weights and AdamW moments, autocast compute; off: `dtype`"
    )
    dtype: str = knob("bfloat16", "weights dtype of policy and reference: bfloat16|float16|float32")
    # 5. publish every k steps; or the on-policy baseline
    sync_every: int = knob(2, "k: publish the trainer's weights every k steps", at_least=1)
    synchronous: bool = knob(
        False, "on-policy baseline: generate with the newest weights only, train on them (lag 0)"
    )
    # ---- plumbing: processes, devices, engines, memory, restarts, timeouts (a learner may skip)
    num_searchers: int = knob(3, "searcher processes S (paper: 3, one per GPU)", at_least=1)
    searcher_devices: str = knob(
        "cuda:1,cuda:2,cuda:3", "one device per searcher (comma list), or one for all"
    )
    trainer_device: str = knob("cuda:0", "device of the trainer, which runs in the main process")
    engine: str = knob(
        "auto", "generation engine: vllm | hf (transformers) | auto: vLLM on a GPU if installed"
    )
    vllm_gpu_memory_utilization: float = knob(0.85, "fraction of a searcher GPU vLLM may take")
    vllm_kv_cache_gb: float = knob(
        0.0,
        "KV cache of each vLLM searcher in GB, fixed instead of sized from the memory free at its "
        "start-up; vLLM still needs vllm_gpu_memory_utilization of the GPU free (0: sized)",
        at_least=0,
    )
    vllm_compile: bool = knob(
        True,
        "vLLM compiled, its default: torch.compile, and CUDA graphs on a GPU; "
        "off (--no-vllm_compile): eager, faster to start",
    )
    weight_store: str = knob(
        "auto", "cuda (CUDA IPC; auto with a CUDA trainer) | shared_memory (no GPU peer access)"
    )
    trust_remote_code: bool = knob(
        False, "let transformers run model code from the hub (off: safer)"
    )
    gradient_checkpointing: bool = knob(False, "trade trainer compute for activation memory")
    micro_batch_size: int = knob(
        20,
        "sequences per forward pass, in whole prompt groups (at least one; "
        "the gradient does not depend on it); 0: all in one pass",
        at_least=0,
    )
    queue_size: int = knob(
        8, "bound of the trajectory queue, in messages (one per generate call)", at_least=1
    )
    max_searcher_restarts: int = knob(
        3, "restarts allowed per run, all searchers together; one more failure stops it", at_least=0
    )
    torch_threads: int = knob(0, "torch CPU threads per process; 0: cores / processes", at_least=0)
    timeout_s: float = knob(
        600.0, "longest wait for any process or queue before failing loudly", above=0
    )
    # ---- the run: seed, outputs, checkpoints
    seed: int = knob(0, "seed of trainer, buffer and searchers (searcher s uses seed + 1 + s)")
    output_dir: str = knob("runs/gsm8k", "metrics.jsonl, results.json, checkpoints")
    resume: bool = knob(
        False, "continue from output_dir/checkpoint.pt (weights, optimizer, step, RNG, buffer)"
    )
    checkpoint_every: int = knob(
        175,
        "resumable checkpoint every this many steps (0: every k); released: 4 a run",
        at_least=0,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the field when a value or a combination cannot work."""
        for f in dataclasses.fields(self):  # the bounds each knob declares
            value, low = getattr(self, f.name), f.metadata.get("at_least")
            need(low is None or value >= low, f"--{f.name} must be >= {low}, got {value}")
            above = f.metadata.get("above")
            need(above is None or value > above, f"--{f.name} must be > {above}, got {value}")
        need(
            2 <= self.responses_per_prompt <= self.buffer_capacity,
            "--responses_per_prompt (K) must be >= 2 "
            "(log Z is a mean over K: with K = 1 the loss is 0) and <= --buffer_capacity, "
            f"got {self.responses_per_prompt}",
        )
        need(
            self.num_generations <= self.buffer_capacity,
            f"--num_generations ({self.num_generations}) must be <= --buffer_capacity "
            f"({self.buffer_capacity}), or one generate call evicts its own samples",
        )
        need(0.0 <= self.mop_prob <= 1.0, f"--mop_prob must be in [0, 1], got {self.mop_prob}")
        for name in ("max_lag", "max_train_lag"):
            bound = getattr(self, name)
            need(
                bound == -1 or bound >= self.sync_every - 1,
                f"--{name} must be -1 (no bound) or >= sync_every - 1 = {self.sync_every - 1}: "
                f"only every k-th version is published, so a tighter bound can never be met "
                f"(got {bound})",
            )
        need(
            self.warmup_steps + self.stable_steps + self.decay_steps >= 1,
            "--warmup_steps + --stable_steps + --decay_steps must be >= 1",
        )
        for name, allowed in (
            ("dtype", ("bfloat16", "float16", "float32")),
            ("engine", ("auto", "vllm", "hf")),
            ("weight_store", ("auto", "cuda", "shared_memory")),
        ):
            value = getattr(self, name)
            need(value in allowed, f"--{name} {value!r} is not one of {', '.join(allowed)}")
        devices = len(self.searcher_device_list())
        need(
            devices in (1, self.num_searchers),
            f"--searcher_devices lists {devices} devices for {self.num_searchers} searchers "
            "(one each, or one)",
        )
        need(
            not self.synchronous
            or self.num_searchers * self.searcher_batch_prompts >= self.prompts_per_step,
            "--synchronous generates one batch per searcher per version: num_searchers * "
            "searcher_batch_prompts must be >= prompts_per_step",
        )

    def searcher_device_list(self) -> list[str]:
        """One device string per searcher."""
        devices = [d.strip() for d in self.searcher_devices.split(",") if d.strip()]
        return devices * self.num_searchers if len(devices) == 1 else devices

    def threads_per_process(self) -> int:
        """torch CPU threads for the trainer and each searcher: ``torch_threads``, or the cores
        split evenly over the S + 1 processes (oversubscribed threads only spin)."""
        return self.torch_threads or max(1, (os.cpu_count() or 1) // (self.num_searchers + 1))

    def logprob_temperature(self) -> float:
        """T of the scored log-probs: the sampling temperature when tempered, else 1."""
        return self.temperature if self.tempered_logprobs else 1.0

    def torch_dtype(self) -> torch.dtype:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
            self.dtype
        ]


# ---- plumbing: loading models, measuring memory (a learner may skip) ----


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load per process drowns the trainer's bar
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return model.to(device)


def meta_causal_lm(path: str, trust_remote_code: bool):
    """The model at ``path`` on the meta device: its parameter names and shapes, in the order
    ``load_causal_lm``'s model lists them (a tied head once), with no weights read and no
    memory taken."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS id when it has none (pad positions are masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory in GB: on CUDA the allocator's peak reservation on ``device``
    (model, optimizer, activations, vLLM's KV cache), else the peak resident set (RAM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
