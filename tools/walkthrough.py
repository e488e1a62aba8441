"""docs/walkthrough.md from a real run: one asynchronous step of the tiny preset followed through
steps 1-5 of tba.py's algorithm, with the core's own classes (``Searcher``, ``ReplayBuffer``,
``Trainer``, ``WeightStore``) and the preset's checks (extensions/checks.py).

    python -m tools.walkthrough                 # rewrites docs/walkthrough.md (CPU, about 40 s)
    python -m tools.walkthrough --out PATH      # writes the page elsewhere

tests/test_walkthrough.py writes it again and compares it with the page, so the page says what
the code does. The searcher and the trainer run in one process, on one thread and seeded, so that
every number can be shown and comes out the same on every run of this machine's kind; they run
in the order the preset's two processes do (``drive``). The step shown is the first that shows
what makes TBA asynchronous (``shows_asynchrony``). Where the page states a fact of the run in
words, the writer checks it and raises when it no longer holds.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# The page's arithmetic runs on AVX2 kernels, ATen's and MKL's, which every x86-64 CPU this
# project meets has: left to choose, an AVX-512 CPU rounds otherwise, the seeded run samples other
# tokens, and the page would hold on one kind of machine only. ATen reads this once, when torch
# first dispatches, so it must be set before torch is imported: `python -m tools.walkthrough` is
# a fresh process, and main() refuses one where torch chose other kernels first.
if platform.machine() == "x86_64":
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")

import torch
from transformers import AutoTokenizer

from buffer import Trajectory
from engines import make_weight_store
from extensions import checks
from extensions.tiny import (
    TINY_CHECKS,
    TINY_PRESET,
    TINY_WARM_START,
    tiny_configs,
    tiny_task,
    tiny_warm_start,
)
from plumbing.models import meta_causal_lm, special_token_ids
from rewards import gsm8k_gold, gsm8k_reward
from searcher import SearcherSetup
from tba import group_logprobs, tb_clipped
from tools.bench_machine import cpu_kind
from trainer import Parts, Trainer, item_tensor

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "walkthrough.md"
MAX_STEPS = 60  # the run stops here if no step has shown the asynchrony (an error)


def fmt(x: float) -> str:
    """A number as the page prints it (3 decimals; -0.000 as 0.000)."""
    text = f"{x:.3f}"
    return "0.000" if text == "-0.000" else text


def claim(holds: bool, what: str) -> None:
    """Raise unless a fact the page states in words holds in this run."""
    if not holds:
        raise RuntimeError(
            f"tools/walkthrough.py: the page would say {what!r}, which no longer holds"
        )


# ----------------------------------------------------------------------------- the run


def observed(base: type[Trainer]) -> type[Trainer]:
    """``base`` (the preset's trainer) that keeps what a step drew (``drawn``: the groups and
    whether each is most-on-policy), its beta, log pi of the groups before the update (``logp``)
    and the update's metrics."""

    class Observed(base):
        def __init__(self, *args):
            super().__init__(*args)
            sample = self.buffer.sample

            def sample_and_keep(*args, **kwargs):
                self.drawn = sample(*args, **kwargs)
                return self.drawn

            self.buffer.sample = sample_and_keep

        def update(self, groups: list[list[Trajectory]]) -> dict:
            self.beta_used = self.beta()
            with torch.no_grad():
                self.logp = self.score(groups)
                previous = self.previous  # the weights one update old: the second anchor
                self.proximal = None if previous is None else self.score(groups, model=previous)
            self.last_metrics = super().update(groups)
            return self.last_metrics

    return Observed


def conditions(trainer: Trainer) -> list[tuple[str, str, bool]]:
    """2. ``Trainer.can_step``'s conditions, each as (name, the numbers it compares, whether it
    holds); raises when they no longer make up ``can_step``."""
    cfg = trainer.cfg
    buffer = trainer.buffer
    oldest = trainer.oldest_version()
    young = buffer.count_prompts_since(oldest)
    trained = (trainer.step + 1) * cfg.trajectories_per_step()
    rows = [
        (
            "the initial fill: items >= initial_samples",
            f"{len(buffer)} >= {trainer.initial_samples}",
            len(buffer) >= max(trainer.initial_samples, 1),
        ),
        (
            "P prompts in the buffer",
            f"{len(buffer.by_prompt)} >= {cfg.prompts_per_step}",
            len(buffer.by_prompt) >= cfg.prompts_per_step,
        ),
        (
            f"P prompts hold items of version >= step - max_train_lag = {oldest}",
            f"{young} >= {cfg.prompts_per_step}",
            young >= cfg.prompts_per_step,
        ),
        (
            "newest version >= step - barrier_lag",
            f"{buffer.newest_version} >= {trainer.step - cfg.barrier_lag}",
            buffer.newest_version >= trainer.step - cfg.barrier_lag,
        ),
        (
            "trajectories trained by the step <= replay_ratio x generated",
            f"{trained} <= {cfg.replay_ratio:g} x {buffer.num_added}",
            trained <= cfg.replay_ratio * buffer.num_added,
        ),
    ]
    claim(
        all(ok for _, _, ok in rows) == trainer.can_step(),
        "these conditions are Trainer.can_step",
    )
    return rows


@dataclass
class StepRecord:
    """What the timeline shows of one step."""

    step: int
    arrived: list[int]  # versions of the batches that arrived since the previous step
    lags: Counter  # items of the step at each lag
    mop: int  # most-on-policy groups
    grad_norm: float
    drawn: dict  # prompt id -> whether the step drew it most-on-policy


def build(workdir: Path):
    """The preset's parts: the warm start, the config, the weight store, the checked searcher
    and trainer (as ``trainer.run_tba`` builds them, here in one process)."""
    train, _, val = tiny_task()
    model = tiny_warm_start(workdir, train, val, TINY_PRESET["seed"])
    cfg, _ = tiny_configs(model, output_dir=str(workdir / "run"))
    claim(TINY_CHECKS == {"parity_check": True}, "the preset's checks are the parity check")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    # The parity probe as extensions/launch.parity_probe makes it for an fp32 run (no floor).
    probe_tokens = tokenizer(checks.PROBE_TEXT)["input_ids"]
    probe = checks.ParityProbe.from_prompt(probe_tokens, checks.ChecksConfig().parity_tol)
    parts = checks.install(Parts(), probe)
    device = torch.device(cfg.trainer_device)
    store = make_weight_store(cfg, meta_causal_lm(cfg.model, cfg.trust_remote_code), device)
    # run_tba starts the searchers before the trainer loads its model; a Searcher seeds torch.
    setup = SearcherSetup(0, cfg, train, gsm8k_reward, store, None, None)
    searcher = parts.searcher(setup)
    pad_id, eos_id = special_token_ids(cfg.model, cfg.trust_remote_code)
    trainer = observed(parts.trainer)(cfg, device, pad_id, eos_id)
    return cfg, tokenizer, train, store, searcher, trainer, probe


def shows_asynchrony(trainer: Trainer, before_ok: bool) -> int | None:
    """The group to follow if the step just taken shows what the page is for, else None: the
    trainer waited for the batch that let it run; its items are one and two versions old, none
    on-policy; the cap on the gradient's norm binds; and a group drawn from the whole buffer holds
    right and wrong answers, two versions old, and items the trust region drops (some, not
    all)."""
    groups, is_mop = trainer.drawn
    version = trainer.step - 1
    lags = {version - t.version for g in groups for t in g}
    if before_ok or lags != {1, 2}:
        return None
    if trainer.last_metrics["train/grad_norm"] <= trainer.cfg.max_grad_norm:
        return None
    dropped = dropped_items(trainer, version)
    for g, group in enumerate(groups):
        rewards = {t.reward for t in group}
        if is_mop[g] or len(rewards) < 2 or {version - t.version for t in group} != {2}:
            continue
        if 0 < int(dropped[g].sum()) < len(group):
            return g
    return None


def dropped_items(trainer: Trainer, version: int) -> torch.Tensor:
    """4. The items (P, K) the trust region dropped in the step that started from ``version``, by
    the arguments ``Trainer.backward`` gives ``tba.tb_clipped``."""
    groups, _ = trainer.drawn
    device = trainer.device
    ref = item_tensor(groups, "ref_logprob", device)
    reward = item_tensor(groups, "reward", device)
    lags = version - item_tensor(groups, "version", device)
    behaviour = item_tensor(groups, "behaviour_logprob", device)
    region = (behaviour, trainer.cfg.tb_clip_eps, lags, trainer.proximal)
    return tb_clipped(trainer.logp, ref, reward, trainer.beta_used, *region)


def drive(searcher, trainer, store):
    """1-5 as the preset's processes run them: the searcher sends a batch and at once starts the
    next (1a: it loads the newest weights before the trainer has stepped on the batch it sent);
    the trainer adds the batch to its buffer (2) and takes every step ``can_step`` allows (3-4),
    publishing after each (5), before the next batch arrives (the faster of the two here). Stops
    after the first step that ``shows_asynchrony``; returns the timeline, the batches, that
    step's group to follow, and can_step's conditions before and after its batch arrived."""
    timeline = []
    batches = []
    trainer.publish(store)  # 5. version 0, which the searcher waits for (1a)
    batch = searcher.next_batch()  # 1a-1c
    arrived = []
    while trainer.step < MAX_STEPS:
        following = searcher.next_batch()  # 1a-1c of the next batch: it loads before the steps
        batches.append(batch)
        before = conditions(trainer)  # 2. what the trainer waits on
        trainer.buffer.extend(batch.trajectories)  # 1d, 2. the intake
        arrived.append(batch.stats.version)
        after = conditions(trainer)
        first = True
        while trainer.can_step():
            metrics = trainer.train_step()  # 3-4
            groups, is_mop = trainer.drawn
            version = trainer.step - 1
            timeline.append(
                StepRecord(
                    version,
                    arrived,
                    Counter(version - t.version for g in groups for t in g),
                    sum(is_mop),
                    metrics["train/grad_norm"],
                    {group[0].prompt_id: mop for group, mop in zip(groups, is_mop, strict=True)},
                )
            )
            arrived = []
            before_ok = not first or all(ok for _, _, ok in before)
            followed = shows_asynchrony(trainer, before_ok)
            first = False
            if followed is not None:
                return timeline, batches, followed, before, after
            trainer.publish(store)  # 5
        batch = following
    raise RuntimeError(f"tools/walkthrough.py: no step up to {MAX_STEPS} showed the asynchrony")


# ----------------------------------------------------------------------------- the page


def run(workdir: Path) -> list[str]:
    """The run, and the page's lines."""
    cfg, tokenizer, train, store, searcher, trainer, probe = build(workdir)
    timeline, batches, g, before, after = drive(searcher, trainer, store)
    examples = {ex["id"]: ex for ex in train}
    t = trainer.step - 1  # the step shown: it started from version t, and made version t + 1
    groups, is_mop = trainer.drawn
    group = groups[g]
    pid = group[0].prompt_id
    lag = t - group[0].version
    claim(all(t - x.version == lag for x in group), "the followed group's items share a version")
    beta = trainer.beta_used
    metrics = trainer.last_metrics
    K = cfg.responses_per_prompt
    PK = cfg.trajectories_per_step()

    def text(x: Trajectory) -> str:
        return tokenizer.decode(x.response_tokens, skip_special_tokens=True).replace("\n", " / ")

    out = intro(cfg, t)
    out += timeline_section(cfg, timeline, t)

    # ---- 1. the batch that brought the followed prompt
    source = next(
        b
        for b in batches
        if b.stats.version == group[0].version and any(x.prompt_id == pid for x in b.trajectories)
    )
    generated = [x for x in source.trajectories if x.prompt_id == pid]
    stored = [item.trajectory() for item in trainer.buffer.by_prompt[pid]]
    claim(all(x.version == group[0].version for x in stored), "the prompt holds one batch's items")
    where = {tuple(x.response_tokens): j for j, x in enumerate(stored)}
    newest = batches[-1]
    example = examples[pid]
    out += [
        f"## 1. The searcher: prompt {pid}'s responses (searcher.py, `Searcher.next_batch`)",
        "",
        f"Step {t}'s most-on-policy groups come from the batch that arrived just before it, "
        f"generated by version {newest.stats.version}; prompt {pid}, drawn from the whole "
        f"buffer and followed on this page, comes from the batch before, generated by version "
        f"{source.stats.version}. That batch was made as every batch is:",
        "",
        f"- **1a load.** `Searcher.load_newest_weights` (searcher.py) found version "
        f"{source.stats.version} published and copied it into the engine: "
        "`WeightStore.load_into` (engines.py) hands `HFEngine.load_weights` (engines.py) views "
        "of the shared weights. The preset's check, `CheckedSearcher.load_newest_weights` "
        "(extensions/checks.py), then scored a fixed probe with the engine and compared it with "
        "the trainer's (step 5 below).",
        f"- **1b generate, with log pi_b.** `Searcher.responses` has "
        f"`HFEngine.generate_with_logprobs` (engines.py) sample N = {cfg.num_generations} "
        f"responses to each of {cfg.searcher_batch_prompts} prompts at T = {cfg.temperature:g}, "
        "and the engine's log-prob of each sampled token by the rule of step 4 (the untempered "
        "model); `Searcher.search_once` sums them into log pi_b(y|x), the log-prob under the "
        "behaviour policy, the weights that sampled y.",
        "- **1c rewards and log p_ref.** `Searcher.rewards` calls `gsm8k_reward` (rewards.py: 1 "
        "when the final number is the sum, else 0); `Searcher.reference_logprobs` scores log "
        "p_ref(y|x) under the frozen reference, the warm start, by the rule log pi is scored "
        "with (`TBAConfig.scoring_rule`: the untempered model, the final EOS included).",
        f"- **1d send.** `Searcher.put` puts the {len(source.trajectories)} trajectories, tagged "
        f"with version {source.stats.version}, on the bounded queue (here they go to the trainer "
        "directly).",
        "",
        f"Prompt {pid}, gold answer {gsm8k_gold(example):g}:",
        "",
        "```",
        example["prompt"],
        "```",
        "",
        "| i | response | r | log p_ref | log pi_b | stored as item |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, x in enumerate(generated):
        out.append(
            f"| {i} | `{text(x)}` | {x.reward:g} | {fmt(x.ref_logprob)} | "
            f"{fmt(x.behaviour_logprob)} | {where[tuple(x.response_tokens)]} |"
        )
    apart = sum(abs(x.ref_logprob - x.behaviour_logprob) for x in generated) / len(generated)
    claim(apart > 1e-3, "log pi_b differs from log p_ref")
    out += [
        "",
        f"log pi_b differs from log p_ref by {fmt(apart)} nats on average: after "
        f"{source.stats.version} steps the policy is no longer the warm start.",
        "",
    ]

    # ---- 2. the intake and the wait
    out += [
        "## 2. The intake and the wait (trainer.py, `Intake`, `Trainer.can_step`; buffer.py, "
        "`ReplayBuffer.add`)",
        "",
        "`Intake` drains the queue into the replay buffer on a thread of its own, so that the "
        "trainer's step and the intake overlap. `ReplayBuffer.add` groups the items by prompt "
        "and stores each distinct response once (a repeat replaces the older copy, with the "
        f"newer reward, log-probs and version): prompt {pid} keeps {len(stored)} of its "
        f"{len(generated)} responses. Between steps the trainer waits in `Intake.wait_for` until "
        f"`Trainer.can_step()`. After publishing version {t} it could not step again until the "
        "searcher's next batch arrived:",
        "",
        "| `Trainer.can_step` | before the batch | after it |",
        "| --- | --- | --- |",
    ]
    for (name, was, ok_was), (_, now, ok_now) in zip(before, after, strict=True):
        out.append(f"| {name} | {was}: {yes(ok_was)} | {now}: {yes(ok_now)} |")
    claim(not before[-1][2] and all(ok for _, _, ok in before[:-1]), "only the pace held it")
    out += [
        "",
        "Only the pace held it: replay_ratio = 1 lets the trainer train at most as many "
        "trajectories as the searcher has generated.",
        "",
    ]

    # ---- 3. the sample
    oldest = t - cfg.max_train_lag
    eligible = trainer.buffer.count_prompts_since(oldest)
    batches_a_pass = len(train) / cfg.searcher_batch_prompts
    fresh = [b for b in range(len(groups)) if is_mop[b]]
    whole = [b for b in range(len(groups)) if not is_mop[b]]
    drawn_items = [where[tuple(x.response_tokens)] for x in group]
    mop_lags = {t - x.version for b in fresh for x in groups[b]}
    claim(mop_lags == {1}, "the most-on-policy groups are one version old")
    claim(newest.stats.version == t - 1, "the newest batch is one version old")
    claim(len(trainer.buffer.fresh) == cfg.searcher_batch_prompts, "the fresh set is one batch")
    eligible_items = [x for x in stored if x.version >= oldest]
    replacement = (
        f"it holds {len(eligible_items)}, fewer than K, so they are drawn with replacement"
        if len(eligible_items) < K
        else f"drawn without replacement from its {len(eligible_items)}"
    )
    right_drawn = sum(x.reward == 1 for x in group)
    right_generated = sum(x.reward == 1 for x in generated)
    before_step = timeline[-2].drawn
    if pid in before_step:
        how = "most-on-policy" if before_step[pid] else "from the whole buffer"
        earlier = (
            f"Step {t - 1} drew prompt {pid} too ({how}), when these same items were one "
            "version old."
        )
    else:
        earlier = f"Step {t - 1} did not draw prompt {pid}."
    out += [
        "## 3. The sample (buffer.py, `ReplayBuffer.sample`, called by `Trainer.train_step`)",
        "",
        f"Each of the P = {cfg.prompts_per_step} draws is most-on-policy (MOP) with probability "
        f"m = {cfg.mop_prob:g}: a prompt refreshed since the latest publish (here the "
        f"{cfg.searcher_batch_prompts} prompts of the batch that just arrived), with its newest "
        "items. Otherwise it is a draw from the whole buffer: any prompt holding items of "
        f"version {oldest} or newer (max_train_lag = {cfg.max_train_lag}; "
        f"{eligible} prompts here), its K = {K} items drawn uniformly (inv_temp = "
        f"{cfg.inv_temp:g}) among those, with replacement when it holds fewer than K. "
        f"Step {t} drew {len(fresh)} MOP groups, one version old, and {len(whole)} from the "
        f"whole buffer; group {g} is prompt {pid}, two versions old. Its K items are the stored "
        f"items {drawn_items} ({replacement}), {right_drawn} of them right, where "
        f"{right_generated} of the N generated were: the buffer holds each distinct response "
        "once, so a group weighs distinct answers, not how often the policy gave them. "
        f"{earlier}",
        "",
        f"A prompt comes back once per pass over the {len(train)} sums ({batches_a_pass:g} "
        "batches), so a prompt's items in the buffer share one version: in one step, the items "
        "one version old and those two versions old belong to different prompts.",
        "",
    ]

    # ---- 4. the loss and the AdamW step
    device = trainer.device
    logp = trainer.logp.double()
    ref = item_tensor(groups, "ref_logprob", device).double()
    reward = item_tensor(groups, "reward", device).double()
    behaviour = item_tensor(groups, "behaviour_logprob", device).double()
    lags = t - item_tensor(groups, "version", device).double()
    d = logp - ref - reward / beta
    log_z = -d.mean(dim=1, keepdim=True)
    push = log_z + d
    rho = logp - behaviour
    u = -torch.sign(push) * rho
    radius = cfg.tb_clip_eps * lags.clamp(min=1).sqrt()
    u_previous = -torch.sign(push) * (logp - trainer.proximal.double())
    by_previous = (u_previous > cfg.tb_clip_eps) & ~(u > radius)
    dropped = dropped_items(trainer, t)
    claim(torch.equal((u > radius) | by_previous, dropped), "dropped when u > eps_ij or u' > eps")
    claim(int(dropped.sum()) == round(metrics["offpolicy/clip_frac"] * PK), "the drops counted")
    shares = push.pow(2).sum(dim=1) / PK
    loss = shares.sum().item()
    claim(abs(loss - metrics["loss/tb"]) <= 1e-4 * max(1.0, loss), "the shares sum to loss/tb")
    gradient = torch.where(dropped, torch.zeros_like(push), 2 * push / PK)
    out += [
        "## 4. The loss and the AdamW step (trainer.py, `Trainer.update`, `Trainer.backward`; "
        "tba.py, `tb_loss`, `tb_clipped`)",
        "",
        f"`Trainer.score` computes log pi of every item under version {t}, with gradients, by "
        "the rule log p_ref was scored with. For each item d = log pi - log p_ref - r / beta "
        f"(beta = {beta:g}, so r / beta = {fmt(1 / beta)} for a right answer); logZ = -mean of "
        f"d over the group (no gradient); the loss is the mean of (logZ + d)^2 over the P K = "
        f"{PK} items (`tb_loss`). Its gradient with respect to an item's log pi is 2 (logZ + "
        "d) / (P K) (the table's last column, before the cap below): the AdamW step pushes "
        "log pi down where logZ + d > 0 and up where it is < 0.",
        "",
        "The trust region (`tb_clipped`) measures how far the policy has moved on an item since "
        "its sampler: rho = log pi - log pi_b, and u = -sign(logZ + d) rho, how far along its "
        f"push. An item with u > eps_ij = {cfg.tb_clip_eps:g} sqrt(max(1, lag)) "
        f"({fmt(cfg.tb_clip_eps)} at lag 1, {fmt(cfg.tb_clip_eps * math.sqrt(2))} at lag 2) "
        "gives no gradient: earlier steps have already moved it that way further than the "
        "region allows. The region's second anchor is the weights one update old (version "
        f"{t - 1}, kept by `Trainer.update`): an item with u' = -sign(logZ + d) (log pi - log "
        f"pi_{t - 1}) > {cfg.tb_clip_eps:g} gives none either, the last update having moved it "
        f"that far along its push ({int(by_previous.sum())} of the P K items in this step, "
        "beyond those the sampler's anchor drops).",
        "",
        f"Group {g} (prompt {pid}, lag {lag}): logZ = {fmt(log_z[g, 0].item())}.",
        "",
        "| k | item | r | log p_ref | log pi_b | log pi | rho | d | logZ + d | u | "
        "gradient on log pi |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, x in enumerate(group):
        grad = "0 (dropped)" if dropped[g, k] else fmt(gradient[g, k].item())
        out.append(
            f"| {k} | {drawn_items[k]} | {x.reward:g} | {fmt(ref[g, k].item())} | "
            f"{fmt(behaviour[g, k].item())} | {fmt(logp[g, k].item())} | "
            f"{fmt(rho[g, k].item())} | {fmt(d[g, k].item())} | {fmt(push[g, k].item())} | "
            f"{fmt(u[g, k].item())} | {grad} |"
        )
    gone = int(dropped[g].sum())
    one = int(dropped[g].nonzero()[0])
    kept = int((~dropped[g]).nonzero()[0])
    out += [
        "",
        f"{gone} of the K = {K} draws are dropped. Draw k = {one} (stored item "
        f"{drawn_items[one]}): logZ + d = {fmt(push[g, one].item())} {direction(push[g, one])}, "
        f"and since version {group[one].version} sampled it the policy has moved it "
        f"{fmt(abs(rho[g, one].item()))} nats that way (rho = {fmt(rho[g, one].item())}): u = "
        f"{fmt(u[g, one].item())} > {fmt(radius[g, one].item())}. Draw k = {kept} (stored item "
        f"{drawn_items[kept]}) is kept: u = {fmt(u[g, kept].item())} <= "
        f"{fmt(radius[g, kept].item())}. Were these K items sampled by the policy itself and "
        "kept as sampled, this gradient would be REINFORCE with the group's mean as baseline "
        "(`tb_loss`, paper App. A); they are two versions old, and the buffer stores each "
        "distinct response once, so it is TB's off-policy gradient.",
        "",
        "Every group's share of the loss is the sum of its (logZ + d)^2 over its K items, "
        f"divided by P K = {PK}; the shares add up to the loss:",
        "",
        "| group | prompt | draw | lag | right answers of K | logZ | dropped | share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b, items in enumerate(groups):
        lag_b = ", ".join(str(v) for v in sorted({t - x.version for x in items}))
        draw = "MOP" if is_mop[b] else "whole buffer"
        right = sum(x.reward == 1 for x in items)
        out.append(
            f"| {b} | {items[0].prompt_id} | {draw} | {lag_b} | {right} | "
            f"{fmt(log_z[b, 0].item())} | {int(dropped[b].sum())} | {fmt(shares[b].item())} |"
        )
    out.append(f"| all | | | | | | {int(dropped.sum())} | {fmt(loss)} |")
    norm = metrics["train/grad_norm"]
    capped = trainer.grad_norm().item()
    norms = [r.grad_norm for r in timeline]
    claim(min(norms) > cfg.max_grad_norm, "the cap bound at every step")
    out += [
        "",
        f"`Trainer.update` reports `loss/tb` = {fmt(metrics['loss/tb'])}.",
        "",
        f"**The cap on the gradient's norm.** The gradient's norm is {fmt(norm)} "
        f"(`Trainer.grad_norm`), over max_grad_norm = {cfg.max_grad_norm:g}, so `Trainer.update` "
        f"scales the whole gradient by {cfg.max_grad_norm:g} / {fmt(norm)} = "
        f"{cfg.max_grad_norm / norm:.4f} (its norm is then {fmt(capped)}). Every item's "
        "gradient is scaled alike, so the gradient keeps its direction. AdamW's update is a "
        "running average of gradients divided by the root of a running average of their "
        "squares, so scaling every step's gradient alike would change nothing; what the cap "
        "changes is how much each step counts in those averages: each enters with norm "
        f"{cfg.max_grad_norm:g}, not the {fmt(min(norms))} to {fmt(max(norms))} that r / beta "
        "gives the raw gradient in this run (the cap bound at every step). The paper preset "
        "has no cap (tba.py, "
        f"max_grad_norm). AdamW then steps at lr = {metrics['train/lr']:g}: the weights are "
        f"version {trainer.step}.",
        "",
    ]

    # ---- 5. the publish, and the searcher's next load
    trainer.publish(store)  # 5
    held = searcher.version
    with torch.no_grad():
        after_trainer = trainer.score([group]).double()[0]
    searcher.load_newest_weights()  # 1a, the searcher's next
    engine_probe = checks.engine_logprob(searcher.engine, probe.prompt, probe.response)
    rule = cfg.scoring_rule(searcher.pad_id, searcher.eos_id, searcher.device)
    with torch.no_grad():
        after = group_logprobs(
            searcher.engine.model,
            [group[0].prompt_tokens],
            [[x.response_tokens for x in group]],
            **rule,
        ).double()[0]
    claim(torch.allclose(after, after_trainer, atol=1e-5), "the engine scores as the trainer")
    claim(held == t, "the searcher held version t while the trainer stepped")
    moved = after - logp[g]
    pushed = sum((moved[k] < 0) == (push[g, k] > 0) for k in range(K) if not dropped[g, k])
    out += [
        "## 5. The publish, and a searcher loading it (trainer.py, `Trainer.publish`; "
        "engines.py, `WeightStore`; searcher.py, `Searcher.load_newest_weights`)",
        "",
        f"With k = {cfg.publish_every} the trainer publishes after every step: "
        f"`Trainer.publish` copies its weights into the shared store as version "
        f"{store.version()} (`WeightStore.publish`, engines.py: one flat shared tensor and a "
        "version counter, read under a seqlock), with the probe's log-prob "
        f"{fmt(searcher.published_probe)} (`CheckedTrainer.probe`, extensions/checks.py), and "
        "`ReplayBuffer.mark_published` empties the set of refreshed prompts that MOP draws "
        f"from. The searcher, generating its next batch with version {held}, loads version "
        f"{searcher.version} at its next 1a: `Searcher.load_newest_weights` runs "
        "`WeightStore.load_into(HFEngine.load_weights)`, which copies the shared tensors into "
        "the engine's parameters (and reads again if a publish overlapped). The check: the "
        f"engine scores the probe at {fmt(engine_probe)}, the trainer's "
        f"{fmt(searcher.published_probe)}. "
        f"The engine now gives prompt {pid}'s items the trainer's new log-probs:",
        "",
        f"| k | item | dropped | push | log pi, version {t} | version {t + 1} (engine) | change |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in range(K):
        out.append(
            f"| {k} | {drawn_items[k]} | {yes(bool(dropped[g, k]))} | "
            f"{'down' if push[g, k] > 0 else 'up'} | {fmt(logp[g, k].item())} | "
            f"{fmt(after[k].item())} | {fmt(moved[k].item())} |"
        )
    out += [
        "",
        f"{pushed} of the {K - gone} kept items moved the way they were pushed. One AdamW step "
        "moves every weight, so a dropped item moves too, with the items that share its "
        "weights. Step after step, each prompt's d tends to the same value for every response: "
        "the policy then is p_ref exp(r / beta) / Z, TB's target.",
        "",
    ]
    return out


def yes(ok: bool) -> str:
    return "yes" if ok else "no"


def direction(push: torch.Tensor) -> str:
    return "> 0 pushes it down" if push > 0 else "< 0 pushes it up"


def intro(cfg, t: int) -> list[str]:
    """The page's head: what ran, and the preset's knobs the step uses."""
    knobs = [
        ("P, prompts_per_step", f"{cfg.prompts_per_step}", "prompts a step trains on"),
        (
            "K, responses_per_prompt; N, num_generations",
            f"{cfg.responses_per_prompt}; {cfg.num_generations}",
            "items of a prompt in a step; responses generated per prompt",
        ),
        ("searcher_batch_prompts", f"{cfg.searcher_batch_prompts}", "prompts a batch generates"),
        ("initial_samples", f"{cfg.initial_samples}", "items in the buffer before step 0"),
        ("buffer_capacity", f"{cfg.buffer_capacity}", "items kept per prompt"),
        ("m, mop_prob", f"{cfg.mop_prob:g}", "probability a draw is most-on-policy"),
        ("k, publish_every", f"{cfg.publish_every}", "steps between publishes"),
        ("barrier_lag", f"{cfg.barrier_lag}", "the trainer waits while its newest data is older"),
        ("max_train_lag", f"{cfg.max_train_lag}", "every item a step trains is at most this old"),
        ("replay_ratio", f"{cfg.replay_ratio:g}", "trajectories trained per trajectory generated"),
        ("beta", f"{cfg.beta_start:g}", "KL strength (no anneal)"),
        ("T, temperature", f"{cfg.temperature:g}", "the searcher's sampling temperature"),
        ("tb_clip_eps", f"{cfg.tb_clip_eps:g}", "TB's trust region, in nats"),
        ("max_grad_norm", f"{cfg.max_grad_norm:g}", "the cap on the gradient's norm"),
        ("lr, warmup_steps", f"{cfg.lr:g}, {cfg.warmup_steps}", "AdamW's peak lr and warmup"),
    ]
    claim(not cfg.tempered_logprobs and cfg.eos_in_logprob, "the scoring rule the page names")
    claim(cfg.beta_start == cfg.beta_end, "beta does not anneal")
    out = [
        f"# An asynchronous step of TBA: step {t} of a tiny run",
        "",
        "Written by `python -m tools.walkthrough` (40-90 s on one free CPU core, by the CPU); "
        "tests/test_walkthrough.py runs it again and fails when a word or a number here no "
        "longer matches the run. It runs on AVX2 kernels on every x86-64 CPU, AVX-512 or not; "
        "another kind of CPU rounds floats differently, and the seeded run samples other tokens "
        "with it: the last line names the CPU, and the test says so when it is not this one. "
        "The run is the tiny preset's (extensions/tiny.py, "
        "`TINY_PRESET` and its parity check; docs/tiny.md): two-digit sums in GSM8K's format, "
        "a tiny Llama warm-started as the preset does (supervised, until greedy accuracy on "
        f"{TINY_WARM_START['val']} validation sums reaches {TINY_WARM_START['target']:g}), one "
        "searcher and the trainer. The step numbers are "
        "tba.py's: 1a load, 1b generate with log pi_b, 1c rewards and log p_ref, 1d send; 2 "
        "intake and the wait; 3 sample; 4 the loss and the AdamW step; 5 publish. A step is "
        "one AdamW update; the weights after t steps are version t; an item's lag in a step is "
        "how many versions older its sampler is than the weights the step starts from.",
        "",
        "| knob | value | what it sets |",
        "| --- | --- | --- |",
    ]
    out += [f"| {name} | {value} | {what} |" for name, value, what in knobs]
    out += [
        "",
        "Log-probs are of the untempered model with the final EOS scored (`tempered_logprobs` "
        "off, `eos_in_logprob` on). Here the searcher and the trainer share one process, one "
        "thread and fixed seeds, so that every number can be shown and is the same on every "
        "run; they act in the order of the preset's two processes. The searcher sends a batch "
        "and at once starts the next, loading the newest weights (1a) before the trainer has "
        "stepped on the batch it sent; the trainer, the faster of the two on this task, takes "
        "every step `Trainer.can_step` allows, publishing after each, before the next batch "
        "arrives.",
        "",
    ]
    return out


def timeline_section(cfg, timeline: list[StepRecord], t: int) -> list[str]:
    """The steps up to the one shown: which batches let each run, and the lags it trained."""
    # From this step on, each step ran on one batch, generated one version before it.
    steady = next(
        r.step
        for r in timeline
        if all(s.arrived == [s.step - 1] for s in timeline if s.step >= r.step)
    )
    claim(steady < t, "the run is in its steady state before the step shown")
    fill = len(timeline[0].arrived)
    claim(set(timeline[0].arrived) == {0}, "the fill's batches are version 0's")
    out = [
        f"## Steps 0 to {t}: why the items are one and two versions old",
        "",
        "| step | batches that arrived before it, by the version that generated them | "
        "items at lag 0 | lag 1 | lag 2 | MOP groups | gradient norm |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in timeline:
        arrived = ", ".join(str(v) for v in r.arrived) or "none"
        out.append(
            f"| {r.step} | {arrived} | {r.lags[0]} | {r.lags[1]} | {r.lags[2]} | {r.mop} | "
            f"{fmt(r.grad_norm)} |"
        )
    out += [
        "",
        "The buffer counts distinct items (a repeated response is stored once), so the first "
        f"{fill} batches, all generated by version 0, fill it past initial_samples = "
        f"{cfg.initial_samples}. Then the trainer steps while `Trainer.can_step` allows (step 2 "
        "below): up to replay_ratio = 1 times the trajectories generated, and until its newest "
        f"data is more than barrier_lag = {cfg.barrier_lag} versions old; meanwhile the searcher "
        f"generates with the version it loaded before those steps. From step {steady} on, each "
        "batch lets exactly one step run. The searcher starts a batch the moment it sends the "
        "one before, so it generates with the weights from before the trainer's step on that "
        "one: each batch arrives one version behind the trainer's weights, and the batch before "
        "it is then two behind. MOP draws take the newest "
        "prompts (lag 1); a draw from the whole buffer can take an older one (lag 2). Step "
        f"{t} is the first step that shows a draw from the whole buffer two versions old whose "
        "items the trust region partly drops.",
        "",
    ]
    return out


def machine() -> str:
    """The kind of machine a page's numbers belong to (``bench_machine.cpu_kind``: another kind
    rounds floats differently, and the seeded run samples other tokens)."""
    return f"{platform.machine()}, {cpu_kind()}, torch {torch.__version__}"


MACHINE_LINE = "The numbers are those of a run on: "


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(PAGE), help="where to write the page")
    args = parser.parse_args(argv)
    torch.set_num_threads(TINY_PRESET["torch_threads"])  # the same arithmetic on every run
    if torch.get_num_threads() != TINY_PRESET["torch_threads"]:  # vLLM's CPU engine can veto it
        raise RuntimeError(
            f"torch kept {torch.get_num_threads()} threads, not {TINY_PRESET['torch_threads']}: "
            "a vLLM engine built in this process makes torch.set_num_threads a no-op; "
            "write the page in a fresh process"
        )
    kernels = torch.backends.cpu.get_cpu_capability()
    if platform.machine() == "x86_64" and kernels != "AVX2":
        raise RuntimeError(
            f"torch runs ATen's {kernels} kernels, not AVX2: it was imported before this module "
            "could choose them; write the page in a fresh process (`python -m tools.walkthrough`)"
        )
    with tempfile.TemporaryDirectory() as workdir:
        lines = run(Path(workdir))
    lines += ["", f"{MACHINE_LINE}{machine()}."]
    out = Path(args.out)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
