"""The trust region in the synchronous mode, PPO's way: two updates on each batch, the second
against the sampler (docs/tiny.md, "Asynchrony against the strongest synchronous rival";
``--sync_two_pass``, a flag of extensions/offpolicy.py).

On-policy data have rho = log pi - log pi_b = 0, so the sampler's anchor of the core's trust
region (``tba.tb_loss``) never acts in a ``--synchronous`` run. The standard ways to give an
on-policy learner the region's regulariser:

* anchored at the weights one update old, the proximal policy of AReaL's decoupled PPO (Fu et
  al. 2025, arXiv 2505.24298): the core's rule does this at every age, so ``--synchronous
  --tb_clip_eps R`` is this rival. It pays one forward pass a step without gradient (the
  previous update's weights, kept by the trainer) and a copy of the weights.
* PPO's own (Schulman et al. 2017, arXiv 1707.06347: several epochs over each batch, the clip
  measured against the sampler), this file: two AdamW updates on each batch, the second one
  update away from the sampler, so its rho != 0 and the sampler's anchor acts; the proximal
  anchor is off, so that the region is the sampler's alone, as PPO's. It pays a second forward
  and backward pass and a second AdamW update a step. A step is still one batch and one
  version; the lr schedule and beta stay per step.

At ``--tb_clip_eps 0`` no region acts: the core is plain synchronous TB exactly, and two passes
are plain TB's update taken twice on each batch (tests/test_sync_region.py).
"""

from __future__ import annotations

import dataclasses

import torch

from buffer import Trajectory
from plumbing.config import need
from tba import TBAConfig
from trainer import Parts, Trainer


def install(parts: Parts) -> Parts:
    """``parts`` with the two-pass synchronous trainer over its trainer."""
    name = f"{TwoPassTrainer.__name__}{parts.trainer.__name__}"
    return dataclasses.replace(parts, trainer=type(name, (TwoPassTrainer, parts.trainer), {}))


class TwoPassTrainer(Trainer):
    """4. Synchronous TB with two AdamW updates on each batch, the second against the sampler."""

    def __init__(self, cfg: TBAConfig, device: torch.device, pad_id: int, eos_id: int):
        # the region's anchors are the synchronous mode's (asynchronous data has its sampler's)
        need(cfg.synchronous, "--sync_two_pass is an option of --synchronous")
        super().__init__(cfg, device, pad_id, eos_id)
        self.previous = None  # the sampler's anchor alone, as PPO's clip

    def backward(self, groups: list[list[Trajectory]], beta: float) -> dict[str, float]:
        """4. The first pass's gradient and its AdamW update here (on-policy: rho = 0, plain TB's
        update, its gradient norm capped as the core's), then the second pass's gradient, for
        the core's ``update`` to take: the policy is now one update from the sampler, so the
        region drops the items that update moved more than eps along their push. Returns the
        second pass's metrics and the first's loss and gradient norm (``two_pass/*``)."""
        first = super().backward(groups, beta)
        grad_norm = self.grad_norm()
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(
                f"step {self.step}: the first pass's gradient norm is {grad_norm.item()}"
            )
        if self.cfg.max_grad_norm > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        second = super().backward(groups, beta)
        second["two_pass/first_loss"] = first["loss/tb"]
        second["two_pass/first_grad_norm"] = grad_norm.item()
        return second
