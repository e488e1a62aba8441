"""tools/bench.py's staleness harness (staleness, hard_staleness, countdown_staleness,
tldr_staleness): one process, step t trains on a batch generated d versions behind, per loss and
lag (docs/staleness.md)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from extensions import grpo, offpolicy, tba_prime
from extensions.evaluate import Evaluator
from extensions.tiny import (
    HARD_DATA,
    HARD_PRESET,
    TINY_PRESET,
    tiny_configs,
    tiny_task,
)
from jobs import run_countdown, run_tldr
from plumbing.config import ConfigError
from plumbing.models import pad_token_id
from rewards import gsm8k_reward
from searcher import SearcherSetup
from tools.bench_machine import log
from trainer import Parts

STALE_EVAL_EVERY = 25  # steps between greedy evaluations in the staleness experiment
STALE_REPORT_STEPS = (100, 200, 300, 400)
STALE_WINDOW = 100  # steps per window of the evaluations' means
STALE_THRESHOLD = 0.85
STALE_LEVELS = {"hard": 0.40, "countdown": 0.45}  # "steps to" counts this (else STALE_THRESHOLD)
COLLAPSE_DROP = 0.2  # a collapse: accuracy falls this far below its best so far
# What the loss name tb_clip runs: the core's rule (tba.tb_loss: the sampler's anchor at eps
# sqrt(max(1, lag)), the previous update's at eps) at the tiny presets' radius, which holds the
# tiny task from lag 1 to 256 (docs/staleness.md)
TB_CLIP_EPS = 0.05
TB_FIXED_EPS = 0.3  # tb_fixed: the sampler's anchor alone, one radius for every lag
TB_CLIP_HORIZON = 16.0  # tb_clip_lag's horizon: the lag to which eps 0.3 holds the tiny task
TB_M2_TAU = 0.09  # tb_m2's tau: rho^2 of whole responses, the trust region's eps squared
M2PO_TAU = 0.04  # grpo_m2po's tau on tokens, the M2PO paper's
STEP_KEYS = (
    "train/grad_norm",
    "policy/logp_mean",
    "reward/mean",
    "grpo/clip_frac",
    "prime/ratio_mean",
    "prime/capped_frac",
    "prime/kl_mean",
    "prime/kl_clamped_frac",
    "prime/adv_abs_mean",
    "ratio/ratio_mean",
    "ratio/capped_frac",
    "reference/rescored_frac",
)  # kept per step, with offpolicy/*
# The staleness losses: a name's flags (over STALE_FLAGS), and the flag a suffix _VALUE sets.
STALE_FLAGS = {
    "loss": "tb",
    "grpo_dr": False,
    "tb_prime": False,
    "prime_is": True,
    "prime_ratio_cap": tba_prime.PrimeConfig.prime_ratio_cap,
    "ref_reset_every": 0,
    "tb_clip_eps": 0.0,
    "tb_m2_tau": 0.0,
    "tb_clip_horizon": 0.0,
    "sync_two_pass": False,
    "sampler_only": False,  # the trust region's first anchor alone (the trainer keeps no other)
    "m2_pushed_only": False,
    "grpo_m2po_tau": 0.0,
    "grpo_decoupled": False,
    "grpo_is_cap": offpolicy.OffPolicyConfig.grpo_is_cap,
    "ratio_cap": grpo.GRPOConfig.ratio_cap,
    "ratio_norm": grpo.GRPOConfig.ratio_norm,
    "prime_kl_from": tba_prime.PrimeConfig.prime_kl_from,
    "prime_kl_clamp": tba_prime.PrimeConfig.prime_kl_clamp,
    "prime_norm": tba_prime.PrimeConfig.prime_norm,
    "adam_beta1": tba_prime.PrimeConfig.adam_beta1,
    "adam_beta2": tba_prime.PrimeConfig.adam_beta2,
    "weight_decay": None,  # None: the preset's
}
# The released TBA′ runs' settings that are this harness's flags (tba_prime.PRIME_VALUES: the
# loss's, the reference reset's, AdamW's); the async level is the harness's lag.
RELEASED = {k: v for k, v in tba_prime.PRIME_VALUES.items() if k in STALE_FLAGS}
RELEASED_ADAMW = {k: RELEASED[k] for k in ("adam_beta1", "adam_beta2", "weight_decay")}
STALE_LOSSES = {
    "tb": ({}, None),  # plain TB, the paper's
    "tb_clip": ({"tb_clip_eps": TB_CLIP_EPS}, "tb_clip_eps"),  # the trust region, the core's rule
    # the rule's first anchor alone: the sampler's, its radius widened as sqrt(lag)
    "tb_sampler": ({"tb_clip_eps": TB_CLIP_EPS, "sampler_only": True}, "tb_clip_eps"),
    # the sampler's anchor alone at one radius for every lag (an infinite horizon): the core's
    # region before its rule
    "tb_fixed": (
        {"tb_clip_eps": TB_FIXED_EPS, "tb_clip_horizon": math.inf, "sampler_only": True},
        "tb_clip_eps",
    ),
    "tb_clip_lag": (  # the trust region widened from a horizon on (extensions/offpolicy.py)
        {"tb_clip_eps": TB_FIXED_EPS, "tb_clip_horizon": TB_CLIP_HORIZON},
        "tb_clip_horizon",
    ),
    # the synchronous mode's trust region PPO's way (extensions/sync_region.py, --synchronous):
    # a second update on each batch, against the sampler alone
    "tb_two_pass": ({"sync_two_pass": True, "tb_clip_eps": TB_CLIP_EPS}, "tb_clip_eps"),
    "tb_m2": ({"tb_m2_tau": TB_M2_TAU}, "tb_m2_tau"),  # the second-moment mask
    "tb_m2_pushed": ({"tb_m2_tau": TB_M2_TAU, "m2_pushed_only": True}, "tb_m2_tau"),
    "tb_clip_m2": ({"tb_clip_eps": TB_CLIP_EPS, "tb_m2_tau": TB_M2_TAU}, "tb_m2_tau"),
    # TBA′'s loss with importance sampling and the reference reset every 50 steps (the released
    # MATH config; extensions/tba_prime.py); without the reset, or without importance sampling
    "tb_prime": ({"tb_prime": True, "ref_reset_every": 50}, "ref_reset_every"),
    "tb_prime_noreset": ({"tb_prime": True}, None),
    "tb_prime_nois": ({"tb_prime": True, "prime_is": False, "ref_reset_every": 50}, None),
    "tb_prime_cap": ({"tb_prime": True, "ref_reset_every": 50}, "prime_ratio_cap"),
    # TBA′'s loss as released: the group's KL mean the sampler's, each token's KL clamped at 10,
    # each response over its own length, AdamW (0.9, 0.99) with weight decay 0.01
    "tb_prime_rel": (RELEASED, "ref_reset_every"),
    # the released baseline (the paper's Dr. GRPO), PRIME-RL's ratio loss as released
    "ratio": ({"loss": "ratio", "ratio_norm": "sequence", **RELEASED_ADAMW}, "ratio_cap"),
    "grpo": ({"loss": "grpo"}, None),  # the baseline
    "dr_grpo": (
        {"loss": "grpo", "grpo_dr": True},
        None,
    ),  # Dr. GRPO (extensions/grpo.py, --grpo_dr)
    "grpo_m2po": ({"loss": "grpo", "grpo_m2po_tau": M2PO_TAU}, "grpo_m2po_tau"),
    "grpo_m2po_pushed": (
        {"loss": "grpo", "grpo_m2po_tau": M2PO_TAU, "m2_pushed_only": True},
        "grpo_m2po_tau",
    ),
    "grpo_decoupled": ({"loss": "grpo", "grpo_decoupled": True}, "grpo_is_cap"),
}


def stale_loss(name: str) -> dict:
    """A staleness loss name as its flags (every key of STALE_FLAGS): tb is plain TB (the
    paper's), tb_prime TBA′'s loss with the reference reset every 50 steps (tb_prime_noreset
    without it, tb_prime_nois without importance sampling, tb_prime_cap with the ratio's cap a
    number), tb_prime_rel TBA′'s loss as released (tba_prime.PRIME_VALUES), ratio the released
    baseline as released (--loss ratio), dr_grpo Dr. GRPO, tb_clip TB with the trust region by
    the core's rule at 0.05 nats, tb_sampler with its sampler's anchor alone, tb_fixed with that
    anchor alone at one radius of 0.3 for every lag, tb_clip_lag with 0.3 widened beyond a
    horizon of 16 versions (extensions/offpolicy.py), tb_two_pass two updates a batch, the
    second's region against the sampler (--synchronous; extensions/sync_region.py), tb_m2
    with the second-moment mask (extensions/offpolicy.py), tb_m2_pushed with the mask on the pushed
    items only, tb_clip_m2 with both, grpo the baseline, grpo_m2po M2PO, grpo_m2po_pushed M2PO's
    final version, grpo_decoupled AReaL's decoupled PPO; NAME_VALUE sets NAME's number
    (tb_clip_0.1: eps 0.1, tb_clip_lag_32: the horizon 32, tb_m2_0.04: tau 0.04,
    grpo_decoupled_2: the weight cap 2, tb_prime_25: the reset every 25 steps, tb_prime_cap_2:
    the ratio capped at 2, ratio_4: the released baseline's cap at 4)."""
    if name in STALE_LOSSES:
        flags, _ = STALE_LOSSES[name]
        return {**STALE_FLAGS, **flags}
    for base, (flags, knob_name) in STALE_LOSSES.items():
        if knob_name is None or not name.startswith(base + "_"):
            continue
        try:
            value = float(name.removeprefix(base + "_"))
        except ValueError:
            continue
        if math.isfinite(value) and value > 0:
            return {**STALE_FLAGS, **flags, knob_name: value}
    raise ConfigError(
        f"--losses: {name!r} is not one of {', '.join(STALE_LOSSES)} "
        "(or NAME_VALUE, VALUE > 0, for a name with a number)"
    )


def stale_order(name: str) -> tuple:
    """TB's losses, then the others; in each, as STALE_LOSSES lists them, then by the number."""
    flags = stale_loss(name)
    base = max((b for b in STALE_LOSSES if name == b or name.startswith(b + "_")), key=len)
    knob_name = STALE_LOSSES[base][1]
    return (flags["loss"] != "tb", list(STALE_LOSSES).index(base), flags.get(knob_name, 0))


def staleness_run(
    model_dir: str,
    loss: str,
    lag: int,
    seed: int,
    steps: int,
    overrides: dict,
    task: str = "gsm8k",
    through_buffer: bool = False,
) -> dict:
    """Staleness in isolation, one process and no asynchrony: step t trains on a fresh batch
    (P prompts x N responses, the tiny preset's) generated with the trainer's weights of step
    t - lag (the starting weights while t < lag). ``through_buffer``: the batch goes into the
    trainer's replay buffer, and the step trains on P groups of K that the buffer samples by the
    core's rules (most-on-policy with probability m, within max_train_lag, a publish after every
    step): the asynchronous system's steady state at lag 1, one batch a step, without its
    timing. Returns the score every STALE_EVAL_EVERY
    steps: on ``task`` gsm8k greedy accuracy on the held-out sums (hard: those of the harder
    tiny task, its preset, ``model_dir`` its warm start; countdown: Countdown's held-out
    problems, jobs/run_countdown.py's preset and warm start); on tldr (run_tldr's tiny
    preset, its proxy reward cached beside ``model_dir``) the gold win rate of greedy summaries
    against the references, with their perplexity under the SFT model at the end; and per step
    the off-policy metrics of the update (``plumbing.metrics.offpolicy_metrics``) and its
    gradient norm (``steps``), with their means (``offpolicy``). A loss with the reference
    reset (tb_prime) resets it on the trainer every R steps and on the searcher once the weights
    it generates with are at or past the reset, as the system does (extensions/tba_prime.py);
    the lag stays below R, so the searcher's reference is then the trainer's."""
    torch.set_num_threads(1)
    flags = stale_loss(loss)
    tb_flags = {k: flags[k] for k in ("tb_clip_eps", "weight_decay") if flags[k] is not None}
    if flags["sync_two_pass"]:  # an option of the synchronous mode
        tb_flags["synchronous"] = True
    if task == "tldr":
        train, test, _ = run_tldr.tiny_task()
        preset = run_tldr.TINY_PRESET
        reward_fn = run_tldr.tiny_reward_model(Path(model_dir).parent)[0]
    elif task == "countdown":
        train, test, _ = run_countdown.countdown_task()
        preset = run_countdown.TINY_PRESET
        reward_fn = run_countdown.countdown_reward
    else:
        hard = task == "hard"
        train, test, _ = tiny_task(HARD_DATA if hard else None)
        preset = HARD_PRESET if hard else TINY_PRESET
        reward_fn = gsm8k_reward
    with tempfile.TemporaryDirectory(prefix="tba_stale_") as out:
        cfg, eval_cfg = tiny_configs(
            model_dir, preset, seed=seed, output_dir=out, **{**tb_flags, **overrides}
        )
        parts = grpo.install(Parts(), grpo.GRPOConfig(**fields_of(grpo.GRPOConfig, flags)))
        corrections = fields_of(offpolicy.OffPolicyConfig, flags)
        parts = offpolicy.install(parts, offpolicy.OffPolicyConfig(**corrections))
        prime_flags = fields_of(tba_prime.PrimeConfig, flags)
        prime_flags["ref_reset_every"] = int(prime_flags["ref_reset_every"])
        prime = tba_prime.PrimeConfig(**prime_flags)
        if prime.ref_reset_every and lag >= prime.ref_reset_every:
            raise ConfigError(f"staleness: a reset every {prime.ref_reset_every} needs lags below")
        parts = tba_prime.configure(tba_prime.install(parts, prime), prime)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        torch.manual_seed(seed)
        trainer = parts.trainer(
            cfg, torch.device("cpu"), pad_token_id(tokenizer), tokenizer.eos_token_id
        )
        if flags["sampler_only"]:
            trainer.previous = None  # the trust region's second anchor, and its refresh, off
        setup = SearcherSetup(
            rank=0,
            cfg=cfg,
            examples=train,
            reward_fn=reward_fn,
            store=None,
            out_queue=None,
            stop_event=None,
        )
        searcher = parts.searcher(setup)
        if task == "tldr":
            sft = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            evaluator = run_tldr.SummaryEvaluator(
                cfg, eval_cfg, tokenizer, run_tldr.tiny_gold(), sft
            )

            def score(model):
                return evaluator.evaluate(model, test)["win_rate"]

        else:
            chosen = run_countdown.CountdownEvaluator if task == "countdown" else Evaluator
            evaluator = chosen(cfg, eval_cfg, tokenizer)

            def score(model):
                return evaluator.accuracy(model, test)

        # The weights of the last lag + 1 versions; the oldest generates the next batch.
        versions = collections.deque(maxlen=lag + 1)
        versions.append(_weights_copy(trainer.model))
        curve = [(0, score(trainer.model))]
        generated_by = []  # the version of the weights that generated each step's batch
        per_step = []  # offpolicy/* and the gradient norm of each update
        t0 = time.perf_counter()
        for _ in range(steps):
            searcher.engine.load_weights(versions[0])
            searcher.version = trainer.step - (len(versions) - 1)
            if prime.ref_reset_every and searcher.reference_due():
                # the weights of the searcher's newest reset are the trainer's reference: the
                # lag is below the reset interval
                searcher.load_reference(trainer.reference.named_parameters())
                searcher.ref_version = trainer.ref_version
            generated_by.append(searcher.version)
            trajectories, _ = searcher.search_once()
            n = cfg.num_generations
            k = cfg.responses_per_prompt
            groups = [trajectories[i : i + n][:k] for i in range(0, len(trajectories), n)]
            if through_buffer:
                trainer.buffer.extend(trajectories)
                groups, _ = trainer.buffer.sample(cfg.prompts_per_step, k, trainer.oldest_version())
            metrics = trainer.update(groups)
            if through_buffer:
                trainer.buffer.mark_published()
            per_step.append(
                {k: v for k, v in metrics.items() if k in STEP_KEYS or k.startswith("offpolicy/")}
            )
            versions.append(_weights_copy(trainer.model))
            if trainer.step % STALE_EVAL_EVERY == 0 or trainer.step == steps:
                curve.append((trainer.step, score(trainer.model)))
        final = evaluator.evaluate(trainer.model, test) if task == "tldr" else {}
    return {
        "loss": loss,
        "lag": lag,
        "seed": seed,
        "task": task,
        "curve": curve,
        "perplexity": final.get("perplexity"),
        "generated_by": generated_by,
        "steps": per_step,
        "offpolicy": {
            key: statistics.fmean(row[key] for row in per_step)
            for key in per_step[0]
            if key.startswith("offpolicy/") or key == "grpo/clip_frac"
        },
        "seconds": time.perf_counter() - t0,
    }


def fields_of(config_class, flags: dict) -> dict:
    """The entries of ``flags`` that are fields of the dataclass ``config_class``."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {k: v for k, v in flags.items() if k in names}


def _weights_copy(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def _staleness_task(args: tuple) -> dict:
    return staleness_run(*args)


STALE_MEANS = {  # summary key: the run's mean over steps (the first key a run has)
    "clip_frac": ("offpolicy/clip_frac", "grpo/clip_frac"),  # TB's trust region; GRPO's clip
    "mask_frac": (
        "offpolicy/m2_mask_frac",
        "offpolicy/is_cap_frac",
    ),  # extensions/offpolicy.py's masks
    "rho_abs_mean": ("offpolicy/rho_abs_mean",),
    "rho_q10": ("offpolicy/rho_q10",),
    "rho_q50": ("offpolicy/rho_q50",),
    "rho_q90": ("offpolicy/rho_q90",),
}


STALE_TASK_NAMES = {"countdown": "Countdown problems", "hard": "three-digit sums"}


def stale_level(task: str | None) -> float:
    """The accuracy "steps to" counts on ``task``: STALE_LEVELS's, else STALE_THRESHOLD."""
    return STALE_LEVELS.get(task, STALE_THRESHOLD)


def oscillation(values: list[float]) -> dict[str, float]:
    """How much a run's evaluations in a window move: ``second_half_sd``, their standard
    deviation (population), and ``second_half_swing``, the mean absolute change from one
    evaluation to the next (a trend moves it little, a zig-zag much)."""
    if len(values) < 2:
        return {"second_half_sd": 0.0, "second_half_swing": 0.0}
    changes = [abs(b - a) for a, b in itertools.pairwise(values)]
    return {
        "second_half_sd": statistics.pstdev(values),
        "second_half_swing": statistics.fmean(changes),
    }


def summarize_staleness(runs: list[dict]) -> dict:
    """Per loss and lag: accuracy at fixed steps, its mean over the second half of the run
    (the evaluations at steps >= steps / 2: 200-400 of 400), the first evaluated step at or
    above STALE_THRESHOLD (STALE_LEVELS for the runs' task), collapses (a fall of more than
    COLLAPSE_DROP below the best so far), how much the second half's evaluations oscillate
    (``oscillation``), and the means over steps of STALE_MEANS (the share of items, or GRPO's
    tokens, clipped or masked; rho = log pi - log pi_b of whole responses), per seed and as
    medians over seeds; the second half's mean also as a mean over seeds with its spread; and
    the mean of each STALE_WINDOW-step window's evaluations (steps 1-100: those at 25 ... 100),
    as medians over seeds and, paired by seed, against the same loss's d = 0."""
    out: dict = {}
    for run in runs:
        accuracy = dict(run["curve"])
        best = 0.0
        worst_drop = 0.0
        for _, acc in run["curve"]:
            best = max(best, acc)
            worst_drop = max(worst_drop, best - acc)
        reached = [step for step, acc in run["curve"] if acc >= stale_level(run.get("task"))]
        last = run["curve"][-1][0]
        second_half = [acc for step, acc in run["curve"] if step >= last / 2]
        means = run.get("offpolicy", {})
        row = out.setdefault(run["loss"], {}).setdefault(str(run["lag"]), {"seeds": []})
        row["seeds"].append(
            {
                "seed": run["seed"],
                "at": {str(s): accuracy.get(s) for s in STALE_REPORT_STEPS},
                "final": run["curve"][-1][1],
                "mean_second_half": statistics.fmean(second_half),
                "windows": step_windows(run["curve"]),
                **oscillation(second_half),
                "steps_to": reached[0] if reached else None,
                "worst_drop": worst_drop,
                "collapsed": worst_drop > COLLAPSE_DROP,
                **{
                    key: next((means[k] for k in keys if k in means), None)
                    for key, keys in STALE_MEANS.items()
                },
            }
        )
    for by_lag in out.values():
        for row in by_lag.values():
            seeds = row["seeds"]
            row["median_at"] = {}
            for step in map(str, STALE_REPORT_STEPS):
                values = [s["at"][step] for s in seeds if s["at"][step] is not None]
                row["median_at"][step] = statistics.median(values) if values else None
            row["median_final"] = statistics.median(s["final"] for s in seeds)
            halves = [s["mean_second_half"] for s in seeds]
            row["median_mean_second_half"] = statistics.median(halves)
            row["mean_mean_second_half"] = statistics.fmean(halves)
            row["sd_mean_second_half"] = statistics.stdev(halves) if len(halves) > 1 else 0.0
            for key in ("second_half_sd", "second_half_swing"):
                row[f"median_{key}"] = statistics.median(s[key] for s in seeds)
            steps_to = [s["steps_to"] for s in seeds]
            row["steps_to_reached"] = sum(s is not None for s in steps_to)
            row["median_steps_to"] = statistics.median(
                s if s is not None else float("inf") for s in steps_to
            )
            row["collapses"] = sum(s["collapsed"] for s in seeds)
            for key in STALE_MEANS:  # means over steps, median over seeds
                values = [s[key] for s in seeds if s[key] is not None]
                row[f"median_{key}"] = statistics.median(values) if values else None
            row["median_windows"] = {
                w: statistics.median(s["windows"][w] for s in seeds) for w in seeds[0]["windows"]
            }
        on_policy = {s["seed"]: s["windows"] for s in by_lag.get("0", {"seeds": []})["seeds"]}
        for row in by_lag.values():
            paired = [s for s in row["seeds"] if s["seed"] in on_policy]
            common = [
                w for w in row["median_windows"] if all(w in on_policy[s["seed"]] for s in paired)
            ]
            if paired:
                row["median_windows_vs_d0"] = {
                    w: statistics.median(s["windows"][w] - on_policy[s["seed"]][w] for s in paired)
                    for w in common
                }
    return out


def step_windows(curve: list[tuple]) -> dict[str, float]:
    """The mean of a run's evaluations in each window of STALE_WINDOW steps (the evaluation at
    step 0, the warm start, in none), as far as the run went."""
    last = curve[-1][0]
    return {
        f"{lo + 1}-{lo + STALE_WINDOW}": statistics.fmean(
            acc for step, acc in curve if lo < step <= lo + STALE_WINDOW
        )
        for lo in range(0, last - STALE_WINDOW + 1, STALE_WINDOW)
    }


def plot_staleness(runs: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    losses = sorted({r["loss"] for r in runs}, key=stale_order)
    lags = sorted({r["lag"] for r in runs})
    fig, axes = plt.subplots(1, len(losses), figsize=(6 * len(losses), 4), squeeze=False)
    colors = plt.get_cmap("viridis")
    for ax, loss in zip(axes[0], losses, strict=True):
        for i, lag in enumerate(lags):
            mine = [r for r in runs if r["loss"] == loss and r["lag"] == lag]
            if not mine:
                continue
            steps = [step for step, _ in mine[0]["curve"]]
            median = [
                statistics.median(dict(r["curve"]).get(step, float("nan")) for r in mine)
                for step in steps
            ]
            color = colors(i / max(1, len(lags) - 1))
            for r in mine:
                ax.plot(*zip(*r["curve"], strict=True), color=color, alpha=0.25, lw=0.8)
            ax.plot(steps, median, color=color, lw=2, label=f"d = {lag}")
        ax.set_title(f"{loss.upper()}: data generated d versions behind")
        ax.set_xlabel("trainer step")
        ax.set_ylabel(
            f"greedy accuracy, held-out {STALE_TASK_NAMES.get(runs[0].get('task'), 'sums')}"
        )
        ax.set_ylim(0, 1)
        ax.axhline(stale_level(runs[0].get("task")), color="grey", ls="--", lw=0.8)
        ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def plot_offpolicy(runs: list[dict], path: Path) -> str | None:
    """The mechanism, per step of the TB runs of the largest lag and of d = 0 (seed 0): the
    median and 10-90% band of rho = log pi - log pi_b on the batch trained, the gradient norm
    before clipping, the share of items clipped, and the accuracy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    first_seed = min(x["seed"] for x in runs)
    tb_runs = [r for r in runs if stale_loss(r["loss"])["loss"] == "tb" and r["seed"] == first_seed]
    if not tb_runs:
        return None
    top = max(r["lag"] for r in tb_runs)
    shown = sorted(
        (r for r in tb_runs if r["lag"] in (0, top)),
        key=lambda r: (stale_order(r["loss"]), r["lag"]),
    )
    fig, axes = plt.subplots(1, 4, figsize=(22, 4))
    colors = plt.get_cmap("tab10")
    for i, run in enumerate(shown):
        label = f"{run['loss']}, d = {run['lag']}"
        steps = range(1, len(run["steps"]) + 1)
        rows = run["steps"]
        color = colors(i)
        median = [row.get("offpolicy/rho_q50", float("nan")) for row in rows]
        axes[0].plot(steps, median, color=color, lw=1.2, label=label)
        low = [row.get("offpolicy/rho_q10", float("nan")) for row in rows]
        high = [row.get("offpolicy/rho_q90", float("nan")) for row in rows]
        axes[0].fill_between(steps, low, high, color=color, alpha=0.15)
        axes[1].plot(steps, [row["train/grad_norm"] for row in rows], color=color, lw=0.8)
        clipped = [row.get("offpolicy/clip_frac", 0.0) for row in rows]
        axes[2].plot(steps, clipped, color=color, lw=0.8)
        axes[3].plot(*zip(*run["curve"], strict=True), color=color, lw=1.5, label=label)
    axes[0].set_title("rho = log pi - log pi_b on the batch trained (median, 10-90%)")
    axes[1].set_title("gradient norm (before clipping at 1.0)")
    axes[2].set_title("share of items the trust region clipped")
    axes[3].set_title("greedy accuracy, 200 held-out sums")
    axes[3].set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("trainer step")
    axes[0].legend(loc="lower left", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def bench_staleness(
    model_dir: str,
    losses: list[str],
    lags: list[int],
    seeds: range,
    steps: int,
    jobs: int,
    overrides: dict,
    png: Path,
    task: str = "gsm8k",
    through_buffer: bool = False,
) -> dict:
    """Every (loss, lag, seed) run, ``jobs`` at a time in separate processes."""
    tasks = [
        (model_dir, loss, lag, seed, steps, overrides, task, through_buffer)
        for seed in seeds
        for loss in losses
        for lag in lags
    ]
    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs, maxtasksperchild=1) as pool:
        runs = []
        for run in pool.imap_unordered(_staleness_task, tasks):
            log(
                f"staleness {run['loss']} d={run['lag']} seed {run['seed']}: "
                f"final {run['curve'][-1][1]:.3f} in {run['seconds']:.0f} s"
            )
            runs.append(run)
    runs.sort(key=lambda r: (r["loss"], r["lag"], r["seed"]))
    return {
        "steps": steps,
        "eval_every": STALE_EVAL_EVERY,
        "overrides": overrides,
        "through_buffer": through_buffer,
        "runs": runs,
        "summary": summarize_staleness(runs),
        "plot": plot_staleness(runs, png),
        "plot_offpolicy": plot_offpolicy(runs, png.with_name(png.stem + "_offpolicy.png")),
    }
