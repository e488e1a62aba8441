"""docs/walkthrough.md from a real run: one prompt of the tiny task followed through steps 1-5
of tba.py's algorithm with the core's own classes (``Searcher``, ``ReplayBuffer``, ``Trainer``,
``WeightStore``), in one process so that every number can be shown and comes out the same on
every run of this machine's kind.

    python -m tools.walkthrough                 # rewrites docs/walkthrough.md (CPU, about 20 s)
    python -m tools.walkthrough --out PATH      # writes the page elsewhere

tests/test_walkthrough.py writes it again and compares it with the page, so the page says what
the code does. The run: a tiny Llama warm-started on two-digit sums (a fixed number of
supervised steps, so that it is right on some sums and wrong on others), the tiny preset's
settings, one searcher and one trainer step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from buffer import Trajectory
from engines import make_weight_store
from extensions.tiny import (
    TINY_WARM_START,
    answer_rows,
    build_char_tokenizer,
    supervised_warm_start,
    tiny_configs,
    tiny_task,
)
from plumbing.models import meta_causal_lm, pad_token_id
from rewards import gsm8k_reward
from searcher import Searcher, SearcherSetup
from tba import tb_log_z
from trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "walkthrough.md"
WARM_STEPS = 300  # supervised steps: right on some sums, wrong on others
PROMPTS = 4  # P, and the prompts of the one generate call
SEED = 0


def fmt(x: float) -> str:
    """A number as the page prints it (3 decimals; -0.000 as 0.000)."""
    text = f"{x:.3f}"
    return "0.000" if text == "-0.000" else text


def run(workdir: Path) -> list[str]:
    """The walk, as the page's lines."""
    # ---- the setup: a warm-started tiny Llama, the tiny preset, the weights as version 0
    train, _, _ = tiny_task()
    tokenizer = build_char_tokenizer()
    spec = dict(TINY_WARM_START, max_steps=WARM_STEPS)
    rows = answer_rows(tokenizer, train, "answer")
    model = supervised_warm_start(workdir / "warm", tokenizer, rows, spec, SEED, "warm start")
    cfg, _ = tiny_configs(
        model,
        prompts_per_step=PROMPTS,
        searcher_batch_prompts=PROMPTS,
        initial_samples=0,
        seed=SEED,
        output_dir=str(workdir / "run"),
    )
    device = torch.device("cpu")
    torch.manual_seed(SEED)
    store = make_weight_store(cfg, meta_causal_lm(model, False), device)
    trainer = Trainer(cfg, device, pad_token_id(tokenizer), tokenizer.eos_token_id)
    trainer.publish(store)
    setup = SearcherSetup(0, cfg, train[:64], gsm8k_reward, store, None, None)
    searcher = Searcher(setup)

    def decoded(t: Trajectory) -> str:
        return tokenizer.decode(t.response_tokens, skip_special_tokens=True).replace("\n", " / ")

    out = [
        "# One prompt through TBA, with a real run's numbers",
        "",
        "Written by `python -m tools.walkthrough` (tests/test_walkthrough.py checks that it still "
        "says what the code does). The tiny task: two-digit sums in GSM8K's format, a tiny "
        f"Llama warm-started for {WARM_STEPS} supervised steps, the tiny preset's settings "
        f"(N = K = {cfg.num_generations}, beta = {cfg.beta_start}, T = {cfg.temperature}, "
        f"log-probs of the untempered model with the final EOS scored, trust region "
        f"eps = {cfg.tb_clip_eps}, lr = {cfg.lr}), one searcher and the trainer, here in one "
        "process. The step numbers are tba.py's.",
        "",
    ]

    # ---- 1. the searcher: newest weights, N responses, rewards, log p_ref, log pi_b
    batch = searcher.next_batch()
    by_prompt: dict = {}
    for t in batch.trajectories:
        by_prompt.setdefault(t.prompt_id, []).append(t)
    pid, mine = next(
        (p, ts) for p, ts in by_prompt.items() if len({t.reward for t in ts}) > 1
    )  # the first prompt with right and wrong answers: the one followed here
    example = next(ex for ex in train if ex["id"] == pid)
    out += [
        "## 1. A searcher generates, scores and sends",
        "",
        f"The searcher loads version {searcher.version} (1a: the trainer published its "
        f"untrained weights), takes {cfg.searcher_batch_prompts} prompts of its shard and "
        f"samples N = {cfg.num_generations} responses to each (1b), scores each response's "
        "reward and its log-prob under the frozen reference p_ref (1c), keeps the engine's own "
        "log-prob of what it sampled, log pi_b (1b), and sends the "
        f"{len(batch.trajectories)} trajectories, tagged with version {searcher.version} (1d). "
        f"The prompt followed here is example {pid}:",
        "",
        "```",
        example["prompt"],
        "```",
        "",
        f"Its gold answer is {example['answer'].split('####')[-1].strip()}. The N responses:",
        "",
        "| i | response | r | log p_ref | log pi_b | version |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, t in enumerate(mine):
        out.append(
            f"| {i} | `{decoded(t)}` | {t.reward:g} | {fmt(t.ref_logprob)} | "
            f"{fmt(t.behaviour_logprob)} | {t.version} |"
        )
    out += [
        "",
        "log p_ref and log pi_b are equal here: the policy has not moved from the reference "
        "yet. They are sums over the response's tokens, the EOS included (the preset's rule; "
        "`TBAConfig.scoring_rule`).",
        "",
    ]

    # ---- 2. the buffer: what arrived, grouped by prompt; may the trainer step?
    trainer.buffer.extend(batch.trajectories)
    stored = [item.trajectory() for item in trainer.buffer.by_prompt[pid]]
    out += [
        "## 2. The trainer's buffer",
        "",
        f"The intake adds them to the replay buffer: {len(trainer.buffer.by_prompt)} prompts, "
        f"{len(trainer.buffer)} trajectories. Prompt {pid} keeps {len(stored)} of its "
        f"{len(mine)} responses: the buffer holds each distinct response once (a repeat "
        "replaces the older copy, with the newest reward, log-probs and version):",
        "",
        "| stored item | response | r | version |",
        "| --- | --- | --- | --- |",
    ]
    for j, t in enumerate(stored):
        out.append(f"| {j} | `{decoded(t)}` | {t.reward:g} | {t.version} |")
    out += [
        "",
        f"Every prompt was refreshed since the latest publish, so all "
        f"{len(trainer.buffer.by_prompt)} are most-on-policy (MOP). `Trainer.can_step()` is "
        f"{trainer.can_step()}: P = {cfg.prompts_per_step} prompts hold data at most "
        f"max_train_lag = {cfg.max_train_lag} versions old (step 2's other conditions: "
        "`Trainer.can_step`).",
        "",
    ]

    # ---- 3. the sample: P groups of K
    groups, is_mop = trainer.buffer.sample(
        cfg.prompts_per_step, cfg.responses_per_prompt, trainer.oldest_version()
    )
    where = next(g for g, group in enumerate(groups) if group[0].prompt_id == pid)
    group = groups[where]
    drawn = [stored.index(t) for t in group]
    right = sum(t.reward for t in group) / len(group)
    out += [
        "## 3. The step samples P groups of K",
        "",
        f"`ReplayBuffer.sample` draws P = {cfg.prompts_per_step} prompts, each most-on-policy "
        f"with probability m = {cfg.mop_prob} (this step: {sum(is_mop)} of {len(is_mop)}), "
        f"and K = {cfg.responses_per_prompt} of each prompt's newest items; a prompt that "
        f"holds fewer than K draws some twice. Prompt {pid} is group {where}, "
        f"{'most-on-policy' if is_mop[where] else 'drawn from the whole buffer'}; its K items "
        f"are the stored items {drawn}, {fmt(right)} of them right, where "
        f"{fmt(sum(t.reward for t in mine) / len(mine))} of the N generated were: the buffer "
        "keeps one copy of each response and draws among them uniformly, so a group weighs "
        "distinct answers, not how often the policy gave them. TB's optimum does not depend on "
        "the distribution the items came from (`tba.tb_loss`).",
        "",
    ]

    # ---- 4. the loss on that group, then the real AdamW step on all P groups
    beta = trainer.beta()
    with torch.no_grad():
        logp = trainer.score(groups).double()
    ref = torch.tensor([[t.ref_logprob for t in g] for g in groups], dtype=torch.float64)
    reward = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float64)
    d = logp - ref - reward / beta
    log_z = tb_log_z(logp, ref, reward, beta)
    residual = log_z[:, None] + d
    loss = residual.pow(2).mean()
    push = -2 * residual / residual.numel()  # -dL/dlog pi: the direction a step moves log pi
    out += [
        "## 4. The loss, and one AdamW step",
        "",
        f"The trainer scores log pi of every item with gradients (`Trainer.score`, the same "
        f"rule as log p_ref). beta = {beta}, so r / beta = {fmt(1 / beta)} for a right answer. "
        "For each item d = log pi - log p_ref - r / beta; log Z = -mean over the group of d "
        "(no gradient); the item's residual is log Z + d, and the loss is the mean of the "
        "squared residuals over all P K items (`tba.tb_loss`). The gradient of the loss with "
        "respect to an item's log pi is 2 (log Z + d) / (P K): a step pushes log pi down where "
        "the residual is positive and up where it is negative.",
        "",
        f"Group {where} (prompt {pid}): log Z = {fmt(log_z[where].item())}.",
        "",
        "| item | stored item | r | log pi | d | log Z + d | push on log pi |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, t in enumerate(group):
        out.append(
            f"| {k} | {drawn[k]} | {t.reward:g} | {fmt(logp[where, k].item())} | "
            f"{fmt(d[where, k].item())} | {fmt(residual[where, k].item())} | "
            f"{'up' if push[where, k] > 0 else 'down'} {fmt(abs(push[where, k].item()))} |"
        )
    metrics = trainer.update(groups)  # the trainer's own step 4 on the same P groups
    out += [
        "",
        "With log pi = log p_ref (the policy has not moved yet), a right answer's d is -r / beta "
        f"and a wrong one's 0, so log Z = (share right) / beta = {fmt(right / beta)}: right "
        "answers get a negative residual and are pushed up, wrong ones a positive residual "
        "and are pushed down. That is REINFORCE with the group's mean as baseline, scaled by "
        "2 / beta (`tba.tb_loss`, paper App. A).",
        "",
        f"The loss over the P groups is {fmt(loss.item())} (`Trainer.update` reports "
        f"`loss/tb` = {fmt(metrics['loss/tb'])}); the trust region clipped "
        f"{fmt(metrics['offpolicy/clip_frac'])} of the items (on-policy, log pi = log pi_b "
        f"and nothing is clipped). Gradient norm {fmt(metrics['train/grad_norm'])}, clipped "
        f"to {cfg.max_grad_norm}; learning rate {metrics['train/lr']:.2e} (warmup). The "
        f"weights are now version {trainer.step}.",
        "",
    ]

    # ---- 5. the publish, and what it changed
    trainer.publish(store)
    searcher.load_newest_weights()
    with torch.no_grad():
        after = trainer.score([group]).double()[0]
    moved = after - logp[where]
    agree = sum(
        (m > 0) == (p > 0) for m, p in zip(moved.tolist(), push[where].tolist(), strict=True)
    )
    out += [
        "## 5. The publish",
        "",
        f"With k = {cfg.publish_every} the trainer publishes at once: version {store.version()} "
        f"goes into the weight store, the buffer's MOP set starts afresh, and the searcher "
        f"loads version {searcher.version} before its next generate call (1a). Its next "
        "trajectories carry that version; these ones are now one version behind (lag 1).",
        "",
        f"What the step did to prompt {pid}'s items, log pi under version {trainer.step} minus "
        f"under version {trainer.step - 1}:",
        "",
        "| item | stored item | r | push | log pi after | change |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k, t in enumerate(group):
        out.append(
            f"| {k} | {drawn[k]} | {t.reward:g} | {'up' if push[where, k] > 0 else 'down'} | "
            f"{fmt(after[k].item())} | {fmt(moved[k].item())} |"
        )
    out += [
        "",
        f"{agree} of {len(group)} items moved the way their residual pushed (one AdamW step "
        "moves every weight, so an item can also move with its neighbours). Repeated for "
        "hundreds of steps, right answers gain probability until each prompt's log pi - "
        "log p_ref - r / beta is the same for every response: the policy is then "
        "p_ref exp(r / beta) / Z, TB's target.",
        "",
    ]
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(PAGE), help="where to write the page")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same arithmetic, hence the same numbers, on every run
    with tempfile.TemporaryDirectory() as workdir:
        lines = run(Path(workdir))
    out = Path(args.out)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
