"""The weight group's two sides (extensions/weight_group.py says what the group is): in each
searcher actor, ``GroupWeightSource``, which receives each version into a staging copy while the
searcher generates and hands the engine only a complete one; in the driver, ``GroupSender``, a
thread that forms the group, sends each new version in rounds, and gives a failed round up."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from engines import WeightStore
from extensions.group_store import StoreServer
from extensions.weight_group import (
    CONTROL_S,
    Announce,
    GroupPlan,
    StoreSnapshot,
    WeightGroup,
    WeightGroupError,
    ask,
)
from plumbing.processes import SearcherFailed


class GroupWeightSource:
    """searcher.WeightSource over the weight group, in a searcher actor. ``start`` runs a thread
    of its own that follows the board (plans, announcements) and receives each version into a
    staging copy of the weights while the searcher generates; ``load_into`` hands the engine
    the newest complete version between generate calls, so no version is ever half-loaded.

    ``version()`` is the newest version complete in the staging copy; while the copy is being
    overwritten, the version the engine already holds (nothing newer to load yet). Names,
    shapes and dtypes (``layout``) travel once, with the actor's construction."""

    POLL_S = 1.0  # the longest poll of the board: a receiver's heartbeat

    def __init__(
        self,
        board,
        layout: list,
        dtype: torch.dtype,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
    ):
        self.board = board
        self.layout = layout
        self.dtype = dtype
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.numel = sum(math.prod(shape) for _, _, shape in layout)
        self.thread: threading.Thread | None = None  # the rest is made in start()

    def start(self, rank: int, incarnation: str) -> None:
        """In the actor's process: the staging copy, and the receiver thread."""
        import ray

        ctx = ray.get_runtime_context()
        self.rank = rank
        self.who = dict(
            incarnation=incarnation,
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
        )
        self.staging = self._new_staging()
        self.cond = threading.Condition()  # held while the engine copies from the staging copy
        self.staged: tuple[int, float] | None = None  # (version, probe) complete in staging
        self.held: tuple[int, float] = (-1, 0.0)  # what load_into last handed the engine
        self.group: WeightGroup | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tba-weight-receiver", daemon=True)
        self.thread.start()

    def version(self) -> int:
        if self.error is not None:
            raise RuntimeError(f"searcher {self.rank}: the weight receiver died") from self.error
        staged = self.staged
        return staged[0] if staged is not None else self.held[0]

    def load_into(
        self, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None]
    ) -> tuple[int, float]:
        with self.cond:
            # version() saw a complete version that a new receive has begun to overwrite
            # since: wait for that one (rare; one receive at most).
            got = self.cond.wait_for(
                lambda: self.staged is not None or self.error is not None, self.timeout_s
            )
            if not got or self.error is not None:
                raise TimeoutError(f"searcher {self.rank}: no complete version to load")
            flat = self.staging.view(self.dtype)
            views = []
            for name, offset, shape in self.layout:
                views.append((name, flat[offset : offset + math.prod(shape)].view(shape)))
            load_fn(views)
            self.held = self.staged
            return self.held

    def _run(self) -> None:
        after = -1
        try:
            while True:
                poll = self.board.poll.remote(self.rank, self.who, after, self.POLL_S)
                command = ask(poll, self.POLL_S + CONTROL_S)
                if command is None:
                    continue
                after = command.seq
                if isinstance(command, GroupPlan):
                    error = self._join(command)
                elif self.group is not None and self.group.epoch == command.epoch:
                    error = self._receive(command)
                else:
                    continue
                if error is not False:  # False: not a member of this plan
                    self.board.report.remote(
                        self.rank, self.who["incarnation"], command.round, error
                    )
        except BaseException as exc:  # noqa: BLE001 (raised on the searcher's thread)
            self.error = exc
            with self.cond:
                self.cond.notify_all()

    def _join(self, plan: GroupPlan) -> str | bool | None:
        """Leave the old group; join ``plan``'s if it names this incarnation. The error, None
        when joined, False when not a member."""
        if self.group is not None:
            self.group.close()
            self.group = None
        group_rank = plan.members.get((self.rank, self.who["incarnation"]))
        if group_rank is None:
            return False
        try:
            self.group = WeightGroup(
                self.backend,
                plan.host,
                plan.port,
                plan.secret,
                plan.epoch,
                group_rank,
                plan.world,
                self.timeout_s,
                self.who["node_ip"],
                abandon=functools.partial(self._closed, plan.epoch),
            )
        except WeightGroupError as exc:
            return str(exc)
        return None

    def _receive(self, announce: Announce) -> str | None:
        """The announced version into the staging copy; then, if the driver says its bytes
        were one version (``flag`` 1: the store's seqlock stayed put meanwhile), it is the newest
        complete one; else (0: a publish overlapped) it is not staged, and the next round brings
        the newer version. The error, or None."""
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            self.staged = None  # waits for a load in progress; from here it is being written
        try:
            self.group.broadcast(self.staging, self.bucket_bytes, deadline)
            if self.group.flag(0.0, deadline) == 1.0:
                with self.cond:
                    self.staged = (announce.version, announce.probe)
                    self.cond.notify_all()
            self.group.flag(1.0, deadline, total=True)  # tell the driver it arrived
        except WeightGroupError as exc:
            self.group.close()
            self.group = None
            with self.cond:
                # A bucket given up may still write into the copy: receive into a new one. A
                # staged copy is whole (every bucket landed before the flag) and stays: a new
                # copy behind it would hand the engine bytes no version holds.
                if self.staged is None:
                    self.staging = self._new_staging()
            return str(exc)
        return None

    def _new_staging(self) -> torch.Tensor:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        pinned = self.backend == "nccl"  # the GPU buffers' copies to and from it are DMA
        return torch.empty(self.numel * itemsize, dtype=torch.uint8, pin_memory=pinned)

    def _closed(self, epoch: int, deadline: float) -> str | None:
        """The driver gave group ``epoch`` up (WeightGroup's ``abandon``), asked by the deadline."""
        try:
            closed = ask(self.board.is_closed.remote(epoch), deadline - time.monotonic())
        except TimeoutError:
            return "the board did not answer by the deadline"
        return "the driver closed the group" if closed else None


# ----------------------------------------------------------------------------- the driver


class GroupSender:
    """The driver's side of the weight group, on a thread of its own: it never waits for the
    trainer, and the intake thread never waits for it. Each round:

    1. Membership: the searchers whose receivers polled the board lately, less those killed as
       stragglers. When it differs from the group's (a searcher restarted, or one is gone),
       a new incarnation of the group is formed: a fresh secret on the store (the old one's
       keys and clients dropped), the plan on the board, the rendezvous under the deadline.
    2. The newest version the store holds, if the group lacks it (all of it: a searcher
       that just joined gets a full copy): announced on the board, broadcast in buckets from
       the store itself (a CUDA store over gloo: from a host snapshot, ``StoreSnapshot``),
       then a flag saying whether the store's seqlock stayed put meanwhile (else the bytes
       may mix two versions, and the receivers drop them), then a sum that tells the driver
       every member has it. While it waits, the driver asks Ray every quarter second whether
       each member's process is still the one it runs, and gives the round up if not.
    3. On an error, a member gone or the deadline (``timeout_s``): the group is closed on
       the board, and its other members give their part up within a quarter second (they
       ask too); a member that says how its part ended is a survivor, one whose process Ray
       no longer runs is gone (Ray restarts it); one that says nothing by the deadline is a
       straggler, handed to ``kill`` (Ray restarts it, and it joins at a later round).
       ``MAX_FAILED_ROUNDS`` failures in a row stop the run (``error``, raised by the pool).

    "Alive", before a round: polled the board within ``POLL_S`` + 2 s, and its process is the
    one Ray runs for that searcher now (``pids(timeout_s)``: searcher rank -> the pid of its
    live actor, from Ray's GCS), so that a rendezvous never waits for a process already dead.
    Every call to the board and the GCS in a round ends by the round's deadline. ``stop`` sets
    ``stopping``, which every wait asks about, and joins the thread, which closes the group
    itself on its way out: the group is never closed under a round."""

    MAX_FAILED_ROUNDS = 3
    BOARD_EVERY_S = 0.25  # how often membership is read from the board
    REPORT_S = 2.0  # past the deadline, for survivors to say how their part ended
    # A member silent this long past its longest poll is left out of the next group (a hung
    # process would hold every round to the deadline); it joins again when it polls again.
    HEARTBEAT_GRACE_S = 2.0

    def __init__(
        self,
        store: WeightStore,
        board,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
        host: str,
        pids: Callable[[float], dict[int, int]],
        kill: Callable[[int, dict, str], None],
        log: Callable[[str], None] = print,
    ):
        self.store = store
        self.board = board
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host
        self.pids = pids
        self.kill = kill
        self.log = log
        self.server = StoreServer(host)  # the group's address only; a port the OS picks
        self.snapshot = StoreSnapshot(store) if store.flat.is_cuda and backend == "gloo" else None
        self.stream = torch.cuda.Stream(store.flat.device) if store.flat.is_cuda else None
        self.epoch = 0
        self.round = 0  # the rounds that did something
        self.sending: int | None = None  # the version of the round under way
        self.group: WeightGroup | None = None
        self.members: dict[int, dict] = {}  # searcher rank -> what the board said, in the group
        self.sent = -1  # the version every member of the group holds
        self.status: dict[int, dict] = {}
        self.status_at = 0.0
        self.checked: dict | None = None  # the status self.running was read for
        self.running: dict[int, int] = {}
        self.killed: set[str] = set()  # incarnations killed as stragglers
        self.failed_rounds = 0  # in a row
        self.rebuilds = 0
        self.seconds: list[float] = []  # per version: announced until every member had it
        self.error: BaseException | None = None
        self.close_wait_s = 10.0  # for the group's threads, as the thread ends
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tba-weight-sender", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait for it (its waits ask ``stopping`` every quarter second, its
        calls to Ray end by the deadline); it closes the group, waiting up to ``timeout`` for
        the group's threads, and the store."""
        self.close_wait_s = timeout
        self.stopping.set()
        if not self.thread.is_alive():
            self._close()
            return
        self.thread.join(timeout + self.timeout_s)
        if self.thread.is_alive():
            self.log(f"the weight group's sender did not stop within {timeout + self.timeout_s}s")

    def _close(self) -> None:
        if self.group is not None:
            self.group.close(wait_s=self.close_wait_s)
            self.group = None
        self.server.close()

    def _run(self) -> None:
        try:
            if self.stream is not None:  # NCCL and the snapshot: none of the trainer's waits
                torch.cuda.set_device(self.store.flat.device)
            while not self.stopping.is_set():
                self._round()
        except BaseException as exc:  # noqa: BLE001 (raised by the pool's collect)
            self.error = exc
        finally:
            self._close()

    def _read_board(self, timeout_s: float, force: bool = False) -> dict[int, dict]:
        if force or time.monotonic() - self.status_at > self.BOARD_EVERY_S:
            self.status = ask(self.board.status.remote(), timeout_s)
            self.status_at = time.monotonic()
        return self.status

    def _alive(self) -> dict[int, dict]:
        fresh = GroupWeightSource.POLL_S + self.HEARTBEAT_GRACE_S
        status = self._read_board(CONTROL_S)
        if status is not self.checked:  # Ray's view of the processes, with each new status
            self.checked = status
            self.running = self.pids(CONTROL_S)
        return {
            rank: info
            for rank, info in status.items()
            if info["age"] < fresh
            and info["incarnation"] not in self.killed
            and self.running.get(rank) == info["pid"]
        }

    def _round(self) -> None:
        members = self._alive()
        same = {r: m["incarnation"] for r, m in members.items()} == {
            r: m["incarnation"] for r, m in self.members.items()
        }
        if self.store.version() < 0 or not members or (same and self.store.version() <= self.sent):
            self.stopping.wait(0.002)
            return
        deadline = time.monotonic() + self.timeout_s
        self.round += 1
        try:
            if not same or self.group is None:
                self._form(members, deadline)
            with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
                self._send(deadline)
            self.failed_rounds = 0
        except WeightGroupError as exc:
            # Its traceback's frames hold the group's operations, and with them its sockets,
            # which must close with the group for the members to notice.
            exc.__traceback__ = None
            if not self.stopping.is_set():  # stopping: nobody is to blame
                self._failed(exc, deadline)
        finally:
            self.sending = None

    def _form(self, members: dict[int, dict], deadline: float) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.epoch += 1
        self.members = members
        self.sent = -1
        ranks = {(r, m["incarnation"]): i + 1 for i, (r, m) in enumerate(sorted(members.items()))}
        secret = self.server.open()  # the previous group's keys and clients are dropped
        try:
            ask(
                self.board.post_plan.remote(
                    self.round, self.epoch, self.host, self.server.port, secret, ranks
                ),
                deadline - time.monotonic(),
            )
        except TimeoutError:
            raise WeightGroupError(
                f"group {self.epoch}: the board took the plan too late"
            ) from None
        self.group = WeightGroup(
            self.backend,
            self.host,
            self.server.port,
            secret,
            self.epoch,
            0,
            1 + len(ranks),
            self.timeout_s,
            self.host,
            abandon=self._abandon,
            deadline=deadline,
        )
        self.rebuilds += 1

    def _send(self, deadline: float) -> None:
        header = self.store.header
        seq = header[WeightStore.SEQ].item()
        if seq % 2:
            return  # a publish is under way: the next round sends it
        if self.snapshot is not None:
            read = self.snapshot.read()
            if read is None:
                return
            version, probe, flat = read
        else:
            version = int(header[WeightStore.VERSION].item())
            probe = header[WeightStore.PROBE].item()
            flat = self.store.flat
        t0 = time.perf_counter()
        self.sending = version
        self.board.post_announce.remote(self.round, self.epoch, version, probe)
        self.group.broadcast(flat.view(-1).view(torch.uint8), self.bucket_bytes, deadline)
        whole = self.snapshot is not None or header[WeightStore.SEQ].item() == seq
        self.group.flag(1.0 if whole else 0.0, deadline)
        arrived = self.group.flag(0.0, deadline, total=True)
        if arrived != len(self.members):
            raise WeightGroupError(f"{arrived:g} of {len(self.members)} members confirmed")
        if whole:
            self.sent = version
            self.seconds.append(time.perf_counter() - t0)

    def _abandon(self, deadline: float) -> str | None:
        """Why the round is to be given up now (WeightGroup's ``abandon``), or None: the sender
        is stopping, or a member's process is gone, as Ray's GCS says by the deadline."""
        if self.stopping.is_set():
            return "the weight group's sender is stopping"
        try:
            running = self.pids(deadline - time.monotonic())
        except TimeoutError:
            return "Ray's GCS did not answer by the deadline"
        gone = [rank for rank, m in self.members.items() if running.get(rank) != m["pid"]]
        return f"the process of searcher(s) {gone} is gone" if gone else None

    def _failed(self, error: WeightGroupError, deadline: float) -> None:
        """Close the group (its members give their part up), sort its members into
        survivors, the gone and stragglers (killed), and say so. Every call ends by the
        deadline and ``REPORT_S``."""
        if self.group is not None:
            self.group.close()
            self.group = None
        until = deadline + self.REPORT_S
        with contextlib.suppress(TimeoutError):  # the members' own deadline ends their part
            ask(self.board.post_closed.remote(self.epoch), until - time.monotonic())
        members, self.members = self.members, {}
        epoch = self.epoch
        round = self.round
        failed_at = time.monotonic()
        quiet = dict(members)
        gone = []
        # A survivor's part ends soon after the group closes (its peer's socket is gone), or
        # by the group's own timeout at the latest, and it reports within moments.
        while quiet and time.monotonic() < until and not self.stopping.is_set():
            try:
                status = self._read_board(until - time.monotonic(), force=True)
                running = self.pids(until - time.monotonic())
            except TimeoutError:
                break
            for rank in list(quiet):
                now = status.get(rank, quiet[rank])
                if running.get(rank) != quiet[rank]["pid"]:
                    gone.append(rank)  # Ray restarts it
                    del quiet[rank]
                    continue
                reported = now["outcome"] is not None and now["outcome"][0] == round
                restarted = now["incarnation"] != quiet[rank]["incarnation"]
                polled = now["age"] < time.monotonic() - failed_at
                if reported or restarted or polled:
                    del quiet[rank]
            if quiet:
                self.stopping.wait(0.05)
        if self.stopping.is_set():
            return
        for rank, info in quiet.items():
            self.killed.add(info["incarnation"])
            self.kill(rank, info, f"missed the weight group's deadline ({error})")
        self.failed_rounds += 1
        survivors = sorted(set(members) - set(quiet) - set(gone))
        self.log(
            f"weight group {epoch} failed ({error}); searchers whose process is gone: "
            f"{sorted(gone)}, killed: {sorted(quiet)}; rebuilding it with {survivors}"
        )
        if self.failed_rounds >= self.MAX_FAILED_ROUNDS:
            raise SearcherFailed(
                f"the weight group failed {self.failed_rounds} rounds in a row; the last: {error}"
            )

    def describe(self) -> dict:
        """The path and its seconds per version (median), for the run summary."""
        out = {
            "path": f"broadcast ({self.backend}, buckets of {self.bucket_bytes >> 20} MiB)",
            "versions_sent": len(self.seconds),
            "group_rebuilds": self.rebuilds,
        }
        if self.seconds:
            out["seconds_per_version"] = statistics.median(self.seconds)
        return out


@contextlib.contextmanager
def _nothing():
    yield
