"""The replay buffer beyond the learner's tests: sampling, the realised m, packed storage, state."""

from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest
import torch

from buffer import ReplayBuffer, StoredTrajectory, Trajectory
from engines import WeightStore
from plumbing.checkpoint import buffer_state, load_buffer_state
from tba import TBAConfig
from test_tba import traj
from trainer import Trainer


def load_into(buffer: ReplayBuffer, state: dict) -> None:
    load_buffer_state(buffer, state, StoredTrajectory)


def test_buffer_shapes_and_sampling_with_replacement():
    buf = ReplayBuffer(capacity=10, seed=0)
    for pid in range(5):
        for j in range(3):  # fewer items than K: sampled with replacement
            buf.add(traj(pid, [pid, j]))
    groups, is_mop = buf.sample(4, 8)
    assert len(groups) == 4 and all(len(g) == 8 for g in groups) and len(is_mop) == 4
    assert len({g[0].prompt_id for g in groups}) == 4  # distinct prompts within a step
    assert all(len({t.prompt_id for t in g}) == 1 for g in groups)
    with pytest.raises(ValueError, match="prompts asked"):
        buf.sample(6, 2)


def test_buffer_counts_what_the_steps_trained_on():
    """stats() says how many trajectories were generated, the share of them some step trained
    on, and by how many steps each of those was trained; an item a group draws twice counts
    once, and a duplicate response replaces its item with an untrained one."""
    buf = ReplayBuffer(capacity=4, mop_prob=1.0, seed=0)
    for pid in (0, 1):
        for j in (2, 3):
            buf.add(traj(pid, [pid, j]))
    buf.sample(1, 2)  # one prompt's two items
    buf.sample(1, 3)  # the other prompt's (a cycle of the prompts), one of them twice
    stats = buf.stats()
    assert (buf.num_drawn, buf.num_drawn_first) == (4, 4)
    assert stats["buffer/generated"] == 4
    assert stats["buffer/trained_frac"] == 1.0 and stats["buffer/reuse"] == 1.0
    buf.sample(2, 2)  # every item again
    assert (buf.num_drawn, buf.num_drawn_first) == (8, 4)
    buf.add(traj(0, [0, 2]))  # a duplicate: its newest copy, which no step trained on
    buf.sample(2, 2)
    stats = buf.stats()
    assert (buf.num_drawn, buf.num_drawn_first) == (12, 5)
    assert stats["buffer/trained_frac"] == 5 / 5 and stats["buffer/reuse"] == 12 / 5


@pytest.fixture
def one_torch_thread():
    """One torch thread in this process for the test, as run_tba gives its trainer on a small
    CPU (``TBAConfig.threads_per_process``); the previous count afterwards. On the tiny model's
    matmuls a second thread only spins, and when the other core is busy 40 of this file's
    trainer steps took 149 s with two threads and 3.9 s with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_mop_fraction_is_realised_at_the_paper_shape(tiny_model_dir):
    """Simulated searchers at the paper's shape feed the real Trainer as run_tba does: 3
    searchers of different speeds (a batch of 3 prompts x 24 every 1, 1.7 and 2.9 trainer
    steps), P = 7 prompts of K = 20 per step, a sync every 2 steps. Often fewer than P prompts
    are fresh since the publish; the realised most-on-policy fraction is still m."""
    cfg = TBAConfig(
        model=tiny_model_dir,
        dtype="float32",
        num_searchers=3,
        searcher_devices="cpu",
        trainer_device="cpu",
        lr=1e-4,
        max_new_tokens=4,
        initial_samples=200,
        # One forward pass a step: which items a step draws (and so m) does not depend on the
        # passes (test_trainer's micro-batch test); one pass costs half the time of seven here.
        micro_batch_size=0,
    )
    trainer = Trainer(cfg, torch.device("cpu"), pad_id=0, eos_id=1)
    store = WeightStore(list(trainer.model.named_parameters()), torch.float32, torch.device("cpu"))
    rng = random.Random(0)
    periods, next_prompt = (1.0, 1.7, 2.9), 0
    due, held = [0.0, 0.0, 0.0], [0, 0, 0]  # next delivery (in steps) and weights version held
    mop_fracs, short_steps = [], 0
    for step in range(200):
        for s in range(3):
            while due[s] <= step:  # deliver a batch made with the weights held, then load newer
                for _ in range(3):
                    for _ in range(24):
                        trainer.buffer.add(
                            Trajectory(
                                next_prompt % 400,
                                [5, 6],
                                [rng.randrange(4, 40) for _ in range(3)] + [1],
                                float(rng.random() < 0.4),
                                -9.0,
                                held[s],
                            )
                        )
                    next_prompt += 1
                due[s] += periods[s]
                held[s] = store.version()
        if not trainer.can_step():
            continue
        short_steps += len(trainer.buffer.fresh) < cfg.prompts_per_step
        metrics = trainer.train_step()
        mop_fracs.append(metrics["async/mop_frac"])
        if trainer.step % cfg.publish_every == 0:
            trainer.publish(store)
    realised = sum(mop_fracs) / len(mop_fracs)
    assert len(mop_fracs) > 150 and short_steps > 20
    assert abs(realised - cfg.mop_prob) < 0.03, f"realised m {realised:.3f}"


def test_buffer_inv_temp_zero_is_uniform_and_large_picks_best():
    uniform = ReplayBuffer(capacity=10, mop_prob=0.0, inv_temp=0.0, seed=2)
    for j in range(10):
        uniform.add(traj("p", [j], reward=float(j)))
    counts = [0] * 10
    for _ in range(3000):
        for t in uniform.sample(1, 2)[0][0]:
            counts[t.response_tokens[0]] += 1
    freqs = [c / 6000 for c in counts]
    assert max(abs(f - 0.1) for f in freqs) < 0.025, freqs

    greedy = ReplayBuffer(capacity=10, mop_prob=0.0, inv_temp=1000.0, seed=3)
    for j in range(10):
        greedy.add(traj("p", [j], reward=float((7 * j) % 10)))  # rewards 0..9, shuffled
    for _ in range(50):
        picked = sorted(t.reward for t in greedy.sample(1, 3)[0][0])
        assert picked == [7.0, 8.0, 9.0]


# Pearson's chi-square with 3 degrees of freedom (4 items) exceeds 30.7 with probability 1e-6.
CHI2_3DOF_1E6 = 30.7


@pytest.mark.parametrize("inv_temp", [1.0, 2.5])
def test_buffer_draws_a_short_group_with_replacement_by_softmax_of_reward(inv_temp):
    """A replayed prompt holding fewer items than K (the TL;DR preset's inv_temp = 1): its K
    items are drawn with replacement, each with probability softmax(reward * inv_temp). The
    counts of 16,000 draws against that distribution: honest seeds give chi-square 0-11 here;
    a temperature 20% off gives about 300, uniform draws thousands."""
    rewards = [0.0, 0.5, 1.0, 2.0]
    buf = ReplayBuffer(capacity=8, mop_prob=0.0, inv_temp=inv_temp, seed=11)
    for j, reward in enumerate(rewards):
        buf.add(traj("p", [j], reward=reward))
    counts = [0] * len(rewards)
    for _ in range(2000):
        (group,), (mop,) = buf.sample(1, 8)
        assert not mop and len(group) == 8
        for t in group:
            counts[t.response_tokens[0]] += 1
    weights = [math.exp(inv_temp * r) for r in rewards]
    expected = [sum(counts) * w / sum(weights) for w in weights]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi2 < CHI2_3DOF_1E6, f"counts {counts}, softmax(reward * {inv_temp}) expects {expected}"


def test_buffer_late_duplicate_of_an_older_version_replaces_its_copy_in_version_order():
    """A response that arrives again from an older version after its newer copy (a searcher
    still on older weights delivers late): the later arrival replaces the copy (the newest
    reward, log-probs and version win, buffer.py's rule) and takes its version's place, so the
    group stays ordered by version: the most-on-policy items are the newest version's, the
    late copy is evicted as the old item it is, and the per-version counts follow."""
    buf = ReplayBuffer(capacity=3, mop_prob=1.0, seed=0)
    buf.add(traj("p", [10], reward=0.0, version=2))
    buf.add(traj("p", [11], reward=0.0, version=4))
    buf.add(traj("p", [12], reward=1.0, version=5))
    buf.add(traj("p", [12], reward=0.5, version=3))  # [12] again, late, from version 3
    group = buf.by_prompt["p"]
    assert [(t.response_tokens, t.version, t.reward) for t in group] == [
        ([10], 2, 0.0),
        ([12], 3, 0.5),
        ([11], 4, 0.0),
    ]
    assert (len(buf), buf.num_added, buf.newest_version) == (3, 4, 5)
    assert buf.stats(5)["buffer/age_mean"] == pytest.approx((3 + 2 + 1) / 3)
    (drawn,), (mop,) = buf.sample(1, 2)  # most-on-policy: the version-4 item, twice
    assert mop and [t.response_tokens for t in drawn] == [[11], [11]]
    buf.add(traj("p", [13], version=6))  # full: the oldest goes, [10]
    buf.add(traj("p", [14], version=7))  # and then the late copy
    assert [(t.response_tokens, t.version) for t in buf.by_prompt["p"]] == [
        ([11], 4),
        ([13], 6),
        ([14], 7),
    ]
    buf.add(traj("p", [12], version=8))  # evicted, so a new item, not a replacement
    assert [t.response_tokens for t in buf.by_prompt["p"]] == [[13], [14], [12]]
    assert buf.stats(8)["buffer/age_mean"] == pytest.approx((2 + 1 + 0) / 3)


def test_buffer_state_round_trip(tmp_path):
    buf = ReplayBuffer(capacity=5, mop_prob=0.5, inv_temp=2.0, seed=4)
    for pid in range(6):
        for j in range(4):
            buf.add(traj(pid, [pid, j], reward=random.Random(j).random(), version=pid % 3))
    buf.sample(2, 3)
    torch.save(buffer_state(buf), tmp_path / "buf.pt")
    copy = ReplayBuffer()
    load_into(copy, torch.load(tmp_path / "buf.pt", weights_only=True))
    assert copy.stats(5) == buf.stats(5)
    for _ in range(5):
        a, b = buf.sample(3, 4), copy.sample(3, 4)
        assert [[t.response_tokens for t in g] for g in a[0]] == [
            [t.response_tokens for t in g] for g in b[0]
        ]
        assert a[1] == b[1]


def test_buffer_state_round_trips_per_token_log_probs(tmp_path):
    """The per-token lists a loss asked for (GRPO's) survive a checkpoint (weights_only); an
    item without them loads with None."""
    buf = ReplayBuffer(capacity=4, seed=1)
    lists = {"behaviour": [-0.5, -1.5], "reference": [-0.25, -1.0]}
    buf.add(Trajectory(0, [5], [7, 8, 1], 1.0, -2.0, 0, lists))
    buf.add(traj(1, [9, 1]))
    torch.save(buffer_state(buf), tmp_path / "buf.pt")
    copy = ReplayBuffer()
    load_into(copy, torch.load(tmp_path / "buf.pt", weights_only=True))
    assert copy.by_prompt[0][0].token_logprobs == lists
    assert copy.by_prompt[1][0].token_logprobs is None


def test_buffer_keeps_each_items_reference_version(tmp_path):
    """Trajectory.ref_version (which reference scored ref_logprob) comes back from sample and
    from a checkpoint; a duplicate's newer copy brings its own; a state written before the
    field existed loads with 0, the run's own reference."""
    buf = ReplayBuffer(capacity=4, seed=1)
    buf.add(dataclasses.replace(traj(0, [7, 1]), ref_version=50))
    buf.add(traj(1, [8, 1]))
    buf.add(dataclasses.replace(traj(1, [8, 1], version=3), ref_version=100))  # replaces it
    assert sorted(t.ref_version for g in buf.sample(2, 1)[0] for t in g) == [50, 100]
    state = buffer_state(buf)
    torch.save(state, tmp_path / "buf.pt")
    copy = ReplayBuffer()
    load_into(copy, torch.load(tmp_path / "buf.pt", weights_only=True))
    assert [copy.by_prompt[p][0].ref_version for p in (0, 1)] == [50, 100]
    for _, columns in state["groups"]:
        del columns["ref_version"]
    older = ReplayBuffer()
    load_into(older, state)
    assert [older.by_prompt[p][0].ref_version for p in (0, 1)] == [0, 0]


class ListLayoutBuffer(ReplayBuffer):
    """The slow reference: ReplayBuffer.add as it was before items were packed (Trajectory
    records holding lists, deduplication by tuples, a sort per add), with the same sampling."""

    def add(self, traj: Trajectory) -> None:
        group = self.by_prompt.pop(traj.prompt_id, [])
        self.by_prompt[traj.prompt_id] = group
        self.fresh.add(traj.prompt_id)
        if group:
            traj = dataclasses.replace(traj, prompt_tokens=group[0].prompt_tokens)
        key = tuple(traj.response_tokens)
        gone = [t for t in group if tuple(t.response_tokens) == key]
        group[:] = [t for t in group if tuple(t.response_tokens) != key] + [traj]
        group.sort(key=lambda t: t.version)
        gone += group[: -self.capacity]
        del group[: -self.capacity]
        for t in gone:
            self._per_version[t.version] -= 1
        self._per_version[traj.version] += 1
        self.num_added += 1
        self.newest_version = max(self.newest_version, traj.version)

    def _unpacked(self, items: list) -> list[Trajectory]:
        # the same counts, of records that have no counter: by identity (each record kept
        # referenced, so that no identity is reused)
        draws = self.__dict__.setdefault("draws_of", {})
        for t in {id(t): t for t in items}.values():
            held, count = draws.get(id(t), (t, 0))
            self.num_drawn_first += count == 0
            draws[id(t)] = (held, count + 1)
            self.num_drawn += 1
        return list(items)


def test_buffer_checkpoint_with_empty_responses_loads_weights_only(tmp_path):
    """An empty response and empty per-token lists (a response of only an unscored EOS) survive
    torch.save and torch.load(weights_only=True): pickle writes empty bytes as a call that the
    weights-only unpickler refuses."""
    buffer = ReplayBuffer(capacity=4, seed=0)
    empty = {"behaviour": [], "reference": []}
    buffer.add(Trajectory("p", [5, 6], [], 1.0, -0.5, 3, token_logprobs=empty))
    lists = {"behaviour": [-0.1, -0.2], "reference": [-0.3, -0.4]}
    buffer.add(Trajectory("p", [5, 6], [7, 2**31 - 1], 0.0, -1.5, 4, lists))
    torch.save(buffer_state(buffer), tmp_path / "buffer.pt")
    loaded = ReplayBuffer()
    load_into(loaded, torch.load(tmp_path / "buffer.pt", weights_only=True))
    assert loaded.sample(1, 2)[0] == buffer.sample(1, 2)[0]
    assert sorted(len(t.response_tokens) for t in loaded.sample(1, 2)[0][0]) == [0, 2]


def test_buffer_packed_layout_draws_what_the_list_layout_drew():
    """Packed items change no draw: against the list layout, the same seed gives the same
    prompts, items and flags through duplicates, out-of-order versions, evictions, syncs and
    every kind of sample, and the same stored groups."""
    rng = random.Random(0)
    kwargs = dict(capacity=5, mop_prob=0.6, inv_temp=1.5, seed=7)
    packed, reference = ReplayBuffer(**kwargs), ListLayoutBuffer(**kwargs)
    version = 0
    draws = 0
    for i in range(1500):
        version += rng.random() < 0.02
        # a few short responses over a small vocabulary: many duplicates
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        t = Trajectory(
            rng.randrange(40),
            [rng.randrange(9), 70000],
            tokens,
            round(rng.uniform(-2, 2), 1),
            -rng.random(),
            max(0, version - rng.randrange(3)),  # some arrive out of order
        )
        packed.add(t)
        reference.add(t)
        if i % 200 == 199:
            packed.mark_published()
            reference.mark_published()
        if i % 10 == 9 and len(packed.by_prompt) >= 4:
            for shape, bound in (
                ((4, 3), {}),
                ((4, 3), {"min_version": version - 1}),
                ((2, 2), {"min_version": version}),
            ):
                try:
                    drawn = packed.sample(*shape, **bound)
                except ValueError as error:  # too few eligible prompts: the same for both
                    with pytest.raises(ValueError, match=re.escape(str(error))):
                        reference.sample(*shape, **bound)
                    continue
                assert drawn == reference.sample(*shape, **bound)
                draws += 1
    assert draws > 300
    assert list(packed.by_prompt) == list(reference.by_prompt)
    for pid, group in packed.by_prompt.items():
        assert [t.trajectory() for t in group] == reference.by_prompt[pid]
    assert packed.stats(version) == reference.stats(version)


def test_buffer_packs_tokens_exactly_and_shares_a_prompt():
    buf = ReplayBuffer(capacity=3)
    tokens = [0, 1, 50256, 151_000, 2**31 - 1]
    logprobs = [-0.1, -1e-300, -123.456789012345, -0.0, -7.0]
    lists = {"behaviour": logprobs, "reference": logprobs[::-1]}
    buf.add(Trajectory("p", [3, 151_646], tokens, 1.0, -2.5, 4, lists))
    buf.add(Trajectory("p", [9, 9, 9], [5], 0.0, -1.0, 4))  # the group's first prompt is kept
    first, second = buf.by_prompt["p"]
    assert first.response_tokens == tokens and first.token_logprobs == lists
    assert second.token_logprobs is None
    assert first.prompt is second.prompt and second.prompt_tokens == [3, 151_646]
    assert len(first.response) == 4 * len(tokens)  # int32, not Python ints
    (group,), _ = buf.sample(1, 3, min_version=4)
    assert all(isinstance(t, Trajectory) for t in group)
    assert Trajectory("p", [3, 151_646], tokens, 1.0, -2.5, 4, lists) in group
    with pytest.raises(OverflowError):
        buf.add(Trajectory("q", [1], [2**31], 0.0, 0.0, 0))


def test_buffer_packed_state_round_trips(tmp_path):
    """A packed state loads (weights_only) to the same items (behaviour log-probs, recorded or
    not, included), prompts shared, and draws as the list layout does; a state of another
    format is a clear error."""
    buf = ReplayBuffer(capacity=4, mop_prob=0.5, inv_temp=1.0, seed=2)
    reference = ListLayoutBuffer(capacity=4, mop_prob=0.5, inv_temp=1.0, seed=2)
    rng = random.Random(1)
    for i in range(300):
        logprobs = [rng.uniform(-5, 0) for _ in range(3)] if i % 3 else None
        t = Trajectory(
            (i % 17, "x") if i % 2 else i % 17,  # tuple ids come back as tuples
            [i % 17, 70000],
            [rng.randrange(100_000) for _ in range(rng.randint(1, 4))],
            rng.random(),
            -rng.random(),
            i // 40,
            None if logprobs is None else {"behaviour": logprobs, "reference": logprobs},
            -rng.uniform(0, 300) if i % 5 else None,  # the behaviour log-prob, when recorded
        )
        buf.add(t)
        reference.add(t)
    buf.sample(3, 2)
    reference.sample(3, 2)
    torch.save(buffer_state(buf), tmp_path / "buf.pt")
    expected = [reference.sample(3, 2) for _ in range(5)]
    loaded = ReplayBuffer()
    load_into(loaded, torch.load(tmp_path / "buf.pt", weights_only=True))
    assert list(loaded.by_prompt) == list(buf.by_prompt)
    for pid, group in buf.by_prompt.items():
        assert [t.trajectory() for t in loaded.by_prompt[pid]] == [t.trajectory() for t in group]
        assert all(t.prompt is loaded.by_prompt[pid][0].prompt for t in loaded.by_prompt[pid])
    assert loaded.stats(9) == buf.stats(9)
    assert [loaded.sample(3, 2) for _ in range(5)] == expected
    again = loaded.by_prompt[5][-1].trajectory()  # a loaded item's duplicate replaces it
    loaded.add(dataclasses.replace(again, reward=9.0, version=20))
    assert len(loaded) == len(buf) and loaded.by_prompt[5][-1].reward == 9.0
    other = buffer_state(buf)
    other["format"] = 3  # the format before the behaviour log-prob
    with pytest.raises(ValueError, match="state of format 3"):
        load_into(ReplayBuffer(), other)
