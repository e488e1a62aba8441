"""Benchmarks of the TBA system, as ratios measured in one run so that machine noise cancels.

    python bench.py --out bench.json     # ~8-10 min on a 2-core CPU
    python bench.py --quick --out q.json # ~1 min smoke test, same keys

Keys written (see ``GOALS``): async_over_sync(_2_searchers), publish_over_copy,
tb_step_over_bare_step, searcher_busy_fraction, scaling (rows), gpu, machine.
Every model is built from a config in code (no download); every process uses one torch thread,
as the system does with one searcher on two cores.
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

from buffer import Trajectory
from rewards import gsm8k_reward
from run_gsm8k import PROMPT_TEMPLATE, build_char_tokenizer, build_tiny_model, synthetic_problems
from tba import TBAConfig, pad_sequences
from trainer import Trainer, WeightStore, run_tba

# name: (goal, "min" or "max"); a ratio meets its goal when it is >= (min) or <= (max) it.
GOALS = {"async_over_sync": (1.8, "min"), "publish_over_copy": (2.0, "max"),
         "tb_step_over_bare_step": (1.15, "max"), "searcher_busy_fraction": (0.9, "min")}
# The system workload: a trainer step (P*K sequences forward+backward) and a searcher batch
# (generate N per prompt, score, reference forward) take comparable time on one core here, so
# synchronous mode alternates two equal halves and asynchrony can at best double steps/s.
SYSTEM = dict(hidden=192, layers=2, heads=4, P=4, K=8, T=48)
LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                  tie_word_embeddings=True)  # ~110M parameters, 440 MB in fp32


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine_info() -> dict:
    import transformers
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor(),
            "cuda": torch.cuda.is_available(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def make_model_dir(root: str, hidden: int, layers: int, heads: int) -> str:
    """Save a char tokenizer and a random tiny Llama under ``root``; returns the directory."""
    path = Path(root) / f"llama_h{hidden}_l{layers}"
    if not path.exists():
        tok = build_char_tokenizer()
        build_tiny_model(tok, hidden=hidden, layers=layers, heads=heads).save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def examples(n: int = 64) -> list[dict]:
    return [{"id": i, "prompt": PROMPT_TEMPLATE.format(question=r["question"]), **r}
            for i, r in enumerate(synthetic_problems(n, seed=0))]


# ----------------------------------------------------------------------------- the system

class _Enough(Exception):
    """Raised from on_step to end a run after its time budget (run_tba cleans up on any exit)."""


def run_system(model_dir: str, seconds: float, warmup_s: float, *, S: int = 1, sync: bool = False,
               P: int, K: int, T: int, **_) -> dict:
    """One run_tba for ``seconds`` after its first step; steps/s etc. from metrics.jsonl rows
    after ``warmup_s`` (so the initial fill, model loading and the first steps are excluded)."""
    out = tempfile.mkdtemp(prefix="tba_bench_")
    cfg = TBAConfig(model=model_dir, dtype="float32", num_searchers=S, searcher_devices="cpu",
                    trainer_device="cpu", num_generations=K, group_size=K, prompts_per_step=P,
                    searcher_batch_prompts=math.ceil(P / S), max_new_tokens=T, synchronous=sync,
                    lr=1e-5, warmup_steps=1, total_steps=10**6, initial_samples=P * K,
                    output_dir=out, timeout_s=120, max_searcher_restarts=0, torch_threads=1)
    first: list[float] = []

    def on_step(trainer, metrics):
        first.append(first[0] if first else time.monotonic())
        if time.monotonic() - first[0] > warmup_s + seconds:
            raise _Enough
    t0 = time.monotonic()
    try:
        run_tba(cfg, examples(), gsm8k_reward, on_step=on_step, show_progress=False)
    except _Enough:
        pass
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    start = next((r for r in rows[:-1] if r["wall_time"] >= rows[0]["wall_time"] + warmup_s), rows[0])
    last = rows[-1]
    steps_per_s = (last["step"] - start["step"]) / (last["wall_time"] - start["wall_time"])
    window = [r for r in rows if r["step"] > start["step"]]

    def mean(key):
        vals = [r[key] for r in window if key in r]
        return sum(vals) / len(vals) if vals else float("nan")
    searcher_s = mean("time/generate") + mean("time/reward") + mean("time/reference")
    tokens_per_step = mean("throughput/tokens_per_s") * (mean("time/sample") + mean("time/forward_backward"))
    return {"mode": "sync" if sync else "async", "S": S, "P": P, "K": K, "T": T,
            "steps_per_s": steps_per_s, "samples_per_s": steps_per_s * P * K,
            "train_tokens_per_s": steps_per_s * tokens_per_step,
            "trainer_step_s": mean("time/sample") + mean("time/forward_backward"),
            "searcher_batch_s": searcher_s, "lag_mean": mean("async/lag_mean"),
            "busy_frac": min(last.get(f"searcher{r}/busy_frac", float("nan")) for r in range(S)),
            "steps_measured": last["step"] - start["step"], "run_s": time.monotonic() - t0}


def bench_system(model_dir: str, seconds: float, warmup_s: float, scale_seconds: float) -> dict:
    """Async vs sync with 1 and 2 searchers, then async steps/s against K, T and S (the K, T,
    S = 3 variants only when ``scale_seconds`` > 0)."""
    base = dict(SYSTEM)
    runs = {}
    for S in (1, 2):
        for sync in (True, False):
            log(f"system run: {'sync' if sync else 'async'}, {S} searcher(s)")
            runs[(S, sync)] = run_system(model_dir, seconds, warmup_s, S=S, sync=sync, **base)
            log(f"  {runs[(S, sync)]}")
    scaling = [runs[(1, False)], runs[(2, False)]]
    variants = ([dict(base, K=k) for k in (base["K"] // 2, base["K"] * 2)]
                + [dict(base, T=t) for t in (base["T"] // 2, base["T"] * 2)] + [dict(base, S=3)])
    for v in variants if scale_seconds > 0 else []:
        log(f"scaling run: S={v.get('S', 1)} K={v['K']} T={v['T']}")
        scaling.append(run_system(model_dir, scale_seconds, warmup_s, **v))
        log(f"  {scaling[-1]}")
    scaling.insert(0, runs[(1, True)])
    scaling.insert(2, runs[(2, True)])
    one = runs[(1, False)]
    return {"async_over_sync": one["steps_per_s"] / runs[(1, True)]["steps_per_s"],
            "async_over_sync_2_searchers": runs[(2, False)]["steps_per_s"] / runs[(2, True)]["steps_per_s"],
            # The ideal ratio for perfect overlap: sync step = trainer + searcher, async = trainer.
            "async_over_sync_ideal": 1 + one["searcher_batch_s"] / one["trainer_step_s"],
            "searcher_busy_fraction": one["busy_frac"], "scaling": scaling}


# ----------------------------------------------------------------------------- weight publish

def _load_child(store: WeightStore, model_kwargs: dict, device: str, cmd_q, res_q) -> None:
    """A searcher stand-in: its own model; each command loads the store into its parameters
    exactly as HFEngine.load_weights does (named copy_ into the parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(1)
    with torch.device("meta"):  # shapes only; real storage below, no init cost
        model = LlamaForCausalLM(LlamaConfig(**model_kwargs))
    model.to_empty(device=device)
    params = dict(model.named_parameters())

    @torch.no_grad()
    def load(named):
        for name, tensor in named:
            params[name].copy_(tensor)
    res_q.put("ready")
    while cmd_q.get(timeout=300) is not None:
        t0 = time.perf_counter()
        version, _ = store.load_into(load)
        res_q.put((version, time.perf_counter() - t0))


def bench_publish(reps: int, device: str = "cpu", model_kwargs: dict = LLAMA_100M) -> dict:
    """publish (trainer -> store) + load (store -> searcher model in a spawned process) over two
    raw copies of the same bytes on the same device."""
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**model_kwargs))
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # touch every page: untouched memory copies unrealistically fast
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    store = WeightStore(named, torch.float32, torch.device(device))
    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_load_child, args=(store, model_kwargs, device, cmd_q, res_q))
    proc.start()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        assert res_q.get(timeout=300) == "ready"
        totals, pubs, loads = [], [], []
        for rep in range(reps + 1):  # rep 0 warms up: first touches of the shared pages
            t0 = time.perf_counter()
            store.publish(named, version=rep)
            pub = time.perf_counter() - t0
            cmd_q.put(rep)
            version, load = res_q.get(timeout=300)
            assert version == rep, (version, rep)
            if rep:
                pubs.append(pub), loads.append(load), totals.append(pub + load)
        cmd_q.put(None)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    src, dst = store.flat.clone(), torch.empty_like(store.flat)
    copies = []
    for rep in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        copies.append(time.perf_counter() - t0)
    copy = statistics.median(copies[1:])
    gb = numel * 4 / 1e9
    return {"publish_over_copy": statistics.median(totals) / (2 * copy), "params_M": numel / 1e6,
            "publish_s": statistics.median(pubs), "load_s": statistics.median(loads),
            "raw_copy_s": copy, "publish_GBps": gb / statistics.median(pubs),
            "load_GBps": gb / statistics.median(loads), "copy_GBps": gb / copy,
            "load_where": "spawned process, shared " + ("CUDA IPC" if device != "cpu" else "memory")}


# ----------------------------------------------------------------------------- trainer overhead

def bench_tb_step(model_dir: str, P: int, K: int, T: int, reps: int) -> dict:
    """Trainer.train_step over a bare forward+backward+AdamW step on the same padded groups."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    cfg = TBAConfig(model=model_dir, dtype="float32", trainer_device="cpu", searcher_devices="cpu",
                    num_searchers=1, prompts_per_step=P, group_size=K, num_generations=K,
                    searcher_batch_prompts=P, max_new_tokens=T, lr=1e-5, warmup_steps=1)
    tok = build_char_tokenizer()
    trainer = Trainer(cfg, torch.device("cpu"), tok.pad_token_id)
    vocab = trainer.model.config.vocab_size
    for p, ex in enumerate(examples(P)):
        prompt = tok(ex["prompt"])["input_ids"]
        for _ in range(K):  # exactly K distinct items per prompt: every step samples all of them
            resp = [rng.randrange(4, vocab) for _ in range(rng.randint(T // 2, T - 1))] + [tok.eos_token_id]
            trainer.buffer.add(Trajectory(p, prompt, resp, float(rng.random() < 0.3),
                                          -4.6 * len(resp), version=0))
    groups, _ = trainer.sample()
    batches = [pad_sequences([t.prompt_tokens for t in g], [t.response_tokens for t in g],
                             tok.pad_token_id) for g in groups]
    model = trainer.model
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
        t2 = time.perf_counter()
        if rep >= 2:
            tb.append(t1 - t0), bare.append(t2 - t1)
    return {"tb_step_over_bare_step": statistics.median(tb) / statistics.median(bare),
            "tb_step_s": statistics.median(tb), "bare_step_s": statistics.median(bare),
            "P": P, "K": K, "T": T, "model_dir": Path(model_dir).name}


# ----------------------------------------------------------------------------- GPU

def bench_gpu(model_dir: str, reps: int) -> dict | str:
    """transformers-engine tokens/s and CUDA-IPC publish bandwidth vs device memcpy."""
    if not torch.cuda.is_available():
        return "not measured: no CUDA device"
    from searcher import HFEngine
    tok = build_char_tokenizer()
    cfg = TBAConfig(model=model_dir, dtype="bfloat16", num_searchers=1, searcher_devices="cuda:0",
                    max_new_tokens=128, num_generations=16, group_size=16)
    engine = HFEngine(cfg, torch.device("cuda:0"), tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(ex["prompt"])["input_ids"] for ex in examples(8)]
    engine.generate(prompts, 16)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, 16)
    tokens = sum(len(r) for o in outs for r, _ in o)
    return {"hf_engine_tokens_per_s": tokens / (time.perf_counter() - t0),
            "ipc": bench_publish(reps, device="cuda:0")}


# ----------------------------------------------------------------------------- report

def print_table(result: dict) -> None:
    print(f"\n{'metric':<30}{'value':>10}  {'goal':<8} met")
    for name in ("async_over_sync", "async_over_sync_2_searchers", "async_over_sync_ideal",
                 "publish_over_copy", "tb_step_over_bare_step", "tb_step_over_bare_step_tiny",
                 "searcher_busy_fraction"):
        goal = GOALS.get(name)
        mark = "" if goal is None else (">= " if goal[1] == "min" else "<= ") + str(goal[0])
        met = "" if goal is None else ("yes" if result["goals_met"][name] else "NO")
        print(f"{name:<30}{result[name]:>10.3f}  {mark:<8} {met}")
    cols = ("mode", "S", "K", "T", "steps_per_s", "samples_per_s", "train_tokens_per_s",
            "trainer_step_s", "searcher_batch_s", "busy_frac", "lag_mean", "steps_measured")
    print("\nscaling (system runs; P = %d prompts per step, N = K)" % SYSTEM["P"])
    print("".join(f"{c[:13]:>14}" for c in cols))
    for row in result["scaling"]:
        print("".join(f"{row[c]:>14.3f}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in cols))
    print(f"\npublish: {json.dumps(result['publish_detail'])}")
    print(f"gpu: {json.dumps(result['gpu'])}")
    print(f"total runtime: {result['total_runtime_s']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench.json", help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="~1 minute smoke test, same keys")
    args = parser.parse_args()
    start = time.monotonic()
    # Quick: short windows, no scaling variants, a 2-layer publish model, the tb-step ratio on
    # the system model only; the keys are the same. Full: ~8-10 min on 2 cores.
    seconds, warmup, scale_s, pub_reps, tb_reps = (4, 1, 0, 2, 3) if args.quick else (45, 5, 25, 7, 15)
    publish_model = dict(LLAMA_100M, num_hidden_layers=2) if args.quick else LLAMA_100M
    result: dict = {"quick": args.quick, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="tba_bench_models_") as root:
        model_dir = make_model_dir(root, SYSTEM["hidden"], SYSTEM["layers"], SYSTEM["heads"])
        log("trainer overhead: system model")
        tiny = bench_tb_step(model_dir, P=SYSTEM["P"], K=SYSTEM["K"], T=SYSTEM["T"], reps=tb_reps)
        small = tiny
        if not args.quick:
            log("trainer overhead: small model (hidden 256, 4 layers)")
            small = bench_tb_step(make_model_dir(root, 256, 4, 4), P=4, K=8, T=64, reps=tb_reps)
        result.update(tb_step_over_bare_step=small["tb_step_over_bare_step"],
                      tb_step_over_bare_step_tiny=tiny["tb_step_over_bare_step"],
                      tb_step_detail=[small, tiny] if small is not tiny else [tiny])
        log(f"  {result['tb_step_detail']}")
        log("publish + load of a Llama from config")
        publish = bench_publish(pub_reps, model_kwargs=publish_model)
        result.update(publish_over_copy=publish["publish_over_copy"], publish_detail=publish)
        log(f"  {publish}")
        result.update(bench_system(model_dir, seconds, warmup, scale_s))
        log("GPU (if any)")
        result["gpu"] = bench_gpu(model_dir, pub_reps)
    result["goals_met"] = {name: (result[name] >= goal if kind == "min" else result[name] <= goal)
                           for name, (goal, kind) in GOALS.items()}
    result["total_runtime_s"] = time.monotonic() - start
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
