"""Replay buffer for TBA, grouped by prompt, with most-on-policy sampling (steps 2-3 of tba.py's
algorithm).

This file imports nothing from the project (standard library only), so it can be copied out alone.

Sampling (step 3):
* ``sample(P, K)`` returns P groups of exactly K trajectories. For each group, with probability
  ``mop_prob`` (m) the prompt is "most on-policy" (MOP) and its K items are its newest ones
  (those of its newest policy version). Otherwise the prompt is any prompt, and the K items are
  drawn by softmax(reward * inv_temp) (0 = uniform).
* MOP prompts are those refreshed (given new items) since the latest weight publish, which the
  trainer announces with ``mark_published()``; when fewer than P prompts were refreshed, the P
  most recently refreshed ones. Contract: call ``mark_published()`` every time new weights are
  published. Without it "refreshed since the publish" means "ever refreshed", so MOP draws become
  uniform over every prompt and m loses its meaning (``stats()`` reports ``buffer/fresh`` to
  make this visible). The official code's barrier delivers a publish interval's data at once;
  without a barrier data trickles in, and the fallback keeps every MOP draw possible, so the
  realised MOP fraction is m.
* Prompts are drawn without replacement, cycling through each pool before repeating (as the
  official code does), so a step never trains twice on one prompt.
* Groups with fewer than K eligible items are sampled with replacement (official behaviour).
* ``sample(P, K, min_version=v)`` bounds the age of everything drawn: only items of version v
  or newer, MOP and off-policy draws alike (``TBAConfig.max_train_lag``; the synchronous
  baseline draws with v = the trainer's own version).

Storage (step 2):
* Items are grouped by prompt; each group keeps at most ``capacity`` trajectories, oldest evicted.
* Exact-token deduplication: a response already in the group is replaced by the new copy (the
  newest reward, log-probs and version win), as in the official TBA buffer.
* Thread-safe: every public method holds the buffer's lock, so a thread can drain the searchers'
  queue into the buffer while the trainer samples.
* Compact (``StoredTrajectory``, a learner may skip): token ids packed as int32 bytes, per-token
  log-probs (when recorded) as float64 bytes (exact), one prompt-token record per prompt, which
  the garbage collector does not traverse; deduplication looks the packed response up in a dict
  per prompt, and an insert appends or bisects by version, so an ``add`` costs about the same
  with 20 or 100 items per prompt (OPERATIONS.md, "Intake", has the figures). ``sample``
  returns ordinary ``Trajectory`` records with lists; the layout changes no draw (a test pins
  the draws against a list layout).
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import random
import sys
import threading
from array import array
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
    # Per scored response token (tba.scored_tokens: the loss's temperature and EOS rule), by
    # name, for a loss that weighs tokens (say "behaviour" and "reference"); None for TB.
    token_logprobs: dict[str, list[float]] | None = None
    # log pi_b(y|x): the generating weights' log-prob of the response, summed over the scored
    # tokens by that same rule; TB's trust region reads it (tba.tb_loss). None: not recorded.
    behaviour_logprob: float | None = None
    # Which reference scored ref_logprob: 0, the frozen p_ref of the run; an extension that
    # resets p_ref to the policy (tba_prime.py) sets the policy version it copied, so that a
    # loss never pairs this log p_ref with another reference.
    ref_version: int = 0


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


class StoredTrajectory:
    """A trajectory as the buffer holds it: the fields of ``Trajectory``, with token ids and
    per-token log-probs packed into bytes (``pack``). The prompt's bytes are one object shared by
    every item of a prompt. Reading ``response_tokens`` (or another packed field) unpacks a
    list; ``trajectory()`` rebuilds the record the searcher sent."""

    __slots__ = (
        "behaviour_logprob",
        "draws",
        "packed_token_logprobs",
        "prompt",
        "prompt_id",
        "ref_logprob",
        "ref_version",
        "response",
        "reward",
        "version",
    )

    def __init__(
        self,
        prompt_id: Hashable,
        prompt: bytes,
        response: bytes,
        reward: float,
        ref_logprob: float,
        version: int,
        packed_token_logprobs: dict[str, bytes] | None = None,
        behaviour_logprob: float | None = None,
        draws: int = 0,
        ref_version: int = 0,
    ):
        self.prompt_id = prompt_id
        self.prompt = prompt  # packed prompt token ids
        self.response = response  # packed response token ids: the deduplication key
        self.reward = reward
        self.ref_logprob = ref_logprob
        self.version = version
        self.packed_token_logprobs = packed_token_logprobs
        self.behaviour_logprob = behaviour_logprob
        self.draws = draws  # how many steps ``sample`` has handed it to
        self.ref_version = ref_version

    @classmethod
    def from_trajectory(cls, traj: Trajectory, prompt: bytes) -> StoredTrajectory:
        """``traj`` packed, with ``prompt`` (the packed prompt tokens of its group) as prompt."""
        token_logprobs = None
        if traj.token_logprobs is not None:
            token_logprobs = {k: pack(v, FLOAT_TYPE) for k, v in traj.token_logprobs.items()}
        return cls(
            traj.prompt_id,
            prompt,
            pack(traj.response_tokens, TOKEN_TYPE),
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


_version = operator.attrgetter("version")


def _locked(method):
    """``method`` run holding the buffer's lock: a thread may add while another samples."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


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
        self._lock = threading.RLock()  # held by every public method (an intake thread adds)
        # prompt -> its items, oldest version first; the dict is ordered by latest refresh
        self.by_prompt: dict[Hashable, list[StoredTrajectory]] = {}
        # prompt -> its items by packed response: deduplication without a pass over the group
        self._responses: dict[Hashable, dict[bytes, StoredTrajectory]] = {}
        self.num_added = 0  # every trajectory ever added, duplicates included
        self.num_drawn = 0  # items ``sample`` handed out, each once per step that drew it
        self.num_drawn_first = 0  # items handed out for the first time
        self.newest_version = -1  # the newest policy version among the items (never decreases)
        self._per_version: Counter[int] = Counter()  # items held per policy version
        self._fresh: set[Hashable] = set()  # prompts refreshed since the latest mark_published()
        self._mop_drawn: set[Hashable] = set()  # drawn as MOP in this cycle of the fresh set
        self._any_drawn: set[Hashable] = set()  # drawn off-policy in this cycle of all prompts
        self._mop_since_publish: set[Hashable] = set()  # drawn as MOP since the latest publish
        self.fresh_untrained = 0  # refreshed prompts no step drew as MOP before the last publish

    # ------------------------------------------------------------------ adding

    @_locked
    def add(self, traj: Trajectory) -> None:
        """Insert one trajectory: dedup by response tokens (newest kept), then evict oldest.
        The buffer stores its own packed copy of the record; the caller's object is not changed."""
        if not math.isfinite(traj.reward):
            raise ValueError(
                f"ReplayBuffer.add: non-finite reward {traj.reward} for prompt {traj.prompt_id!r}"
            )
        if traj.behaviour_logprob is not None and math.isnan(traj.behaviour_logprob):
            raise ValueError(f"ReplayBuffer.add: NaN behaviour log-prob, prompt {traj.prompt_id!r}")
        group = self.by_prompt.pop(traj.prompt_id, [])
        self.by_prompt[traj.prompt_id] = group  # re-inserted last: the most recently refreshed
        self._fresh.add(traj.prompt_id)
        # One prompt record per prompt, not one per trajectory (bounded memory): the first one.
        prompt = group[0].prompt if group else pack(traj.prompt_tokens, TOKEN_TYPE)
        item = StoredTrajectory.from_trajectory(traj, prompt)
        index = self._responses.setdefault(traj.prompt_id, {})
        duplicate = index.get(item.response)
        gone = []
        if duplicate is not None:  # a group holds no two equal responses: at most one
            group.remove(duplicate)
            gone.append(duplicate)
        index[item.response] = item
        # Keep the group ordered by version so "oldest" means oldest policy, even when two
        # searchers at different versions deliver out of order; inserted after its equals, as a
        # stable sort of the group with the new item appended would place it.
        if not group or group[-1].version <= item.version:
            group.append(item)
        else:
            bisect.insort_right(group, item, key=_version)
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
        for traj in trajs:
            self.add(traj)

    # ------------------------------------------------------------------ sampling

    @_locked
    def __len__(self) -> int:
        return sum(self._per_version.values())

    @_locked
    def mark_published(self) -> None:
        """The trainer has published new weights: the MOP set starts afresh. Prompts refreshed
        since the previous publish that no step drew as MOP are counted (``buffer/fresh_untrained``
        in ``stats()``): data arriving faster than the trainer uses it."""
        self.fresh_untrained = len(self._fresh - self._mop_since_publish)
        self._fresh.clear()
        self._mop_drawn.clear()
        self._mop_since_publish.clear()

    @_locked
    def mop_prompts(
        self, at_least: int, min_version: int | None = None, eligible: list | None = None
    ) -> list[Hashable]:
        """Prompts refreshed since the latest publish, or the ``at_least`` most recently refreshed
        ones when fewer were; with ``min_version``, only prompts holding items that new
        (``eligible``, in refresh order, when the caller has listed them already)."""
        if eligible is None:
            eligible = [pid for pid in self.by_prompt if self._holds_version(pid, min_version)]
        fresh = [pid for pid in eligible if pid in self._fresh]
        if len(fresh) >= at_least:
            return fresh
        return eligible[-at_least:]

    def _holds_version(self, pid: Hashable, min_version: int | None) -> bool:
        """Whether the prompt holds an item of ``min_version`` or newer (groups are sorted by
        version, so its last item is its newest)."""
        return min_version is None or self.by_prompt[pid][-1].version >= min_version

    @_locked
    def count_prompts_since(self, min_version: int) -> int:
        """Prompts holding at least one item of ``min_version`` or newer."""
        return sum(g[-1].version >= min_version for g in self.by_prompt.values())

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

    def _draw_items(
        self, items: list[StoredTrajectory], count: int, inv_temp: float
    ) -> list[StoredTrajectory]:
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

    @_locked
    def sample(
        self,
        num_prompts: int,
        per_prompt: int,
        min_version: int | None = None,
    ) -> tuple[list[list[Trajectory]], list[bool]]:
        """P groups of exactly K trajectories, and for each group whether it is most-on-policy.

        ``min_version``: a bound on age. Only items of that version or newer are eligible, MOP
        and off-policy draws alike, and only prompts holding such items; so no trajectory in the
        batch is older than ``min_version``.

        Raises ValueError when fewer than ``num_prompts`` prompts are eligible.
        """
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
                pid = self._draw_prompt(mop, self._mop_drawn, chosen)
                self._mop_since_publish.add(pid)
                group = self.by_prompt[pid]
                newest = [t for t in group if t.version == group[-1].version]
                batch.append(self._unpacked(self._draw_items(newest, per_prompt, 0.0)))
                is_mop.append(True)
            else:
                pid = self._draw_prompt(everyone, self._any_drawn, chosen)
                recent = [t for t in self.by_prompt[pid] if t.version >= oldest]
                batch.append(self._unpacked(self._draw_items(recent, per_prompt, self.inv_temp)))
                is_mop.append(False)
            chosen.add(pid)
        return batch, is_mop

    def _unpacked(self, items: list[StoredTrajectory]) -> list[Trajectory]:
        """A group's drawn items as the records the searchers sent (a new record per draw). Each
        distinct item is counted once, however often the group drew it: ``num_drawn`` counts
        (item, step) pairs, ``num_drawn_first`` items no step had trained on before."""
        distinct = {id(t): t for t in items}.values()
        for t in distinct:
            self.num_drawn_first += t.draws == 0
            t.draws += 1
        self.num_drawn += len(distinct)
        return [t.trajectory() for t in items]

    # ------------------------------------------------------------------ stats and state

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
            "buffer/fresh": float(len(self._fresh)),
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

    @_locked
    def state_dict(self) -> dict:
        """Plain Python containers and strings only, so it loads with
        ``torch.load(weights_only=True)`` without unpickling arbitrary objects. Items keep their
        packed bytes (as latin-1 strings, ``_text``); a prompt's are one object, which pickle
        writes once."""
        return {
            "format": STATE_FORMAT,
            "packing": _packing(),
            "capacity": self.capacity,
            "mop_prob": self.mop_prob,
            "inv_temp": self.inv_temp,
            "rng": _rng_state_to_list(self.rng.getstate()),
            "num_added": self.num_added,
            "num_drawn": self.num_drawn,
            "num_drawn_first": self.num_drawn_first,
            "newest_version": self.newest_version,
            "groups": [[pid, _columns(g)] for pid, g in self.by_prompt.items()],
            "fresh": [pid for pid in self.by_prompt if pid in self._fresh],
            "mop_drawn": [pid for pid in self.by_prompt if pid in self._mop_drawn],
            "mop_since_publish": [pid for pid in self.by_prompt if pid in self._mop_since_publish],
            "any_drawn": [pid for pid in self.by_prompt if pid in self._any_drawn],
        }

    @_locked
    def load_state_dict(self, state: dict) -> None:
        """A state of ``state_dict``."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"ReplayBuffer.load_state_dict: state format {state.get('format')}, this code "
                f"reads format {STATE_FORMAT}"
            )
        if state["packing"] != _packing():
            raise ValueError(
                f"ReplayBuffer.load_state_dict: the state was packed as {state['packing']}, "
                f"this machine packs {_packing()}"
            )
        self.capacity, self.mop_prob = state["capacity"], state["mop_prob"]
        self.inv_temp = state["inv_temp"]
        self.rng.setstate(_rng_state_from_list(state["rng"]))
        self.num_added, self.newest_version = state["num_added"], state["newest_version"]
        self.num_drawn, self.num_drawn_first = state["num_drawn"], state["num_drawn_first"]
        self.by_prompt = {
            _key(pid): _from_columns(_key(pid), columns) for pid, columns in state["groups"]
        }
        self._responses = {pid: {t.response: t for t in g} for pid, g in self.by_prompt.items()}
        self._per_version = Counter(t.version for g in self.by_prompt.values() for t in g)
        self._fresh = {_key(p) for p in state["fresh"]}
        self._mop_drawn = {_key(p) for p in state["mop_drawn"]}
        self._mop_since_publish = {_key(p) for p in state["mop_since_publish"]}
        self._any_drawn = {_key(p) for p in state["any_drawn"]}


# A group's items as one record of columns, packed (``_columns``), so that the unpickler of
# torch.load(weights_only=True), written in Python, handles a few objects per prompt rather than
# a few hundred per trajectory.
STATE_FORMAT = 6
_COUNT_TYPE = "q"  # of versions and byte lengths in a state


def _text(packed: bytes | None) -> str | None:
    """Packed bytes as a latin-1 string for a state. torch.save pickles bytes as a latin-1
    string anyway (pickle protocol 2), except empty bytes, which it writes as a call of
    ``bytes`` that torch.load(weights_only=True) refuses; an empty response or per-token list
    is real (a response of only EOS)."""
    return None if packed is None else packed.decode("latin-1")


def _bytes(text: str | None) -> bytes | None:
    """``_text`` undone."""
    return None if text is None else text.encode("latin-1")


def _columns(group: list[StoredTrajectory]) -> dict:
    """A group's items as one record of columns; field names as in Trajectory, the per-token
    log-probs one mapping (or None) per item; packed bytes as ``_text``. A behaviour log-prob
    not recorded is stored as NaN (a recorded one never is)."""
    return {
        "prompt_tokens": _text(group[0].prompt),
        "response_tokens": _text(b"".join(t.response for t in group)),
        "response_bytes": _text(pack([len(t.response) for t in group], _COUNT_TYPE)),
        "reward": _text(pack([t.reward for t in group], FLOAT_TYPE)),
        "ref_logprob": _text(pack([t.ref_logprob for t in group], FLOAT_TYPE)),
        "version": _text(pack([t.version for t in group], _COUNT_TYPE)),
        "ref_version": _text(pack([t.ref_version for t in group], _COUNT_TYPE)),
        "draws": _text(pack([t.draws for t in group], _COUNT_TYPE)),
        "behaviour_logprob": _text(
            pack([_nan_if_none(t.behaviour_logprob) for t in group], FLOAT_TYPE)
        ),
        "token_logprobs": [
            None
            if t.packed_token_logprobs is None
            else {k: _text(v) for k, v in t.packed_token_logprobs.items()}
            for t in group
        ],
    }


def _from_columns(prompt_id: Hashable, columns: dict) -> list[StoredTrajectory]:
    """The items of a record of ``_columns``, sharing one prompt record (as ``add`` does)."""
    sizes = unpack(_bytes(columns["response_bytes"]), _COUNT_TYPE)
    rewards = unpack(_bytes(columns["reward"]), FLOAT_TYPE)
    ref_logprobs = unpack(_bytes(columns["ref_logprob"]), FLOAT_TYPE)
    versions = unpack(_bytes(columns["version"]), _COUNT_TYPE)
    # A state written before the reference had a version holds none: the run's own p_ref.
    ref_versions = [0] * len(sizes)
    if "ref_version" in columns:
        ref_versions = unpack(_bytes(columns["ref_version"]), _COUNT_TYPE)
    draws = unpack(_bytes(columns["draws"]), _COUNT_TYPE)
    behaviour = [
        None if math.isnan(x) else x
        for x in unpack(_bytes(columns["behaviour_logprob"]), FLOAT_TYPE)
    ]
    token_logprobs = [
        None if per_item is None else {k: _bytes(v) for k, v in per_item.items()}
        for per_item in columns["token_logprobs"]
    ]
    columns_read = (rewards, ref_logprobs, versions, ref_versions, draws, behaviour)
    lengths = {len(column) for column in columns_read}
    if lengths | {len(token_logprobs)} != {len(sizes)}:
        raise ValueError(f"ReplayBuffer.load_state_dict: columns of unequal length, {prompt_id!r}")
    prompt = _bytes(columns["prompt_tokens"])
    responses = _bytes(columns["response_tokens"])
    items = []
    start = 0
    for i, size in enumerate(sizes):
        items.append(
            StoredTrajectory(
                prompt_id,
                prompt,
                responses[start : start + size],
                rewards[i],
                ref_logprobs[i],
                versions[i],
                token_logprobs[i],
                behaviour[i],
                draws[i],
                ref_versions[i],
            )
        )
        start += size
    if start != len(responses):
        raise ValueError(f"ReplayBuffer.load_state_dict: response bytes of {prompt_id!r} corrupt")
    return items


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _packing() -> list:
    """How ``pack`` lays numbers out here: typecodes, their sizes, and the byte order."""
    codes = [TOKEN_TYPE, FLOAT_TYPE, _COUNT_TYPE]
    return codes + [array(code).itemsize for code in codes] + [sys.byteorder]


def _key(pid):
    """Prompt ids round-trip through lists; tuples come back as lists and must be hashable."""
    return tuple(pid) if isinstance(pid, list) else pid


def _rng_state_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
