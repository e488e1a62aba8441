"""Benchmarks of the TBA system: ratios measured in one run, so that machine noise cancels.

    python bench.py --out bench.json      # ~8-10 min on a 2-core CPU
    python bench.py --quick --out q.json  # ~1 min smoke test, same keys

Keys: async_over_sync(_2_searchers), publish_over_copy, tb_step_over_bare_step,
searcher_busy_fraction, scaling (rows), gpu, machine (see GOALS for the targets). Models are
built from configs in code (no download); every process runs one torch thread, as the system
does with one searcher on two cores. The ratios of the system runs need idle cores: the JSON
records how much CPU other programs used during each run and how well two processes scale.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from buffer import Trajectory
from rewards import gsm8k_reward
from run_gsm8k import build_char_tokenizer, build_tiny_model, synthetic_problems, to_examples
from tba import TBAConfig, pad_sequences
from searcher import HFEngine
from trainer import Trainer, WeightStore, run_tba

# name: (goal, "min" | "max"): met when the value is >= (min) or <= (max) the goal.
GOALS = {"async_over_sync": (1.8, "min"), "publish_over_copy": (2.0, "max"),
         "tb_step_over_bare_step": (1.15, "max"), "searcher_busy_fraction": (0.9, "min")}
# The system workload, chosen so that a trainer step (P*K sequences forward+backward+AdamW) and
# a searcher batch (generate K per prompt, score, reference forward) each take ~0.3 s on one
# core here: sync mode alternates two equal halves, so asynchrony can at best double steps/s.
SYSTEM = dict(hidden=224, layers=2, heads=4, P=4, K=8, T=48)
LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                  tie_word_embeddings=True)  # 110M parameters, 440 MB in fp32


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, of this process and its reaped children). Over a
    run their difference is the load of other programs, which steals the cores asynchrony uses."""
    t = os.times()
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except OSError:  # not Linux
        busy = float("nan")
    return busy, t.user + t.system + t.children_user + t.children_system


def wait_idle(max_s: float, threshold: float = 0.3) -> float:
    """Wait up to ``max_s`` for other programs to use under ``threshold`` cores (2 s samples);
    returns the last sample. Asynchrony overlaps work on idle cores; busy ones hide it."""
    deadline = time.monotonic() + max_s
    while True:
        (b0, o0), t0 = cpu_seconds(), time.monotonic()
        time.sleep(2)
        (b1, o1) = cpu_seconds()
        load = ((b1 - b0) - (o1 - o0)) / (time.monotonic() - t0)
        if not load >= threshold or time.monotonic() > deadline:  # nan (not Linux): go
            return load


def _spin(seconds: float, start, out_q) -> None:
    """A single-threaded matmul loop, the system's kind of work; reports iterations per second."""
    torch.set_num_threads(1)
    a, w = torch.randn(1536, 192), torch.randn(192, 768)
    out_q.put("ready")
    start.wait(timeout=120)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        (a @ w).relu_().sum()
        n += 1
    out_q.put(n / seconds)


def parallel_speedup(seconds: float) -> float:
    """Throughput of two concurrent single-threaded processes over one alone: what two processes
    (trainer + one searcher) can gain over one on this machine right now (2.0 on two idle cores)."""
    ctx, rates = mp.get_context("spawn"), []
    for n in (1, 2):
        start, out_q = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(seconds, start, out_q)) for _ in range(n)]
        for p in procs:
            p.start()
        for _ in procs:  # each has imported torch: start them together
            out_q.get(timeout=120)
        start.set()
        rates.append(sum(out_q.get(timeout=120) for _ in procs))
        for p in procs:
            p.join(timeout=30)
    return rates[1] / rates[0]


def machine_info(speedup_s: float) -> dict:
    """Versions, platform and date, plus the load and two-process speedup at the start."""
    import transformers
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.cuda.is_available(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_at_start": os.getloadavg()[0], "parallel_speedup": parallel_speedup(speedup_s)}


def make_model_dir(root: str, hidden: int, layers: int, heads: int) -> str:
    """Save the char tokenizer and a random tiny Llama under ``root``; returns the directory."""
    path = Path(root) / f"llama_h{hidden}_l{layers}"
    if not path.exists():
        tok = build_char_tokenizer()
        build_tiny_model(tok, hidden=hidden, layers=layers, heads=heads).save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def examples(n: int = 64) -> list[dict]:
    return to_examples(synthetic_problems(n, seed=0))


# ----------------------------------------------------------------------------- the system

class _Enough(Exception):
    """Raised from on_step to end a run on time (run_tba stops its searchers on any exit)."""


def run_system(model_dir: str, seconds: float, warmup_s: float, *, S: int = 1, sync: bool = False,
               P: int, K: int, T: int, **_) -> dict:
    """One run_tba, stopped ``warmup_s + seconds`` after its first step. Rates come from the
    metrics.jsonl wall_time of rows after the warm-up (model loading and initial fill excluded)."""
    with tempfile.TemporaryDirectory(prefix="tba_bench_run_") as out:
        cfg = TBAConfig(model=model_dir, dtype="float32", num_searchers=S, searcher_devices="cpu",
                        trainer_device="cpu", num_generations=K, group_size=K, prompts_per_step=P,
                        searcher_batch_prompts=math.ceil(P / S), max_new_tokens=T, synchronous=sync,
                        lr=1e-5, warmup_steps=1, total_steps=10**6, initial_samples=P * K,
                        output_dir=out, timeout_s=120, max_searcher_restarts=0, torch_threads=1,
                        checkpoint_every=10**6)  # a save stalls the trainer ~0.5 s: not a step cost
        first_step: list[float] = []

        def on_step(trainer, metrics):
            first_step[:] = first_step or [time.monotonic()]
            if time.monotonic() - first_step[0] > warmup_s + seconds:
                raise _Enough
        t0, (busy0, own0) = time.monotonic(), cpu_seconds()
        try:
            run_tba(cfg, examples(), gsm8k_reward, on_step=on_step, show_progress=False)
        except _Enough:
            pass
        (busy1, own1), wall = cpu_seconds(), time.monotonic() - t0
        rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    start = next((r for r in rows[:-1] if r["wall_time"] >= rows[0]["wall_time"] + warmup_s), rows[0])
    last, window = rows[-1], [r for r in rows if r["step"] > start["step"]]
    steps_per_s = (last["step"] - start["step"]) / (last["wall_time"] - start["wall_time"])

    def mean(*keys):  # sum of the keys' means over the window (searcher keys: rows with batches)
        return sum(statistics.fmean([r[k] for r in window if k in r] or [math.nan]) for k in keys)
    step_s = mean("time/sample", "time/forward_backward")
    return {"mode": "sync" if sync else "async", "S": S, "K": K, "T": T, "steps_per_s": steps_per_s,
            "samples_per_s": steps_per_s * P * K,
            "tokens_per_s": steps_per_s * step_s * mean("throughput/tokens_per_s"),
            "trainer_step_s": step_s, "searcher_batch_s": mean("time/generate", "time/reward", "time/reference"),
            "busy_frac": min(last.get(f"searcher{r}/busy_frac", math.nan) for r in range(S)),
            "lag_mean": mean("async/lag_mean"), "steps": last["step"] - start["step"],
            "own_cores": (own1 - own0) / wall, "other_cores": ((busy1 - busy0) - (own1 - own0)) / wall}


def bench_system(model_dir: str, seconds: float, warmup_s: float, scale_s: float) -> dict:
    """Async vs sync with 1 and 2 searchers; then async steps/s against K, T and S (scale_s > 0)."""
    runs, base = {}, dict(SYSTEM)
    for S in (1, 2):
        for sync in (True, False):
            log(f"system: {'sync' if sync else 'async'}, {S} searcher(s)")
            runs[S, sync] = run_system(model_dir, seconds, warmup_s, S=S, sync=sync, **base)
            log(f"  {runs[S, sync]}")
    scaling = [runs[1, True], runs[1, False], runs[2, True], runs[2, False]]
    variants = [dict(base, K=base["K"] // 2), dict(base, K=base["K"] * 2), dict(base, T=base["T"] // 2),
                dict(base, T=base["T"] * 2), dict(base, S=3)]
    for v in variants if scale_s > 0 else []:
        log(f"scaling: {v}")
        scaling.append(run_system(model_dir, scale_s, warmup_s, **v))
        log(f"  {scaling[-1]}")
    one = runs[1, True]
    return {"async_over_sync": runs[1, False]["steps_per_s"] / runs[1, True]["steps_per_s"],
            "async_over_sync_2_searchers": runs[2, False]["steps_per_s"] / runs[2, True]["steps_per_s"],
            # Perfect overlap on free cores: sync step = trainer + searcher, async step = trainer
            # (times from the sync run, where the two never compete for a core).
            "async_over_sync_ideal": 1 + one["searcher_batch_s"] / one["trainer_step_s"],
            "searcher_busy_fraction": runs[1, False]["busy_frac"], "scaling": scaling}


# ----------------------------------------------------------------------------- weight publish

def _llama(model_kwargs: dict, device: str):
    """A Llama from a config with uninitialised storage (meta, then real memory): no init cost."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**model_kwargs))
    model.to_empty(device=device)
    model.tie_weights()  # to_empty unties lm_head from the embedding
    return model


def _load_child(store: WeightStore, model_kwargs: dict, device: str, cmd_q, res_q) -> None:
    """A searcher stand-in in its own process: per command, load the store into a transformers
    engine's model, as a searcher does (WeightStore.load_into with HFEngine.load_weights)."""
    torch.set_num_threads(1)
    cfg = TBAConfig(searcher_devices=device, num_searchers=1)
    engine = HFEngine(cfg, torch.device(device), eos_id=0, pad_id=0, model=_llama(model_kwargs, device))
    res_q.put("ready")
    while cmd_q.get(timeout=300) is not None:
        t0 = time.perf_counter()
        version, _ = store.load_into(engine.load_weights)
        res_q.put((version, time.perf_counter() - t0))


def bench_publish(reps: int, device: str = "cpu", model_kwargs: dict = LLAMA_100M) -> dict:
    """Trainer publish + searcher load (spawned process; shared memory or CUDA IPC) over two raw
    flat copies of the same bytes on the same device."""
    torch.set_num_threads(1)
    model = _llama(model_kwargs, device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # touch every page: untouched memory would copy unrealistically fast
    named = list(model.named_parameters())
    store = WeightStore(named, torch.float32, torch.device(device))
    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_load_child, args=(store, model_kwargs, device, cmd_q, res_q))
    proc.start()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    src, dst = store.flat.clone(), torch.empty_like(store.flat)
    pubs, loads, copies = [], [], []
    try:
        assert res_q.get(timeout=300) == "ready"
        for rep in range(reps + 1):  # rep 0 is a warm-up: first touches of the shared pages
            t0 = time.perf_counter()
            store.publish(named, version=rep)
            pubs.append(time.perf_counter() - t0)
            cmd_q.put(rep)
            version, load_s = res_q.get(timeout=300)
            assert version == rep, f"loaded version {version}, published {rep}"
            loads.append(load_s)
            sync()  # the baseline in the same rep, so that drift in other load hits both
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            copies.append(time.perf_counter() - t0)
        cmd_q.put(None)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    pub, load, copy = (statistics.median(x[1:]) for x in (pubs, loads, copies))
    ratios = [(p + l) / (2 * c) for p, l, c in zip(pubs[1:], loads[1:], copies[1:])]
    gb = store.flat.numel() * 4 / 1e9
    return {"publish_over_copy": statistics.median(ratios), "per_rep": [round(r, 3) for r in ratios],
            "params_M": store.flat.numel() / 1e6,
            "publish_s": pub, "load_s": load, "copy_s": copy, "publish_GBps": gb / pub,
            "load_GBps": gb / load, "copy_GBps": gb / copy,
            "load_in": f"spawned process via {'CUDA IPC' if device != 'cpu' else 'shared memory'}"}


# ----------------------------------------------------------------------------- trainer overhead

def bench_tb_step(model_dir: str, P: int, K: int, T: int, reps: int) -> dict:
    """Trainer.train_step over a bare forward+backward+AdamW step on the same padded groups
    (one forward/backward per prompt group, as train_step does), on the same model."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng, tok = random.Random(0), build_char_tokenizer()
    cfg = TBAConfig(model=model_dir, dtype="float32", trainer_device="cpu", searcher_devices="cpu",
                    num_searchers=1, prompts_per_step=P, group_size=K, num_generations=K,
                    searcher_batch_prompts=P, max_new_tokens=T, lr=1e-5, warmup_steps=1)
    trainer = Trainer(cfg, torch.device("cpu"), tok.pad_token_id, tok.eos_token_id)
    model, vocab = trainer.model, trainer.model.config.vocab_size
    for p, ex in enumerate(examples(P)):
        prompt = tok(ex["prompt"])["input_ids"]
        for _ in range(K):  # K distinct items per prompt: every step trains on all of them
            resp = [rng.randrange(4, vocab) for _ in range(rng.randint(T // 2, T - 1))] + [tok.eos_token_id]
            trainer.buffer.add(Trajectory(p, prompt, resp, float(rng.random() < 0.3), -4.6 * len(resp), 0))
    batches = [pad_sequences([t.prompt_tokens for t in g], [t.response_tokens for t in g], tok.pad_token_id)
               for g in trainer.sample()[0]]
    bare_opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def bare_step():
        bare_opt.zero_grad(set_to_none=True)
        for ids, attn, resp in batches:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1),
                                                    reduction="none")
            ((nll * resp[:, 1:].reshape(-1)).sum() / len(batches)).backward()
        bare_opt.step()
    tb, bare = [], []
    for rep in range(reps + 2):  # interleaved, so drift hits both; 2 warm-ups (AdamW state)
        t0 = time.perf_counter()
        trainer.train_step()
        t1 = time.perf_counter()
        bare_step()
        if rep >= 2:
            tb.append(t1 - t0), bare.append(time.perf_counter() - t1)
    return {"tb_step_over_bare_step": statistics.median(tb) / statistics.median(bare),
            "tb_step_s": statistics.median(tb), "bare_step_s": statistics.median(bare),
            "model": Path(model_dir).name, "P": P, "K": K, "T": T}


# ----------------------------------------------------------------------------- GPU

def bench_gpu(model_dir: str, reps: int) -> dict | str:
    """transformers-engine tokens/s and CUDA-IPC publish+load bandwidth vs device memcpy."""
    if not torch.cuda.is_available():
        return "not measured: no CUDA device"
    tok = build_char_tokenizer()
    cfg = TBAConfig(model=model_dir, dtype="bfloat16", num_searchers=1, searcher_devices="cuda:0",
                    max_new_tokens=128, num_generations=16, group_size=16)
    engine = HFEngine(cfg, torch.device("cuda:0"), tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(ex["prompt"])["input_ids"] for ex in examples(8)]
    engine.generate(prompts, 16)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = sum(len(r) for o in engine.generate(prompts, 16) for r in o)
    return {"device": torch.cuda.get_device_name(0),
            "hf_engine_tokens_per_s": tokens / (time.perf_counter() - t0),
            "ipc_publish": bench_publish(reps, device="cuda:0")}


# ----------------------------------------------------------------------------- report

def print_table(res: dict) -> None:
    print(f"\n{'metric':<30}{'value':>8}  {'goal':<8} met")
    for name in ("async_over_sync", "async_over_sync_2_searchers", "async_over_sync_ideal",
                 "publish_over_copy", "tb_step_over_bare_step", "tb_step_over_bare_step_tiny",
                 "searcher_busy_fraction"):
        goal, kind = GOALS.get(name, (None, None))
        mark = "" if goal is None else f"{'>=' if kind == 'min' else '<='} {goal}"
        met = "" if goal is None else ("yes" if res["goals_met"][name] else "NO")
        print(f"{name:<30}{res[name]:>8.3f}  {mark:<8} {met}")
    m = res["machine"]
    print(f"two-process speedup available at start: {m['parallel_speedup']:.2f} (2.0 = two idle cores); "
          f"other programs' load before the system runs: {res['other_cores_before_system']:.2f} cores")
    cols = list(res["scaling"][0])
    print(f"\nsystem runs (P = {SYSTEM['P']} prompts per step, N = K, hidden {SYSTEM['hidden']}, "
          f"{SYSTEM['layers']} layers); other_cores = CPU used by other programs meanwhile")
    print(" ".join(f"{c[:10]:>10}" for c in cols))
    for row in res["scaling"]:
        print(" ".join(f"{row[c]:>10.3f}" if isinstance(row[c], float) else f"{row[c]:>10}" for c in cols))
    print(f"\npublish: {json.dumps(res['publish_detail'])}")
    print(f"tb step: {json.dumps(res['tb_step_detail'])}")
    print(f"gpu: {json.dumps(res['gpu'])}")
    print(f"total runtime: {res['total_runtime_s']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench.json", help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="~1 min smoke test with the same keys")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before the system runs, wait up to S seconds for other programs to "
                             "leave the cores idle (their load is recorded either way)")
    args = parser.parse_args()
    start = time.monotonic()
    # Quick: short windows, no scaling variants, a 2-layer publish model, the trainer-overhead
    # ratio on the system model only. Full: ~8-10 min on 2 cores.
    seconds, warmup, scale_s, reps = (3, 1, 0, 3) if args.quick else (40, 5, 20, 15)
    res: dict = {"quick": args.quick, "machine": machine_info(1.0 if args.quick else 3.0)}
    with tempfile.TemporaryDirectory(prefix="tba_bench_models_") as root:
        model_dir = make_model_dir(root, SYSTEM["hidden"], SYSTEM["layers"], SYSTEM["heads"])
        log("trainer overhead")
        details = [bench_tb_step(model_dir, SYSTEM["P"], SYSTEM["K"], SYSTEM["T"], reps)]
        if not args.quick:  # a bigger model too: fixed per-step costs matter less there
            details.insert(0, bench_tb_step(make_model_dir(root, 256, 4, 4), 4, 8, 64, reps))
        res.update(tb_step_over_bare_step=details[0]["tb_step_over_bare_step"],
                   tb_step_over_bare_step_tiny=details[-1]["tb_step_over_bare_step"], tb_step_detail=details)
        log(f"  {details}")
        log("publish + load")
        publish = bench_publish(2 if args.quick else 7,
                                model_kwargs=dict(LLAMA_100M, num_hidden_layers=2) if args.quick else LLAMA_100M)
        res.update(publish_over_copy=publish["publish_over_copy"], publish_detail=publish)
        log(f"  {publish}")
        if args.wait_idle > 0:
            log(f"waiting up to {args.wait_idle:.0f} s for idle cores")
        res["other_cores_before_system"] = wait_idle(args.wait_idle)
        res.update(bench_system(model_dir, seconds, warmup, scale_s))
        log("gpu")
        res["gpu"] = bench_gpu(model_dir, 3)
    res["goals_met"] = {n: res[n] >= g if kind == "min" else res[n] <= g for n, (g, kind) in GOALS.items()}
    res["total_runtime_s"] = time.monotonic() - start
    Path(args.out).write_text(json.dumps(res, indent=2))
    print_table(res)


if __name__ == "__main__":
    main()
