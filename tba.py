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
  3. Each step t samples P groups of K trajectories. With probability m a group is "most
     on-policy" (MOP): a prompt refreshed since the latest weight sync (or, when fewer than P
     were, one of the P most recently refreshed), with its newest items. Otherwise it is any
     prompt, with items drawn by softmax(r * inv_temp) (inv_temp = 0: uniform). Stale data is
     fine because the TB optimum does not depend on the sampling distribution.
  4. It recomputes log pi_theta(y|x) with gradients and minimises the VarGrad TB loss (Eq. 5):

        d_i     = log pi_theta(y_i|x) - log p_ref(y_i|x) - r(x, y_i) / beta_t
        log Z^  = -(1/K) sum_i d_i                         (per prompt, no gradient)
        L       = 1/(P K) sum_x sum_i (log Z^(x) + d_i)^2

     with beta_t annealed linearly (beta_start -> beta_end), AdamW and a warmup-stable-decay
     learning rate. Log-probs are sums of fp32 log-softmax(logits / T) over response tokens.
  5. Every k steps it publishes its weights to the weight store as version v = t.

How the pieces fit (one machine; paper: S = 3 searchers on GPUs 1-3, trainer on GPU 0)
-------------------------------------------------------------------------------------

   searcher 0 (GPU 1) --+                                         +--> metrics.jsonl
   searcher 1 (GPU 2) --+-- Trajectory queue (bounded) --> trainer (GPU 0, main process)
   searcher 2 (GPU 3) --+                                    |  replay buffer (buffer.py)
        ^                                                    |  tb_loss + AdamW (tba.py)
        +------- WeightStore: shared tensors + version <-----+  publish every k steps
                 (CUDA IPC on the trainer's GPU, or shared memory)

The paper preset is the released run, and where it departs from the paper's equations
----------------------------------------------------------------------------------------
TBAConfig's defaults are the authors' released GSM8K run (bbartoldson/TBA,
launch_training_gsm8k.sh, the 54.6% one). Four of its choices differ from the paper's text; each
is one flag, so the paper's equations are one flag away:
  * tempered_logprobs (on): log pi and log p_ref are of logits / T with T = 0.7, the sampling
    temperature. The TB target is then the tempered policy, which is exactly what the searchers
    sample from; beta is a KL strength in tempered units (log-ratios ~1/0.7 larger). Off: the
    models themselves, the paper's Eq. 5.
  * eos_in_logprob (off): the EOS that ends a response is generated and kept but not scored
    (the released code pads with EOS and masks it). On: stopping is part of the response.
  * fp32_master_weights (off): weights and AdamW moments in bf16, no mixed precision. An AdamW
    step moves a weight by about lr at most, so at lr 1e-5 a bf16 weight with |w| > ~0.004
    (half an ulp > 1e-5) does not move at all. On: fp32 weights and moments, bf16 autocast.
  * max_grad_norm (0): no gradient clipping. With r/beta between 71 and 250 the TB residuals
    are large, and clipping at 1.0 would bind nearly every step (a different effective lr).

Deviations from the official code, with reasons
-----------------------------------------------
  * Processes and queues instead of MPI ranks with a barrier at every sync: the trainer truly
    never waits for a searcher (the official trainer blocks at each sync until every searcher
    finishes its batch). Staleness then depends on how fast the trainer is relative to the
    searchers; every step reports it as async/lag_*.
  * Most-on-policy without barriers: the official "online" prompts are those a sync delivered,
    all at once. Here data trickles in, so MOP prompts are those refreshed since the latest
    publish, topped up with the most recently refreshed when fewer than P arrived; every MOP
    draw can then succeed, and the realised fraction (async/mop_frac) is m.
  * Weights travel as shared tensors (CUDA IPC or shared memory) with a version counter, not
    MPI broadcasts through CPU copies: a sync is a device copy, nothing is pickled.
  * Log-softmax runs in fp32 (sequence_logprobs says why); the official code runs it in bf16.
  * The loss is back-propagated one prompt group at a time (accumulation over P), like the
    official micro-batches of one prompt x 20; it equals tb_loss on the (P, K) batch because
    log Z^ is per prompt, and it bounds memory at K sequences per forward.
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
    stable_steps: int = _knob(350, "constant-lr steps after warmup")
    decay_steps: int = _knob(600, "steps of the cosine decay to 0 after the stable phase (released "
                                   "run: 600, cut at step 700, where the lr is half its peak)")
    total_steps: int = _knob(700, "trainer steps (released run: 98,000 episodes / 140 per step)")
    weight_decay: float = _knob(0.0, "AdamW weight decay")
    max_grad_norm: float = _knob(0.0, "clip the gradient norm to this; 0 = no clipping (released run)")
    fp32_master_weights: bool = _knob(False, "trainer keeps fp32 weights and AdamW moments and "
                                             "computes in `dtype` under autocast (mixed precision); "
                                             "off: weights and moments in `dtype` (released run)")
    tempered_logprobs: bool = _knob(True, "log pi and log p_ref of logits / temperature (released "
                                          "run); off: of the models themselves (the paper's Eq. 5)")
    eos_in_logprob: bool = _knob(False, "count the EOS token in log pi(y|x) and log p_ref(y|x); off: "
                                        "EOS is generated and kept but not scored (released run)")
    beta_start: float = _knob(0.014, "KL strength beta at step 0")
    beta_end: float = _knob(0.004, "KL strength beta after the anneal")
    beta_anneal_steps: int = _knob(500, "steps of the linear beta anneal")
    gradient_checkpointing: bool = _knob(False, "trade trainer compute for activation memory")
    micro_batch_size: int = _knob(20, "sequences per forward pass: in a trainer step rounded down to "
                                      "whole prompt groups (at least one; the loss and gradient do "
                                      "not depend on it), and in the searchers' reference pass; "
                                      "0: everything in one pass")
    # --- asynchrony and replay buffer ---
    mop_prob: float = _knob(0.95, "m: probability a prompt is drawn most-on-policy")
    inv_temp: float = _knob(0.0, "off-policy part draws items by softmax(reward * inv_temp); 0 = uniform")
    sync_every: int = _knob(2, "k: publish trainer weights every k steps")
    max_lag: int = _knob(3, "the trainer waits while the newest data in its buffer is more than "
                            "this many versions behind it (-1: never waits); the released run's "
                            "barrier keeps it within 2k - 1 = 3")
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
    data_dir: str = _knob("data/gsm8k", "directory with OpenAI's GSM8K train.jsonl and test.jsonl "
                                        "(a relative path not found here is taken from the repository)")
    resume: bool = _knob(False, "continue from output_dir/checkpoint (step, optimizer, scheduler, "
                                "beta, RNG, replay buffer)")
    checkpoint_every: int = _knob(175, "write a resumable checkpoint every this many steps "
                                       "(0: every sync interval k); released run: 4 per run")
    eval_every: int = _knob(0, "greedy accuracy on the fixed subset every this many steps (0: only "
                               "before and after training, as the released run)")
    eval_subset: int = _knob(200, "size of the fixed evaluation subset (also pass@k and diversity)")
    eval_test_size: int = _knob(0, "test problems scored greedily before and after training "
                                   "(0: the whole test split)")
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
                     "eval_samples", "eval_test_size", "micro_batch_size"):
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
        need(self.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0: off), got {self.max_grad_norm}")
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
        need(self.max_lag == -1 or self.max_lag >= self.sync_every - 1,
             f"max_lag must be -1 (no bound) or >= sync_every - 1 = {self.sync_every - 1}: only "
             f"every k-th version is published, so a tighter bound can never be met")
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

    def logprob_temperature(self) -> float:
        """T of the scored log-probs: the sampling temperature when tempered, else 1."""
        return self.temperature if self.tempered_logprobs else 1.0

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
    """Warmup-stable-decay multiplier of the peak lr at ``step`` (transformers' ``get_wsd_schedule``
    with cosine decay, which the released run uses).

    Linear warmup from 0 over ``warmup`` steps, constant for ``stable`` steps, then cosine decay
    to 0 over ``decay`` steps; 0 afterwards. The trainer evaluates it at update t = 1, 2, ...
    """
    if step < warmup:
        return step / warmup
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


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts so that they all end at the last column (where generation or the
    responses continue). Returns ``input_ids``, ``attention_mask`` and ``position_ids`` (P, W);
    positions count real tokens from 0, as without padding."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[row, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(1) - 1).clamp(min=0)


def summed_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """sum_t mask_t log softmax(logits_t / T)[target_t] per row (B,), for logits (B, T, V)
    aligned with targets and mask (B, T).

    Log-softmax runs in fp32 because bf16 log-probs summed over ~500 tokens drift by whole nats,
    which beta = 0.004 would amplify 250-fold in d. T != 1 scores the tempered policy, as the
    released code does with T = 0.7.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    token_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return (token_logp * mask.to(token_logp.dtype)).sum(dim=1)


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, response_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log pi(y|x) per row (B,) of right-padded prompt+response rows (``pad_sequences``): token
    t is predicted by the logits at t-1; prompt and padding positions are masked out."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return summed_logprobs(logits, input_ids[:, 1:], response_mask[:, 1:], temperature)


def group_logprobs(model: torch.nn.Module, prompts: list[list[int]], groups: list[list[list[int]]],
                   *, pad_id: int, eos_id: int, temperature: float = 1.0, include_eos: bool = True,
                   share_prompt: bool = True, device: torch.device | str = "cpu") -> torch.Tensor:
    """log pi(y|x) (P, K) of K responses ``groups[i]`` to each of P ``prompts[i]``, as the TB
    loss uses it: log-probs of logits / ``temperature``, a final EOS left out unless
    ``include_eos``. The trainer (log pi, with gradients) and the searchers (log p_ref) both
    call it, so the two sides of d always match.

    ``share_prompt``: each prompt runs once and its KV cache is repeated for its K responses,
    instead of K forwards over prompt + response (2.2x faster on the tiny preset, whose prompts
    are longer than its answers; equal up to float rounding, gradients included). Turn it off
    under gradient checkpointing, which drops the cache.
    """
    size = len(groups[0])
    if any(len(g) != size for g in groups):
        raise ValueError(f"group_logprobs: groups of sizes {sorted({len(g) for g in groups})}")
    flat = [r for g in groups for r in g]
    if not include_eos:  # the EOS is the last token: dropping it equals masking its position
        flat = [r[:-1] if r and r[-1] == eos_id else r for r in flat]
    if not share_prompt:
        ids, attn, resp = pad_sequences([p for p in prompts for _ in range(size)], flat, pad_id, device)
        return sequence_logprobs(model, ids, attn, resp, temperature).view(len(prompts), size)
    from transformers import DynamicCache

    ids, attn, positions = left_pad(prompts, pad_id, device)
    cache = DynamicCache(config=model.config)
    last = model(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                 use_cache=True).logits[:, -1:]  # predicts each response's first token
    cache.batch_repeat_interleave(size)
    width = max(1, max(len(r) for r in flat))
    targets = torch.full((len(flat), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(flat), width), dtype=torch.long)
    for row, r in enumerate(flat):
        targets[row, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[row, :len(r)] = 1
    targets, mask = targets.to(device), mask.to(device)
    attn = attn.repeat_interleave(size, 0)
    logits = model(input_ids=targets, attention_mask=torch.cat([attn, mask], dim=1),
                   position_ids=attn.sum(1, keepdim=True) + torch.arange(width, device=attn.device),
                   past_key_values=cache, use_cache=True).logits[:, :-1]
    logits = torch.cat([last.repeat_interleave(size, 0), logits], dim=1)
    return summed_logprobs(logits, targets, mask, temperature).view(len(prompts), size)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory in GB: on CUDA the allocator's peak reservation on ``device``
    (model, optimizer, activations, vLLM's KV cache), else the peak resident set (RAM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
