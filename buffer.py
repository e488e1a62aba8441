"""Replay buffer for TBA, grouped by prompt, with most-on-policy sampling.

This file imports nothing from the project (standard library only), so it can be copied out alone.

* Items are grouped by prompt; each group keeps at most ``capacity`` trajectories, oldest evicted.
* Exact-token deduplication: a response already in the group is replaced by the new copy (the
  newest reward, log-probs and version win), as in the official TBA buffer.
* ``sample(P, K)`` returns P groups of exactly K trajectories. For each group, with probability
  ``mop_prob`` (m) the prompt is "most on-policy" (MOP) and its K items are its newest ones
  (those of its newest policy version). Otherwise the prompt is any prompt, and the K items are
  drawn by softmax(reward * inv_temp) (0 = uniform).
* MOP prompts are those refreshed (given new items) since the latest weight sync, which the
  trainer announces with ``mark_sync()``; when fewer than P prompts were refreshed, the P most
  recently refreshed ones. Contract: call ``mark_sync()`` every time new weights are
  published. Without it "refreshed since the sync" means "ever refreshed", so MOP draws become
  uniform over every prompt and m loses its meaning (``stats()`` reports ``buffer/fresh`` to
  make this visible). The official code's barrier delivers a sync interval's data at once;
  without a barrier data trickles in, and the fallback keeps every MOP draw possible, so the
  realised MOP fraction is m.
* Prompts are drawn without replacement, cycling through each pool before repeating (as the
  official code does), so a step never trains twice on one prompt.
* Groups with fewer than K eligible items are sampled with replacement (official behaviour).
* ``sample(P, K, min_version=v)`` bounds the age of everything drawn: only items of version v
  or newer, MOP and off-policy draws alike (``TBAConfig.max_train_lag``).
* ``sample(P, K, version=v)`` is the synchronous baseline's: P prompts with items of version v,
  K of those items each.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class Trajectory:
    """One response to one prompt, as a searcher sends it to the trainer."""

    prompt_id: Hashable  # identifies the prompt (dataset index)
    prompt_tokens: list[int]  # prompt token ids (what the policy conditions on)
    response_tokens: list[int]  # generated token ids, EOS included when generated
    reward: float  # r(x, y)
    ref_logprob: float  # log p_ref(y|x), summed over response tokens
    version: int  # policy version (trainer steps) of the weights that generated it
    # Per scored response token (tba.scored_tokens: the loss's temperature and EOS rule); only
    # for --loss grpo, None otherwise (TB needs neither; older checkpoints have neither).
    logprobs: list[float] | None = None  # log pi_old, the behaviour policy, as it sampled
    ref_token_logprobs: list[float] | None = None  # log p_ref, for GRPO's KL penalty


class ReplayBuffer:
    """Trajectories grouped by prompt; see the module docstring for the sampling rule."""

    def __init__(
        self, capacity: int = 100, mop_prob: float = 0.95, inv_temp: float = 0.0, seed: int = 0
    ):
        if capacity < 1:
            raise ValueError(f"ReplayBuffer: capacity must be >= 1, got {capacity}")
        if not 0.0 <= mop_prob <= 1.0:
            raise ValueError(f"ReplayBuffer: mop_prob must be in [0, 1], got {mop_prob}")
        if inv_temp < 0:
            raise ValueError(f"ReplayBuffer: inv_temp must be >= 0, got {inv_temp}")
        self.capacity = capacity
        self.mop_prob = mop_prob
        self.inv_temp = inv_temp
        self.rng = random.Random(seed)
        # prompt -> its items, oldest version first; the dict is ordered by latest refresh
        self.groups: dict[Hashable, list[Trajectory]] = {}
        self.num_added = 0  # every trajectory ever added, duplicates included
        self.newest_version = -1  # the newest policy version among the items (never decreases)
        self._per_version: Counter[int] = Counter()  # items held per policy version
        self._fresh: set[Hashable] = set()  # prompts refreshed since the latest mark_sync()
        self._mop_drawn: set[Hashable] = set()  # drawn as MOP in this cycle of the fresh set
        self._any_drawn: set[Hashable] = set()  # drawn off-policy in this cycle of all prompts
        self._mop_since_sync: set[Hashable] = set()  # drawn as MOP since the latest sync
        self.fresh_untrained = 0  # refreshed prompts no step drew as MOP before the last sync

    # ------------------------------------------------------------------ adding

    def add(self, traj: Trajectory) -> None:
        """Insert one trajectory: dedup by response tokens (newest kept), then evict oldest.
        The buffer stores its own copy of the record; the caller's object is not changed."""
        if not math.isfinite(traj.reward):
            raise ValueError(
                f"ReplayBuffer.add: non-finite reward {traj.reward} for prompt {traj.prompt_id!r}"
            )
        group = self.groups.pop(traj.prompt_id, [])
        self.groups[traj.prompt_id] = group  # re-inserted last: the most recently refreshed
        self._fresh.add(traj.prompt_id)
        if group:  # one prompt-token list per prompt, not one per trajectory (bounded memory)
            traj = dataclasses.replace(traj, prompt_tokens=group[0].prompt_tokens)
        key = tuple(traj.response_tokens)
        gone = [t for t in group if tuple(t.response_tokens) == key]
        group[:] = [t for t in group if tuple(t.response_tokens) != key] + [traj]
        # Keep the group ordered by version so "oldest" means oldest policy, even when two
        # searchers at different versions deliver out of order; sort is stable for ties.
        group.sort(key=lambda t: t.version)
        gone += group[: -self.capacity]
        del group[: -self.capacity]
        for t in gone:
            self._per_version[t.version] -= 1
        self._per_version[traj.version] += 1
        self.num_added += 1
        self.newest_version = max(self.newest_version, traj.version)

    def extend(self, trajs) -> None:
        for traj in trajs:
            self.add(traj)

    # ------------------------------------------------------------------ sampling

    def __len__(self) -> int:
        return sum(self._per_version.values())

    def mark_sync(self) -> None:
        """The trainer has published new weights: the MOP set starts afresh. Prompts refreshed
        since the previous sync that no step drew as MOP are counted (``buffer/fresh_untrained``
        in ``stats()``): data arriving faster than the trainer uses it."""
        self.fresh_untrained = len(self._fresh - self._mop_since_sync)
        self._fresh.clear()
        self._mop_drawn.clear()
        self._mop_since_sync.clear()

    def mop_prompts(
        self, at_least: int, min_version: int | None = None, eligible: list | None = None
    ) -> list[Hashable]:
        """Prompts refreshed since the latest sync, or the ``at_least`` most recently refreshed
        ones when fewer were; with ``min_version``, only prompts holding items that new
        (``eligible``, in refresh order, when the caller has listed them already)."""
        if eligible is None:
            eligible = [pid for pid in self.groups if self._holds_version(pid, min_version)]
        fresh = [pid for pid in eligible if pid in self._fresh]
        if len(fresh) >= at_least:
            return fresh
        return eligible[-at_least:]

    def _holds_version(self, pid: Hashable, min_version: int | None) -> bool:
        """Whether the prompt holds an item of ``min_version`` or newer (groups are sorted by
        version, so its last item is its newest)."""
        return min_version is None or self.groups[pid][-1].version >= min_version

    def count_prompts_since(self, min_version: int) -> int:
        """Prompts holding at least one item of ``min_version`` or newer."""
        return sum(g[-1].version >= min_version for g in self.groups.values())

    def _draw_prompt(self, candidates: list[Hashable], drawn: set, exclude: set) -> Hashable:
        """A candidate not yet ``drawn`` in this cycle nor in ``exclude`` (this step's prompts);
        once every candidate was drawn, a new cycle starts."""
        choices = [pid for pid in candidates if pid not in drawn and pid not in exclude]
        if not choices:
            drawn.difference_update(candidates)
            choices = [pid for pid in candidates if pid not in exclude]
        pid = self.rng.choice(choices)
        drawn.add(pid)
        return pid

    def _draw_items(self, items: list[Trajectory], count: int, inv_temp: float) -> list[Trajectory]:
        """``count`` items by softmax(reward * inv_temp): without replacement (Gumbel top-k), or
        with replacement when fewer exist."""
        if len(items) < count:
            if inv_temp == 0:
                return [self.rng.choice(items) for _ in range(count)]
            top = max(t.reward for t in items)
            weights = [math.exp(inv_temp * (t.reward - top)) for t in items]
            return self.rng.choices(items, weights=weights, k=count)
        # Gumbel-max trick: adding Gumbel noise to the logits and taking the top-k is sampling
        # k items without replacement from softmax(logits); no exp, so no underflow.
        keys = [
            inv_temp * t.reward - math.log(-math.log(self.rng.random() or 1e-300)) for t in items
        ]
        order = sorted(range(len(items)), key=keys.__getitem__, reverse=True)
        return [items[i] for i in order[:count]]

    def sample(
        self,
        num_prompts: int,
        per_prompt: int,
        version: int | None = None,
        min_version: int | None = None,
    ) -> tuple[list[list[Trajectory]], list[bool]]:
        """P groups of exactly K trajectories, and for each group whether it is most-on-policy.

        ``min_version``: a bound on age. Only items of that version or newer are eligible, MOP
        and off-policy draws alike, and only prompts holding such items; so no trajectory in the
        batch is older than ``min_version``.
        ``version`` (the synchronous baseline): P prompts holding items of exactly that version
        and K of those items each, all on-policy.

        Raises ValueError when fewer than ``num_prompts`` prompts are eligible.
        """
        if version is not None:
            return self._sample_version(num_prompts, per_prompt, version)
        everyone = [pid for pid in self.groups if self._holds_version(pid, min_version)]
        if len(everyone) < num_prompts:
            since = "" if min_version is None else f" with items of version {min_version} or newer"
            raise ValueError(
                f"ReplayBuffer.sample: {num_prompts} prompts asked, {len(everyone)} in the "
                f"buffer{since}"
            )
        oldest = -math.inf if min_version is None else min_version
        mop = self.mop_prompts(num_prompts, min_version, everyone)
        batch = []
        is_mop = []
        chosen = set()
        for _ in range(num_prompts):
            if self.rng.random() < self.mop_prob:  # MOP: the newest items of a fresh prompt
                pid = self._draw_prompt(mop, self._mop_drawn, chosen)
                self._mop_since_sync.add(pid)
                group = self.groups[pid]
                newest = [t for t in group if t.version == group[-1].version]
                batch.append(self._draw_items(newest, per_prompt, 0.0))
                is_mop.append(True)
            else:
                pid = self._draw_prompt(everyone, self._any_drawn, chosen)
                recent = [t for t in self.groups[pid] if t.version >= oldest]
                batch.append(self._draw_items(recent, per_prompt, self.inv_temp))
                is_mop.append(False)
            chosen.add(pid)
        return batch, is_mop

    def _sample_version(
        self, num_prompts: int, per_prompt: int, version: int
    ) -> tuple[list[list[Trajectory]], list[bool]]:
        """The synchronous baseline's sample: see ``sample``."""
        holders = [pid for pid, g in self.groups.items() if any(t.version == version for t in g)]
        if len(holders) < num_prompts:
            raise ValueError(
                f"ReplayBuffer.sample: {num_prompts} prompts asked, {len(holders)} in the "
                f"buffer with items of version {version}"
            )
        batch = []
        for pid in self.rng.sample(holders, num_prompts):
            items = [t for t in self.groups[pid] if t.version == version]
            batch.append(self._draw_items(items, per_prompt, 0.0))
        return batch, [True] * num_prompts

    def count_version(self, version: int) -> int:
        """Prompts holding at least one item of ``version``."""
        return sum(any(t.version == version for t in g) for g in self.groups.values())

    # ------------------------------------------------------------------ stats and state

    def stats(self, current_version: int | None = None) -> dict[str, float]:
        """Sizes, and with ``current_version`` the mean lag of stored items (from per-version
        counts: a step should not cost a pass over every stored trajectory)."""
        total = len(self)
        out = {
            "buffer/prompts": float(len(self.groups)),
            "buffer/trajectories": float(total),
            "buffer/frac_newest": self._per_version[self.newest_version] / total if total else 0.0,
            "buffer/fresh": float(len(self._fresh)),
            "buffer/fresh_untrained": float(self.fresh_untrained),
        }
        if current_version is not None and total:
            out["buffer/lag_mean"] = (
                sum((current_version - v) * n for v, n in self._per_version.items()) / total
            )
        return out

    def state_dict(self) -> dict:
        """Plain Python containers only, so it loads with ``torch.load(weights_only=True)``
        or JSON-like formats without unpickling arbitrary objects."""
        return {
            "capacity": self.capacity,
            "mop_prob": self.mop_prob,
            "inv_temp": self.inv_temp,
            "rng": _rng_state_to_list(self.rng.getstate()),
            "num_added": self.num_added,
            "newest_version": self.newest_version,
            # vars() not asdict(): asdict deep-copies every token list, many times slower
            "groups": [[pid, [dict(vars(t)) for t in g]] for pid, g in self.groups.items()],
            "fresh": [pid for pid in self.groups if pid in self._fresh],
            "mop_drawn": [pid for pid in self.groups if pid in self._mop_drawn],
            "mop_since_sync": [pid for pid in self.groups if pid in self._mop_since_sync],
            "any_drawn": [pid for pid in self.groups if pid in self._any_drawn],
        }

    def load_state_dict(self, state: dict) -> None:
        self.capacity, self.mop_prob = state["capacity"], state["mop_prob"]
        self.inv_temp = state["inv_temp"]
        self.rng.setstate(_rng_state_from_list(state["rng"]))
        self.num_added, self.newest_version = state["num_added"], state["newest_version"]
        self.groups = {_key(pid): [Trajectory(**t) for t in g] for pid, g in state["groups"]}
        self._per_version = Counter(t.version for g in self.groups.values() for t in g)
        self._fresh = {_key(p) for p in state["fresh"]}
        self._mop_drawn = {_key(p) for p in state["mop_drawn"]}
        self._mop_since_sync = {_key(p) for p in state.get("mop_since_sync", [])}
        self._any_drawn = {_key(p) for p in state["any_drawn"]}


def _key(pid):
    """Prompt ids round-trip through lists; tuples come back as lists and must be hashable."""
    return tuple(pid) if isinstance(pid, list) else pid


def _rng_state_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
