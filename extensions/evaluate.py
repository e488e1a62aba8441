"""GSM8K-format prompts and their evaluation: greedy accuracy, and pass@n with the diversity of
n sampled answers. The GSM8K job, the tiny task (GSM8K-format sums), the TL;DR job (whose
evaluator generates the same way), the bench and the tests share it.

On CUDA with vLLM installed (or with ``--engine vllm``) the evaluator keeps a small vLLM engine
beside the trainer, in a process of its own (``EngineProcess``), and loads the trainer's weights
into it before each evaluation; otherwise it wraps the trainer's model in the transformers engine
(no copy, nothing to load).

Why a process of its own: an in-process vLLM engine joins torch.distributed. When the process
already belongs to torchrun's group (rank 0 of a data-parallel trainer), vLLM builds its world
group from that whole group with ``new_group``, which every rank must call, so rank 0 waits for
the other ranks until the timeout (vllm 0.33.0 ``distributed/parallel_state.py``,
``init_distributed_environment`` and ``GroupCoordinator.__init__``); built before the ranks join,
it leaves a one-process default group behind, which the ranks would reuse and train alone. A
spawned child has no group, as a searcher has none, and vLLM makes its own one-process group
there.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import queue as queue_lib
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from engines import HFEngine, VLLMEngine, WeightStore, make_weight_store, wants_vllm
from plumbing.config import knob, need
from plumbing.models import meta_causal_lm, pad_token_id
from plumbing.processes import WeightsNotLoaded
from rewards import gsm8k_reward
from tba import TBAConfig

PROMPT_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"  # official TBA/VinePPO format


def to_examples(rows: list[dict]) -> list[dict]:
    """Rows with a ``question`` -> examples: ``id`` and the formatted ``prompt`` added (what
    searchers need)."""
    return [
        {"id": i, "prompt": PROMPT_TEMPLATE.format(question=r["question"]), **r}
        for i, r in enumerate(rows)
    ]


@dataclass
class EvalConfig:
    """How a job evaluates the policy (extensions/evaluate.py)."""

    eval_every: int = knob(
        0, "evaluate on the fixed subset every this many steps (0: before and after only)"
    )
    eval_subset: int = knob(200, "size of the fixed evaluation subset (also pass@n and diversity)")
    eval_test_size: int = knob(0, "test problems scored before and after training (0: all)")
    eval_samples: int = knob(8, "n of pass@n: sampled answers per subset problem, before and after")
    eval_batch_size: int = knob(64, "prompts per generate call during evaluation")
    vllm_eval_memory_utilization: float = knob(
        0.2, "GPU fraction of the vLLM evaluation engine beside the trainer"
    )

    def __post_init__(self) -> None:
        for name in ("eval_every", "eval_subset", "eval_test_size", "eval_samples"):
            need(getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
        need(
            self.eval_batch_size >= 1, f"--eval_batch_size must be >= 1, got {self.eval_batch_size}"
        )


def distinct_n(texts: list[str], n: int) -> float:
    """Unique word n-grams / all word n-grams over a prompt's sampled answers (diversity)."""
    grams = [tuple(w[i : i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


# ----------------------------------------------------------------------------- the engines


class EvalHFEngine(HFEngine):
    """The transformers engine as an evaluation decodes: around a model in memory (the
    trainer's: no copy, nothing to load), sampled as the searchers sample, or greedy."""

    def __init__(
        self, cfg: TBAConfig, device: torch.device, eos_id: int, pad_id: int, model: torch.nn.Module
    ):  # HFEngine's fields, around ``model`` instead of a loaded ``cfg.model``
        self.cfg, self.device, self.eos_id, self.pad_id = cfg, device, eos_id, pad_id
        self.model = model
        self.weights = dict(self.model.named_parameters())

    def generate(self, prompts, n, greedy=False):
        pick = greedy_tokens if greedy else self.sample_token
        return self._decode(prompts, n, pick, with_logprobs=False)[0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row of ``logits`` (B, V): greedy decoding."""
    return logits.argmax(-1)


@dataclass
class EngineSetup:
    """What the evaluator's engine process is started with (pickled once, at spawn)."""

    cfg: TBAConfig
    device: str
    eos_id: int
    memory_utilization: float
    store: WeightStore  # the weights to load, with the trainer's probe log-prob
    probe: Any  # checks.ParityProbe (--parity_check), or None
    requests: Any  # a bounded queue: ("load",), ("generate", prompts, n, greedy), None to stop
    # A bounded queue: ("ready",), ("loaded", version), ("outputs", outs), or ("failed",
    # traceback, error message, whether the weights did not arrive: WeightsNotLoaded).
    replies: Any


def engine_main(setup: EngineSetup) -> None:
    """The engine process: build the vLLM engine, then serve requests until told to stop or
    the parent is gone. Any exception goes back as a ``failed`` reply, then exit 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    try:
        cfg = setup.cfg
        torch.set_num_threads(cfg.threads_per_process())
        device = torch.device(setup.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # The evaluator's engine takes its own share of the GPU, and sizes its KV cache from it.
        share = setup.memory_utilization or cfg.vllm_gpu_memory_utilization
        own = dataclasses.replace(cfg, vllm_gpu_memory_utilization=share, vllm_kv_cache_gb=0.0)
        engine = VLLMEngine(own, device, setup.eos_id, cfg.seed)
        setup.replies.put(("ready",), timeout=cfg.timeout_s)
        while (request := _next_request(setup.requests)) is not None:
            if request[0] == "load":
                version, expected = setup.store.load_into(engine.load_weights)
                if setup.probe is not None:
                    setup.probe.check(engine, expected, "evaluator")
                reply = ("loaded", version)
            else:
                _, prompts, n, greedy = request
                extra = {"temperature": 0.0} if greedy else {}  # greedy: vLLM's temperature 0
                reply = ("outputs", engine.generate(prompts, n, **extra))
            setup.replies.put(reply, timeout=setup.cfg.timeout_s)
    except BaseException as exc:  # noqa: BLE001 -- report all, then exit 1
        text = traceback.format_exc()
        try:
            failed = ("failed", text, str(exc), isinstance(exc, WeightsNotLoaded))
            setup.replies.put(failed, timeout=5.0)
        except queue_lib.Full:
            print(f"the evaluator's engine failed:\n{text}", flush=True)
        raise SystemExit(1) from None
    setup.replies.cancel_join_thread()  # nobody may read a last reply; never block the exit


def _next_request(requests):
    """The next request; None when told to stop, or when the parent is gone (never outlive it).
    No deadline but that: evaluations may be an hour of training apart."""
    while multiprocessing.parent_process().is_alive():
        try:
            return requests.get(timeout=0.5)
        except queue_lib.Empty:
            continue
    return None


class EngineProcess:
    """The evaluator's vLLM engine in a spawned process (the module docstring says why), with
    the engine's ``generate`` and a load of a model's weights. The weights travel through a
    ``engines.WeightStore`` of their own, placed as the searchers' is (``--weight_store``: CUDA IPC
    on the trainer's GPU, where the engine runs too, else shared memory). Every wait is bounded
    by ``cfg.timeout_s`` and ends early when the process dies; the process ends with ``close``
    (also at exit), or when its parent is gone."""

    def __init__(
        self, cfg: TBAConfig, device: torch.device, eos_id: int, memory_utilization: float, probe
    ):
        self.cfg = cfg
        ctx = mp.get_context("spawn")
        self.store = make_weight_store(
            cfg, meta_causal_lm(cfg.model, cfg.trust_remote_code), device
        )
        self.requests = ctx.Queue(maxsize=1)
        self.replies = ctx.Queue(maxsize=1)
        setup = EngineSetup(
            cfg,
            str(device),
            eos_id,
            memory_utilization,
            self.store,
            probe,
            self.requests,
            self.replies,
        )
        self.proc = ctx.Process(target=engine_main, args=(setup,), name="tba-evaluator-engine")
        self.proc.start()
        atexit.register(self.close)
        # Built before the caller allocates more: vLLM sizes its memory from what is free.
        self._reply("ready", "start")

    def load_weights(self, named: list[tuple[str, torch.Tensor]], probe: float = 0.0) -> None:
        """Load ``named`` (the policy's parameters, in their order) into the engine; ``probe``,
        the trainer's log-prob of the parity probe, is checked there when the process has a
        probe (WeightsNotLoaded on a mismatch)."""
        self.store.publish(named, self.store.version() + 1, probe)
        self._call(("load",), "loaded")

    def generate(self, prompts: list[list[int]], n: int, greedy: bool = False):
        """``VLLMEngine.generate`` in the engine process (greedy: at temperature 0)."""
        return self._call(("generate", prompts, n, greedy), "outputs")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the process: asked, then terminated, then killed."""
        if self.proc.is_alive():
            with contextlib.suppress(queue_lib.Full):  # busy with a request: terminated below
                self.requests.put(None, timeout=1.0)
            self.proc.join(timeout)
        for end in ("terminate", "kill"):
            if self.proc.is_alive():
                getattr(self.proc, end)()
                self.proc.join(3.0)
        self.requests.cancel_join_thread()
        atexit.unregister(self.close)

    def _call(self, request: tuple, expected: str):
        try:
            self.requests.put(request, timeout=self.cfg.timeout_s)
        except queue_lib.Full:
            raise TimeoutError("the evaluator's engine took no request") from None
        return self._reply(expected, request[0])

    def _reply(self, expected: str, what: str):
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                reply = self.replies.get(timeout=0.5)
                break
            except queue_lib.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"the evaluator's vLLM engine died ({what}; exit code {self.proc.exitcode})"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the evaluator's vLLM engine did not answer ({what}) within "
                        f"{self.cfg.timeout_s:g}s (--timeout_s)"
                    ) from None
        if reply[0] == "failed":
            _, text, message, weights = reply
            self.close()
            if weights:  # the check's own message, as in the process
                raise WeightsNotLoaded(message)
            raise RuntimeError(f"the evaluator's vLLM engine failed ({what}):\n{text}")
        if reply[0] != expected:
            raise RuntimeError(f"the evaluator's vLLM engine answered {reply[0]} to {what}")
        return reply[1] if len(reply) > 1 else None


# ----------------------------------------------------------------------------- the evaluator


class Evaluator:
    """Greedy pass@1, and pass@n with distinct-n of n sampled answers, on GSM8K-format examples.

    ``probe`` (checks.ParityProbe, with --parity_check): after each load into the vLLM engine,
    its log-prob of the probe must match the trainer model's, as a searcher's must. With a vLLM
    engine, ``close`` ends its process (at exit it ends anyway). An answer is right when
    ``answer_reward`` pays it 1: a task's evaluator names its own (jobs/run_countdown.py,
    jobs/run_math.py)."""

    answer_reward = staticmethod(gsm8k_reward)

    def __init__(self, cfg: TBAConfig, eval_cfg: EvalConfig, tokenizer, probe=None):
        self.cfg, self.eval_cfg, self.tokenizer, self.probe = cfg, eval_cfg, tokenizer, probe
        self.device = torch.device(cfg.trainer_device)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = pad_token_id(tokenizer)
        self.checked_loads = 0  # weight loads into the vLLM engine that passed the parity check
        self.vllm = (
            EngineProcess(
                cfg, self.device, self.eos_id, eval_cfg.vllm_eval_memory_utilization, probe
            )
            if wants_vllm(cfg, self.device)
            else None
        )

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()

    def _engine(self, model: torch.nn.Module):
        if self.vllm is None:
            return EvalHFEngine(self.cfg, self.device, self.eos_id, self.pad_id, model=model)
        expected = 0.0
        if self.probe is not None:
            # Scored as the trainer scores its publishes: in `dtype` when its weights are fp32.
            mixed = model.dtype != self.cfg.torch_dtype()
            with torch.autocast(self.device.type, self.cfg.torch_dtype(), enabled=mixed):
                expected = self.probe.logprob(model, self.pad_id, self.device)
        self.vllm.load_weights(list(model.named_parameters()), expected)  # checked there
        if self.probe is not None:
            self.checked_loads += 1
        return self.vllm

    @torch.no_grad()
    def answers(
        self, model: torch.nn.Module, examples: list[dict], n: int, greedy: bool, desc: str
    ) -> list[list[str]]:
        """n decoded answers to each example's prompt (greedy, or sampled at temperature T)."""
        was_training = model.training
        model.eval()
        engine = self._engine(model)
        size = len(examples) if self.vllm is not None else self.eval_cfg.eval_batch_size
        texts = []
        try:
            for i in tqdm(
                range(0, len(examples), size), desc=desc, leave=False, disable=None
            ):  # None: TTY only
                batch = examples[i : i + size]
                outs = engine.generate(
                    [self.tokenizer(ex["prompt"])["input_ids"] for ex in batch], n, greedy=greedy
                )
                texts += [
                    [self.tokenizer.decode(t, skip_special_tokens=True) for t in o] for o in outs
                ]
        finally:
            model.train(was_training)
        return texts

    def right(self, answer: str, example: dict) -> float:
        """1.0 for an answer the task's reward pays in full, else 0.0 (a format reward is not
        a right answer)."""
        return float(self.answer_reward(answer, example) == 1.0)

    def accuracy(self, model: torch.nn.Module, examples: list[dict], desc: str = "eval") -> float:
        """Greedy pass@1: the share of examples whose greedy answer scores 1."""
        answers = self.answers(model, examples, 1, True, desc)
        correct = [self.right(a[0], ex) for a, ex in zip(answers, examples, strict=True)]
        return sum(correct) / len(examples)

    def diversity(self, model: torch.nn.Module, examples: list[dict], desc: str = "sample") -> dict:
        """pass@n, mean sample accuracy, distinct-1/2 and distinct answers per problem."""
        n = self.eval_cfg.eval_samples
        if n < 1:
            return {}
        answers = self.answers(model, examples, n, False, desc)
        correct = [
            [self.right(a, ex) for a in ans] for ans, ex in zip(answers, examples, strict=True)
        ]
        return {
            f"pass@{n}": sum(max(c) for c in correct) / len(correct),
            "sample_accuracy": sum(map(sum, correct)) / (n * len(correct)),
            "distinct_1": sum(distinct_n(a, 1) for a in answers) / len(answers),
            "distinct_2": sum(distinct_n(a, 2) for a in answers) / len(answers),
            "distinct_answers": sum(len(set(a)) for a in answers) / len(answers),
        }
