"""TBA′ (the paper's last experiment): a simplified TBA on PRIME-RL's asynchronous pipeline, as
in the authors' bbartoldson/tba-prime, with its three settings as flags over this system.

The paper trains Qwen2.5-7B on MATH with it and reports that it "remained stable under a
10-step off-policy setting where Dr. GRPO exhibited noticeable oscillations". The released
configs (MATH_experiments/TBA_qwen_b005_async10_reset50_IS): lr 1e-6, 16 responses per prompt
sampled and trained, async level 10, beta 0.005, the TB loss with importance sampling, the
reference reset to the policy every 50 steps, 4,096-token sequences. docs/tba_prime.md has the
experiments and the GPU recipe (jobs/run_math.py).

1. The loss (``--tb_prime``; ``prime_tb_loss``). TB's gradient written per token with an
   advantage, the form of the released ``tba_loss``: on-policy TB's gradient is REINFORCE on
   the KL-regularised reward R = r - beta log(pi / p_ref) with the group's mean as baseline
   (tba.tb_loss, "On-policy link"), so with

       A_i = (r_i - mean_K r) - beta (KL_i - mean_K KL),   KL_i = log pi(y_i) - log p_ref(y_i)

   each token of response i is pushed by -A_i, in a token mean over the batch. The released
   code's log Z is the group's mean reward and the KL term is centred on the group's mean KL,
   which is A's two means. With importance sampling (``--prime_is``, the released IS configs)
   each token's push is weighted by its ratio pi / pi_b to the weights that sampled it,
   clamped at ``--prime_ratio_cap`` (8, the released clamp), which is what makes stale data
   usable: the estimate is of the gradient at the current policy. Without the KL term this is
   the released Dr. GRPO baseline (``--loss ratio``, extensions/grpo.py).
   As released (the MATH runs, commit 71c1716; ``PRIME_VALUES``): the group's mean KL is the
   sampler's, each response's own KL the policy's (``--prime_kl_from asymmetric``), so the KL
   part of A does not sum to zero over a group; each token's log pi - log p_ref is clamped to
   [-10, 10] before the sum (``--prime_kl_clamp 10``); each response's loss is divided by its
   own length, prompt included, and the batch's by its responses (``--prime_norm sequence``:
   the released trainer's one sequence a pass); AdamW's betas are (0.9, 0.99) and its weight
   decay 0.01 (``--adam_beta2 0.99 --weight_decay 0.01``, over any loss).
2. The reference that resets (``--ref_reset_every`` R; ``ResetTrainer``, ``PrimeSearcher``).
   Every R steps p_ref becomes the policy: on the trainer, which copies its weights into its
   own reference model at step R, 2R, ...; on every searcher, which copies the weights it loads
   into its reference model once it holds a version at or past the next multiple of R. Each
   trajectory carries the version of the reference that scored its log p_ref
   (``Trajectory.ref_version``: 0, the run's initial p_ref; else the policy version copied).
   Before any loss, the trainer gives every item whose reference is not its own a new log p_ref
   from its own reference model (``current_reference``), so no loss pairs a log p_ref with
   another reference. What this costs: the items scored before a reset and trained after it
   (in TBA′'s setting, the batches generated in the A versions before each reset), and those
   of a searcher that reset at a later version than R (it loads the newest version, which may
   be past R): a reference forward each, which the released code spends on every item (its
   trainer scores all of log p_ref). ``reference/rescored_frac`` counts them.
3. The async level A (``--async_level``; ``OnceTrainer``, ``OnceBuffer``): each generate
   call's group of a prompt is trained once, oldest first, and only while it was generated at
   most A versions behind the weights the step starts from; older groups are dropped
   (``buffer/dropped``). No replay, no most-on-policy draw (``async/mop_frac`` is 0).

Departures from the released code, with reasons:
  * The defaults are not the release's: ``--tb_prime`` alone takes KL_i and its mean from the
    policy being trained (``--prime_kl_from policy``, the later code's ``kl_mean_source
    train``), unclamped, in one token mean over the batch, with torch's AdamW betas, as the
    tiny presets were measured; ``PRIME_VALUES`` is the release.
  * ``--prime_kl_from behaviour`` computes KL_i and its mean from the sampler's log-probs (the
    later code's ``kl_per_sample_source inference`` and ``kl_mean_source inference``), so that
    A comes from the data alone. It and ``asymmetric`` let a group's responses be split over
    passes (a ``--micro_batch_size`` below K) and ranks, which 16 responses of up to 4,096
    tokens of a 7B model need (docs/tba_prime.md, the memory plan); ``policy`` needs a group's
    K responses in one pass.
  * The sampler's log-probs are the engine's, recorded as it sampled; the released trainer
    recomputes them with the weights of A steps before (``recompute_logprobs``), which are the
    sampler's when inference runs exactly A steps ahead.
  * Searchers are not held back: the released inference waits when it is A steps ahead;
    here they generate on and the trainer drops what has grown too old.
  * The optimizer is not reset with the reference (the released resetOpt configs are a
    variant; the IS configs keep AdamW's moments).

The extension: ``PrimeConfig`` (its flags), ``prime_advantages`` and ``prime_tb_loss`` (torch
only), ``PrimeTrainer`` (the loss), ``ResetTrainer`` and ``PrimeSearcher`` (the reference),
``OnceTrainer`` and ``OnceBuffer`` (the async level), ``BetasTrainer`` (AdamW's betas),
``install`` and ``configure``, which put them in a run's Parts (launch.parts calls both).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import deque
from dataclasses import dataclass

import torch

from buffer import ReplayBuffer, Trajectory
from extensions.grpo import (
    GRPOSearcher,
    GRPOTrainer,
    check_normalizer,
    checked_split_rows,
    normalized_sum,
    require_token_logprobs,
    sequence_normalizer,
    split_rows,
    token_lists,
)
from plumbing.config import ConfigError, check_bounds, knob, need
from plumbing.metrics import offpolicy_metrics
from plumbing.models import load_causal_lm
from searcher import SearcherSetup
from tba import TBAConfig, group_token_logprobs
from trainer import Parts, Trainer

# The released TBA′ MATH config (MATH_experiments/TBA_qwen_b005_async10_reset50_IS, the code
# of commit 71c1716 and PRIME-RL's AdamW defaults), as flags.
PRIME_VALUES: dict = dict(
    tb_prime=True,
    prime_is=True,
    async_level=10,
    ref_reset_every=50,
    prime_kl_from="asymmetric",
    prime_kl_clamp=10.0,
    prime_norm="sequence",
    adam_beta1=0.9,
    adam_beta2=0.99,
    weight_decay=0.01,
)
TORCH_BETAS = (0.9, 0.999)  # torch's AdamW's, the core's


@dataclass
class PrimeConfig:
    """TBA′'s settings (extensions/tba_prime.py): its loss, the reference reset, the async level."""

    tb_prime: bool = knob(
        False,
        "TBA′'s loss (tba_prime.prime_tb_loss): TB's gradient per token, advantage (r - mean r) "
        "- beta (KL - mean KL) over each prompt's responses, a token mean; with --loss tb",
    )
    prime_is: bool = knob(
        True,
        "TBA′'s loss: weigh each token by its ratio pi / pi_b to the weights that sampled it "
        "(released IS configs: on); off: the plain score function",
    )
    prime_ratio_cap: float = knob(
        8.0, "TBA′'s loss: the ratio is clamped to at most this (released: 8)", above=1.0
    )
    prime_kl_from: str = knob(
        "policy",
        "TBA′'s advantage: KL = log pi - log p_ref and its group mean of the policy being "
        "trained (a prompt's responses in one pass) | behaviour: both of the weights that "
        "sampled them | asymmetric: each response's of the policy, the group mean of the "
        "sampler's (the released MATH runs); the last two let a --micro_batch_size below K "
        "split a prompt's responses over passes",
        choices=("policy", "behaviour", "asymmetric"),
    )
    prime_kl_clamp: float = knob(
        0.0,
        "TBA′'s advantage: each token's log pi - log p_ref clamped to [-c, c] before KL's sum "
        "(released: 10); 0: no clamp",
        at_least=0.0,
    )
    prime_norm: str = knob(
        "tokens",
        "TBA′'s loss: tokens: one token mean over the batch | sequence: each response's sum "
        "over its own length, prompt included, then a mean over responses (released)",
        choices=("tokens", "sequence"),
    )
    ref_reset_every: int = knob(
        0,
        "R: every R steps p_ref becomes the policy, on the trainer and every searcher "
        "(released: 50); 0: the frozen p_ref of the paper",
        at_least=0,
    )
    async_level: int = knob(
        0,
        "A: each prompt's group of responses trained once, oldest first, while generated at "
        "most A versions behind (released: 10); 0: the core's replay buffer",
        at_least=0,
    )
    adam_beta1: float = knob(
        0.9, "AdamW's beta1, over any loss (torch's; released TBA′: 0.9)", at_least=0.0
    )
    adam_beta2: float = knob(
        0.999, "AdamW's beta2, over any loss (torch's; released TBA′: 0.99)", at_least=0.0
    )

    def __post_init__(self) -> None:
        check_bounds(self)  # the bounds each knob declares
        for name in ("adam_beta1", "adam_beta2"):
            need(getattr(self, name) < 1, f"--{name} must be < 1, got {getattr(self, name)}")

    def searchers_needed(self) -> bool:
        """Whether the searchers must be TBA′'s (``PrimeSearcher``)."""
        return self.tb_prime or self.ref_reset_every > 0


def install(parts: Parts, cfg: PrimeConfig) -> Parts:
    """``parts`` with what ``cfg`` turns on: the TBA′ loss (over the TB trainer only), the
    resetting reference (over any loss), the async level (over any), AdamW's betas (over any),
    and TBA′'s searchers
    (``PrimeSearcher``: per-token log-probs, the reference reset). Call it after the losses'
    installs (extensions/grpo.py, extensions/offpolicy.py) and before checks.install, and
    ``configure`` after that."""
    trainer = parts.trainer
    if cfg.tb_prime:
        need(
            not issubclass(trainer, GRPOTrainer),
            "--tb_prime is TB's loss (TBA′'s form of it): it needs --loss tb",
        )
        need(
            trainer.backward is Trainer.backward,
            "--tb_prime replaces TB's loss; the off-policy masks (--tb_m2_tau, "
            "--tb_clip_horizon) are of the core's: choose one",
        )
        trainer = type(f"Prime{trainer.__name__}", (PrimeTrainer, trainer), {})
    if cfg.ref_reset_every > 0:
        trainer = type(f"Reset{trainer.__name__}", (ResetTrainer, trainer), {})
    if cfg.async_level > 0:
        trainer = type(f"Once{trainer.__name__}", (OnceTrainer, trainer), {})
    if (cfg.adam_beta1, cfg.adam_beta2) != TORCH_BETAS:
        trainer = type(f"Betas{trainer.__name__}", (BetasTrainer, trainer), {})
    if trainer is parts.trainer and not cfg.searchers_needed():
        return parts
    trainer.prime = cfg
    searcher = PrimeSearcher if cfg.searchers_needed() else parts.searcher
    return dataclasses.replace(parts, trainer=trainer, searcher=searcher)


def configure(parts: Parts, cfg: PrimeConfig) -> Parts:
    """``parts`` whose searchers, built in their own processes, get ``cfg`` (the reset interval,
    the pass size): ``parts.searcher`` is wrapped once every other extension has wrapped it
    (checks.install builds its subclass over ``PrimeSearcher``)."""
    if not cfg.searchers_needed():
        return parts
    return dataclasses.replace(
        parts, searcher=functools.partial(configured_searcher, parts.searcher, prime=cfg)
    )


def configured_searcher(make, setup: SearcherSetup, prime: PrimeConfig):
    """The run's searcher (``make(setup)``, in the searcher's process) with TBA′'s settings."""
    searcher = make(setup)
    if not isinstance(searcher, PrimeSearcher):
        raise TypeError(
            f"tba_prime.configure: the run's searcher is a {type(searcher).__name__}, not a "
            "PrimeSearcher (tba_prime.install must come before the searcher's other wrappers)"
        )
    searcher.prime = prime
    return searcher


# ----------------------------------------------------------------------------- 4. the loss


def prime_advantages(
    reward: torch.Tensor, kl: torch.Tensor, beta: float, centre_kl: torch.Tensor | None = None
) -> torch.Tensor:
    """TBA′'s advantages (P, K), fp64, detached, for ``reward`` and ``kl`` (P, K): K responses to
    each of P prompts, kl_i = log pi(y_i|x) - log p_ref(y_i|x) summed over the response.

        A_i = (r_i - mean_K r) - beta (kl_i - mean_K c)      c = centre_kl, else kl

    the released ``tba_loss``'s advantage (its log Z is the group's mean reward, its KL term
    centred on a group mean). With c = kl, A_i = R_i - mean_K R for R = r - beta kl, and in
    TB's terms A_i = -beta (d_i - mean_K d) with d = log pi - log p_ref - r / beta: the residual
    tba.tb_loss pushes on, times -beta; A then sums to zero over a group. The released MATH
    runs centre the policy's kl on the mean of the sampler's (``centre_kl``, the same shape),
    and then the KL part of A sums to -beta K (mean kl - mean c) over a group, not zero."""
    centre = kl if centre_kl is None else centre_kl
    if reward.dim() != 2 or reward.shape != kl.shape or centre.shape != kl.shape:
        raise ValueError(
            f"prime_advantages: reward, kl and centre_kl must share a (P, K) shape, got "
            f"{tuple(reward.shape)}, {tuple(kl.shape)}, {tuple(centre.shape)}"
        )
    if beta <= 0:
        raise ValueError(f"prime_advantages: beta must be > 0, got {beta}")
    r = reward.detach().double()
    kl_part = kl.detach().double() - centre.detach().double().mean(dim=1, keepdim=True)
    return (r - r.mean(dim=1, keepdim=True)) - beta * kl_part


def clamped_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, clamp: float):
    """KL_i = sum_t m_it clamp(logp_it - ref_it, -clamp, clamp) of (B, T) per-token log-probs
    (no clamp when ``clamp`` is 0), (B,) fp64, detached: the released per-token clamp."""
    m = mask.bool()
    diff = logp.detach().double() - ref_logp.detach().double()
    if clamp > 0:
        diff = diff.clamp(min=-clamp, max=clamp)
    return torch.where(m, diff, 0.0).sum(dim=1)


def prime_tb_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    importance_sampling: bool = True,
    ratio_cap: float = 8.0,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """TBA′'s loss, TB's gradient per token (bbartoldson/tba-prime ``tba_loss``). Needs only
    torch; copy it with grpo's ``check_normalizer`` and ``normalized_sum``.

    Shapes: ``logp`` (B, T) = log pi_theta(y_t | x, y_<t) of each scored token (carries the
    gradient), ``behaviour_logp`` (B, T) the same under pi_b, the weights that sampled the
    response, ``mask`` (B, T) 1 on scored tokens; ``advantages`` (B,) one per response,
    ``prime_advantages(...).reshape(-1)`` (prompt-major rows, detached). ``normalizer``: None,
    the batch's scored tokens; a number; or a (B,) tensor, row i's sum over its own entry (the
    released per-sequence mean: grpo.sequence_normalizer). Returns a scalar, fp32.

        w_t   = min(exp(logp_t - behaviour_t), ratio_cap)    (importance_sampling)
        loss  = -sum_i (sum_t m_it w_it A_i) / N_i            (N_i = N, or normalizer[i])
        loss  = -sum_i (sum_t m_it logp_it A_i) / N_i         (no importance sampling)

    The gradient is -sum_it m_it w_it A_i grad logp_it / N: each token pushed by its response's
    advantage, weighted by its ratio to the sampler; a token whose ratio is over the cap gives
    none (the clamp is flat there), so no token weighs more than ratio_cap. Its value is not
    TB's: only its gradient is meant. The cap is not a trust region: it stops a token's push
    whatever the sign of its advantage, so a token of a bad response that grew past the cap
    is no longer pushed down (PPO's clip and tba.tb_loss's trust region stop only the push
    in the direction already moved); at the tiny tasks' lr ten versions of drift collapse it
    where TB's trust region holds, and a tighter cap is worse (docs/tba_prime.md).

    Why it is TB (tests/test_prime.py): on-policy (behaviour = logp, w = 1 with gradient
    grad logp), its gradient is tba.tb_loss's times beta P K / (2 N): TB's is
    -(2 / beta) (1 / PK) sum_i (R_i - mean R) grad log pi(y_i) (tba.tb_loss, the REINFORCE
    link), and A_i = R_i - mean R. Off-policy the ratio makes it an estimate of that gradient
    at the current policy from the sampler's data, which the released code relies on at async
    level 10. Gradient accumulation: pass the whole batch's token count as ``normalizer`` to
    every micro-batch and sum their losses. Masked positions may hold anything.
    """
    if logp.dim() != 2 or behaviour_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            "prime_tb_loss: logp, behaviour_logp and mask must share a (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(behaviour_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"prime_tb_loss: advantages must be ({logp.shape[0]},), got {tuple(advantages.shape)}"
        )
    if ratio_cap <= 1:
        raise ValueError(f"prime_tb_loss: ratio_cap must be > 1, got {ratio_cap}")
    check_normalizer("prime_tb_loss", normalizer, logp.shape[0])
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    lp = torch.where(m, logp.float(), zero)
    adv = advantages.detach().float().unsqueeze(1)
    if importance_sampling:
        old = torch.where(m, behaviour_logp.detach().float(), zero)
        weight = torch.clamp(torch.exp(lp - old), max=ratio_cap)
    else:
        weight = lp
    return normalized_sum(torch.where(m, -weight * adv, zero), m, normalizer)


# ----------------------------------------------------------------------------- the trainers


class PrimeTrainer(Trainer):
    """The trainer with TBA′'s loss in place of TB's (``install`` sets ``prime``)."""

    prime: PrimeConfig = PrimeConfig(tb_prime=True)

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        rows = checked_split_rows(cfg)
        if rows and self.prime.prime_kl_from == "policy":
            raise ConfigError(
                f"--micro_batch_size {rows} splits a prompt's {cfg.responses_per_prompt} "
                "responses, but TBA′'s advantage from the policy's KL needs them in one pass: "
                "--prime_kl_from behaviour or asymmetric, or --micro_batch_size 0 or at least K"
            )
        super().__init__(cfg, device, pad_id, eos_id)

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. prime_tb_loss over ``micro_batches`` of whole prompt groups, or of parts of
        ``micro_batch_size`` responses when that is below K (``split_rows``), each pass's sum
        over the whole batch's token count (``prime_norm`` tokens) or over each response's
        own length times the batch's responses (sequence, grpo.sequence_normalizer): the passes
        sum to the loss on the whole batch. The group's part of each advantage is known before
        any pass when it comes from the sampler (``prime_kl_from`` behaviour, asymmetric).
        Reads the per-token log pi_b the searchers record (``Trajectory.token_logprobs``,
        PrimeSearcher's), and log p_ref summed, or per token where ``prime_kl_clamp`` clamps
        each token's term."""
        prime = self.prime
        clamp = prime.prime_kl_clamp
        require_token_logprobs(groups, "--tb_prime")
        items = sum(len(g) for g in groups)
        tokens = sum(len(t.token_logprobs["behaviour"]) for g in groups for t in g)
        before = {}  # id(item) -> its advantage (behaviour), or the part not its own KL's
        if prime.prime_kl_from != "policy":
            for group in groups:
                reward = torch.tensor([[t.reward for t in group]], dtype=torch.float64)
                sampler = torch.tensor([[sampler_kl(t, clamp) for t in group]])
                if prime.prime_kl_from == "behaviour":
                    adv = prime_advantages(reward, sampler, beta)
                else:  # A is linear in the item's own KL: all but -beta KL_i is the group's
                    adv = prime_advantages(reward, torch.zeros_like(sampler), beta, sampler)
                for t, a in zip(group, adv[0].tolist(), strict=True):
                    before[id(t)] = a
        units = groups
        rows = split_rows(self.cfg)
        if rows:  # parts of a group, one a pass (the core's passes: max(1, rows // K) groups)
            units = [g[i : i + rows] for g in groups for i in range(0, len(g), rows)]
        sums = dict.fromkeys(("loss", "logp", "ratio", "capped", "kl", "kl_clamped", "adv"), 0.0)
        rhos = []
        for chunk in self.micro_batches(units):
            flat = [t for part in chunk for t in part]
            logp, mask = self.score(chunk, group_token_logprobs)  # per token
            keys = ("behaviour", "reference") if clamp > 0 else ("behaviour",)
            old, *ref = token_lists(flat, mask, keys, "--tb_prime")
            sequence = logp.detach().double().sum(1)
            if clamp > 0:  # each token's log-ratio to p_ref clamped, as released
                kl = clamped_kl(logp, ref[0], mask, clamp).cpu()
                diff = (logp.detach() - ref[0]).abs()
                sums["kl_clamped"] += int((mask.bool() & (diff > clamp)).sum())
            else:
                ref_sum = torch.tensor([t.ref_logprob for t in flat], dtype=torch.float64)
                kl = sequence.cpu() - ref_sum
            if prime.prime_kl_from == "policy":
                reward = torch.tensor([[t.reward for t in part] for part in chunk])
                adv = prime_advantages(reward, kl.view(reward.shape), beta).reshape(-1)
            else:
                adv = torch.tensor([before[id(t)] for t in flat], dtype=torch.float64)
                if prime.prime_kl_from == "asymmetric":
                    adv = adv - beta * kl  # the item's own KL, of the policy being trained
            adv = adv.to(self.device)
            if prime.prime_norm == "sequence":
                normalizer = sequence_normalizer(flat, items, self.device)
            else:
                normalizer = float(max(tokens, 1))
            loss = prime_tb_loss(
                logp, old, mask, adv, prime.prime_is, prime.prime_ratio_cap, normalizer
            )
            loss.backward()
            m = mask.bool()
            ratio = torch.exp(torch.where(m, logp.detach().float() - old, 0.0))
            sums["loss"] += loss.item()
            sums["logp"] += sequence.sum().item()
            sums["ratio"] += torch.where(m, ratio, 0.0).sum().item()
            sums["capped"] += int((m & (ratio > prime.prime_ratio_cap)).sum())
            sums["kl"] += kl.sum().item()
            sums["adv"] += adv.abs().sum().item()
            behaviour = torch.tensor([t.behaviour_logprob for t in flat], dtype=torch.float64)
            rhos.append((sequence.cpu() - behaviour).view(len(chunk), -1))
        metrics = {
            "loss/tb_prime": sums["loss"],
            "prime/ratio_mean": sums["ratio"] / max(tokens, 1),  # pi / pi_b per token
            "prime/capped_frac": sums["capped"] / max(tokens, 1),  # tokens over the cap
            "prime/kl_mean": sums["kl"] / items,  # log pi - log p_ref of a response
            "prime/kl_clamped_frac": sums["kl_clamped"] / max(tokens, 1),  # past +-clamp
            "prime/adv_abs_mean": sums["adv"] / items,
            "policy/logp_mean": sums["logp"] / items,
            **offpolicy_metrics(torch.cat(rhos), 0, items),  # rows: groups, or equal parts
        }
        del metrics["offpolicy/clip_frac"]  # TB's trust region's, not this loss's
        return metrics


def sampler_kl(t: Trajectory, clamp: float) -> float:
    """KL_i of the weights that sampled ``t``: log pi_b - log p_ref summed over its tokens, each
    token's term clamped to [-clamp, clamp] when ``clamp`` > 0 (its per-token lists)."""
    if clamp <= 0:
        return t.behaviour_logprob - t.ref_logprob
    lists = t.token_logprobs
    pairs = zip(lists["behaviour"], lists["reference"], strict=True)
    return math.fsum(min(max(b - r, -clamp), clamp) for b, r in pairs)


class BetasTrainer(Trainer):
    """The trainer whose AdamW has the betas ``--adam_beta1``, ``--adam_beta2`` (``install``
    sets ``prime``): PRIME-RL's (0.9, 0.99) for the released runs, over any loss."""

    prime: PrimeConfig = PrimeConfig(adam_beta2=0.99)

    def make_optimizer(self):
        """4. The core's AdamW and schedule, with these betas in every parameter group."""
        optimizer, scheduler = super().make_optimizer()
        betas = (self.prime.adam_beta1, self.prime.adam_beta2)
        optimizer.defaults["betas"] = betas
        for group in optimizer.param_groups:
            group["betas"] = betas
        return optimizer, scheduler


class ResetTrainer(Trainer):
    """A trainer whose reference is reset to the policy every ``ref_reset_every`` steps, and
    which gives every item scored by another reference a log p_ref of its own before any loss
    (``install`` sets ``prime``). Over any loss: TB's, TBA′'s, GRPO's (whose per-token
    "reference" lists are rescored too)."""

    prime: PrimeConfig = PrimeConfig(ref_reset_every=50)

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        super().__init__(cfg, device, pad_id, eos_id)
        # The reference in the searchers' dtype (they score log p_ref in it), frozen between
        # resets. Under a data-parallel trainer every rank holds it whole; sharded (--fsdp), it
        # is sharded as the policy is, and every rank rescores the same items (the whole
        # batch's), so that its gathers line up.
        reference = load_causal_lm(
            cfg.ref_model or cfg.model, cfg.torch_dtype(), device, cfg.trust_remote_code
        )
        self.reference = reference.eval().requires_grad_(False)
        if getattr(self, "sharded", False):  # data_parallel.DataParallelTrainer with --fsdp
            from extensions.data_parallel import shard_model

            shard_model(self.reference, self.ranks)
        self.ref_version = 0  # 0: the run's initial p_ref; else the policy version copied

    def update(self, groups: list[list[Trajectory]]) -> dict:
        metrics = super().update(groups)  # the step count is now the new version
        if self.step % self.prime.ref_reset_every == 0:
            self.reset_reference()
        metrics["reference/version"] = float(self.ref_version)
        return metrics

    @torch.no_grad()
    def reset_reference(self) -> None:
        """p_ref := the policy, as version ``step``. Sharded (FSDP2), each rank copies its own
        shard, which the reference's sharding matches (every rank runs ``update``)."""
        reshard(self.reference)
        policy = dict(self.model.named_parameters())
        for name, param in self.reference.named_parameters():
            if hasattr(param, "to_local"):  # a DTensor: shard to shard
                param.to_local().copy_(policy[name].to_local())
            else:
                param.copy_(policy[name])
        self.ref_version = self.step

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        groups, rescored = self.current_reference(groups)
        metrics = super().backward(groups, beta)
        items = sum(len(g) for g in groups)
        metrics["reference/rescored_frac"] = rescored / items
        return _per_rank(self, metrics, "reference/rescored_frac")

    @torch.no_grad()
    def current_reference(self, groups: list[list[Trajectory]]) -> tuple[list, int]:
        """``groups`` with every item whose log p_ref came from another reference rescored by
        this trainer's (``ref_logprob``, and ``token_logprobs["reference"]`` where it is
        recorded), tagged with its version; and how many were. Scored by the searchers' rule
        (``tba.group_token_logprobs``), a prompt's stale responses in one pass, or in passes of
        ``split_rows`` responses."""
        cfg = self.cfg
        rule = dict(
            pad_id=self.pad_id,
            eos_id=self.eos_id,
            logprob_temperature=cfg.logprob_temperature(),
            include_eos=cfg.eos_in_logprob,
            device=self.device,
        )
        out = []
        rescored = 0
        for group in groups:
            stale = [i for i, t in enumerate(group) if t.ref_version != self.ref_version]
            if not stale:
                out.append(group)
                continue
            group = list(group)
            rows = split_rows(cfg) or len(stale)
            for start in range(0, len(stale), rows):
                part = stale[start : start + rows]
                token_logp, mask = group_token_logprobs(
                    self.reference,
                    [group[0].prompt_tokens],
                    [[group[i].response_tokens for i in part]],
                    **rule,
                )
                for i, lp, n in zip(part, token_logp.tolist(), mask.sum(1).tolist(), strict=True):
                    t = group[i]
                    lists = t.token_logprobs
                    if lists is not None and "reference" in lists:
                        lists = {**lists, "reference": lp[:n]}
                    group[i] = dataclasses.replace(
                        t,
                        ref_logprob=math.fsum(lp[:n]),
                        ref_version=self.ref_version,
                        token_logprobs=lists,
                    )
            rescored += len(stale)
            out.append(group)
        reshard(self.reference)  # free the gathered weights before the loss's passes
        return out, rescored

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["reference"] = self.reference.state_dict()
        state["ref_version"] = self.ref_version
        return state

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint without the reference (a sharded trainer's: extensions/data_parallel.py
        writes its own state) resets it to the resumed policy."""
        super().load_state_dict(state)
        if "reference" in state:
            self.reference.load_state_dict(state["reference"])
            self.ref_version = state["ref_version"]
        else:
            self.reset_reference()


def reshard(module: torch.nn.Module) -> None:
    """Put a sharded (FSDP2) module's weights back in their shards: after a forward without
    gradients no backward does it, and the root's stay gathered; a plain module is left."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.reshard()


def _per_rank(trainer: Trainer, metrics: dict, key: str) -> dict:
    """A metric that is already the whole batch's on every rank, divided by the ranks, so that
    a data-parallel trainer's sum over them (extensions/data_parallel.py) gives it back."""
    ranks = getattr(trainer, "ranks", None)
    if ranks is not None:
        metrics[key] /= ranks.world_size
    return metrics


class OnceBuffer(ReplayBuffer):
    """The buffer of the async level: besides the core's store (kept for its statistics and
    checkpoints), a queue of each generate call's group of a prompt (the N items of one
    prompt and version, in arrival order), which ``sample`` hands out oldest first, each once.
    Groups generated before ``min_version`` are dropped when met. The queue is not
    checkpointed: a resumed run waits for new groups."""

    def __init__(self, group_size: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_size = group_size
        self.filling: dict = {}  # (prompt id, version) -> its items so far
        self.ready_groups: deque[list[Trajectory]] = deque()
        self.dropped = 0  # groups dropped for age

    def add(self, traj: Trajectory) -> None:
        with self._lock:
            super().add(traj)
            key = (traj.prompt_id, traj.version)
            items = self.filling.setdefault(key, [])
            items.append(traj)
            if len(items) == self.group_size:
                self.ready_groups.append(self.filling.pop(key))

    def count_ready(self, min_version: int) -> int:
        """Groups that a step starting from ``min_version`` + A may train (older ones dropped)."""
        with self._lock:
            while self.ready_groups and self.ready_groups[0][0].version < min_version:
                self.ready_groups.popleft()
                self.dropped += 1
            stale = [key for key in self.filling if key[1] < min_version]
            for key in stale:  # a group that will never fill in time (a searcher restarted)
                del self.filling[key]
            return len(self.ready_groups)

    def sample(self, num_prompts: int, per_prompt: int, min_version: int | None = None):
        """The ``num_prompts`` oldest groups of version ``min_version`` or newer, each once."""
        with self._lock:
            if self.count_ready(min_version if min_version is not None else -math.inf) < (
                num_prompts
            ):
                raise ValueError(
                    f"OnceBuffer.sample: {num_prompts} groups asked, {len(self.ready_groups)} ready"
                )
            batch = [self.ready_groups.popleft() for _ in range(num_prompts)]
            for group in batch:
                if len(group) != per_prompt:
                    raise ValueError(
                        f"OnceBuffer.sample: a group of {len(group)} responses, {per_prompt} asked"
                    )
            drawn = num_prompts * per_prompt
            self.num_drawn += drawn
            self.num_drawn_first += drawn
            return batch, [False] * num_prompts

    def stats(self, current_version: int | None = None) -> dict[str, float]:
        out = super().stats(current_version)
        out["buffer/ready_groups"] = float(len(self.ready_groups))
        out["buffer/dropped"] = float(self.dropped)
        return out


class OnceTrainer(Trainer):
    """The trainer of the async level A (``install`` sets ``prime``): a step trains P groups
    each once, oldest first, generated at most A versions behind the weights it starts from."""

    prime: PrimeConfig = PrimeConfig(async_level=10)

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        if cfg.responses_per_prompt != cfg.num_generations:
            raise ConfigError(
                f"--async_level trains each prompt's group as generated: --responses_per_prompt "
                f"({cfg.responses_per_prompt}) must be --num_generations ({cfg.num_generations})"
            )
        super().__init__(cfg, device, pad_id, eos_id)
        self.buffer = OnceBuffer(
            cfg.num_generations, cfg.buffer_capacity, cfg.mop_prob, cfg.inv_temp, cfg.seed
        )

    def oldest_version(self) -> int:
        return self.step - self.prime.async_level

    def can_step(self) -> bool:
        """2. P groups generated at most A versions behind are waiting."""
        return self.buffer.count_ready(self.oldest_version()) >= self.cfg.prompts_per_step


# ----------------------------------------------------------------------------- 1. the searcher


class PrimeSearcher(GRPOSearcher):
    """TBA′'s searcher: per-token log pi_b and log p_ref (GRPOSearcher's lists), its reference
    reset to the policy at the first version it holds at or past each multiple of R, the
    version copied on every trajectory (``Trajectory.ref_version``), and log p_ref scored in
    passes of ``split_rows`` responses. ``configure`` hands it ``prime`` in its process."""

    prime: PrimeConfig = PrimeConfig()
    ref_version = 0  # of the reference held: 0, the run's initial p_ref

    def load_newest_weights(self) -> float:
        seconds = super().load_newest_weights()
        if self.reference_due():
            # The store's newest version (usually the one just loaded; a newer one if the
            # trainer published since, which the tag then says).
            self.ref_version, _ = self.store.load_into(self.load_reference)
        return seconds

    def reference_due(self) -> bool:
        """Whether the weights held are at or past a reset this searcher's reference predates."""
        every = self.prime.ref_reset_every
        newest_reset = (self.version // every) * every if every > 0 else 0
        return self.version >= 0 and newest_reset > self.ref_version

    @torch.no_grad()
    def load_reference(self, named) -> None:
        """Copy named weights (the policy's, transformers names) into the reference model."""
        params = dict(self.ref.named_parameters())
        for name, tensor in named:
            params[name].copy_(tensor)

    def search_once(self):
        trajectories, seconds = super().search_once()
        for t in trajectories:
            t.ref_version = self.ref_version
        return trajectories, seconds

    def reference_logprobs(self, prompts, outputs):
        """1c. As the core's, in passes of ``split_rows`` responses of one prompt when set (a 7B
        reference scoring 16 responses of 4,096 tokens at once would not fit)."""
        rows = split_rows(self.cfg)
        if not rows:
            return super().reference_logprobs(prompts, outputs)
        sums = []
        for prompt, responses in zip(prompts, outputs, strict=True):
            mine = []
            for start in range(0, len(responses), rows):
                part = responses[start : start + rows]
                token_logp, _ = self.reference_token_logprobs([prompt], [part])
                mine += token_logp.sum(dim=1).tolist()
            sums.append(mine)
        return sums
