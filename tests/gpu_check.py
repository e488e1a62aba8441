"""The GPU check: what a machine with one CUDA GPU, torch, transformers, no vLLM and no network
can tell about the paper run, in under 8 minutes. Its figures go to stdout and to a JSON file.

    python tests/gpu_check.py             # on a CUDA GPU (runs/gpu_check.json)
    python tests/gpu_check.py --dry_run   # on the CPU, tiny shapes: the same steps, in a minute

In this order:

1. **The CUDA tests** (``pytest -k cuda`` over the files that hold them): the CUDA-IPC weight
   store and the transformers engine on the GPU, the Ray driver's copy of a CUDA store that does
   not wait for the trainer's kernels.
2. **The paper preset's trainer** on a randomly initialised Llama of rho-1b's config
   (``RHO_1B``; no download) in bf16: seconds per AdamW step on P 7 groups of K 20 responses of
   512 tokens after a prompt of ``PROMPT_TOKENS``, one micro-batch of 20 sequences a pass (the
   released run's), and the trainer process's peak GPU memory.
3. **A publish**: the weights into a CUDA weight store, with the parity probe's log-prob; the
   same through host memory (what an FSDP publish did before it gathered on the GPU), and the
   Ray driver's copy of the store to host memory (``weight_group.StoreSnapshot``).
4. **A searcher's process** (spawned, as a searcher is): the transformers engine on the GPU
   loads the weights from the store by CUDA IPC, its probe log-prob must match the trainer's
   (the parity check), then it times generate calls of the searchers' shape (3 prompts x N 24,
   up to 512 new tokens: a random model rarely ends early, so every call is the longest) and
   reports its own peak memory.
5. **The weight group** (extensions/weight_group.py, ``--ray_weights broadcast``, without Ray),
   as far as one GPU shows it: the same version from this process to the searcher's over a
   gloo weight group of the two (from the CUDA store through host memory, ``StoreSnapshot``,
   in buckets), into a staging copy, then into its engine on the GPU, the parity probe checked
   again; and an NCCL weight group of one rank (NCCL refuses two ranks on one GPU): it forms
   on the group's store and runs a version's buckets from the store and from host memory
   through its two GPU buffers, as a searcher's receive would. Two GPUs are needed for NCCL's
   transfer itself.
6. **An estimate** of the paper run on 4xA100 from these figures (``estimate``), beside the
   authors' 82 minutes.

The dry run takes the same steps on the CPU at tiny shapes (the tiny Llama, P 2, K 4, 16
tokens, a shared-memory store); ``tests/test_gpu_check.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the project's modules are one level up
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# rho-1b (realtreetune/rho-1b-sft-GSM8K) is TinyLlama-1.1B's architecture: its config.json.
RHO_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
PROMPT_TOKENS = 160  # a GSM8K question in the paper's template: ~100-250 tokens of rho-1b's
PAPER = dict(prompts=7, k=20, n=24, call_prompts=3, new_tokens=512, micro=20, steps=700)
DRY = dict(prompts=2, k=4, n=4, call_prompts=2, new_tokens=16, micro=4, steps=700)
AUTHORS_MINUTES = 82  # the paper's GSM8K run on 4xA100 (README)
# Dense bf16 peak of the GPUs the estimate scales by (NVIDIA's data sheets, TFLOPS, SXM).
BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}
CUDA_TEST_FILES = ("tests/test_trainer.py",)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry_run", action="store_true", help="the CPU at tiny shapes")
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu_check.json"))
    parser.add_argument("--timed_steps", type=int, default=3, help="trainer steps timed")
    parser.add_argument("--timed_calls", type=int, default=2, help="generate calls timed")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here; --dry_run runs the CPU's tiny shapes")
    started = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    shape = DRY if args.dry_run else PAPER
    results: dict = {"machine": machine(device), "dry_run": args.dry_run, "shape": shape}
    results["cuda_tests"] = cuda_tests()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as root:
        model_dir = save_model(Path(root), args.dry_run)
        cfg = config(model_dir, shape, args.dry_run)
        results["trainer"], trainer = trainer_steps(cfg, device, shape, args.timed_steps)
        results["publish"], store, probe = publish(trainer, device)
        del trainer
        results["searcher"], results["weight_group"] = searcher_process(
            cfg, device, store, probe, shape, args.timed_calls
        )
        results["weight_group"]["nccl_one_rank"] = (
            nccl_one_rank(store) if not args.dry_run else None
        )
    results["estimate"] = estimate(results, shape)
    results["total_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    report(results, out)
    failed = results["cuda_tests"]["returncode"] not in (0, 5) or not results["searcher"]["parity"]
    if failed or not results["weight_group"]["parity"]:
        raise SystemExit(1)
    return results


def machine(device: torch.device) -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": "cpu",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, memory_gb=props.total_memory / 1e9)
    return info


# ----------------------------------------------------------------------------- 1. CUDA tests


def cuda_tests() -> dict:
    """``pytest -k cuda`` over CUDA_TEST_FILES (without a GPU they skip): its summary line."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "cuda",
            *CUDA_TEST_FILES,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    return {
        "returncode": proc.returncode,  # 5: nothing selected
        "summary": lines[-1] if lines else proc.stderr[-500:],
        "seconds": time.perf_counter() - t0,
        "failures": proc.stdout[-3000:] if proc.returncode not in (0, 5) else "",
    }


# ----------------------------------------------------------------------------- 2. the trainer


def save_model(root: Path, dry_run: bool) -> str:
    """A randomly initialised Llama of rho-1b's config in bf16 (the tiny Llama in the dry run),
    saved where the trainer and the engine load it."""
    if dry_run:
        from extensions.tiny import save_tiny_model

        return save_tiny_model(root / "model", hidden=64, layers=2, heads=2, tied=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**RHO_1B, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    del model
    torch.cuda.empty_cache()
    return str(root / "model")


def config(model_dir: str, shape: dict, dry_run: bool):
    from tba import TBAConfig

    return TBAConfig(
        model=model_dir,
        dtype="bfloat16",
        trainer_device="cpu" if dry_run else "cuda:0",
        searcher_devices="cpu" if dry_run else "cuda:0",
        num_searchers=1,
        engine="hf",
        weight_store="shared_memory" if dry_run else "cuda",
        prompts_per_step=shape["prompts"],
        responses_per_prompt=shape["k"],
        num_generations=shape["n"],
        searcher_batch_prompts=shape["call_prompts"],
        max_new_tokens=shape["new_tokens"],
        micro_batch_size=shape["micro"],
        torch_threads=1 if dry_run else 0,
    )


def synthetic_groups(cfg, vocab: int, seed: int) -> list:
    """P groups of K trajectories of the longest responses, random tokens (no EOS)."""
    from buffer import Trajectory

    gen = torch.Generator().manual_seed(seed)
    prompt_len = min(PROMPT_TOKENS, 8) if cfg.max_new_tokens < 64 else PROMPT_TOKENS

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    groups = []
    for p in range(cfg.prompts_per_step):
        prompt = tokens(prompt_len)
        groups.append(
            [
                Trajectory(p, prompt, tokens(cfg.max_new_tokens), float(k % 2), -300.0, 0)
                for k in range(cfg.responses_per_prompt)
            ]
        )
    return groups


def trainer_steps(cfg, device: torch.device, shape: dict, timed: int):
    """Seconds per AdamW step at the shape (the first, warm-up, apart) and the peak memory."""
    from plumbing.metrics import peak_memory_gb
    from trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(cfg, device, pad_id=0, eos_id=eos_of(cfg))
    vocab = trainer.model.config.vocab_size
    seconds = []
    for step in range(timed + 1):
        groups = synthetic_groups(cfg, vocab, seed=step)
        sync(device)
        t0 = time.perf_counter()
        trainer.update(groups)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    tokens = cfg.prompts_per_step * cfg.responses_per_prompt * cfg.max_new_tokens
    return {
        "first_step_s": seconds[0],
        "step_s": statistics.median(seconds[1:]),
        "steps_timed": timed,
        "response_tokens_per_step": tokens,
        "peak_memory_gb": peak_memory_gb(device),
        "params_M": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
    }, trainer


def eos_of(cfg) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model).eos_token_id


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- 3. a publish


def probe_of(vocab: int):
    """The parity probe in token ids (no tokenizer here): 12 prompt and 22 response tokens."""
    from extensions.checks import ParityProbe

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (34,), generator=gen).tolist()
    # The trainer and the engine run the same transformers code on the same device and bf16
    # weights here: their log-probs agree far closer than bf16 vLLM's would.
    return ParityProbe(ids[:12], ids[12:], tolerance=1e-3)


def publish(trainer, device: torch.device):
    """A checked publish into the store the trainer would use (CUDA on a GPU): the weights and
    the probe's log-prob; the same weights through host memory; and the Ray driver's copy of
    the store to host memory. Seconds each, median of 3."""
    from engines import make_weight_store
    from extensions.weight_group import StoreSnapshot

    probe = probe_of(trainer.model.config.vocab_size)
    store = make_weight_store(trainer.cfg, trainer.model, device)
    snapshot = StoreSnapshot(store)
    direct, via_host, snapshot_s = [], [], []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        expected = probe.logprob(trainer.model, 0, device)
        store.publish(trainer.weights_to_publish(), trainer.step, expected)
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host = [(name, p.detach().cpu()) for name, p in trainer.weights_to_publish()]
        store.publish(host, trainer.step, expected)
        via_host.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snapshot.read()
        snapshot_s.append(time.perf_counter() - t0)
    return (
        {
            "store": str(store.flat.device),
            "weights_gb": store.flat.numel() * store.flat.element_size() / 1e9,
            "publish_s": statistics.median(direct),
            "publish_via_host_s": statistics.median(via_host),
            "ray_snapshot_s": statistics.median(snapshot_s),
            "probe_logprob": expected,
        },
        store,
        probe,
    )


# ----------------------------------------------------------------------------- 4. a searcher


def searcher_process(cfg, device, store, probe, shape: dict, timed: int) -> tuple[dict, dict]:
    """The searcher's side in a spawned process: load by IPC, the parity check, generate; then
    the same version by the weight group (``send_by_group``)."""
    from extensions.group_store import StoreServer

    server = StoreServer("127.0.0.1")
    secret = server.open()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    args = (cfg, str(device), store, probe, shape, timed, server.port, secret, out)
    proc = ctx.Process(target=_searcher, args=args)
    proc.start()
    try:
        result = out.get(timeout=300)
        if "error" in result:
            raise RuntimeError(f"the searcher's process failed:\n{result['error']}")
        sent = send_by_group(store, server.port, secret)
        received = out.get(timeout=300)
        if "error" in received:
            raise RuntimeError(f"the searcher's weight group failed:\n{received['error']}")
    finally:
        proc.join(timeout=30)
        proc.kill()
        server.close()
    return result, {**sent, **received}


GROUP_BUCKET = 64 << 20  # RayConfig.ray_bucket_mb's default
GROUP_TIMEOUT_S = 300.0


def send_by_group(store, port: int, secret: str) -> dict:
    """Rank 0 of a gloo weight group of two (this process and the searcher's): the store's
    version through host memory (StoreSnapshot: a stream of its own, pinned memory), in
    buckets, then the flag that it is whole and the sum that says it arrived."""
    from extensions.weight_group import StoreSnapshot, WeightGroup

    group = WeightGroup("gloo", "127.0.0.1", port, secret, 1, 0, 2, GROUP_TIMEOUT_S, "127.0.0.1")
    snapshot = StoreSnapshot(store)
    t0 = time.perf_counter()
    read = snapshot.read()
    snapshot_s = time.perf_counter() - t0
    assert read is not None, "a publish overlapped the snapshot; nothing publishes here"
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    group.broadcast(read[2].view(-1).view(torch.uint8), GROUP_BUCKET, deadline)
    group.flag(1.0, deadline)
    arrived = group.flag(0.0, deadline, total=True)
    seconds = time.perf_counter() - t0
    group.close(wait_s=30.0)
    return {"snapshot_s": snapshot_s, "send_s": seconds, "arrived": arrived == 1.0}


def nccl_one_rank(store) -> dict:
    """An NCCL weight group of one rank on this GPU: formed on its own store, a version's
    buckets broadcast from the CUDA store and from host memory (through the two GPU buffers a
    searcher receives into), the flags. Seconds of each; on failure, the error."""
    from extensions.group_store import StoreServer
    from extensions.weight_group import WeightGroup

    server = StoreServer("127.0.0.1")
    try:
        secret = server.open()
        group = WeightGroup("nccl", "127.0.0.1", server.port, secret, 1, 0, 1, 60.0, "")
        flat = store.flat.view(-1).view(torch.uint8)
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        figures = {}
        for name, tensor in (("from_store_s", flat), ("through_buffers_s", host)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            deadline = time.monotonic() + 60.0
            group.broadcast(tensor, GROUP_BUCKET, deadline)
            group.flag(1.0, deadline)
            group.flag(0.0, deadline, total=True)
            torch.cuda.synchronize()
            figures[name] = time.perf_counter() - t0
        group.close(wait_s=30.0)
        return {"formed": True, **figures}
    except Exception as error:  # noqa: BLE001 -- reported, as the check's finding
        return {"formed": False, "error": f"{type(error).__name__}: {error}"[:500]}
    finally:
        server.close()


def _searcher(
    cfg, device: str, store, probe, shape: dict, timed: int, port: int, secret: str, out
) -> None:
    import traceback

    try:
        figures, engine = _searcher_figures(cfg, torch.device(device), store, probe, shape, timed)
        out.put(figures)
    except Exception:  # noqa: BLE001 -- the parent reports it
        out.put({"error": traceback.format_exc()})
        return
    try:
        out.put(_received_by_group(engine, store, probe, port, secret))
    except Exception:  # noqa: BLE001 -- the parent reports it
        out.put({"error": traceback.format_exc()})


def _received_by_group(engine, store, probe, port: int, secret: str) -> dict:
    """Rank 1 of ``send_by_group``'s group: the version into a staging copy in host memory
    (pinned on a GPU machine), then into the engine, and the parity probe on the engine."""
    import math

    from extensions.checks import engine_logprob
    from extensions.weight_group import WeightGroup

    group = WeightGroup("gloo", "127.0.0.1", port, secret, 1, 1, 2, GROUP_TIMEOUT_S, "127.0.0.1")
    staging = torch.empty(
        store.flat.numel() * store.flat.element_size(),
        dtype=torch.uint8,
        pin_memory=torch.cuda.is_available(),
    )
    engine.load_weights([(n, torch.zeros_like(v)) for n, v in store.views()])  # forget them
    t0 = time.perf_counter()
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    group.broadcast(staging, GROUP_BUCKET, deadline)
    whole = group.flag(0.0, deadline) == 1.0
    group.flag(1.0, deadline, total=True)
    receive_s = time.perf_counter() - t0
    group.close(wait_s=30.0)
    flat = staging.view(store.flat.dtype)
    views = [(n, flat[o : o + math.prod(shape)].view(shape)) for n, o, shape in store.layout]
    t0 = time.perf_counter()
    engine.load_weights(views)
    sync(engine.device)
    load_s = time.perf_counter() - t0
    expected = store.header[store.PROBE].item()
    got = engine_logprob(engine, probe.prompt, probe.response)
    return {
        "whole": whole,
        "receive_s": receive_s,
        "load_s": load_s,
        "probe_got": got,
        "parity": whole and abs(got - expected) <= probe.tolerance * max(1.0, abs(expected)),
    }


def _searcher_figures(cfg, device, store, probe, shape: dict, timed: int) -> tuple[dict, object]:
    from engines import HFEngine
    from extensions.checks import engine_logprob
    from plumbing.metrics import peak_memory_gb

    torch.set_num_threads(cfg.threads_per_process())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = HFEngine(cfg, device, eos_id=eos_of(cfg), pad_id=0)
    t0 = time.perf_counter()
    version, expected = store.load_into(engine.load_weights)
    load_s = time.perf_counter() - t0
    got = engine_logprob(engine, probe.prompt, probe.response)
    gen = torch.Generator().manual_seed(3)
    vocab = engine.model.config.vocab_size
    prompt_len = PROMPT_TOKENS if shape["new_tokens"] >= 64 else 8
    prompts = [
        torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(shape["call_prompts"])
    ]
    seconds, tokens = [], []
    for _ in range(timed + 1):
        sync(device)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, shape["n"])
        sync(device)
        seconds.append(time.perf_counter() - t0)
        tokens.append(sum(len(r) for o in outs for r in o))
    return {
        "version": version,
        "load_s": load_s,
        "probe_expected": expected,
        "probe_got": got,
        "parity": abs(got - expected) <= probe.tolerance * max(1.0, abs(expected)),
        "first_call_s": seconds[0],
        "generate_call_s": statistics.median(seconds[1:]),
        "tokens_per_call": statistics.median(tokens[1:]),
        "peak_memory_gb": peak_memory_gb(device),
    }, engine


# ----------------------------------------------------------------------------- 6. the estimate


def estimate(results: dict, shape: dict) -> dict:
    """The paper run's minutes from the measured figures. Asynchronous, a step takes the longer
    of the trainer's step (with a publish every k = 2) and the searchers' time to make a step's
    fresh data: with m = 0.95 nearly every step trains on P fresh prompts, which take P / 3
    generate calls spread over 3 searchers. The searchers' figure is the transformers engine's,
    an upper bound (vLLM is faster; it is not on this machine); evaluation and start-up are not
    counted. Scaled to an A100 by dense bf16 peak when this GPU is in BF16_TFLOPS, which
    assumes the same share of the peak on both."""
    step_s = results["trainer"]["step_s"] + results["publish"]["publish_s"] / 2
    search_s = shape["prompts"] / shape["call_prompts"] * results["searcher"]["generate_call_s"]
    search_s /= 3  # three searchers
    here = {
        "trainer_bound_min": shape["steps"] * step_s / 60,
        "hf_searcher_bound_min": shape["steps"] * search_s / 60,
    }
    here["async_min"] = max(here.values())
    name = results["machine"]["device"]
    tflops = next((v for k, v in BF16_TFLOPS.items() if k in name), None)
    out = {"on_this_device": here, "authors_4xA100_min": AUTHORS_MINUTES}
    if tflops is not None:
        scale = tflops / BF16_TFLOPS["A100"]
        out["scaled_to_A100"] = {k: v * scale for k, v in here.items()}
        out["scale"] = scale
    return out


def report(results: dict, out: Path) -> None:
    t, p, s, e = results["trainer"], results["publish"], results["searcher"], results["estimate"]
    m, tests, g = results["machine"], results["cuda_tests"], results["weight_group"]
    nccl = g["nccl_one_rank"]
    if nccl is None:
        nccl_line = "not run (the dry run has no GPU)"
    elif nccl["formed"]:
        nccl_line = (
            f"formed; a version's buckets {nccl['from_store_s']:.3f} s from the store, "
            f"{nccl['through_buffers_s']:.3f} s from host memory through the GPU buffers"
        )
    else:
        nccl_line = f"FAILED: {nccl['error']}"
    print(
        f"gpu_check on {m['device']} (torch {m['torch']}, transformers {m['transformers']})"
        f"{' DRY RUN, tiny shapes' if results['dry_run'] else ''}\n"
        f"CUDA tests: {tests['summary']} ({tests['seconds']:.0f} s)\n"
        f"trainer: {t['step_s']:.2f} s per step (first {t['first_step_s']:.1f} s), "
        f"{t['response_tokens_per_step']} response tokens a step, "
        f"peak {t['peak_memory_gb']:.1f} GB\n"
        f"publish: {p['publish_s']:.3f} s into the {p['store']} store "
        f"({p['weights_gb']:.2f} GB), {p['publish_via_host_s']:.3f} s through host memory; "
        f"Ray's copy of the store {p['ray_snapshot_s']:.3f} s\n"
        f"searcher: IPC load {s['load_s']:.2f} s, parity {'ok' if s['parity'] else 'FAILED'} "
        f"({s['probe_got']:.4f} against {s['probe_expected']:.4f}); "
        f"{s['generate_call_s']:.2f} s per generate call ({s['tokens_per_call']:.0f} tokens), "
        f"peak {s['peak_memory_gb']:.1f} GB\n"
        f"weight group (gloo, two processes here): {g['send_s']:.2f} s to the searcher's "
        f"staging copy (host snapshot {g['snapshot_s']:.3f} s), {g['load_s']:.2f} s into its "
        f"engine, parity {'ok' if g['parity'] else 'FAILED'}; NCCL, one rank: {nccl_line}\n"
        f"estimate of the paper run: {e['on_this_device']['async_min']:.0f} min on this device "
        f"(trainer-bound {e['on_this_device']['trainer_bound_min']:.0f}, transformers-engine "
        f"searchers {e['on_this_device']['hf_searcher_bound_min']:.0f})"
        + (
            f", {e['scaled_to_A100']['async_min']:.0f} min scaled to 4xA100"
            if "scaled_to_A100" in e
            else ""
        )
        + f"; the authors' {e['authors_4xA100_min']} min\n"
        f"total {results['total_s']:.0f} s; {out}"
    )


if __name__ == "__main__":
    main()
