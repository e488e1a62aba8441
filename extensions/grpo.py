"""The GRPO baseline: the on-policy policy-gradient method TBA is compared with, run by the same
searchers, buffer and trainer (``--loss grpo``).

It follows Hugging Face TRL's GRPOTrainer: DeepSeekMath's objective (Shao et al. 2024, Eq. 3:
group-normalised advantages, PPO's clipped ratio pi / pi_old, a k3 KL penalty to p_ref) with
DAPO's token-level averaging, clip 0.2, one update per batch, std + 1e-4 over the sample std;
its KL coefficient is DeepSeekMath's 0.04 (TRL's default is 0). Its surrogate is an on-policy
estimator: data from an older policy needs the ratio to pi_old, the policy that sampled it, so
each trajectory carries log pi_old per token, as the engine sampled it (scored by the trainer's
rule: temperature and EOS), and log p_ref per token for the KL (``GRPOSearcher`` attaches
"behaviour" and "reference"). Asynchronous GRPO trains on data up to barrier_lag
versions old, which only the clip keeps in check; --synchronous is its home.

Dr. GRPO (``--grpo_dr``; Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3.2)
is the same objective without its two normalisations: the advantage r - mean r, not divided by
the group's standard deviation, and the loss summed over a response's tokens and divided by a
constant (the batch's responses times max_new_tokens, as its code divides by the generation
budget), not by the tokens there are.

The ratio loss (``--loss ratio``; ``ratio_loss``) is the baseline TBA′ was released with
(bbartoldson/tba-prime, MATH_experiments/GRPO_qwen_async2 and _async10: PRIME-RL's ``ratio``
loss), which the paper calls Dr. GRPO: each token's ratio to the sampler clamped at
``--ratio_cap`` (8) times the advantage r - mean r, with no PPO clip and no KL term; with
``--ratio_norm sequence`` each response's sum over its own length, prompt included (the
released run's one sequence a pass). It is TBA′'s loss without its KL term
(extensions/tba_prime.py); docs/tba_prime.md says which project loss is which released config.

One departure from TRL: pi_old is the engine's own log-prob of the sample (vLLM's on GPUs),
where TRL with one update per batch takes the trainer's (logp.detach()), so on-policy the ratio
is 1 only up to the numerical difference of the two engines (grpo/ratio_mean shows it); the
asynchronous mode has no trainer-side pi_old to recompute.

The extension: ``GRPOConfig`` (its flags), the losses (torch only: copy them anywhere),
``GRPOTrainer`` and ``RatioTrainer`` (``Trainer.backward`` replaced), ``GRPOSearcher`` (the
per-token log-probs) and ``install``, which puts them in a run's Parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from buffer import Trajectory
from plumbing.config import check_bounds, knob, need
from plumbing.metrics import offpolicy_metrics
from searcher import Searcher
from tba import TBAConfig, group_token_logprobs
from trainer import Parts, Trainer


@dataclass
class GRPOConfig:
    """The GRPO baseline's knobs (extensions/grpo.py)."""

    loss: str = knob(
        "tb",
        "tb: VarGrad trajectory balance (the paper) | grpo: the on-policy GRPO baseline "
        "(DeepSeekMath Eq. 3, token-level as TRL; extensions/grpo.py) | ratio: TBA′'s released "
        "Dr. GRPO baseline, PRIME-RL's ratio loss (the ratio to the sampler capped at "
        "--ratio_cap, times r - mean r; no clip, no KL)",
        choices=("tb", "grpo", "ratio"),
    )
    grpo_clip_eps: float = knob(0.2, "GRPO: clip range of the ratio pi / pi_old (TRL's default)")
    grpo_kl_coef: float = knob(
        0.04, "GRPO: weight of the k3 KL to p_ref (DeepSeekMath's 0.04; TRL's default is 0)"
    )
    grpo_dr: bool = knob(
        False,
        "Dr. GRPO (Liu et al. 2025) with --loss grpo: advantages r - mean r (no division by "
        "the group's std) and the loss summed over tokens over a constant, responses x "
        "max_new_tokens (no division by length); off: GRPO as TRL",
    )
    ratio_cap: float = knob(
        8.0,
        "--loss ratio: each token's ratio pi / pi_b clamped to at most this (released: 8)",
        above=1.0,
    )
    ratio_norm: str = knob(
        "tokens",
        "--loss ratio: tokens: one token mean over the batch | sequence: each response's sum "
        "over its own length, prompt included, then a mean over responses (released)",
        choices=("tokens", "sequence"),
    )

    def __post_init__(self) -> None:
        check_bounds(self)  # the bounds each knob declares, --loss's choices among them
        need(
            0.0 < self.grpo_clip_eps < 1.0,
            f"--grpo_clip_eps must be in (0, 1), got {self.grpo_clip_eps}",
        )
        need(self.grpo_kl_coef >= 0, f"--grpo_kl_coef must be >= 0, got {self.grpo_kl_coef}")
        need(not self.grpo_dr or self.loss == "grpo", "--grpo_dr (Dr. GRPO) needs --loss grpo")


def install(parts: Parts, cfg: GRPOConfig) -> Parts:
    """``parts`` with the GRPO trainer when ``cfg.loss`` is grpo, the ratio trainer when it is
    ratio (its config as a class attribute), and searchers that record each sampled token's
    behaviour and reference log-probs."""
    if cfg.loss == "tb":
        return parts
    base, name = (RatioTrainer, "Ratio") if cfg.loss == "ratio" else (GRPOTrainer, "GRPO")
    trainer = type(f"{name}{parts.trainer.__name__}", (base, parts.trainer), {"grpo": cfg})
    return dataclasses.replace(parts, trainer=trainer, searcher=GRPOSearcher)


# ----------------------------------------------------------------------------- the losses


def grpo_advantages(reward: torch.Tensor, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """Group-relative advantages of the GRPO baseline (DeepSeekMath Sec. 4.1.2, outcome
    supervision), fp32, shape (P, K) like ``reward`` (K responses to each of P prompts):

        A_pk = (r_pk - mean_k r_pk) / (std_k r_pk + eps)     (scale: GRPO)
        A_pk =  r_pk - mean_k r_pk                            (no scale: Dr. GRPO)

    Dr. GRPO (Liu et al. 2025, Sec. 3.2) drops the division: it weighs a group whose rewards
    barely differ (nearly all right, or nearly all wrong) up, the difficulty bias it removes.

    std_k is the sample standard deviation over the K responses (Bessel: divide by K - 1), as
    TRL's GRPOTrainer computes it (``scale_rewards="group"``, eps = 1e-4); DeepSeekMath says
    only "std". Every token of response k gets A_pk. Flatten with ``.reshape(-1)`` for
    ``grpo_loss`` (prompt-major rows).

    A group whose K rewards are all equal gets A = 0 exactly: its rewards tell its responses
    nothing apart. The formula alone would divide the mean's rounding error (an ulp of r) by eps
    (8 rewards of 0.9 in fp32 would give A ~ 6e-4), so those groups are zeroed explicitly (TRL
    does not).
    """
    if reward.dim() != 2:
        raise ValueError(f"grpo_advantages: reward must be (P, K), got {tuple(reward.shape)}")
    if reward.shape[1] < 2:
        raise ValueError(
            "grpo_advantages: K must be >= 2 (with one response per prompt the group baseline "
            "is the reward itself and every advantage is 0)"
        )
    if eps <= 0:
        raise ValueError(f"grpo_advantages: eps must be > 0, got {eps}")
    r = reward.detach().float()
    if not torch.isfinite(r).all():
        raise ValueError("grpo_advantages: reward has NaN or inf entries")
    centred = r - r.mean(dim=1, keepdim=True)
    if not scale:
        scaled = centred
    else:
        scaled = centred / (r.std(dim=1, correction=1, keepdim=True) + eps)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    return scaled.masked_fill(constant, 0.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || p_ref) (DeepSeekMath Eq. 4; Schulman 2020,
    "Approximating KL divergence"), fp32, the shape of ``logp`` and ``ref_logp``:

        x  = ref_logp - logp = log(p_ref / pi) at the sampled token
        k3 = exp(x) - x - 1          >= 0 (exp(x) >= 1 + x), = 0 iff logp == ref_logp

    Unbiased for KL(pi || p_ref) when the token is sampled from pi; here it is sampled from
    pi_old, which is pi on-policy and close to it within the clip range.
    """
    x = ref_logp.float() - logp.float()
    return torch.exp(x) - x - 1.0


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
) -> torch.Tensor:
    """GRPO loss, the on-policy baseline (DeepSeekMath Eq. 3) with token-level averaging (DAPO
    Sec. 3.3). Needs only torch; copy it with ``normalized_sum``. Follows Hugging Face TRL's
    GRPOTrainer (``loss_type="dapo"``, ``epsilon=0.2``, one update per batch).

    Shapes: ``logp``, ``old_logp``, ``ref_logp``, ``mask`` are (B, T), one entry per response
    token, B = P K rows in prompt-major order; ``advantages`` is (B,), one per response
    (``grpo_advantages(reward).reshape(-1)``), broadcast over its tokens. ``logp`` =
    log pi_theta(y_t | x, y_<t) (carries the gradient); ``old_logp`` the same under pi_old, the
    behaviour policy that generated the response (recorded by the searcher); ``ref_logp`` under
    p_ref (may be None when kl_coef == 0, TRL's default); ``mask`` is 1 (or True) on scored
    tokens, 0 on padding. ``old_logp``, ``ref_logp`` and ``advantages`` are data (detached).
    Returns a scalar; all arithmetic in fp32.

        rho_it  = exp(logp_it - old_logp_it)
        surr_it = min(rho_it A_i, clip(rho_it, 1 - clip_eps, 1 + clip_eps) A_i)
        kl_it   = exp(ref_it - logp_it) - (ref_it - logp_it) - 1                  (k3)
        loss    = -sum_it m_it (surr_it - kl_coef kl_it) / sum_it m_it
                  (``normalizer`` given: / normalizer in place of sum_it m_it)

    Contract for a copier: ``logp`` and ``old_logp`` (and ``ref_logp``) must be scored by one
    rule -- the same temperature and the same tokens (a final EOS on both sides or on neither);
    any mismatch is a ratio != 1 on-policy, which the clip then treats as drift.

    Token-level averaging (DAPO; TRL "dapo"): every real token weighs the same, so a long
    response counts for more than a short one. DeepSeekMath's Eq. 3 averages each response's
    tokens first (TRL "grpo"), which favours short correct and long wrong responses (the length
    bias of Dr. GRPO, Liu et al. 2025). With no real token the loss is 0 (the denominator is
    clamped at 1). Gradient accumulation over micro-batches must divide by the token count of
    the whole batch: scale each micro-batch's loss by its tokens / all tokens. Dr. GRPO divides
    by a constant instead, ``normalizer`` = the batch's responses times the generation budget
    (its code's ``generate_max_length``), so a token weighs the same in a long response as in a
    short one and in a small batch as in a large one; pass the whole batch's constant to each
    micro-batch and sum their losses.

    Clipping: a token whose ratio has moved past the clip range in its advantage's direction
    (A > 0 and rho > 1 + eps, or A < 0 and rho < 1 - eps) takes the constant clipped branch and
    gets no surrogate gradient; otherwise d surr / d logp = rho A.

    On-policy link: with old_logp = logp.detach() rho = 1, nothing is clipped, and with
    kl_coef = 0
        grad loss = -(1 / sum m) sum_i A_i grad sum_t m_it logp_it,
    REINFORCE with the group-mean baseline (scaled by the group std), token-weighted.

    Masked positions may hold anything, NaN or -inf included: they are replaced before the
    arithmetic, so they reach neither the value nor the gradient.
    """
    if logp.dim() != 2:
        raise ValueError(f"grpo_loss: logp must be (B, T), got {tuple(logp.shape)}")
    if old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            "grpo_loss: logp, old_logp and mask must share a (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(
            f"grpo_loss: ref_logp must be {tuple(logp.shape)} like logp, got "
            f"{tuple(ref_logp.shape)}"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"grpo_loss: advantages must be ({logp.shape[0]},), one per sequence, "
            f"got {tuple(advantages.shape)}"
        )
    if not 0 < clip_eps < 1:
        raise ValueError(f"grpo_loss: clip_eps must be in (0, 1), got {clip_eps}")
    if kl_coef < 0:
        raise ValueError(f"grpo_loss: kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp")
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"grpo_loss: normalizer must be > 0, got {normalizer}")
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    lp = torch.where(m, logp.float(), zero)
    old = torch.where(m, old_logp.detach().float(), zero)
    adv = advantages.detach().float().unsqueeze(1)
    ratio = torch.exp(lp - old)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if kl_coef > 0:
        ref = torch.where(m, ref_logp.detach().float(), zero)
        per_token = per_token + kl_coef * k3_kl(lp, ref)
    return normalized_sum(torch.where(m, per_token, zero), m, normalizer)


@torch.no_grad()
def grpo_metrics(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
) -> dict[str, torch.Tensor]:
    """Token means over real tokens of ``grpo_loss``'s inputs (same shapes), as 0-d fp32
    tensors: ``clip_frac``, the share of tokens on the clipped branch (no surrogate gradient);
    ``kl``, the mean k3 KL to p_ref; ``ratio_mean``, the mean of pi / pi_old (1 on-policy)."""
    m = mask.bool()
    count = m.sum().clamp(min=1)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    lp = torch.where(m, logp.float(), zero)
    ratio = torch.exp(lp - torch.where(m, old_logp.float(), zero))
    adv = advantages.float().unsqueeze(1)
    clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
    kl = k3_kl(lp, torch.where(m, ref_logp.float(), zero))
    return {
        "clip_frac": (clipped & m).sum() / count,
        "kl": torch.where(m, kl, zero).sum() / count,
        "ratio_mean": torch.where(m, ratio, zero).sum() / count,
    }


def ratio_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    cap: float = 8.0,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The ratio loss, the baseline TBA′ was released with (PRIME-RL's ``ratio`` loss, run by
    bbartoldson/tba-prime's GRPO_qwen configs; the paper's Dr. GRPO). Needs only torch; copy
    it with ``check_normalizer`` and ``normalized_sum``.

    Shapes: ``logp`` (B, T) = log pi_theta(y_t | x, y_<t) of each scored token (carries the
    gradient), ``old_logp`` (B, T) the same under pi_b, the weights that sampled the response,
    ``mask`` (B, T) 1 on scored tokens; ``advantages`` (B,) one per response,
    ``grpo_advantages(reward, scale=False).reshape(-1)``: r - mean r over its prompt's K
    responses (PRIME-RL's default advantage, Dr. GRPO's). ``normalizer``: None, the batch's
    scored tokens; a number; or a (B,) tensor, row i's sum divided by its own entry (the
    released per-sequence mean: ``sequence_normalizer``). Returns a scalar, fp32.

        w_it = min(exp(logp_it - old_it), cap)            (the released clamp(., 0, cap))
        loss = -sum_i (sum_t m_it w_it A_i) / N_i          (N_i = N, or normalizer[i])

    The gradient is -m_it w_it A_i grad logp_it / N_i below the cap and 0 above it (the clamp
    is flat there). There is no PPO clip: a token's push goes on while its ratio moves past
    1 + eps in its advantage's direction, and stops only past the cap, whatever the sign of A.
    There is no KL term and no reference. On-policy (old = logp, w = 1 with gradient
    grad logp) the gradient is REINFORCE with the group's mean as baseline, Dr. GRPO's.
    TBA′'s loss (tba_prime.prime_tb_loss) is this loss with A_i - beta (KL_i - mean KL) in
    place of A_i. Masked positions may hold anything, NaN or -inf included.
    """
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            "ratio_loss: logp, old_logp and mask must share a (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"ratio_loss: advantages must be ({logp.shape[0]},), got {tuple(advantages.shape)}"
        )
    if cap <= 0:
        raise ValueError(f"ratio_loss: cap must be > 0, got {cap}")
    check_normalizer("ratio_loss", normalizer, logp.shape[0])
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    lp = torch.where(m, logp.float(), zero)
    old = torch.where(m, old_logp.detach().float(), zero)
    weight = torch.clamp(torch.exp(lp - old), max=cap)
    per_token = torch.where(m, -weight * advantages.detach().float().unsqueeze(1), zero)
    return normalized_sum(per_token, m, normalizer)


def check_normalizer(name: str, normalizer, rows: int) -> None:
    """A token loss's ``normalizer``: None, a number > 0, or a (rows,) tensor of entries > 0."""
    if isinstance(normalizer, torch.Tensor):
        if normalizer.shape != (rows,) or not (normalizer > 0).all():
            raise ValueError(f"{name}: a normalizer tensor must be ({rows},), every entry > 0")
    elif normalizer is not None and normalizer <= 0:
        raise ValueError(f"{name}: normalizer must be > 0, got {normalizer}")


def normalized_sum(per_token: torch.Tensor, mask: torch.Tensor, normalizer) -> torch.Tensor:
    """The (B, T) per-token losses summed over ``normalizer``: each row over its own entry (a
    tensor: per sequence), over the number (accumulation over passes), or over the mask's
    tokens (None: one token mean)."""
    if isinstance(normalizer, torch.Tensor):  # each row over its own denominator
        return (per_token.sum(dim=1) / normalizer.to(per_token)).sum()
    return per_token.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))


def sequence_normalizer(
    flat: list[Trajectory], items: int, device: torch.device | str
) -> torch.Tensor:
    """The released per-sequence normalisation's denominators, (len(flat),) fp32: each
    response's sequence length, its prompt's tokens and its own (PRIME-RL's ``seq_lens``: the
    released trainer, one sequence a pass, divides each pass's token sum by it), times the
    batch's ``items`` responses (its division by the accumulation steps). So the batch's loss
    is the mean over responses of each one's sum over its own length, whatever the passes."""
    lengths = [len(t.prompt_tokens) + len(t.response_tokens) for t in flat]
    return torch.tensor(lengths, dtype=torch.float32, device=device) * items


# ----------------------------------------------------------------------------- the trainer


class GRPOTrainer(Trainer):
    """The trainer with GRPO's loss in place of TB's: ``backward`` replaced (``install`` sets
    ``grpo``, the config)."""

    grpo: GRPOConfig = GRPOConfig(loss="grpo")

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. grpo_loss over ``micro_batches``: advantages per group (a group's rewards
        alone set its advantages); each pass's token mean weighted by its share of the batch's
        scored tokens, so the passes sum to grpo_loss on the whole batch (token-level), gradient
        included; Dr. GRPO (``grpo_dr``): each pass's token sum over the whole batch's constant,
        responses x max_new_tokens, unweighted. GRPO has no beta (its KL weight is
        grpo_kl_coef). The searchers recorded log pi_old and log p_ref per scored token
        (``tba.scored_tokens``); a list that does not match the tokens scored here is an error
        naming the prompt."""
        cfg = self.grpo
        require_token_logprobs(groups, "--loss grpo")
        total = sum(len(t.token_logprobs["behaviour"]) for g in groups for t in g)
        constant = None  # Dr. GRPO's denominator: every response at the generation budget
        if cfg.grpo_dr:
            constant = float(sum(len(g) for g in groups) * self.cfg.max_new_tokens)
        keys = ("loss", "clip_frac", "kl", "ratio_mean")
        sums = dict.fromkeys(keys, 0.0)
        logp_sum = 0.0
        for chunk in self.micro_batches(groups):
            flat = [t for g in chunk for t in g]
            logp, mask = self.score(chunk, group_token_logprobs)  # per token
            old, ref = token_lists(flat, mask, ("behaviour", "reference"), "--loss grpo")
            reward = torch.tensor([[t.reward for t in g] for g in chunk], device=self.device)
            adv = grpo_advantages(reward, scale=not cfg.grpo_dr).reshape(-1)
            share = int(mask.sum()) / max(total, 1)  # of the batch's tokens: the metrics' weight
            clip, kl = cfg.grpo_clip_eps, cfg.grpo_kl_coef
            loss = grpo_loss(logp, old, ref, mask, adv, clip, kl, normalizer=constant)
            if constant is None:  # a token mean over this pass: weighted by its share
                loss = loss * share
            loss.backward()
            sums["loss"] += loss.item()
            for key, value in grpo_metrics(logp, old, ref, mask, adv, cfg.grpo_clip_eps).items():
                sums[key] += value.item() * share
            logp_sum += logp.detach().sum().item()
        return {
            "loss/grpo": sums["loss"],
            "grpo/clip_frac": sums["clip_frac"],
            "grpo/kl": sums["kl"],
            "grpo/ratio_mean": sums["ratio_mean"],
            "policy/logp_mean": logp_sum / sum(len(g) for g in groups),
        }

    def update(self, groups: list[list[Trajectory]]) -> dict:
        metrics = super().update(groups)
        del metrics["train/beta"]  # GRPO has no beta
        return metrics


class RatioTrainer(GRPOTrainer):
    """The trainer with the ratio loss, TBA′'s released baseline (``install`` sets ``grpo``)."""

    grpo: GRPOConfig = GRPOConfig(loss="ratio")

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        checked_split_rows(cfg)
        super().__init__(cfg, device, pad_id, eos_id)

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. ratio_loss over ``micro_batches`` of whole groups, or of parts of
        ``micro_batch_size`` responses when that is below K (``split_rows``: the released run's
        one sequence a pass), advantages r - mean r of each group computed first (no std, no
        beta, no reference), each pass's sum over the whole batch's scored tokens
        (``ratio_norm`` tokens) or over each response's own length times the batch's responses
        (sequence, ``sequence_normalizer``): the passes sum to the loss on the whole batch.
        Reads the per-token log pi_b the searchers record (``GRPOSearcher``)."""
        cfg = self.grpo
        require_token_logprobs(groups, "--loss ratio")
        items = sum(len(g) for g in groups)
        tokens = sum(len(t.token_logprobs["behaviour"]) for g in groups for t in g)
        advantage_of = {}
        for group in groups:
            reward = torch.tensor([[t.reward for t in group]])
            for t, a in zip(group, grpo_advantages(reward, scale=False)[0].tolist(), strict=True):
                advantage_of[id(t)] = a
        units = groups
        rows = split_rows(self.cfg)
        if rows:  # parts of a group, one a pass (the core's passes: max(1, rows // K) groups)
            units = [g[i : i + rows] for g in groups for i in range(0, len(g), rows)]
        sums = dict.fromkeys(("loss", "logp", "ratio", "capped"), 0.0)
        rhos = []
        for chunk in self.micro_batches(units):
            flat = [t for g in chunk for t in g]
            logp, mask = self.score(chunk, group_token_logprobs)  # per token
            (old,) = token_lists(flat, mask, ("behaviour",), "--loss ratio")
            adv = torch.tensor([advantage_of[id(t)] for t in flat], device=self.device)
            if cfg.ratio_norm == "sequence":
                normalizer = sequence_normalizer(flat, items, self.device)
            else:
                normalizer = float(max(tokens, 1))
            loss = ratio_loss(logp, old, mask, adv, cfg.ratio_cap, normalizer)
            loss.backward()
            m = mask.bool()
            ratio = torch.exp(torch.where(m, logp.detach().float() - old, 0.0))
            sums["loss"] += loss.item()
            sums["logp"] += logp.detach().sum().item()
            sums["ratio"] += torch.where(m, ratio, 0.0).sum().item()
            sums["capped"] += int((m & (ratio > cfg.ratio_cap)).sum())
            behaviour = torch.tensor([t.behaviour_logprob for t in flat], dtype=torch.float64)
            sequence = logp.detach().double().sum(1).cpu()
            rhos.append((sequence - behaviour).view(len(chunk), -1))
        metrics = {
            "loss/ratio": sums["loss"],
            "ratio/ratio_mean": sums["ratio"] / max(tokens, 1),  # pi / pi_b per token
            "ratio/capped_frac": sums["capped"] / max(tokens, 1),  # tokens over the cap
            "policy/logp_mean": sums["logp"] / items,
            **offpolicy_metrics(torch.cat(rhos), 0, items),
        }
        del metrics["offpolicy/clip_frac"]  # TB's trust region's, not this loss's
        return metrics


def split_rows(cfg: TBAConfig) -> int:
    """Responses per pass when ``micro_batch_size`` is below K (a prompt's responses split over
    passes: the ratio loss, TBA′'s loss with the group's part of its advantage known before any
    pass, the references' scoring); 0: whole groups."""
    size = cfg.micro_batch_size
    return size if 0 < size < cfg.responses_per_prompt else 0


def checked_split_rows(cfg: TBAConfig) -> int:
    """``split_rows``, a ConfigError unless it divides K (a loss's passes hold whole parts)."""
    rows, k = split_rows(cfg), cfg.responses_per_prompt
    need(
        rows == 0 or k % rows == 0,
        f"--micro_batch_size {rows} must divide --responses_per_prompt {k}: a pass holds whole "
        "parts of one prompt's group",
    )
    return rows


def require_token_logprobs(groups: list[list[Trajectory]], flag: str) -> None:
    """A ValueError naming the prompt unless every trajectory carries per-token log-probs."""
    for t in (t for g in groups for t in g):
        if t.token_logprobs is None:
            raise ValueError(
                f"{flag}: a trajectory of prompt {t.prompt_id!r} has no per-token log-probs "
                "(made by a searcher, or saved in a checkpoint, under --loss tb)"
            )


def token_lists(
    flat: list[Trajectory], mask: torch.Tensor, keys: tuple[str, ...], flag: str
) -> list[torch.Tensor]:
    """The per-token lists ``keys`` of ``flat``'s trajectories (``Trajectory.token_logprobs``)
    as (B, T) tensors on the mask's device, padded to its width T; a list whose length is not
    its row's scored tokens is an error naming the prompt (the searcher scored by another
    rule)."""
    for t, n in zip(flat, mask.sum(1).tolist(), strict=True):
        for key in keys:
            if len(t.token_logprobs[key]) != n:
                raise ValueError(
                    f"{flag}: prompt {t.prompt_id!r}: {n} scored tokens, but "
                    f"{len(t.token_logprobs[key])} {key} log-probs recorded (the searcher "
                    "scored by another rule)"
                )
    return [padded([t.token_logprobs[k] for t in flat], mask.shape[1], mask.device) for k in keys]


# ----------------------------------------------------------------------------- the searcher


class GRPOSearcher(Searcher):
    """A searcher that attaches to each trajectory what GRPO's loss reads per token
    (``Trajectory.token_logprobs``): "behaviour", log pi_old of each scored token as the engine
    sampled it (``Searcher.responses``), and "reference", log p_ref of each by the trainer's
    rule (``Searcher.reference_token_logprobs``). The sums the core keeps are unchanged."""

    def search_once(self):
        self.behaviour_tokens: list[list[float]] = []  # per response, in the batch's order
        self.reference_tokens: list[list[float]] = []
        trajectories, seconds = super().search_once()
        per_token = zip(trajectories, self.behaviour_tokens, self.reference_tokens, strict=True)
        for t, behaviour, reference in per_token:
            t.token_logprobs = {"behaviour": behaviour, "reference": reference}
        return trajectories, seconds

    def responses(self, prompts):
        outputs, behaviour = super().responses(prompts)
        self.behaviour_tokens += [lp for samples in behaviour for lp in samples]
        return outputs, behaviour

    def reference_token_logprobs(self, prompts, responses):
        token_logp, mask = super().reference_token_logprobs(prompts, responses)
        rows = zip(token_logp.tolist(), mask.sum(1).tolist(), strict=True)
        self.reference_tokens += [lp[:n] for lp, n in rows]
        return token_logp, mask


def padded(rows: list[list[float]], width: int, device: torch.device) -> torch.Tensor:
    """(len(rows), width) fp32, row i = rows[i] from column 0, zeros after."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out.to(device)
