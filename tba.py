"""Trajectory Balance with Asynchrony (TBA) -- the algorithm, its config and its loss.

Bartoldson et al., "Trajectory Balance with Asynchrony: Decoupling Exploration and Learning for
Fast, Scalable LLM Post-Training", arXiv 2503.18929 (NeurIPS 2025).

Notation
--------
  x          a prompt;  y a response (token sequence, EOS included when generated)
  pi_theta   the policy being trained;  p_ref the frozen reference (the SFT model)
  r(x, y)    the reward (rewards.py);  beta > 0 the KL strength (annealed)
  S          number of searcher processes;  N responses generated per prompt (paper 24)
  P          prompts per trainer step (paper 7);  K responses per prompt in a step (paper 20)
  m          probability that a step's prompt is "most on-policy" (paper 0.95)
  k          the trainer publishes its weights every k steps (paper 2)
  v          a policy version = the number of trainer steps behind a set of weights

The target: pi*(y|x) = p_ref(y|x) exp(r(x,y)/beta) / Z(x), the KL-regularised optimum.

The algorithm (numbered as the code runs)
-----------------------------------------
  1. S searchers each hold a copy of pi at some version v_s and a frozen p_ref. Repeatedly:
     a. if the weight store holds a version newer than v_s, load it (only between generate calls);
     b. take the next batch of prompts from the searcher's shard;
     c. generate N responses per prompt at temperature T;
     d. score r(x, y); compute log p_ref(y|x) (sum over response tokens, fp32 log-softmax);
     e. send Trajectory(x, y, r, log p_ref, v_s) to the trainer through a bounded queue.
  2. The trainer drains the queue into a replay buffer grouped by prompt (dedup by tokens,
     capacity per prompt). It waits only once, until the buffer holds the initial samples;
     after that it never waits for generation.
  3. Each step t samples P groups of K trajectories: with probability m a prompt refreshed by
     data from the newest policy version in the buffer (its newest items), else any prompt
     with items drawn by softmax(r * inv_temp) (inv_temp = 0: uniform). Stale data is fine
     because the TB optimum does not depend on the sampling distribution.
  4. It recomputes log pi_theta(y|x) with gradients and minimises the VarGrad TB loss (Eq. 5):

        d_i     = log pi_theta(y_i|x) - log p_ref(y_i|x) - r(x, y_i) / beta_t
        log Z^  = -(1/K) sum_i d_i                         (per prompt, no gradient)
        L       = 1/(P K) sum_x sum_i (log Z^(x) + d_i)^2

     with beta_t annealed linearly (beta_start -> beta_end), AdamW, gradient clipping and a
     warmup-stable-decay learning rate.
  5. Every k steps it publishes its weights to the weight store as version v = t.

How the pieces fit (one machine; paper: S = 3 searchers on GPUs 1-3, trainer on GPU 0)
-------------------------------------------------------------------------------------

   searcher 0 (GPU 1) --+                                         +--> metrics.jsonl
   searcher 1 (GPU 2) --+-- Trajectory queue (bounded) --> trainer (GPU 0, main process)
   searcher 2 (GPU 3) --+                                    |  replay buffer (buffer.py)
        ^                                                    |  tb_loss + AdamW (tba.py)
        +------- WeightStore: shared tensors + version <-----+  publish every k steps
                 (CUDA IPC on the trainer's GPU, or shared memory)

Deviations from the paper and its official code (bbartoldson/TBA), with reasons
-------------------------------------------------------------------------------
  * Processes and queues instead of the official MPI ranks with barriers at every sync: the
    design card asks for plain torch.multiprocessing, and without barriers the trainer truly
    never waits for a searcher (the official trainer blocks at each sync until searchers finish
    their batch). Staleness then depends on how fast the trainer is relative to the searchers
    (a fast trainer replays data more often); every step reports it as async/lag_*.
  * Weights travel as shared tensors (CUDA IPC or shared memory) with a version counter,
    not MPI broadcasts through fp32 CPU copies: a sync is a device copy, nothing is pickled.
  * Log-probs are of the untempered policy, EOS included. The official code scores tempered
    logits (logits / 0.7) and, because its pad token is EOS, drops EOS from the sum. We keep
    the paper's math: the target is p_ref exp(r/beta) of the models themselves, the sampling
    temperature only shapes the behaviour distribution (harmless off-policy), and the choice
    to stop is part of the response.
  * The loss is back-propagated one prompt group at a time (accumulation over P), like the
    official micro-batches of one prompt x 20; it equals tb_loss on the (P, K) batch because
    log Z^ is per prompt, and it bounds memory at K sequences per forward.
  * Most-on-policy = prompts whose newest items come from the newest policy version in the
    buffer. The official code uses "overwritten at the last sync", which is the same set when
    a barrier separates syncs; without barriers, the version is the precise meaning.
  * Schedules follow the issue's paper numbers (warmup 50, stable 450, decay 500, beta 0.012
    -> 0.004); the released script uses 50/350/600 with cosine decay, beta from 0.014, and
    stops at 700 steps. The decay here is cosine, as in transformers' WSD used there.
  * Gradients are clipped at max_grad_norm (1.0). The official loop never clips; clipping is a
    cheap guard against the r/beta = 250 scale of early TB residuals. Set it huge to disable.
  * Searchers shuffle their prompt shard each pass (seeded); the official ones walk it in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch


def _knob(default, help: str):
    """A config field whose help text feeds ``--help`` (one source of truth per knob)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TBAConfig:
    """Every knob of the whole system. Defaults are the paper's GSM8K setup (Sec. 5, App. C)."""

    # --- models ---
    model: str = _knob("realtreetune/rho-1b-sft-GSM8K",
                       "policy to train: a hub name or a local directory")
    ref_model: str = _knob("", "frozen reference p_ref; empty means the same as --model")
    dtype: str = _knob("bfloat16", "weights dtype for policy and reference: bfloat16|float16|float32")
    trust_remote_code: bool = _knob(False, "let transformers run model code from the hub (off: safer)")
    # --- processes and devices ---
    num_searchers: int = _knob(3, "searcher processes S (paper: 3, one per GPU)")
    searcher_devices: str = _knob("cuda:1,cuda:2,cuda:3",
                                  "comma list, one device per searcher (or one for all)")
    trainer_device: str = _knob("cuda:0", "device of the trainer, which runs in the main process")
    engine: str = _knob("auto", "generation engine: auto (vLLM if importable and on GPU) | vllm | hf")
    vllm_gpu_memory_utilization: float = _knob(0.85, "fraction of a searcher GPU vLLM may take")
    weight_store: str = _knob("auto", "auto (CUDA IPC when the trainer is on CUDA) | cuda | shared_memory; "
                                      "shared_memory is for GPUs without peer access")
    synchronous: bool = _knob(False, "on-policy baseline: searchers use only the newest weights and "
                                     "the trainer trains only on data of its current version (lag 0)")
    # --- generation (searchers) ---
    num_generations: int = _knob(24, "N: responses generated per prompt")
    group_size: int = _knob(20, "K: responses per prompt in a training step (sampled from the buffer)")
    prompts_per_step: int = _knob(7, "P: prompts per trainer step")
    searcher_batch_prompts: int = _knob(3, "prompts per generate call in a searcher (official: 3)")
    temperature: float = _knob(0.7, "sampling temperature of the searchers")
    max_new_tokens: int = _knob(512, "longest response, in tokens")
    # --- optimisation (trainer) ---
    lr: float = _knob(1e-5, "peak learning rate of AdamW")
    warmup_steps: int = _knob(50, "linear warmup steps of the warmup-stable-decay schedule")
    stable_steps: int = _knob(450, "constant-lr steps after warmup")
    decay_steps: int = _knob(500, "cosine decay-to-zero steps after the stable phase")
    total_steps: int = _knob(1000, "trainer steps (the released script stops at 700)")
    weight_decay: float = _knob(0.0, "AdamW weight decay")
    max_grad_norm: float = _knob(1.0, "gradient clipping norm")
    beta_start: float = _knob(0.012, "KL strength beta at step 0")
    beta_end: float = _knob(0.004, "KL strength beta after the anneal")
    beta_anneal_steps: int = _knob(500, "steps of the linear beta anneal")
    gradient_checkpointing: bool = _knob(False, "trade trainer compute for activation memory")
    # --- asynchrony and replay buffer ---
    mop_prob: float = _knob(0.95, "m: probability a prompt is drawn most-on-policy")
    inv_temp: float = _knob(0.0, "off-policy part draws items by softmax(reward * inv_temp); 0 = uniform")
    sync_every: int = _knob(2, "k: publish trainer weights every k steps")
    buffer_capacity: int = _knob(100, "trajectories kept per prompt (oldest evicted, dedup by tokens)")
    initial_samples: int = _knob(500, "trajectories in the buffer before the first step")
    queue_size: int = _knob(8, "bound of the trajectory queue, in messages (one per generate call)")
    parity_check: bool = _knob(False, "after each weight load, a searcher checks its engine's log-prob "
                                      "of a probe response against the trainer's (loud error if off)")
    parity_tol: float = _knob(0.02, "relative tolerance of the parity check (bf16 engines differ a little)")
    max_searcher_restarts: int = _knob(3, "restarts of failed searchers before the run stops loudly")
    torch_threads: int = _knob(0, "torch CPU threads per process; 0 = cores / processes")
    # --- run ---
    seed: int = _knob(0, "seed of trainer, buffer and searchers (searcher s uses seed + 1 + s)")
    output_dir: str = _knob("runs/gsm8k", "metrics.jsonl, results.json, checkpoints")
    data_dir: str = _knob("", "directory with OpenAI's GSM8K train.jsonl/test.jsonl; empty: the hub "
                              "(needs the optional `datasets` package and a network)")
    resume: bool = _knob(False, "continue from output_dir/checkpoint (step, optimizer, scheduler, "
                                "beta, RNG, replay buffer)")
    checkpoint_every: int = _knob(50, "write a resumable checkpoint every this many steps "
                                      "(0: every sync interval k)")
    eval_every: int = _knob(50, "greedy accuracy on the fixed subset every this many steps (0: never)")
    eval_subset: int = _knob(200, "size of the fixed evaluation subset (also pass@k and diversity)")
    eval_samples: int = _knob(8, "k of pass@k: sampled answers per subset problem, before and after")
    eval_batch_size: int = _knob(64, "prompts per generate call during evaluation")
    vllm_eval_memory_utilization: float = _knob(0.2, "GPU fraction of the vLLM evaluation engine "
                                                     "beside the trainer")
    timeout_s: float = _knob(600.0, "longest wait for any process or queue before failing loudly")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when a value or a combination cannot work."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"TBAConfig: {msg}")

        for name in ("num_searchers", "num_generations", "group_size", "prompts_per_step",
                     "searcher_batch_prompts", "max_new_tokens", "total_steps", "sync_every",
                     "buffer_capacity", "queue_size", "eval_batch_size"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "stable_steps", "decay_steps", "beta_anneal_steps",
                     "initial_samples", "eval_every", "eval_subset", "weight_decay",
                     "max_searcher_restarts", "torch_threads", "checkpoint_every",
                     "eval_samples"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.group_size >= 2, "group_size (K) must be >= 2: log Z is a mean over K, "
                                   "so with K = 1 the loss is identically 0")
        need(self.group_size <= self.num_generations * max(1, self.buffer_capacity // self.num_generations + 1),
             "group_size cannot exceed what the buffer can hold for one prompt")
        need(self.num_generations <= self.buffer_capacity,
             f"num_generations ({self.num_generations}) must be <= buffer_capacity "
             f"({self.buffer_capacity}), or one generate call evicts its own samples")
        need(0.0 <= self.mop_prob <= 1.0, f"mop_prob must be in [0, 1], got {self.mop_prob}")
        need(self.inv_temp >= 0.0, f"inv_temp must be >= 0, got {self.inv_temp}")
        need(self.beta_start > 0 and self.beta_end > 0, "beta_start and beta_end must be > 0")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        need(self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        need(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        need(self.dtype in ("bfloat16", "float16", "float32"), f"dtype {self.dtype!r} unknown")
        need(self.engine in ("auto", "vllm", "hf"), f"engine {self.engine!r} unknown")
        need(self.weight_store in ("auto", "cuda", "shared_memory"),
             f"weight_store {self.weight_store!r} unknown")
        devices = self.searcher_device_list()
        need(len(devices) in (1, self.num_searchers),
             f"searcher_devices lists {len(devices)} devices for {self.num_searchers} searchers "
             "(give one per searcher, or one for all)")
        need(not self.synchronous or self.num_searchers * self.searcher_batch_prompts
             >= self.prompts_per_step,
             "synchronous mode generates one batch per searcher per version: num_searchers * "
             "searcher_batch_prompts must be >= prompts_per_step")
        need(self.parity_tol > 0, f"parity_tol must be > 0, got {self.parity_tol}")
        need(self.warmup_steps + self.stable_steps + self.decay_steps >= 1,
             "warmup_steps + stable_steps + decay_steps must be >= 1")

    def searcher_device_list(self) -> list[str]:
        """One device string per searcher."""
        devices = [d.strip() for d in self.searcher_devices.split(",") if d.strip()]
        return devices * self.num_searchers if len(devices) == 1 else devices

    def threads_per_process(self) -> int:
        """torch CPU threads for the trainer and each searcher: ``torch_threads``, or the cores
        split evenly over the S + 1 processes (oversubscribed threads only spin)."""
        return self.torch_threads or max(1, (os.cpu_count() or 1) // (self.num_searchers + 1))

    def torch_dtype(self) -> torch.dtype:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}[self.dtype]


# ----------------------------------------------------------------------------- CLI from config

def config_argparser(description: str = "") -> argparse.ArgumentParser:
    """``--field value`` for every TBAConfig field; booleans are bare flags (``--synchronous``).

    Defaults are left as None so that callers can tell an explicit flag from a preset's value.
    """
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TBAConfig):
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if f.type in (bool, "bool"):
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            parser.add_argument(f"--{f.name}", type=kind, default=None, help=help_text)
    return parser


def config_from_args(args: argparse.Namespace, base: dict | None = None) -> TBAConfig:
    """A TBAConfig from ``base`` (e.g. a preset) overridden by every flag the user gave."""
    values = dict(base or {})
    for f in dataclasses.fields(TBAConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return TBAConfig(**values)


# ----------------------------------------------------------------------------- the loss

def tb_loss(logp: torch.Tensor, ref_logp: torch.Tensor, reward: torch.Tensor,
            beta: float) -> torch.Tensor:
    """VarGrad trajectory-balance loss (paper Eq. 5). Needs only torch; copy it anywhere.

    Shapes: ``logp``, ``ref_logp``, ``reward`` are float tensors (P, K) -- K responses to each
    of P prompts. ``logp`` = log pi_theta(y|x) summed over response tokens (carries the
    gradient), ``ref_logp`` = log p_ref(y|x) likewise, ``reward`` = r(x, y). Returns a scalar.

        d_ij    = logp_ij - ref_logp_ij - reward_ij / beta
        logZ_i  = -mean_j d_ij                    (detached)
        loss    = mean_ij (logZ_i + d_ij)^2       (= mean over prompts of the variance of d)

    Why log Z is detached: it is the per-prompt VarGrad estimate of the log-partition function
    (the optimal constant for the batch), not a parameter; its gradient through the mean would
    be zero in expectation and only adds noise (Richter et al. 2020, VarGrad).

    Why it works off-policy: the loss is zero exactly when d is constant in y for each x, i.e.
    pi_theta(y|x) proportional to p_ref(y|x) exp(r/beta), whichever distribution the y's came
    from -- so stale, replayed trajectories are fine (paper Sec. 3).

    On-policy link (paper App. A): with R = r - beta log(pi/p_ref), the KL-regularised reward,
    d_ij - mean_j d = -(R_ij - mean_j R)/beta, so
        grad loss = -(2/beta) (1/(PK)) sum_ij (R_ij - mean_j R_ij) grad log pi(y_ij|x_i),
    i.e. REINFORCE with a per-prompt mean baseline on R, scaled by 2/beta.
    """
    if logp.dim() != 2 or logp.shape != ref_logp.shape or logp.shape != reward.shape:
        raise ValueError("tb_loss: logp, ref_logp and reward must share a (P, K) shape, got "
                         f"{tuple(logp.shape)}, {tuple(ref_logp.shape)}, {tuple(reward.shape)}")
    if logp.shape[1] < 2:
        raise ValueError("tb_loss: K must be >= 2 (with one response per prompt the loss is 0)")
    if beta <= 0:
        raise ValueError(f"tb_loss: beta must be > 0, got {beta}")
    d = logp - ref_logp - reward / beta
    log_z = -d.mean(dim=1, keepdim=True).detach()
    return (log_z + d).pow(2).mean()


def tb_log_z(logp: torch.Tensor, ref_logp: torch.Tensor, reward: torch.Tensor,
             beta: float) -> torch.Tensor:
    """The per-prompt VarGrad log Z^ (P,) used inside ``tb_loss``; for metrics."""
    return -(logp - ref_logp - reward / beta).mean(dim=1).detach()


# ----------------------------------------------------------------------------- schedules

def beta_at(step: int, start: float, end: float, anneal_steps: int) -> float:
    """Linear anneal of beta from ``start`` (step 0) to ``end`` (step >= anneal_steps)."""
    if anneal_steps <= 0:
        return end
    frac = min(max(step, 0) / anneal_steps, 1.0)
    return start + (end - start) * frac


def wsd_lr_factor(step: int, warmup: int, stable: int, decay: int) -> float:
    """Warmup-stable-decay multiplier of the peak lr at ``step`` (0-based).

    Linear warmup over ``warmup`` steps (first step at 1/warmup, never 0), constant for
    ``stable`` steps, then cosine decay to 0 over ``decay`` steps; 0 afterwards.
    """
    if step < warmup:
        return (step + 1) / warmup
    step -= warmup
    if step < stable:
        return 1.0
    step -= stable
    if step < decay:
        return 0.5 * (1.0 + math.cos(math.pi * step / decay))
    return 0.0


# ----------------------------------------------------------------------------- log-probs

def pad_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Right-pad prompt+response rows. Returns ``input_ids``, ``attention_mask``, ``response_mask``,
    each (B, T); ``response_mask`` is 1 on response tokens (EOS included) and 0 on prompt and pad.

    Right padding keeps every real token at its natural position (position ids start at 0 for
    every row), so no position ids need to be passed to the model.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"pad_sequences: {len(prompts)} prompts for {len(responses)} responses")
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    resp = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        ids[row, :n] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attn[row, :n] = 1
        resp[row, len(p):n] = 1
    return ids.to(device), attn.to(device), resp.to(device)


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log pi(y|x) per row (B,): the sum over response tokens of fp32 log-softmax.

    Token t is predicted by the logits at t-1; prompt and padding positions are masked out.
    Log-softmax runs in fp32 because bf16 log-probs summed over ~500 tokens drift by whole nats,
    which beta = 0.004 would amplify 250-fold in d.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = input_ids[:, 1:]
    mask = response_mask[:, 1:].to(torch.float32)
    logits = logits.float()
    token_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return (token_logp * mask).sum(dim=1)
