"""Benchmarks of the TBA system: times and ratios measured in one run, on this machine.

    python -m tools.bench --out bench.json                         # 3 seeds per mode
    python -m tools.bench --seeds 5 --budget 180 --out bench.json  # the figures of docs/tiny.md
    python -m tools.bench --quick --out q.json                     # a smoke test, the same keys

(How long each takes on which machine: OPERATIONS.md.)

time_to_accuracy   The tiny task (run_gsm8k's tiny preset) from one supervised warm start:
                   seconds of training until greedy accuracy on the 200 held-out sums first
                   reaches 0.80 / 0.85 / 0.90 (the goals compare 0.85, below the plateau of
                   0.88-0.91), for asynchronous TBA and for the synchronous mode of the same
                   code (with several searchers, they split a step's P prompts between them),
                   seeds interleaved so that drift in the machine hits both. The clock
                   starts when the first searcher is ready to generate; weights are snapshotted
                   every second and evaluated after the run, so evaluation costs no training
                   time. Also the mean accuracy per window of 30 s, of 50 steps and of
                   trajectories generated; steps/s, samples/s; the accounting of what each step
                   trained on (new and distinct trajectories, the share of the generated ones
                   ever trained, lag, m, clipping) and of where the time went (searcher batch,
                   trainer step, waits), with f, the share of a synchronous step spent in the
                   searcher, and overlap's limit 1 / max(f, 1 - f); a PNG of accuracy against
                   wall-clock (with matplotlib installed). --rivals adds synchronous rivals
                   with the trust region at radius R (proximal_R: the core's rule, anchored
                   on on-policy data at the previous update's weights; two_pass_R: a second
                   update a batch against the sampler, extensions/sync_region.py), each with
                   its own f and overlap limit, and names the strongest; each rival's time
                   over async's comes with its 95% bootstrap interval and both modes' median
                   steps to the target (time = steps / steps a second); two processes over
                   one are measured after each seed.
time_to_accuracy_hard  The same on the harder tiny task (extensions/tiny.py: three-digit
                   sums, warm start 0.335 on 400 held-out sums, which RL lifts slowly for a
                   thousand steps and more); levels 0.38 / 0.40 / 0.42, for --budget_hard
                   seconds. With `--ray HOST:PORT` both sections run their searchers as Ray
                   actors on another node of that cluster (`python -m extensions.ray_cluster`
                   makes one on loopback), so every published version crosses between nodes
                   (docs/staleness.md, "the publish interval k").
staleness          The tiny task trained on data d versions stale in one process, no asynchrony
                   (--lags, --losses: TB, its trust region and its corrections, GRPO and its):
                   greedy accuracy every 25 steps, its mean over the second half of the run,
                   steps to 0.85, collapses, clip and mask shares, rho's quantiles
                   (docs/staleness.md).
hard_staleness     The same on the harder tiny task (steps to 0.40).
countdown_staleness  The same on Countdown's tiny task (jobs/run_countdown.py). With --losses
                   tb_prime,grpo,dr_grpo --lags 2,10 it is TBA′'s experiment in this harness:
                   TBA′'s loss with the reference reset every 50 steps against GRPO and Dr. GRPO,
                   each batch trained once, generated A versions behind (docs/tba_prime.md);
                   every staleness section also reports the spread of the second half's
                   evaluations (the oscillation).
engines            vLLM against the transformers engine on this CPU, on a Llama of tens of
                   millions of parameters with 128-token responses: tokens/s and weight-load time.
publish            a trainer publish plus a searcher's load (another process, shared memory or
                   CUDA IPC) over a raw copy of the same bytes.
data_parallel      trainer steps/s of 1 and of 2 data-parallel ranks (torchrun's environment, gloo
                   on loopback, one thread each) on one fixed batch, no searchers: rank 0 hands
                   out the groups, each rank scores its share, DDP sums the gradients.
intake             the trainer's intake of trajectories: ReplayBuffer.add per second and bytes held
                   per trajectory at 20,000 prompts x 20 responses of 128 tokens, unpickling a
                   searcher's batch, and state_dict / torch.save / torch.load(weights_only) /
                   load_state_dict seconds, beside what 64 searchers deliver (INTAKE_REQUIRED_S);
                   `--intake_reference old_buffer.py` measures another buffer.py the same way.
tldr_staleness     TL;DR tiny (run_tldr's tiny preset) trained on data d versions stale in one
                   process (the staleness section's controlled lag): the gold win rate of greedy
                   summaries against the references, per loss and lag (--lags 0,15).
ray                searchers as Ray actors (only when named in --sections; needs ray): a version
                   (438 MB to one actor and to three, rho-1b's 2.2 GB in bf16 to one; each actor
                   on a Ray node of its own) from the trainer's store to the actors' tensors by
                   the weight group, by the object store (ray.put, the board, each node's pull),
                   and by one raw gloo broadcast of the same bytes to the same ranks, in turn;
                   and trajectories/s of actor calls into the driver against the in-node queue;
                   with the parallel speedup measured beside them.
machine            versions, cores, and how much two processes gain over one right now (2.0 on
                   two idle cores): asynchrony overlaps two processes, so it needs that gain.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The project's modules (and torch) are imported inside the functions that use them, not here:
# every process the bench spawns (searchers, staleness jobs, the two-processes probe) first
# re-imports the module it was launched from, `python -m tools.bench`, and these imports cost
# each child about 3 s of CPU (the probe's three children: 12.7 s with them, 5.9 s without).
REPO = Path(__file__).resolve().parents[1]

HARD = ("time_to_accuracy_hard", "hard_staleness")  # the sections of the harder tiny task
SECTIONS = (
    "time_to_accuracy",
    *HARD,
    "staleness",
    "countdown_staleness",
    "engines",
    "publish",
    "intake",
    "data_parallel",
    "ray",
    "tldr_staleness",
)


# ----------------------------------------------------------------------------- report


def print_time_to_accuracy(res: dict, section: str, plot_path: str | None) -> None:
    from tools.bench_accuracy import TASKS

    tta = res[section]
    spec = TASKS[tta["task"]]
    print(
        f"\n{section}: time to greedy accuracy (seconds of training, median [min-max] over "
        f"{tta['async']['seeds']} seeds; a run that never got there counts as "
        f"{tta['budget_s']:.0f} s)"
    )
    modes = tta["modes"]
    width = max(7, *(len(mode) + 1 for mode in modes))
    print(
        f"{'mode':<{width}}"
        + "".join(f"{'to ' + str(th):>22}" for th in spec.levels)
        + f"{'steps/s':>9}{'samples/s':>11}{'lag':>6}"
    )
    for mode in modes:
        row = tta[mode]
        cells = ""
        for th in map(str, spec.levels):
            times = row[th]
            cells += f"{times['median']:>8.1f} [{times['min']:.0f}-{times['max']:.0f}]"
            cells += f" {times['reached']}/{row['seeds']}"
        rates = f"{row['steps_per_s']:>9.2f}{row['samples_per_s']:>11.0f}{row['lag_mean']:>6.1f}"
        print(f"{mode:<{width}}{cells}{rates}")
    for key, what in (
        ("window_accuracy", "seconds"),
        ("step_accuracy", "steps"),
        ("generated_accuracy", "trajectories generated"),
    ):
        windows = list(tta["async"][key])
        print(f"mean greedy accuracy per window of {what} (median over seeds)")
        print(f"{'mode':<{width}}" + "".join(f"{w:>14}" for w in windows))
        for mode in modes:
            print(f"{mode:<{width}}" + "".join(f"{tta[mode][key][w]:>14.3f}" for w in windows))
    print("accounting (median over seeds of each run's mean per step; trained_frac and reuse")
    print("at the end of the run; seconds per searcher batch and per trainer step)")
    names = list(tta["async"]["accounting"])
    for mode in modes:
        values = tta[mode]["accounting"]
        print(f"  {mode}: " + ", ".join(f"{n} {values[n]:.3g}" for n in names if n in values))
    print(
        f"a synchronous step spends f = {tta['generate_share_f']:.2f} of its time in the searcher; "
        f"overlap alone gives at most 1 / max(f, 1 - f) = {tta['overlap_limit']:.2f}x"
    )
    for mode in modes[1:]:
        row = tta[mode]
        low, high = tta["rivals_interval"][mode]
        print(
            f"  {mode}: time to {tta['target']} over async's {tta['rivals'][mode]:.2f} "
            f"[95% bootstrap {low:.2f}-{high:.2f}], f {row['generate_share_f']:.2f}, overlap "
            f"limit {row['overlap_limit']:.2f}x; async {tta['async']['steps_per_s']:.2f} against "
            f"{row['steps_per_s']:.2f} steps/s, {tta['async']['steps_to_target']:.0f} against "
            f"{row['steps_to_target']:.0f} steps to {tta['target']}; pays beyond plain sync: "
            f"{row['extra_per_step']}"
        )
    print(
        f"sync / async time to {tta['target']}: {tta['sync_over_async']:.2f}; the strongest "
        f"rival, {tta['strongest_rival']}: {tta['rival_over_async']:.2f}; "
        f"goals: {json.dumps(tta['goals'])}"
    )
    per_seed = ", ".join(f"{x:.2f}" for x in tta.get("parallel_speedup_per_seed", []))
    print(
        f"two processes over one: {res['parallel_speedup_start']:.2f} at the start, "
        f"{res['parallel_speedup_end']:.2f} at the end, after each seed's runs [{per_seed}] "
        "(2.0 = two idle cores)"
    )
    print(f"plot: {plot_path}")


def print_staleness(stale: dict) -> None:
    from tools.bench_staleness import (
        COLLAPSE_DROP,
        STALE_LEVELS,
        STALE_REPORT_STEPS,
        STALE_THRESHOLD,
        stale_order,
    )

    print(
        f"\nstaleness (greedy accuracy, median over seeds; 2nd half: the mean of the evaluations "
        f"of the run's second half, sd their spread, swing their mean change from one to the "
        f"next; steps to {STALE_THRESHOLD} (hard: {STALE_LEVELS['hard']}); "
        f"collapses = runs falling > "
        f"{COLLAPSE_DROP} below their best; clipped / masked: share of items (GRPO: tokens) a "
        "step clipped or masked; rho = log pi - log pi_b of whole responses, 10/50/90%; means "
        "over steps)"
    )
    header = "".join(f"{'@' + str(s):>7}" for s in STALE_REPORT_STEPS)
    print(
        f"{'loss':<18}{'d':>4}{header}{'2nd half':>9}{'sd':>7}{'swing':>7}{'steps to':>10}"
        f"{'collapses':>11}{'clipped':>9}{'masked':>8}{'rho 10/50/90':>21}"
    )

    def cell(value, width: int, spec: str) -> str:
        return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"

    for loss, by_lag in sorted(stale["summary"].items(), key=lambda item: stale_order(item[0])):
        for lag, row in sorted(by_lag.items(), key=lambda item: int(item[0])):
            cells = "".join(cell(row["median_at"][str(s)], 7, ".3f") for s in STALE_REPORT_STEPS)
            seeds = len(row["seeds"])
            steps_to = f"{row['median_steps_to']:.0f} ({row['steps_to_reached']}/{seeds})"
            collapses = f"{row['collapses']:>9}/{seeds}"
            rho = [row.get(f"median_rho_q{q}") for q in (10, 50, 90)]
            rho = "/".join(f"{r:.2f}" if r is not None else "-" for r in rho)
            print(
                f"{loss:<18}{lag:>4}{cells}{cell(row['median_mean_second_half'], 9, '.3f')}"
                f"{row['median_second_half_sd']:>7.3f}{row['median_second_half_swing']:>7.3f}"
                f"{steps_to:>10}{collapses}{cell(row.get('median_clip_frac'), 9, '.3f')}"
                f"{cell(row.get('median_mask_frac'), 8, '.3f')}{rho:>21}"
            )
    print(f"plots: {stale['plot']}, {stale['plot_offpolicy']}")


def print_tldr_staleness(stale: dict) -> None:
    """Per loss and lag: the median final win rate over seeds, its spread, and the distance to
    the on-policy (d = 0) median of the same loss."""
    print("\nTL;DR tiny staleness (gold win rate of greedy summaries, final, over seeds)")
    print(f"{'loss':<6}{'d':>4}{'median':>9}{'min':>7}{'max':>7}{'- d=0':>8}{'ppl':>12}")
    by = collections.defaultdict(list)
    for run in stale["runs"]:
        by[(run["loss"], run["lag"])].append(run)
    for (loss, lag), runs in sorted(by.items()):
        finals = [r["curve"][-1][1] for r in runs]
        base = [r["curve"][-1][1] for r in by.get((loss, 0), [])]
        gap = statistics.median(finals) - statistics.median(base) if base else float("nan")
        ppl = statistics.median(r["perplexity"] for r in runs)
        print(
            f"{loss:<6}{lag:>4}{statistics.median(finals):>9.3f}{min(finals):>7.3f}"
            f"{max(finals):>7.3f}{gap:>+8.3f}{ppl:>12.4g}"
        )


def main(argv: list[str] | None = None) -> None:
    import torch

    from extensions.tiny import save_tiny_model, tiny_warm_start
    from jobs import run_countdown, run_tldr
    from plumbing.config import ConfigError
    from tba import TBAConfig
    from tools.bench_accuracy import TASKS, plot, ray_parts, rival, summarize, timed_run
    from tools.bench_machine import log, machine_info, parallel_speedup
    from tools.bench_staleness import (
        bench_staleness,
        stale_loss,
    )
    from tools.bench_system import (
        LLAMA_110M,
        RAY_CASES,
        bench_data_parallel,
        bench_engines,
        bench_intake,
        bench_publish,
        bench_ray,
        print_ray,
    )

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench.json", help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="a smoke test with the same keys")
    parser.add_argument(
        "--sections",
        default="time_to_accuracy,time_to_accuracy_hard,staleness,engines,publish,intake",
        help="comma list of the sections to run (also: data_parallel, ray, tldr_staleness)",
    )
    parser.add_argument(
        "--intake_reference",
        default=None,
        help="intake: another buffer.py to measure the same way (e.g. from git show REV:buffer.py)",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per mode for time to accuracy")
    parser.add_argument(
        "--rivals",
        default="sync",
        help="time to accuracy: comma list of the synchronous rivals run beside async, each "
        "seed in turn: sync (plain TB), proximal_R (the core's trust region at radius R, "
        "anchored at the previous update's weights), two_pass_R (two updates a batch, the "
        "second's region against the sampler; extensions/sync_region.py)",
    )
    parser.add_argument("--budget", type=float, default=120.0, help="seconds of training per run")
    parser.add_argument(
        "--budget_hard", type=float, default=240.0, help="the same for the harder tiny task"
    )
    parser.add_argument("--lags", default="0,1,2,4,8", help="staleness: versions behind, d")
    parser.add_argument(
        "--losses",
        default="tb,tb_clip",
        help="staleness: comma list of tb (plain), tb_prime (TBA′'s loss and reference reset; "
        "tb_prime_noreset, tb_prime_nois, tb_prime_cap; tb_prime_rel as released), ratio (the "
        "released baseline as released), tb_clip (TB's trust region, the core's rule at 0.05), "
        "tb_sampler (its sampler's anchor alone), tb_fixed (that anchor alone at 0.3 for every "
        "lag), tb_two_pass (the synchronous mode's region PPO's way: use with --lags 0), "
        "tb_m2 (the second-moment mask), tb_m2_pushed (on the pushed items), tb_clip_m2 (both), "
        "grpo, dr_grpo, grpo_m2po (M2PO), grpo_m2po_pushed, grpo_decoupled (AReaL's "
        "decoupled PPO); "
        "NAME_VALUE sets its number (tb_clip_0.1, tb_m2_0.04, grpo_decoupled_2: the cap)",
    )
    parser.add_argument("--stale_seeds", type=int, default=3, help="staleness: seeds per setting")
    parser.add_argument("--stale_first_seed", type=int, default=0, help="staleness: the first seed")
    parser.add_argument("--stale_steps", type=int, default=400, help="staleness: steps per run")
    parser.add_argument("--jobs", type=int, default=2, help="staleness: runs at a time")
    parser.add_argument(
        "--stale_buffer",
        action="store_true",
        help="staleness: each step samples its groups from the replay buffer (most-on-policy "
        "rules, a publish every step) instead of training the fresh batch as generated",
    )
    parser.add_argument(
        "--warm_start",
        default="runs/bench",
        help="where the tiny warm start is "
        "cached (all runs start from it; reused by later benches)",
    )
    parser.add_argument(
        "--warm_start_tldr",
        default="runs/bench_tldr",
        help="tldr_staleness: where TL;DR tiny's SFT model and proxy reward are cached",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="TBAConfig overrides of the tiny preset for every run",
    )
    parser.add_argument(
        "--ray",
        default="",
        metavar="HOST:PORT",
        help="time to accuracy: the searchers as Ray actors on this cluster, on nodes offering "
        "the 'searcher' resource (`python -m extensions.ray_cluster` starts one on "
        "loopback; docs/ray.md)",
    )
    args = parser.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    sections = args.sections.split(",")
    overrides = {}
    known = {f.name: f.default for f in dataclasses.fields(TBAConfig)}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in known or not value:
            raise ConfigError(f"--set {item}: expected FIELD=VALUE with FIELD a TBAConfig field")
        default = known[name]
        if isinstance(default, bool):
            overrides[name] = value == "True"
            continue
        try:
            overrides[name] = type(default)(value)
        except ValueError as err:
            raise ConfigError(f"--set {item}: {err}") from None
    for name in args.losses.split(","):
        stale_loss(name)  # a ConfigError now, not after the warm start
    rivals = list(dict.fromkeys(["sync", *args.rivals.split(",")]))  # plain sync always
    for name in rivals:
        rival(name)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"--sections: unknown {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    # quick: one second of training a run (its first step or two, from an untrained model): the
    # code paths, not the learning; each snapshot is then evaluated on every held-out sum.
    seeds, budget = (1, 1.0) if args.quick else (args.seeds, args.budget)
    budget_hard = 1.0 if args.quick else args.budget_hard
    res: dict = {
        "quick": args.quick,
        "machine": machine_info(),
        "budget_s": budget,
        "overrides": overrides,
        "ray_address": args.ray,
        "parallel_speedup_start": parallel_speedup(1.0 if args.quick else 3.0),
    }
    with tempfile.TemporaryDirectory(prefix="tba_bench_models_") as root:
        # Every run of a task starts from its warm start (an untrained model when quick: the
        # code paths, not the learning).
        model_dirs = {}
        for task, needed_by in (("tiny", ("time_to_accuracy", "staleness")), ("hard", HARD)):
            if set(needed_by).isdisjoint(sections):
                continue
            spec = TASKS[task]
            if args.quick:
                model_dirs[task] = save_tiny_model(Path(root) / f"random_{task}")
                continue
            train, _, val = spec.examples()
            where = Path(args.warm_start) if task == "tiny" else Path(args.warm_start) / task
            model_dirs[task] = tiny_warm_start(where, train, val, 0, spec.warm_start, spec.preset)
        model_dir = model_dirs.get("tiny")
        parts = ray_parts(args.ray)
        stem = Path(args.out).stem
        if "data_parallel" in sections:
            log("data parallel")
            res["data_parallel"] = bench_data_parallel(
                root, reps=1 if args.quick else 3, steps=2 if args.quick else 10
            )
            dp = res["data_parallel"]
            print(
                f"data parallel: {dp['steps_per_s_1_rank']:.2f} steps/s on 1 rank, "
                f"{dp['steps_per_s_2_ranks']:.2f} on 2 ranks ({dp['two_over_one']:.2f}x, range "
                f"{dp['two_over_one_range'][0]:.2f}-{dp['two_over_one_range'][1]:.2f}); two "
                f"processes over one on this machine: {dp['parallel_speedup']:.2f}"
            )
        for task, section in (("tiny", "time_to_accuracy"), ("hard", "time_to_accuracy_hard")):
            if section not in sections:
                continue
            spec = TASKS[task]
            runs = []
            speedups = []  # two processes over one after each seed's runs: the load they ran under
            for seed in range(seeds):
                for mode in ("async", *rivals):
                    log(f"{section}: {mode}, seed {seed}")
                    model = model_dirs[task]
                    seconds = budget_hard if task == "hard" else budget
                    runs.append(timed_run(model, mode, seed, seconds, overrides, task, parts))
                    log(
                        f"  to {spec.target}: {runs[-1]['time_to'][str(spec.target)]} s, "
                        f"{runs[-1]['steps_per_s']:.2f} steps/s"
                    )
                if not args.quick:
                    speedups.append(parallel_speedup(3.0))
            res.setdefault("runs", []).extend(runs)
            res[section] = summarize(runs, budget_hard if task == "hard" else budget)
            res[section]["parallel_speedup_per_seed"] = speedups
            suffix = "" if task == "tiny" else f"_{task}"
            res[f"plot{suffix}"] = plot(runs, Path(args.out).with_name(f"{stem}{suffix}.png"))
            if args.quick:  # the start's figure: a measurement starts three processes, each
                # importing this file (44 s on two loaded cores)
                res["parallel_speedup_end"] = res["parallel_speedup_start"]
            else:
                res["parallel_speedup_end"] = parallel_speedup(3.0)
            print_time_to_accuracy(res, section, res[f"plot{suffix}"])
        if "countdown_staleness" in sections:
            if args.quick:
                model_dirs["countdown"] = save_tiny_model(Path(root) / "random_countdown")
            else:
                train, _, val = run_countdown.countdown_task()
                where = Path(args.warm_start) / "countdown"
                model_dirs["countdown"] = run_countdown.tiny_warm_start(where, train, val, 0)
        for section, task, stale_model in (
            ("staleness", "gsm8k", model_dir),
            ("hard_staleness", "hard", model_dirs.get("hard")),
            ("countdown_staleness", "countdown", model_dirs.get("countdown")),
        ):
            if section not in sections:
                continue
            lags = [0, 2] if args.quick else [int(d) for d in args.lags.split(",")]
            first_seed = args.stale_first_seed
            res[section] = bench_staleness(
                stale_model,
                losses=args.losses.split(","),
                lags=lags,
                seeds=range(1) if args.quick else range(first_seed, first_seed + args.stale_seeds),
                steps=4 if args.quick else args.stale_steps,
                # quick: its four runs at once, as their start-up (importing the project) is
                # most of each one's time
                jobs=4 if args.quick else args.jobs,
                overrides=overrides,
                png=Path(args.out).with_name(f"{Path(args.out).stem}_{section}.png"),
                task=task,
                through_buffer=args.stale_buffer,
            )
            print_staleness(res[section])
        if "tldr_staleness" in sections:
            tldr_dir = Path(args.warm_start_tldr)
            first_seed = args.stale_first_seed
            res["tldr_staleness"] = bench_staleness(
                save_tiny_model(Path(root) / "random_tldr")
                if args.quick
                else run_tldr.tiny_setup(tldr_dir)["model"],
                losses=args.losses.split(","),
                lags=[0, 2] if args.quick else [int(d) for d in args.lags.split(",")],
                seeds=range(1) if args.quick else range(first_seed, first_seed + args.stale_seeds),
                steps=4 if args.quick else args.stale_steps,
                jobs=args.jobs,
                overrides=overrides,
                png=Path(args.out).with_name(Path(args.out).stem + "_tldr_staleness.png"),
                task="tldr",
            )
            res["parallel_speedup_end"] = parallel_speedup(1.0 if args.quick else 3.0)
            print_tldr_staleness(res["tldr_staleness"])
        if "engines" in sections:
            log("engines")
            res["engines"] = bench_engines(root, args.quick)
            print(f"engines: {json.dumps(res['engines'])}")
        if "ray" in sections:
            log("ray")
            small = dict(LLAMA_110M, num_hidden_layers=2)
            quick_cases = (("small", small, torch.float32, 1), ("small", small, torch.float32, 2))
            res["ray"] = bench_ray(
                2 if args.quick else 5,
                quick_cases if args.quick else RAY_CASES,
                batches=20 if args.quick else 300,
            )
            res["ray"]["parallel_speedup"] = parallel_speedup(1.0 if args.quick else 3.0)
            print_ray(res["ray"])
        if "publish" in sections:
            log("publish")
            res["publish"] = bench_publish(
                2 if args.quick else 7,
                model_kwargs=dict(LLAMA_110M, num_hidden_layers=2) if args.quick else LLAMA_110M,
            )
            if torch.cuda.is_available():
                res["publish_cuda_ipc"] = bench_publish(3, device="cuda:0")
            print(f"publish: {json.dumps(res['publish'])}")
        if "intake" in sections:
            size = dict(prompts=2000) if args.quick else {}
            buffers = {"intake": "buffer.py", "intake_reference": args.intake_reference}
            for key, path in buffers.items():
                if path is not None:
                    log(f"intake: {path}")
                    res[key] = bench_intake(str(REPO / path), **size)
                    if args.quick:  # the start's figure, as after time to accuracy
                        res[key]["parallel_speedup_after"] = res["parallel_speedup_start"]
                    else:
                        res[key]["parallel_speedup_after"] = parallel_speedup(3.0)
                    print(f"{key} ({path}): {json.dumps(res[key])}")
    res["total_runtime_s"] = time.monotonic() - start
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"total {res['total_runtime_s']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    from extensions.cli import run_cli

    sys.exit(run_cli(main))
