"""tools/bench.py's system sections: engines, weight publish, data parallel, intake and Ray."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from buffer import Trajectory
from engines import HFEngine, VLLMEngine, WeightStore
from extensions import data_parallel
from extensions.evaluate import EvalHFEngine, to_examples
from extensions.tiny import (
    cpu_config,
    save_tiny_model,
    synthetic_problems,
)
from plumbing.checkpoint import buffer_state, load_buffer_state
from tba import TBAConfig
from tools.bench_machine import log, parallel_speedup
from trainer import Parts, Trainer

LLAMA_110M = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
    tie_word_embeddings=True,
)
LLAMA_26M = dict(hidden=512, layers=8, heads=8)  # over the char vocabulary: the engines' bench
# What 64 searchers deliver (the paper's largest red-teaming run: 64 GPUs), as trajectories of 128
# response tokens per second, over-estimated: each searcher a GPU decoding a GPT-2-scale (124M)
# policy with vLLM at 100,000 tokens/s (batch 256 at ~2.5 ms per decode step, bound by per-step
# scheduling: the H100's memory roofline for 248 MB of fp16 weights is ~13,000 steps/s) and
# spending no time on rewards or reference log-probs: 64 * 100,000 / 128 = 50,000 per second.
INTAKE_REQUIRED_S = 64 * 100_000 / 128


# ----------------------------------------------------------------------------- engines


def bench_engines(root: str, quick: bool) -> dict | str:
    """Generation tokens/s and weight-load seconds, vLLM against transformers, one thread."""
    if importlib.util.find_spec("vllm") is None:
        return "not measured: vllm is not installed (pip install -r requirements-test.txt)"
    torch.set_num_threads(1)
    size = dict(hidden=128, layers=2, heads=4) if quick else LLAMA_26M
    path = save_tiny_model(Path(root) / "engine_model", **size)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    new_tokens = 16 if quick else 128
    cfg = cpu_config(
        path,
        max_new_tokens=new_tokens,
        temperature=0.7,
        num_generations=8,
        responses_per_prompt=8,
        searcher_batch_prompts=8,
    )
    prompts = [tok(ex["prompt"])["input_ids"] for ex in to_examples(synthetic_problems(8, seed=4))]
    named = list(model.named_parameters())
    out = {
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "new_tokens": new_tokens,
        "batch": "8 prompts x 8 samples",
    }
    for name, engine in (
        ("hf", HFEngine(cfg, torch.device("cpu"), tok.eos_token_id, tok.pad_token_id)),
        ("vllm", VLLMEngine(cfg, torch.device("cpu"), tok.eos_token_id, seed=0)),
    ):
        engine.generate(prompts[:2], 2)  # warm-up
        rates, loads = [], []
        for _ in range(1 if quick else 3):
            t0 = time.perf_counter()
            tokens = sum(len(r) for o in engine.generate(prompts, 8) for r in o)
            rates.append(tokens / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            engine.load_weights(named)
            loads.append(time.perf_counter() - t0)
        out[f"{name}_tokens_per_s"], out[f"{name}_load_s"] = (
            statistics.median(rates),
            statistics.median(loads),
        )
        del engine
    out["vllm_over_hf_tokens_per_s"] = out["vllm_tokens_per_s"] / out["hf_tokens_per_s"]
    return out


# ----------------------------------------------------------------------------- weight publish


def _load_child(store: WeightStore, model_kwargs: dict, device: str, cmd_q, res_q) -> None:
    """A searcher stand-in in its own process: load the store into a transformers model."""
    torch.set_num_threads(1)
    engine = EvalHFEngine(
        TBAConfig(searcher_devices=device, num_searchers=1),
        torch.device(device),
        eos_id=0,
        pad_id=0,
        model=_llama(model_kwargs, device),
    )
    res_q.put("ready")
    while cmd_q.get(timeout=300) is not None:
        t0 = time.perf_counter()
        version, _ = store.load_into(engine.load_weights)
        res_q.put((version, time.perf_counter() - t0))


def _llama(model_kwargs: dict, device: str):
    """A Llama with uninitialised storage (meta, then real memory): no init cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**model_kwargs))
    model.to_empty(device=device)
    model.tie_weights()  # to_empty unties lm_head from the embedding
    return model


def bench_publish(reps: int, device: str = "cpu", model_kwargs: dict = LLAMA_110M) -> dict:
    """(publish + load in another process) / (2 raw copies of the same bytes), median of reps."""
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
    ratios, seconds = [], []
    try:
        assert res_q.get(timeout=300) == "ready"
        for rep in range(reps + 1):  # rep 0 warms up: first touches of the shared pages
            t0 = time.perf_counter()
            store.publish(named, version=rep)
            publish_s = time.perf_counter() - t0
            cmd_q.put(rep)
            version, load_s = res_q.get(timeout=300)
            assert version == rep, f"loaded version {version}, published {rep}"
            sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            if rep:
                ratios.append((publish_s + load_s) / (2 * (time.perf_counter() - t0)))
                seconds.append(publish_s + load_s)
        cmd_q.put(None)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {
        "publish_over_copy": statistics.median(ratios),
        "publish_and_load_s": statistics.median(seconds),
        "params_M": store.flat.numel() / 1e6,
        "load_in": f"another process via {'CUDA IPC' if device != 'cpu' else 'shared memory'}",
    }


# ----------------------------------------------------------------------------- data parallel

DP_MODEL = dict(hidden=256, layers=4, heads=4)  # over the char vocabulary
DP_BATCH = dict(prompts=8, responses=8, prompt_tokens=48, response_tokens=32)


def fixed_batch(prompts: int, responses: int, prompt_tokens: int, response_tokens: int):
    """P groups of K trajectories of random characters: one step's batch."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(4, 60, (n,), generator=gen).tolist()

    return [
        [
            Trajectory(p, tokens(prompt_tokens), tokens(response_tokens), float(k % 2), -50.0, 0)
            for k in range(responses)
        ]
        for p in range(prompts)
    ]


def _dp_rank(rank: int, world: int, port: int, model_dir: str, steps: int, out_q) -> None:
    """One trainer rank: ``steps`` updates on the fixed batch, rank 0 handing it out each step
    (as run_tba does); rank 0 reports steps/s after one warm-up step."""
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    torch.set_num_threads(1)
    groups = fixed_batch(**DP_BATCH)
    cfg = cpu_config(
        model_dir,
        num_generations=DP_BATCH["responses"],
        responses_per_prompt=DP_BATCH["responses"],
        prompts_per_step=DP_BATCH["prompts"],
        micro_batch_size=0,
    )
    if world == 1:
        trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    else:
        ranks = data_parallel.Ranks.from_env("cpu", timeout_s=300)
        parts = data_parallel.install(Parts(), data_parallel.DataParallelConfig(), ranks)
        if rank > 0:  # updates as rank 0 hands them out (data_parallel.follow)
            data_parallel.follow(ranks, lambda _: parts.trainer)
            ranks.close()
            return
        trainer = parts.trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    t0 = time.perf_counter()
    for step in range(steps + 1):
        if step == 1:
            t0 = time.perf_counter()
        trainer.update(groups)
    out_q.put(steps / (time.perf_counter() - t0))
    if world > 1:
        data_parallel.finish(ranks, trainer)
        ranks.close()


def dp_steps_per_s(model_dir: str, world: int, steps: int) -> float:
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(target=_dp_rank, args=(rank, world, port, model_dir, steps, out_q))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        return out_q.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def bench_data_parallel(root: str, reps: int, steps: int) -> dict:
    """Steps/s of 1 and 2 ranks on the same batch, alternated ``reps`` times (drift in the
    machine hits both); their ratio beside two processes' gain over one (2.0 on idle cores)."""
    model_dir = save_tiny_model(Path(root) / "dp_model", **DP_MODEL)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(reps):
        for world in (1, 2):
            rates[world].append(dp_steps_per_s(model_dir, world, steps))
            log(f"data parallel: {world} rank(s), rep {rep}: {rates[world][-1]:.2f} steps/s")
    ratios = [two / one for one, two in zip(rates[1], rates[2], strict=True)]
    return {
        "steps_per_s_1_rank": statistics.median(rates[1]),
        "steps_per_s_2_ranks": statistics.median(rates[2]),
        "two_over_one": statistics.median(ratios),
        "two_over_one_range": [min(ratios), max(ratios)],
        "parallel_speedup": parallel_speedup(3.0),
        "reps": reps,
        "steps": steps,
        "model": DP_MODEL,
        "batch": DP_BATCH,
    }


# ----------------------------------------------------------------------------- intake


def _load_buffer_module(path: str):
    spec = importlib.util.spec_from_file_location(f"buffer_under_test_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickle look classes up there
    spec.loader.exec_module(module)
    return module


def _random_batch(module, prompt_ids, prompts: dict, tokens: int, version: int, rng) -> list:
    """One response per prompt, as a searcher's batch arrives: fresh Python int lists."""
    return [
        module.Trajectory(
            pid,
            list(prompts[pid]),
            [rng.randrange(50257) for _ in range(tokens)],
            rng.random(),
            -50.0,
            version,
        )
        for pid in prompt_ids
    ]


def bench_intake(
    path: str, prompts: int = 20_000, per_prompt: int = 20, tokens: int = 128, prompt_len: int = 64
) -> dict:
    """A buffer.py (``path``) filled with ``per_prompt`` rounds of one response per prompt
    (versions rising every 5 rounds, capacity 100): microseconds per add over the fill and in its
    last round; bytes held per trajectory (tracemalloc, a tenth of the prompts); unpickling a
    searcher's batch (mp.Queue.get's share of the intake); and the state's round trip."""
    import gc
    import io
    import pickle
    import tracemalloc

    module = _load_buffer_module(path)
    rng = random.Random(0)
    prompt_tokens = {p: [rng.randrange(50257) for _ in range(prompt_len)] for p in range(prompts)}
    out: dict = {"prompts": prompts, "per_prompt": per_prompt, "response_tokens": tokens}

    # Bytes held: everything the buffer keeps of what arrived, inputs dropped.
    few = range(prompts // 10)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    buf = module.ReplayBuffer(capacity=100)
    for r in range(per_prompt):
        for traj in _random_batch(module, few, prompt_tokens, tokens, r // 5, rng):
            buf.add(traj)
    gc.collect()
    out["bytes_per_trajectory"] = (tracemalloc.get_traced_memory()[0] - base) / len(buf)
    tracemalloc.stop()
    del buf

    # Wall-clock and CPU seconds (process_time: without the time the process waited for a core,
    # which on a shared machine is most of the difference).
    buf = module.ReplayBuffer(capacity=100)
    seconds = []
    cpu_s = 0.0
    for r in range(per_prompt):
        batch = _random_batch(module, range(prompts), prompt_tokens, tokens, r // 5, rng)
        t0, c0 = time.perf_counter(), time.process_time()
        for traj in batch:
            buf.add(traj)
        seconds.append(time.perf_counter() - t0)
        cpu_s += time.process_time() - c0
    out["trajectories"] = len(buf)
    out["add_us"] = sum(seconds) / len(buf) * 1e6
    out["add_cpu_us"] = cpu_s / len(buf) * 1e6
    out["add_us_last_round"] = seconds[-1] / prompts * 1e6
    out["add_per_s"] = 1e6 / out["add_us"]

    # Full groups (capacity 100 of a long run): every add also evicts; old layouts scan the group.
    full = module.ReplayBuffer(capacity=100)
    few = range(prompts // 40)
    full_s = full_cpu_s = 0.0
    for r in range(120):
        batch_r = _random_batch(module, few, prompt_tokens, tokens, r // 5, rng)
        t0, c0 = time.perf_counter(), time.process_time()
        for traj in batch_r:
            full.add(traj)
        full_s += (time.perf_counter() - t0) if r >= 100 else 0.0
        full_cpu_s += (time.process_time() - c0) if r >= 100 else 0.0
    out["add_us_full_groups"] = full_s / (20 * len(few)) * 1e6
    out["add_cpu_us_full_groups"] = full_cpu_s / (20 * len(few)) * 1e6
    del full, batch_r

    message = pickle.dumps(batch[:1000])
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(5):
        pickle.loads(message)
    out["unpickle_us"] = (time.perf_counter() - t0) / 5000 * 1e6
    out["unpickle_cpu_us"] = (time.process_time() - c0) / 5000 * 1e6
    out["intake_per_s"] = 1e6 / (out["add_us"] + out["unpickle_us"])
    out["intake_cpu_per_s"] = 1e6 / (out["add_cpu_us"] + out["unpickle_cpu_us"])
    out["required_per_s"] = INTAKE_REQUIRED_S

    t0 = time.perf_counter()
    buf.sample(7, 20)
    out["sample_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    # A reference buffer of an older version of the code saves itself; today's is saved by the
    # checkpoint plumbing.
    state = buf.state_dict() if hasattr(buf, "state_dict") else buffer_state(buf)
    out["state_dict_s"] = time.perf_counter() - t0
    file = io.BytesIO()
    t0 = time.perf_counter()
    torch.save(state, file)
    out["save_s"] = time.perf_counter() - t0
    out["checkpoint_mb"] = file.tell() / 1e6
    del state
    file.seek(0)
    t0 = time.perf_counter()
    state = torch.load(file, weights_only=True)
    out["load_s"] = time.perf_counter() - t0
    copy = module.ReplayBuffer()
    t0 = time.perf_counter()
    if hasattr(copy, "load_state_dict"):
        copy.load_state_dict(state)
    else:
        load_buffer_state(copy, state, module.StoredTrajectory)
    out["load_state_dict_s"] = time.perf_counter() - t0
    assert len(copy) == len(buf)
    return out


# ----------------------------------------------------------------------------- Ray

RAY_BATCH = (72, 100, 128)  # trajectories per batch (3 prompts x 24), prompt and response tokens
# rho-1b (realtreetune/rho-1b-sft-GSM8K: TinyLlama-1.1B's config.json), whose bf16 version is
# the 2.2 GB one of the ray section.
RHO_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
)
# The ray section's versions: (name, the Llama's config, dtype, searcher actors on other nodes).
RAY_CASES = (
    ("438MB", LLAMA_110M, torch.float32, 1),
    ("438MB", LLAMA_110M, torch.float32, 3),
    ("2.2GB", RHO_1B, torch.bfloat16, 1),
)


def _fake_batch(rank: int = 0):
    """A searcher's batch of RAY_BATCH's shape, with its statistics."""
    from searcher import Batch, BatchStats

    count, prompt_tokens, response_tokens = RAY_BATCH
    trajectories = [
        Trajectory(i // 24, list(range(prompt_tokens)), list(range(response_tokens)), 1.0, -9.0, 3)
        for i in range(count)
    ]
    return Batch(rank, trajectories, BatchStats(0.0, 0.0, 0.0, 0.0, 3, 0.5, 0.1))


def _queue_producer(out_queue, batches: int) -> None:
    for _ in range(batches):
        out_queue.put(_fake_batch())


def _in_node_rate(batches: int) -> float:
    """Trajectories/s through the in-node path: a searcher process's bounded mp.Queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue(maxsize=8)
    proc = ctx.Process(target=_queue_producer, args=(queue, batches))
    proc.start()
    queue.get(timeout=120)  # the first: the producer has started
    t0 = time.perf_counter()
    for _ in range(batches - 1):
        queue.get(timeout=120)
    rate = (batches - 1) * RAY_BATCH[0] / (time.perf_counter() - t0)
    proc.join(timeout=30)
    return rate


class _BatchActor:
    """A searcher actor's stand-in: returns a ready batch per call (Ray's share of the path)."""

    def __init__(self):
        self.batch = _fake_batch()

    def next_batch(self):
        return "incarnation", self.batch


class _LoadActor:
    """A searcher actor's weight paths into a flat copy of the weights (its engine's stand-in):
    ray_searchers.RayWeightSource (the object store), weight_rounds.GroupWeightSource (the
    weight group, its receiver thread started here), and a raw gloo group of the same ranks."""

    def __init__(self, rank: int, board, group_board, layout: list, dtype, bucket_bytes: int):
        from extensions import ray_searchers, weight_rounds

        torch.set_num_threads(1)
        self.rank = rank
        self.object_store = ray_searchers.RayWeightSource(board, layout, dtype)
        self.group = weight_rounds.GroupWeightSource(
            group_board, layout, dtype, "gloo", bucket_bytes, 300.0
        )
        self.group.start(rank, f"bench-{rank}")
        numel = sum(math.prod(shape) for _, _, shape in layout)
        self.params = torch.empty(numel, dtype=dtype)
        self.raw = None

    def ready(self) -> bool:
        return True

    def _copy(self, views) -> None:
        offset = 0
        for _, view in views:
            self.params[offset : offset + view.numel()].copy_(view.reshape(-1))
            offset += view.numel()

    def load(self, version: int, path: str) -> float:
        """Wait until ``version`` is there by ``path`` (object_store or broadcast), then copy
        it in; the copy's seconds."""
        if path == "object_store":
            source = self.object_store
            while source.version() < version:
                time.sleep(0.0005)
        else:  # no polling: a searcher's main thread generates meanwhile, it does not spin
            source = self.group
            with source.cond:
                source.cond.wait_for(lambda: source.version() >= version, 600)
        t0 = time.perf_counter()
        source.load_into(self._copy)
        return time.perf_counter() - t0

    def raw_join(self, host: str, port: int, secret: str, world: int) -> None:
        import ray

        from extensions import weight_group

        node_ip = ray.util.get_node_ip_address()
        self.raw = weight_group.WeightGroup(
            "gloo", host, port, secret, 0, self.rank + 1, world, 300.0, node_ip
        )

    def raw_receive(self) -> None:
        """One broadcast of the whole version into the flat copy, as rank ``rank + 1``."""
        deadline = time.monotonic() + 300.0
        self.raw.flag(0.0, deadline, total=True)  # everyone is here
        self.raw.broadcast(self.params.view(-1).view(torch.uint8), 1 << 62, deadline)
        self.raw.flag(1.0, deadline, total=True)


def _weight_paths(name: str, model_kwargs: dict, dtype, searchers: int, reps: int) -> dict:
    """One version of ``model_kwargs``'s Llama in ``dtype`` to ``searchers`` actors, each on a
    worker node of its own, by three paths in turn each repetition, the same bytes: the weight
    group (weight_rounds' GroupSender, buckets of 64 MiB), the object store (ray.put, the
    board, each node's pull), and one raw gloo broadcast to the same ranks. Seconds from the
    version in the trainer's store to the last actor's copy of it."""

    import ray
    from ray._private.state import state

    from extensions import group_store, ray_searchers, weight_group, weight_rounds

    store = WeightStore(
        list(_meta_llama(model_kwargs).named_parameters()), dtype, torch.device("cpu")
    )
    layout = list(store.layout)
    source = torch.empty_like(store.flat)
    named = []
    for param_name, offset, shape in layout:
        named.append((param_name, source[offset : offset + math.prod(shape)].view(shape)))
    nbytes = store.flat.numel() * store.flat.element_size()
    bucket = 64 << 20
    here = ray.util.get_node_ip_address()
    board = ray.remote(ray_searchers.WeightBoard).options(num_cpus=0).remote()
    group_board = ray.remote(weight_group.GroupBoard).options(num_cpus=0).remote()
    actors = [
        ray.remote(_LoadActor)
        .options(num_cpus=0, resources={"searcher": 1})
        .remote(rank, board, group_board, layout, dtype, bucket)
        for rank in range(searchers)
    ]
    ray.get([actor.ready.remote() for actor in actors], timeout=600)

    def pids(timeout_s: float) -> dict[int, int]:
        out = {}
        for rank, actor in enumerate(actors):
            record = state.actor_table(actor._actor_id.hex()) or {}
            if record.get("State") == "ALIVE":
                out[rank] = record["Pid"]
        return out

    def kill(rank: int, info: dict, why: str) -> None:
        raise RuntimeError(f"bench: searcher {rank} {why}")

    sender = weight_rounds.GroupSender(
        store, group_board, "gloo", bucket, 300.0, here, pids, kill, log=print
    )
    sender.start()
    raw_server = group_store.StoreServer(here)
    secret = raw_server.open()
    world = searchers + 1
    joined = [actor.raw_join.remote(here, raw_server.port, secret, world) for actor in actors]
    raw = weight_group.WeightGroup("gloo", here, raw_server.port, secret, 0, 0, world, 300.0, here)
    ray.get(joined, timeout=300)
    rows = []
    try:
        for version in range(reps + 1):  # version 0 warms every page up
            source.normal_()
            t0 = time.perf_counter()
            store.publish(named, version)
            publish_s = time.perf_counter() - t0
            row = {"publish_s": publish_s}
            # The weight group: the sender notices the version by itself.
            loads = [actor.load.remote(version, "broadcast") for actor in actors]
            t0 = time.perf_counter()
            copies = ray.get(loads, timeout=600)
            row["broadcast_s"] = time.perf_counter() - t0
            row["copy_s"] = max(copies)
            # The object store, as RaySearcherPool did it.
            loads = [actor.load.remote(version, "object_store") for actor in actors]
            t0 = time.perf_counter()
            ref = ray.put(store.flat.view(torch.uint8).numpy())
            board.set.remote(version, 0.0, [ref])
            ray.get(loads, timeout=600)
            row["object_store_s"] = time.perf_counter() - t0
            # The board drops the version's object now, not at the next put (memory).
            board.set.remote(version + 0.5, 0.0, [ray.put(b"")])
            del ref
            # One raw broadcast of the same bytes to the same ranks, its end confirmed.
            received = [actor.raw_receive.remote() for actor in actors]
            deadline = time.monotonic() + 300.0
            raw.flag(0.0, deadline, total=True)
            t0 = time.perf_counter()
            raw.broadcast(store.flat.view(-1).view(torch.uint8), 1 << 62, deadline)
            raw.flag(0.0, deadline, total=True)
            row["raw_gloo_s"] = time.perf_counter() - t0
            ray.get(received, timeout=300)
            if version:
                rows.append(row)
    finally:
        sender.stop()
        raw.close()
        raw_server.close()
        for actor in [*actors, board, group_board]:
            ray.kill(actor)
    del store, source, named
    out = {"case": name, "mb": nbytes / 1e6, "searchers": searchers, "reps": reps}
    for key in ("publish_s", "broadcast_s", "copy_s", "object_store_s", "raw_gloo_s"):
        out[key] = statistics.median(r[key] for r in rows)
    for path in ("broadcast", "object_store"):
        ratios = [r[f"{path}_s"] / r["raw_gloo_s"] for r in rows]
        out[f"{path}_over_raw"] = statistics.median(ratios)
        out[f"{path}_over_raw_range"] = [min(ratios), max(ratios)]
    # The driver's side of each round (announced until every member had it), warm-up apart:
    # of broadcast_s, the rest is noticing the version, the actors' copy and Ray's replies.
    out["round_s"] = statistics.median(sender.seconds[1:])
    out["rounds"] = len(sender.seconds)
    out["group_rebuilds"] = sender.rebuilds
    return out


def _meta_llama(model_kwargs: dict):
    """A Llama of ``model_kwargs`` on the meta device: its names and shapes, no memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**model_kwargs))


def bench_ray(reps: int, cases: tuple, batches: int) -> dict:
    """Searchers as Ray actors on a Ray cluster on loopback (a head with the driver, three worker
    nodes, one actor each): each case of ``cases`` by ``_weight_paths``; and trajectories/s
    of actor calls into the driver (ray_in_flight 2) against the in-node queue."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    from extensions import ray_cluster

    temp_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: unix socket paths
    saved = {key: os.environ.get(key) for key in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ.update(RAY_TMPDIR=temp_dir, RAY_AUTH_MODE="disabled")
    torch.set_num_threads(1)
    largest = max(
        sum(p.numel() for p in _meta_llama(kwargs).parameters()) * dtype.itemsize
        for _, kwargs, dtype, _ in cases
    )
    ray_cluster.keep_loopback()
    # Room in each node's object store for a version and a half (the plasma store takes
    # memory only as objects arrive; each version's object is dropped before the next put).
    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=int(largest * 1.5))
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(max(searchers for *_, searchers in cases)):
        cluster.add_node(**node, resources={"searcher": 1})
    cluster.wait_for_nodes()
    results = []
    try:
        ray_cluster.connect(cluster.address)
        for name, kwargs, dtype, searchers in cases:
            log(f"ray: {name} to {searchers} searcher(s)")
            results.append(_weight_paths(name, kwargs, dtype, searchers, reps))
            log(f"  {json.dumps(results[-1])}")
        actor = ray.remote(_BatchActor).options(num_cpus=0, resources={"searcher": 1}).remote()
        ray.get(actor.next_batch.remote())
        pending = [actor.next_batch.remote() for _ in range(2)]
        t0 = time.perf_counter()
        for _ in range(batches):
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])
            pending.append(actor.next_batch.remote())
        ray_rate = batches * RAY_BATCH[0] / (time.perf_counter() - t0)
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    in_node = _in_node_rate(batches)
    return {
        "weights": results,
        "trajectories_per_s_ray": ray_rate,
        "trajectories_per_s_in_node": in_node,
        "ray_over_in_node": ray_rate / in_node,
        "batch": RAY_BATCH,
    }


def print_ray(res: dict) -> None:
    """The weight paths' table: seconds per version, each path, each case."""
    print(
        f"{'version':<8}{'searchers':>10}{'raw gloo':>10}{'broadcast':>11}{'x raw':>7}"
        f"{'object store':>14}{'x raw':>7}{'  (seconds per version; medians)'}"
    )
    for row in res["weights"]:
        print(
            f"{row['case']:<8}{row['searchers']:>10}{row['raw_gloo_s']:>10.3f}"
            f"{row['broadcast_s']:>11.3f}{row['broadcast_over_raw']:>7.2f}"
            f"{row['object_store_s']:>14.3f}{row['object_store_over_raw']:>7.2f}"
        )
    print(
        f"trajectories/s through actor calls {res['trajectories_per_s_ray']:.0f}, through the "
        f"in-node queue {res['trajectories_per_s_in_node']:.0f}; two processes over one "
        f"{res['parallel_speedup']:.2f}"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
