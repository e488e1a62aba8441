"""The replay buffer, grouped by prompt: step 2 stores what the searchers send, step 3 samples a
step's batch most-on-policy (tba.py's algorithm). Standard library only: copy it out alone.

Storing (step 2, ``add``): items are grouped by prompt, each group ordered by policy version
and holding at most ``capacity`` trajectories, the oldest evicted. A response already in its
group is replaced by the new copy (the newest reward, log-probs and version win), as in the
official TBA buffer. Every public method holds the buffer's lock, so the trainer's intake
thread adds while the trainer samples.

Sampling (step 3, ``sample(P, K)``): P groups of exactly K trajectories. For each group, with
probability m (``mop_prob``) the prompt is most-on-policy (MOP) and its K items are its newest
(those of its newest version); otherwise the prompt is any prompt, and its K items are drawn by
softmax(reward * inv_temp) (0: uniform). A group with fewer than K eligible items is drawn with
replacement (official behaviour). Prompts are drawn without replacement, cycling through each
pool before repeating, as the official code does, so a step never trains twice on one prompt.
``min_version`` bounds the lag of everything drawn (``TBAConfig.max_train_lag``).

MOP prompts are those refreshed since the latest weight publish, which the trainer announces
with ``mark_published()``; when fewer than P were refreshed, the P most recently refreshed.
Call ``mark_published()`` at every publish: without it "refreshed since the publish" means
"ever refreshed", and m loses its meaning (``buffer/fresh`` in ``stats()`` shows it). The
official code's barrier delivers a publish interval's data at once; here data trickles in, and
the fallback keeps every MOP draw possible, so the realised MOP fraction is m.

The items are stored packed (``StoredTrajectory``, at the end: token ids as int32 bytes); the
checkpoint's form of the buffer is plumbing/checkpoint.py's.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import random
import threading
from array import array
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class Trajectory:
    """1d. One response to one prompt, as a searcher sends it to the trainer."""

    prompt_id: Hashable  # identifies the prompt (dataset index)
    prompt_tokens: list[int]  # prompt token ids (what the policy conditions on)
    response_tokens: list[int]  # generated token ids, EOS included when generated
    reward: float  # r(x, y)
    ref_logprob: float  # log p_ref(y|x), summed over the scored response tokens
    version: int  # policy version (trainer steps) of the weights that generated it
    # Per scored response token (tba.scored_tokens), by name, for a loss that weighs tokens
    # (say "behaviour" and "reference"); None for TB.
    token_logprobs: dict[str, list[float]] | None = None
    # log pi_b(y|x): the generating weights' log-prob of the response, summed over the scored
    # tokens; TB's trust region reads it (tba.tb_loss). None: not recorded.
    behaviour_logprob: float | None = None
    # Which reference scored ref_logprob: 0, the frozen p_ref of the run; an extension that
    # resets p_ref to the policy (extensions/tba_prime.py) sets the policy version it copied,
    # so that a loss never pairs this log p_ref with another reference.
    ref_version: int = 0


def _locked(method):
    """``method`` run holding the buffer's lock: a thread may add while another samples."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class ReplayBuffer:
    """Trajectories grouped by prompt; the module docstring has the rules."""

    def __init__(
        self, capacity: int = 100, mop_prob: float = 0.95, inv_temp: float = 0.0, seed: int = 0
    ):
        """2-3. An empty buffer: at most ``capacity`` items a prompt, m = ``mop_prob``."""
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
        self._lock = threading.RLock()  # held by every public method (an intake thread adds)
        # prompt -> its items, oldest version first; the dict is ordered by latest refresh
        self.by_prompt: dict[Hashable, list[StoredTrajectory]] = {}
        self.num_added = 0  # every trajectory ever added, duplicates included
        self.num_drawn = 0  # items ``sample`` handed out, each once per step that drew it
        self.num_drawn_first = 0  # items handed out for the first time
        self.newest_version = -1  # the newest policy version among the items (never decreases)
        self.fresh: set[Hashable] = set()  # prompts refreshed since the latest mark_published()
        self.mop_drawn: set[Hashable] = set()  # drawn as MOP in this cycle of the fresh set
        self.any_drawn: set[Hashable] = set()  # drawn off-policy in this cycle of all prompts
        self.mop_since_publish: set[Hashable] = set()  # drawn as MOP since the latest publish
        self.fresh_untrained = 0  # refreshed prompts no step drew as MOP before the last publish
        self.reindex()

    def reindex(self) -> None:
        """Rebuild what ``by_prompt`` determines: each group's items by packed response (dedup
        without a pass over the group) and the count of items per version."""
        self._responses = {pid: {t.response: t for t in g} for pid, g in self.by_prompt.items()}
        self._per_version = Counter(t.version for g in self.by_prompt.values() for t in g)

    # ------------------------------------------------------------------ 2. storing

    @_locked
    def add(self, traj: Trajectory) -> None:
        """2. Insert one trajectory: dedup by response tokens (newest kept), then evict oldest.
        The buffer stores its own packed copy of the record; the caller's object is not changed."""
        if not math.isfinite(traj.reward):
            raise ValueError(
                f"ReplayBuffer.add: non-finite reward {traj.reward} for prompt {traj.prompt_id!r}"
            )
        if traj.behaviour_logprob is not None and math.isnan(traj.behaviour_logprob):
            raise ValueError(f"ReplayBuffer.add: NaN behaviour log-prob, prompt {traj.prompt_id!r}")
        group = self.by_prompt.pop(traj.prompt_id, [])
        self.by_prompt[traj.prompt_id] = group  # re-inserted last: the most recently refreshed
        self.fresh.add(traj.prompt_id)
        # One prompt record per prompt, not one per trajectory (bounded memory): the first one.
        prompt = group[0].prompt if group else pack(traj.prompt_tokens, TOKEN_TYPE)
        item = StoredTrajectory.packed(traj, prompt)
        index = self._responses.setdefault(traj.prompt_id, {})
        duplicate = index.get(item.response)
        gone = []
        if duplicate is not None:  # a group holds no two equal responses: at most one
            group.remove(duplicate)
            gone.append(duplicate)
        index[item.response] = item
        # Ordered by version, so "oldest" means oldest policy even when two searchers at
        # different versions deliver out of order; after its equals, as a stable sort would.
        if not group or group[-1].version <= item.version:
            group.append(item)
        else:
            bisect.insort_right(group, item, key=operator.attrgetter("version"))
        evicted = group[: -self.capacity]
        del group[: -self.capacity]
        for t in evicted:  # the new item among them when it is the oldest of a full group
            del index[t.response]
        for t in gone + evicted:
            self._per_version[t.version] -= 1
        self._per_version[item.version] += 1
        self.num_added += 1
        self.newest_version = max(self.newest_version, item.version)

    @_locked
    def extend(self, trajs) -> None:
        """2. Insert each trajectory of ``trajs``."""
        for traj in trajs:
            self.add(traj)

    @_locked
    def __len__(self) -> int:
        return sum(self._per_version.values())

    @_locked
    def count_prompts_since(self, min_version: int) -> int:
        """2. Prompts holding at least one item of ``min_version`` or newer."""
        return sum(g[-1].version >= min_version for g in self.by_prompt.values())

    # ------------------------------------------------------------------ 3. sampling

    @_locked
    def mark_published(self) -> None:
        """3. Step 5 has published new weights: the MOP set starts afresh. Prompts refreshed since
        the previous publish that no step drew as MOP are counted (``buffer/fresh_untrained``):
        data arriving faster than the trainer uses it."""
        self.fresh_untrained = len(self.fresh - self.mop_since_publish)
        self.fresh.clear()
        self.mop_drawn.clear()
        self.mop_since_publish.clear()

    @_locked
    def sample(
        self, num_prompts: int, per_prompt: int, min_version: int | None = None
    ) -> tuple[list[list[Trajectory]], list[bool]]:
        """3. P groups of exactly K trajectories, and for each group whether it is most-on-policy.
        ``min_version``: only items of that version or newer are eligible, MOP and other draws
        alike, and only prompts holding such items. Raises ValueError when fewer than
        ``num_prompts`` prompts are eligible."""
        everyone = [pid for pid in self.by_prompt if self._holds_version(pid, min_version)]
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
                pid = self._draw_prompt(mop, self.mop_drawn, chosen)
                self.mop_since_publish.add(pid)
                group = self.by_prompt[pid]
                newest = [t for t in group if t.version == group[-1].version]
                batch.append(self._unpacked(self._draw_items(newest, per_prompt, 0.0)))
                is_mop.append(True)
            else:  # any prompt, its items by softmax(reward * inv_temp)
                pid = self._draw_prompt(everyone, self.any_drawn, chosen)
                recent = [t for t in self.by_prompt[pid] if t.version >= oldest]
                batch.append(self._unpacked(self._draw_items(recent, per_prompt, self.inv_temp)))
                is_mop.append(False)
            chosen.add(pid)
        return batch, is_mop

    @_locked
    def mop_prompts(
        self, at_least: int, min_version: int | None = None, eligible: list | None = None
    ) -> list[Hashable]:
        """3. Prompts refreshed since the latest publish, or the ``at_least`` most recently
        refreshed ones when fewer were; with ``min_version``, only prompts holding items that new
        (``eligible``, in refresh order, when the caller has listed them already)."""
        if eligible is None:
            eligible = [pid for pid in self.by_prompt if self._holds_version(pid, min_version)]
        fresh = [pid for pid in eligible if pid in self.fresh]
        if len(fresh) >= at_least:
            return fresh
        return eligible[-at_least:]

    def _holds_version(self, pid: Hashable, min_version: int | None) -> bool:
        """3. Whether the prompt holds an item of ``min_version`` or newer (its last is its
        newest)."""
        return min_version is None or self.by_prompt[pid][-1].version >= min_version

    def _draw_prompt(self, candidates: list[Hashable], drawn: set, exclude: set) -> Hashable:
        """3. A candidate not yet ``drawn`` in this cycle nor in ``exclude`` (this step's prompts);
        once every candidate was drawn, a new cycle starts."""
        choices = [pid for pid in candidates if pid not in drawn and pid not in exclude]
        if not choices:
            drawn.difference_update(candidates)
            choices = [pid for pid in candidates if pid not in exclude]
        pid = self.rng.choice(choices)
        drawn.add(pid)
        return pid

    def _draw_items(
        self, items: list[StoredTrajectory], count: int, inv_temp: float
    ) -> list[StoredTrajectory]:
        """3. ``count`` items by softmax(reward * inv_temp): without replacement (Gumbel top-k), or
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

    def _unpacked(self, items: list[StoredTrajectory]) -> list[Trajectory]:
        """3. A group's drawn items as the records the searchers sent (a new record per draw). Each
        distinct item is counted once, however often the group drew it: ``num_drawn`` counts
        (item, step) pairs, ``num_drawn_first`` items no step had trained on before."""
        distinct = {id(t): t for t in items}.values()
        for t in distinct:
            self.num_drawn_first += t.draws == 0
            t.draws += 1
        self.num_drawn += len(distinct)
        return [t.trajectory() for t in items]

    # ------------------------------------------------------------------ statistics

    @_locked
    def stats(self, current_version: int | None = None) -> dict[str, float]:
        """Sizes, and with ``current_version`` the mean age of stored items, ``buffer/age_mean``:
        versions from an item's to ``current_version`` (the trainer's newest weights; a step's
        ``async/lag_*`` count from the weights it started from, one fewer), from per-version
        counts: a step should not cost a pass over every stored trajectory."""
        total = len(self)
        out = {
            "buffer/prompts": float(len(self.by_prompt)),
            "buffer/trajectories": float(total),
            "buffer/frac_newest": self._per_version[self.newest_version] / total if total else 0.0,
            "buffer/fresh": float(len(self.fresh)),
            "buffer/fresh_untrained": float(self.fresh_untrained),
            # Every trajectory generated (duplicates included), the share of them trained at
            # least once, and by how many steps each of those was: where the searchers' work goes.
            "buffer/generated": float(self.num_added),
            "buffer/trained_frac": self.num_drawn_first / self.num_added if self.num_added else 0.0,
            "buffer/reuse": self.num_drawn / self.num_drawn_first if self.num_drawn_first else 0.0,
        }
        if current_version is not None and total:
            out["buffer/age_mean"] = (
                sum((current_version - v) * n for v, n in self._per_version.items()) / total
            )
        return out


# ----------------------------------------------------------------------------- packed storage

TOKEN_TYPE = "i"  # array typecode of stored token ids: int32 (every vocabulary is < 2**31)
FLOAT_TYPE = "d"  # of stored per-token log-probs: float64, so they round-trip exactly


def pack(values, typecode: str) -> bytes:
    """Numbers as the native bytes of ``array(typecode)``; raises OverflowError when a value does
    not fit (a token id of 2**31 or more)."""
    return array(typecode, values).tobytes()


def unpack(data: bytes, typecode: str) -> list:
    values = array(typecode)
    values.frombytes(data)
    return values.tolist()


@dataclass(slots=True, eq=False)
class StoredTrajectory:
    """A trajectory as the buffer holds it: the fields of ``Trajectory`` with token ids and
    per-token log-probs packed into bytes, which the garbage collector does not traverse (a
    paper run holds up to 100 items of ~500 tokens for each of 7,473 prompts). A prompt's bytes
    are one object shared by its items; the packed response is the deduplication key. Reading a
    token field unpacks a list; ``trajectory()`` rebuilds the record the searcher sent."""

    prompt_id: Hashable
    prompt: bytes  # packed prompt token ids
    response: bytes  # packed response token ids
    reward: float
    ref_logprob: float
    version: int
    packed_token_logprobs: dict[str, bytes] | None = None
    behaviour_logprob: float | None = None
    draws: int = 0  # how many steps ``sample`` has handed it to
    ref_version: int = 0

    @classmethod
    def packed(cls, traj: Trajectory, prompt: bytes) -> StoredTrajectory:
        """``traj`` packed, with ``prompt`` (the packed prompt tokens of its group) as prompt."""
        token_logprobs = None
        if traj.token_logprobs is not None:
            token_logprobs = {k: pack(v, FLOAT_TYPE) for k, v in traj.token_logprobs.items()}
        response = pack(traj.response_tokens, TOKEN_TYPE)
        return cls(
            traj.prompt_id,
            prompt,
            response,
            traj.reward,
            traj.ref_logprob,
            traj.version,
            token_logprobs,
            traj.behaviour_logprob,
            ref_version=traj.ref_version,
        )

    @property
    def prompt_tokens(self) -> list[int]:
        return unpack(self.prompt, TOKEN_TYPE)

    @property
    def response_tokens(self) -> list[int]:
        return unpack(self.response, TOKEN_TYPE)

    @property
    def token_logprobs(self) -> dict[str, list[float]] | None:
        if self.packed_token_logprobs is None:
            return None
        return {k: unpack(v, FLOAT_TYPE) for k, v in self.packed_token_logprobs.items()}

    def trajectory(self) -> Trajectory:
        return Trajectory(
            self.prompt_id,
            self.prompt_tokens,
            self.response_tokens,
            self.reward,
            self.ref_logprob,
            self.version,
            self.token_logprobs,
            self.behaviour_logprob,
            self.ref_version,
        )
