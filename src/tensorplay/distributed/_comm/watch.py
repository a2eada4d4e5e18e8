"""Collective watch: every flat collective is recorded, and ranks that diverge or die raise instead of hanging.

[Note: the collective watch]
Each process group gets a :class:`GroupWatch` (keyed by the group object, so
ranks that are threads of one process never share one). For every collective
that ``_comm/collectives.py`` issues it

- appends a :class:`Record` (sequence number in the group, operation, the
  module or parameter it serves (``where``), numel, dtype, a small ``state``),
  and folds it into a running hash;
- every ``fingerprint_every`` collectives, adds a 20-bit hash of the records
  since the last fingerprint, its square and a count to two store counters
  before issuing the data, and once the data arrived reads the two sums back:
  the ranks agree exactly when sum = W h and sum of squares = W h^2 (their
  spread is zero). Four store operations per rank per fingerprint, whatever
  the world size (see [Note: the watch at scale]); a difference raises
  :class:`CollectiveDivergence` on every rank naming the first collective where
  the ranks' records differ (exchanged through the store, only then). Never in
  the stuck group: a fingerprint can't be paired with another rank's data,
  whatever the ranks issued;
- waits in slices of ``stall_s`` seconds; after each slice the ranks compare
  what they are doing through the default group's store (never through the
  stuck group) and raise when they disagree or one of them died or exited;
  a wait never outlasts the group's own ``timeout=`` (the value given to
  ``init_process_group`` / ``new_group``): its last slice ends early enough for
  the comparison to finish within it, and then it raises whatever the others
  do, naming each rank's collective or what it did last;
- one daemon thread per rank (not per group) reads a probe counter from the
  store every ``heartbeat_s`` (longer from 5,000 ranks on, so that the store
  serves at most about 10,000 such reads a second in all); a stalled rank bumps
  the counter, and every live rank answers with what it is doing in each of
  its groups, and for how long the thread that issues its collectives has been
  idle outside them (see [Note: idle outside our collectives] in
  ``thread_clock.py``). A rank that does not answer within
  :meth:`GroupWatch.verdict_s` is named dead; one that exited said so at exit;
  one that is not in the stalled collective and whose thread has been idle for
  longer than a slice (``idle_s``) is named blocked outside our collectives
  (DDP's own all-reduce, a user's collective) at that slice, not at the
  group's timeout; one whose thread computes is waited for (``straggler_s``).
  Under a launcher that watches its workers (``torchrun``, ``tprun``) there is
  no such thread (the launcher ends the job when a worker dies;
  ``TENSORPLAY_WATCHER=1`` starts it anyway, and ``tprun --survive`` always
  does): a stalled rank then names what the other stalled ranks wait on and
  which ranks exited.

[Note: the watch at scale]
The healthy path writes nothing per collective and reads no other rank's key:
per rank, four store operations per fingerprint (every 32nd collective, one
more interval per 256 ranks: see :meth:`GroupWatch.fingerprint_interval`), and
the watcher's one read per period (plus one read of its thread's CPU time from
``/proc``, no store operation). What every rank is doing is exchanged only
after a stall (then each stalled rank reads the W statuses once per
comparison) or a fingerprint mismatch. Counted by simulation at W = 8 to
16,384 in ``bench/bench_scale.py``.

Off with ``TENSORPLAY_WATCH=0``; stall time ``TENSORPLAY_STALL_S`` (default 5);
``TENSORPLAY_FINGERPRINT_EVERY`` (default 32, 0 = never); ``TENSORPLAY_IDLE_S``
(default: one slice; ``off`` or 0: never name an idle peer before ``straggler_s``);
per group with :func:`configure`. Only Gloo and NCCL groups are watched.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import socket
import threading
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.constants import default_pg_timeout

from .thread_clock import IdleClock

__all__ = ["CollectiveDivergence", "GroupWatch", "Record", "WatchOptions", "configure", "site", "watch_for"]

WATCHED_BACKENDS = ("gloo", "nccl")
_MASK = (1 << 62) - 1
_HISTORY = 256  # records kept per group (the first difference is searched in them)
_RING = 256  # fingerprint slots in the store, per rank
_RECENT = 32  # records in the live status (to compare the one a stalled rank waits on)
_COUNT_SHIFT = 42  # a fingerprint counter holds (ranks counted) << 42 + the sum of their 20-bit hashes
_KEEP_FINGERPRINTS = 64  # rounds kept in the store before rank 0 deletes their counters
_PROBE_READS_PER_S = 10_000  # the watchers' probe reads the store serves per second in all, at most
_RANKS_PER_FINGERPRINT_STEP = 256  # fingerprints are spaced by one more interval for every this many ranks
_MIXED = 0  # GroupWatch.thread once collectives came from more than one thread (native ids are positive)


class CollectiveDivergence(RuntimeError):
    """The ranks of a process group issued different collectives, or one of them died."""


@dataclass(frozen=True)
class WatchOptions:
    enabled: bool = True
    stall_s: float = 5.0
    heartbeat_s: float = 0.5
    fingerprint_every: int = 32  # 8: ZeRO spent 5.6% of a small step in the watch, 32: 2.0% (bench_watchdog)
    #: How long a live peer may be behind (computing, writing a checkpoint) before a stalled rank names it.
    straggler_s: float = 300.0
    #: How long a live peer's thread may be idle outside our collectives before a stalled rank names it (see
    #: [Note: idle outside our collectives] in ``thread_clock.py``). None: one slice (``stall_s``); inf: never.
    idle_s: float | None = None

    @classmethod
    def from_env(cls) -> WatchOptions:
        env = os.environ
        idle = env.get("TENSORPLAY_IDLE_S", "").strip().lower()
        return cls(enabled=env.get("TENSORPLAY_WATCH", "1") not in ("0", "false", "off"),
                   stall_s=float(env.get("TENSORPLAY_STALL_S", cls.stall_s)),
                   fingerprint_every=int(env.get("TENSORPLAY_FINGERPRINT_EVERY", cls.fingerprint_every)),
                   straggler_s=float(env.get("TENSORPLAY_STRAGGLER_S", cls.straggler_s)),
                   idle_s=None if not idle else math.inf if idle in ("0", "off", "never") else float(idle))

    def idle_after_s(self) -> float:
        """Seconds a peer's thread may be idle outside our collectives before it is named (inf: never)."""
        return self.stall_s if self.idle_s is None else self.idle_s


class Record(NamedTuple):
    """One collective as this rank issued it (a tuple: cheap to make for every collective)."""

    seq: int
    op: str
    where: str
    numel: int
    dtype: str
    state: int = 0
    note: str = ""

    def key(self) -> tuple:
        return self.seq, self.op, self.where, self.numel, self.dtype, self.state

    def describe(self) -> str:
        note = f", {self.note}" if self.note else ""
        return f"{self.op} of {self.where!r} (collective {self.seq}, {self.numel} x {self.dtype}{note})"


_SITE: ContextVar[str] = ContextVar("tensorplay_collective_site", default="")


@contextlib.contextmanager
def site(where: str) -> Iterator[None]:
    """Name the module or parameter the collectives issued inside this block serve (for the watch's messages)."""
    token = _SITE.set(where)
    try:
        yield
    finally:
        _SITE.reset(token)


def _code(text: str, cache: dict[str, int]) -> int:
    code = cache.get(text)
    if code is None:
        code = cache[text] = zlib.crc32(text.encode())
    return code


class GroupWatch:
    """This rank's records and checks for one process group (see [Note: the collective watch])."""

    def __init__(self, group: ProcessGroup, options: WatchOptions) -> None:
        self.options = options
        self.name = str(group.group_name)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)  # the global ranks are looked up only for a message (O(W))
        self._group_ref = weakref.ref(group)
        self.seq = 0
        self.records: deque[Record] = deque(maxlen=_HISTORY)
        self.waiting: Record | None = None
        self.hash = 0
        self.incident = 0
        self._codes: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        self._checks: deque[tuple[Record, int]] = deque(maxlen=64)  # fingerprints published, not yet compared
        self._store: Any = None
        self.alarmed = False  # set by the rank's watcher thread when another rank raised in this group
        self._probe = 0  # the probe of this rank's last comparison
        self._exited = False
        self._raised: tuple[str, int] | None = None  # (key, ranks expected) of the last incident this rank raised
        self.timeout_s = group_timeout_s(group)
        self.broken: CollectiveDivergence | None = None  # the divergence this rank raised: the group is unusable
        self._diagnosing = threading.RLock()
        self.thread: int | None = None  # native id of the thread issuing this group's collectives (_MIXED: several)
        self.futures = 0  # collectives of ours handed out as futures and not done yet (DDP comm hooks)
        self._futures_lock = threading.Lock()  # their callbacks run on the backend's threads

    def global_ranks(self) -> list[int] | str:
        """The group's ranks in the default group (for messages only: a list of W)."""
        group = self._group_ref()
        return list(dist.get_process_group_ranks(group)) if group is not None else "?"

    # ---- recording --------------------------------------------------------------------------------
    def begin(self, op: str, tensor: torch.Tensor, where: str | None, state: int = 0,
              version: int | None = None) -> Record:
        """Record a collective about to be issued; raise if another rank raised the alarm."""
        if self.alarmed:
            self.alarmed = False
            self.diagnose(None, None, stalled_s=0.0)
        where = where or _SITE.get() or "?"
        note = ""
        if version is not None:
            changed = self._versions.get(where, version) != version
            self._versions[where] = version
            state, note = state * 2 + changed, ("its shards changed since the last" if changed
                                                 else "its shards unchanged since the last") + f" {op}"
        record = Record(self.seq, op, where, tensor.numel(), str(tensor.dtype), state, note)
        self.seq += 1
        thread = threading.get_native_id()
        if self.thread != thread:
            self.thread = thread if self.thread is None else _MIXED
        self.records.append(record)
        h = self.hash
        for value in (record.seq, _code(op, self._codes), _code(where, self._codes), record.numel,
                      _code(record.dtype, self._codes), state):
            h = (h * 1099511628211 + value) & _MASK
        self.hash = h
        return record

    def fingerprint(self, record: Record, always: bool = False) -> bool:
        """Every ``fingerprint_every``-th collective: add this rank's hash to the store's sums before the data.

        Returns whether it did (then the caller verifies once the data arrived).
        """
        every = self.fingerprint_interval()
        if not always and (every <= 0 or (record.seq + 1) % every):
            return False
        store = self.store()
        if store is None:
            return False
        short = _short_hash(self.hash)
        store.add(f"fp/{record.seq}/sq", short * short)  # first: a full count means every square is in
        store.add(f"fp/{record.seq}/n", (1 << _COUNT_SHIFT) + short)
        if self.rank == 0 and every > 0 and record.seq >= _KEEP_FINGERPRINTS * every:
            old = record.seq - _KEEP_FINGERPRINTS * every
            for key in (f"fp/{old}/n", f"fp/{old}/sq"):
                store.delete_key(key)
        self._checks.append((record, short))
        self.hash = 0  # each fingerprint covers the collectives since the previous one
        return True

    def fingerprint_interval(self) -> int:
        """Collectives between fingerprints: ``fingerprint_every``, times one more for every 256 ranks (0: never).

        Each fingerprint costs every rank four store operations; spacing them with the world size keeps the
        store's load per collective bounded (about 4 x 256 / 32 = 32 operations in all) at any number of ranks,
        and a divergence that does not stall is still named within ``fingerprint_every x W / 256`` collectives.
        """
        every = self.options.fingerprint_every
        return every * -(-self.world // _RANKS_PER_FINGERPRINT_STEP) if every > 0 else 0

    def verify(self, upto: int) -> None:
        """Compare the fingerprints of collectives up to ``upto`` that every rank has published (non-blocking)."""
        store = self.store()
        while store is not None and self._checks and self._checks[0][0].seq <= upto:
            record, short = self._checks[0]
            counted = store.add(f"fp/{record.seq}/n", 0)
            if counted >> _COUNT_SHIFT < self.world:
                return  # a rank has not got there yet
            total, squares = counted & ((1 << _COUNT_SHIFT) - 1), store.add(f"fp/{record.seq}/sq", 0)
            self._checks.popleft()
            if total != self.world * short or squares != self.world * short * short:
                self._raise_mismatch(record, short)

    def hold(self, future: torch.futures.Future) -> None:
        """Count ``future``, a collective of ours that its caller waits for outside the watch, until it is done."""
        with self._futures_lock:
            self.futures += 1

        def done(_: torch.futures.Future) -> None:
            with self._futures_lock:
                self.futures -= 1

        future.add_done_callback(done)

    def _last(self) -> Record | None:
        return self.records[-1] if self.records else None

    # ---- waiting ----------------------------------------------------------------------------------
    def wait_work(self, work: Any, record: Record) -> None:
        """``work.wait()`` in slices of ``stall_s``; between slices, compare with the other ranks.

        Only for CPU tensors: a device collective's ``wait()`` does not block the host (NCCL's own watchdog
        bounds those), and a timeout would make it block.
        """
        if work.is_completed():
            work.wait()
            return
        self.waiting = record
        start = time.monotonic()
        last_call = start + self.final_after_s()
        try:
            while True:
                slice_start = time.monotonic()
                slice_s = max(0.05, min(self.options.stall_s, last_call - slice_start))
                try:
                    work.wait(timeout=timedelta(seconds=slice_s))
                    return
                except RuntimeError as error:
                    ours = "timed out" in str(error).lower() and time.monotonic() - slice_start >= slice_s * 0.9
                    final = time.monotonic() >= last_call - 0.01
                    self.diagnose(record, None if ours else error, stalled_s=time.monotonic() - start, final=final)
                    if not ours:
                        raise
        finally:
            self.waiting = None

    def final_after_s(self) -> float:
        """When a wait's final comparison starts: it, and the error's way up, still end within the group's timeout."""
        return self.timeout_s - self.verdict_s() - min(1.0, self.timeout_s / 10)

    def verdict_s(self) -> float:
        """How long a comparison may take to tell a dead rank (it does not answer the probe) from a live one."""
        watcher = _watcher_for_rank()
        period = watcher.period() if watcher is not None else self.options.heartbeat_s
        return min(max(2.0, 4 * period), self.timeout_s / 4)

    # ---- the store ----------------------------------------------------------------------------------
    def store(self) -> Any:
        if self._store is None:
            watcher = _watcher_for_rank()
            self._store = watcher.group_store(self.name) if watcher is not None else False
            if watcher is not None:
                watcher.add(self)
        return self._store or None

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self.incident}/{what}" + ("" if rank is None else f"/{rank}")

    def _publish(self, store: Any, answered: int = 0, idle_s: float | None = None) -> None:
        """Put this rank's status in the store: what it waits on, did last and recently (answering probe
        ``answered``), and for how long its thread has been idle outside our collectives (``idle_s``)."""
        waiting, last = self.waiting, self._last()
        status = {"answered": answered, "waiting": waiting._asdict() if waiting else None,
                  "last": last._asdict() if last else None, "pid": os.getpid(), "host": socket.gethostname(),
                  "exited": self._exited, "idle_s": idle_s,
                  "recent": [r._asdict() for r in list(self.records)[-_RECENT:]]}
        store.set(f"live/{self.rank}", json.dumps(status))

    def _read(self, store: Any, key: str) -> Any:
        return json.loads(store.get(key)) if store.check([key]) else None

    # ---- diagnosis --------------------------------------------------------------------------------
    def diagnose(self, record: Record | None, error: BaseException | None, stalled_s: float,
                 final: bool = False) -> None:
        """Compare what this rank waits on with the others' live status in the store; raise if they disagree.

        ``record`` is None when this rank is not waiting (another rank raised the alarm); ``final``: the
        group's timeout is up, raise whatever the others do.
        """
        with self._diagnosing:  # one at a time (hook futures fail on the backend's threads), and once
            if self.broken is not None:
                raise CollectiveDivergence(f"{self.broken} (raised before; this group is unusable since)")
            try:
                self._diagnose(record, error, stalled_s, final)
            except CollectiveDivergence as divergence:
                self.broken = divergence
                raise

    def _diagnose(self, record: Record | None, error: BaseException | None, stalled_s: float,
                  final: bool) -> None:
        store = self.store()
        if store is None:
            return
        try:
            self.verify(self.seq)  # a fingerprint every rank published since names the divergence best
            self._publish(store)
            statuses, dead = self._collect(store)
        except RuntimeError as store_error:  # the store's host (global rank 0) is gone
            raise self._store_lost(f"in {record.describe()}" if record else "between collectives",
                                   store_error) from error
        message = self._compare(record, statuses, dead, error, stalled_s, final)
        if message is None:
            return
        with contextlib.suppress(RuntimeError):
            store.set(self._key("alarm"), str(self.rank))
            watcher = _watcher_for_rank()
            if watcher is not None:
                watcher.probe()  # the others' watchers see the alarm at their next read
            waiting = [rank for rank, status in statuses.items()
                       if rank != self.rank and rank not in dead and status and status.get("waiting")]
            self._linger(store, self.world - 1 - len(waiting))  # only ranks in a collective will read it soon
        self.incident += 1
        raise CollectiveDivergence(message) from error

    def _store_lost(self, where: str, error: BaseException) -> CollectiveDivergence:
        host = ("the launcher that hosts it (tprun --survive)" if os.environ.get("TENSORPLAY_SURVIVE") == "1" else
                "the rank that hosts it (global rank 0)")
        return CollectiveDivergence(
            f"process group {self.name!r}: rank {self.rank} is {where} and cannot reach the store ({error}); "
            f"{host} has exited or died")

    def _linger(self, store: Any, gone: int = 0) -> None:
        """Count this rank as raising; the store's host lingers at exit until the others have read it
        (all but ``gone``: dead, exited, or outside the group's collectives)."""
        store.add(self._key("raised"), 1)
        self._raised = (self._key("raised"), self.world - gone)

    def linger_at_exit(self) -> None:
        """On the store's host, after an incident: wait (bounded) until every live rank of it has raised.

        At exit rather than before raising: the error reaches the user at once, and the
        store the others read their diagnosis from stays up a little longer.
        """
        if self._raised is None or dist.get_rank() != 0 or not self._store:
            return
        key, expected = self._raised
        deadline = time.monotonic() + self.verdict_s() + 1.0
        with contextlib.suppress(RuntimeError):
            while self._store.add(key, 0) < expected and time.monotonic() < deadline:
                time.sleep(0.1)

    def _collect(self, store: Any) -> tuple[dict[int, Any], list[int]]:
        """Every rank's live status, and the ranks that are dead or exited.

        Bumps the probe counter, which every live rank's watcher answers within its period, and reads the
        statuses until each rank answered or :meth:`verdict_s` passed. A rank that said it exited is dead at
        once; one that never reported in this group is not counted dead (it may be alive elsewhere). Under a
        launcher that watches its workers no rank answers (see :func:`_answering`): the statuses are read
        once, and only exited ranks count as gone (the launcher ends the job when one dies).
        """
        watcher = _watcher_for_rank()
        probe = self._probe = watcher.probe() if watcher is not None else 0
        self._publish(store, probe)
        period = min(self.options.heartbeat_s, self.verdict_s() / 4)
        deadline = time.monotonic() + (self.verdict_s() if _answering() else 0.0)
        while True:
            latest = {rank: self._read(store, f"live/{rank}") for rank in range(self.world)}
            exited = [rank for rank, status in latest.items() if rank != self.rank and status and status["exited"]]
            silent = [rank for rank in range(self.world) if rank != self.rank and rank not in exited and
                      latest[rank] is not None and latest[rank].get("answered", 0) < probe] if _answering() else []
            if not silent or time.monotonic() >= deadline:
                return latest, sorted(exited + silent)
            time.sleep(period)

    def _compare(self, record: Record | None, statuses: dict[int, Any], dead: list[int],
                 error: BaseException | None, stalled_s: float, final: bool = False) -> str | None:
        """The error message, or None while the ranks may still meet.

        A rank disagrees when it issued something else as this collective, is dead, is not in it and its
        thread has been idle for longer than a slice (blocked outside our collectives: see [Note: idle outside
        our collectives] in ``thread_clock.py``), or (after ``straggler_s``, never less than ``6 * stall_s``,
        or once the group's timeout is up: ``final``) is still behind or so far ahead that its record of this
        collective is not in its status: a live peer that is only busy (a long checkpoint write, an
        evaluation) is not an error before that. ``record`` None: another rank raised the alarm, so this one
        raises too.
        """
        patience = 0.0 if final else max(self.options.straggler_s, 6 * self.options.stall_s)
        problems = list(dead)
        for rank, status in statuses.items():
            if rank == self.rank or rank in dead or status is None or record is None:
                continue
            recent = {item["seq"]: item for item in status.get("recent", [])}
            if status.get("waiting"):
                recent[status["waiting"]["seq"]] = status["waiting"]
            theirs = recent.get(record.seq)
            if theirs is not None:
                problems += [rank] if Record(**theirs).key() != record.key() else []
            elif stalled_s >= patience or _idle_for(status) >= self.options.idle_after_s():
                problems.append(rank)  # behind for too long, far ahead, or blocked elsewhere
        if not problems and error is None and record is not None and not final:
            return None
        seen = self._last_completed(record)
        lines = [f"rank {rank} " + _doing(statuses.get(rank), rank in dead, self._probe, seen, self.verdict_s(),
                                          self.options.idle_after_s()) for rank in range(self.world)]
        lines[self.rank] = f"rank {self.rank} " + (f"is in {record.describe()}" if record else
                                                   _doing(statuses.get(self.rank), False))
        head = f"process group {self.name!r} (global ranks {self.global_ranks()}): "
        head += _silent_ranks(dead, statuses)
        if problems:
            head += f"rank {self.rank} waited {stalled_s:.1f} s and rank(s) {sorted(set(problems))} are elsewhere; "
        if final and stalled_s >= self.final_after_s() - 0.1:
            head += f"the group's timeout ({self.timeout_s:g} s) is up; "
        if error is not None:
            head += f"the collective failed ({error}); "
        return head + "; ".join(lines) + ". Every rank must issue the same collectives in the same order."

    def _last_completed(self, record: Record | None) -> Record | None:
        """The last collective of this group before ``record`` (every rank took part: this rank is past it)."""
        if record is None:
            return self._last()
        return next((r for r in reversed(self.records) if r.seq < record.seq), None)

    def _raise_mismatch(self, record: Record, short: int) -> None:
        """Fingerprints differ: exchange each rank's hash and recent records; name the first collective that differs.

        Only now does a rank read every other rank's keys. Every rank builds the same message: the largest
        group of agreeing ranks (lowest rank first) is the reference, and each other group's lowest rank is
        compared with it. What each rank issued as the fingerprinted collective is exchanged with its hash:
        the message names it even when a peer's records do not arrive in time.
        """
        hashes, checked = self._exchange_fingerprints(record, short)
        agreeing: dict[str, list[int]] = {}
        for rank, value in enumerate(hashes):
            agreeing.setdefault(value, []).append(rank)
        groups = sorted(agreeing.values(), key=lambda ranks: (-len(ranks), ranks[0]))
        wanted = [ranks[0] for ranks in groups]
        records: dict[int, Any] = {}
        store = self.store()
        if store is not None:
            store.set(self._key("records", self.rank), json.dumps([r._asdict() for r in self.records]))
            deadline = time.monotonic() + 2 * self.options.stall_s + 3.0  # a peer may publish after a stall
            for rank in wanted:
                while records.get(rank) is None and time.monotonic() < deadline:
                    records[rank] = self._read(store, self._key("records", rank))
                    time.sleep(0 if records[rank] is not None else 0.05)
            self._linger(store)
        self.incident += 1
        details = "; ".join(_first_difference(records, wanted[0], other) for other in wanted[1:])
        if any(records.get(rank) is None for rank in wanted) and len(set(checked)) > 1:
            details += f"; as collective {record.seq}, " + ", ".join(
                f"rank {rank} issued {checked[rank]}" for rank in wanted)
        sides = " vs ".join(f"rank(s) {ranks}" for ranks in groups)
        raise CollectiveDivergence(
            f"process group {self.name!r} (global ranks {self.global_ranks()}): the ranks' collectives diverged "
            f"(fingerprints of collective {record.seq} differ: {sides}): {details}. Every rank must issue the same "
            "collectives in the same order (the same forward/backward passes, optimizer steps and averaging steps).")


    def _exchange_fingerprints(self, record: Record, short: int) -> tuple[list[str], list[str]]:
        """Every rank's hash and description of ``record``'s collective, through the store ("?" if late)."""
        store = self.store()
        if store is None:
            return [str(short)], [record.describe()]
        store.set(f"fp/{record.seq}/{self.rank}", f"{short}:{record.describe()}")
        deadline = time.monotonic() + 2 * self.options.stall_s + 3.0  # a peer may see the mismatch after a stall
        keys = [f"fp/{record.seq}/{rank}" for rank in range(self.world)]
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = [store.get(key).decode().split(":", 1) if store.check([key]) else ["?", "?"] for key in keys]
        return [h for h, _ in rows], [issued for _, issued in rows]


def _short_hash(value: int) -> int:
    """``value`` folded to 20 bits: small enough that W x h^2 fits the store's int64 counters up to 2^22 ranks."""
    return (value ^ (value >> 20) ^ (value >> 40)) & ((1 << 20) - 1)


def group_timeout_s(group: ProcessGroup) -> float:
    """The ``timeout=`` ``group`` was made with (its backend's), in seconds; c10d's default if it can't be read."""
    for device in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(device)).options._timeout.total_seconds())
        except (RuntimeError, AttributeError, ValueError):
            continue
    return default_pg_timeout.total_seconds()


def _idle_for(report: Any) -> float:
    """How long a rank's thread has been idle outside our collectives, by its status (0: unknown or busy)."""
    idle_s = report.get("idle_s") if report and not report.get("waiting") else None
    return idle_s if isinstance(idle_s, (int, float)) else 0.0


def _doing(report: Any, dead: bool, probe: int = 0, seen: Record | None = None, verdict_s: float = 0.0,
           idle_after_s: float = math.inf) -> str:
    if report is None:
        return "has not reported (never issued a collective in this group, or its store connection is gone)"
    last = report.get("last")
    after = f"after {Record(**last).describe()}" if last else "before its first collective"
    if not report.get("exited") and not report.get("waiting") and report.get("answered", 0) < probe and not dead:
        return ("did not answer (no watcher thread under a launcher that watches its workers); it last said it "
                f"was not in a collective of this group ({after})")
    if report.get("exited"):
        return f"exited (pid {report.get('pid')}) {after}"
    if dead:
        return _not_answering(report, seen, verdict_s)
    if report.get("waiting"):
        return f"is in {Record(**report['waiting']).describe()}"
    if _idle_for(report) >= idle_after_s:
        ours = f"was {Record(**last).describe()}" if last else "none yet"
        return (f"is alive but blocked outside tensorplay's collectives (its thread idle for {_idle_for(report):.1f} "
                f"s; its last collective of ours in this group {ours}): probably a collective we do not issue, "
                "e.g. DDP's all-reduce or your own")
    return f"is not in a collective of this group ({after})"


def _silent_ranks(dead: list[int], statuses: dict[int, Any]) -> str:
    """The head of a message naming the ranks that did not answer: which exited, which died, which live on."""
    exited = [rank for rank in dead if (statuses.get(rank) or {}).get("exited")]
    gone = [rank for rank in dead if rank not in exited and _process_state(statuses.get(rank) or {}) in _GONE]
    silent = [rank for rank in dead if rank not in exited and rank not in gone]
    return "".join(f"rank(s) {ranks} {what}; " for ranks, what in
                   ((exited, "exited"), (gone, "died"), (silent, "do not answer the watch")) if ranks)


def _not_answering(report: Any, seen: Record | None, verdict_s: float) -> str:
    """A rank that did not answer the probe: whether its process lives and what it does, where it was last seen.

    Its published status is as old as its last answer (a rank publishes only when asked), so the place
    named is the last collective the reporting rank completed, which the silent one took part in.
    """
    pid, state = report.get("pid"), _process_state(report)
    where = (f"last seen in {seen.describe()}, the last one this rank completed with it" if seen is not None else
             "not seen in a collective of this group yet")
    probe = f"did not answer the watch's probe within {verdict_s:.1f} s"
    if state is None:
        return f"{probe} (pid {pid} on host {report.get('host')}: dead, or alive and stuck); {where}"
    if state in _GONE:
        return f"is dead (pid {pid} is gone, {probe}); {where}"
    return f"is alive but not answering: pid {pid} is {_STATES.get(state, f'in state {state}')}; it {probe}; {where}"


#: /proc/<pid>/stat states of a process that is gone ("": no such process; a zombie or dead one not yet reaped).
_GONE = ("", "Z", "X")

#: /proc/<pid>/stat states of a live process, as a message says them.
_STATES = {"R": "running (busy outside collectives, or stuck in a loop)",
           "S": "sleeping (blocked outside collectives?)", "D": "in uninterruptible I/O",
           "T": "stopped (SIGSTOP or job control)", "t": "stopped by a debugger"}


def _process_state(report: Any) -> str | None:
    """The state letter of the reporting rank's process ("" when gone), or None when it runs on another host."""
    if report.get("host", socket.gethostname()) != socket.gethostname():
        return None
    try:
        with open(f"/proc/{report.get('pid')}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""
    except (OSError, IndexError):
        return None


def _first_difference(records: dict[int, Any], reference: int, other: int) -> str:
    ours, theirs = records.get(reference), records.get(other)
    if ours is None or theirs is None:
        return f"rank {reference if ours is None else other} did not publish its records in time"
    by_seq = {item["seq"]: Record(**item) for item in ours}
    for item in theirs:
        mine = by_seq.get(item["seq"])
        if mine is not None and mine.key() != Record(**item).key():
            return (f"first difference at collective {mine.seq}: rank {other} issued {Record(**item).describe()} "
                    f"where rank {reference} issued {mine.describe()}")
    return f"ranks {reference} and {other} differ before the {_HISTORY} collectives kept"


_BEAT_JOIN_S = 5.0  # at exit, the longest wait for the watcher inside a store call (a store host that hangs)


class _RankWatcher:
    """The one watcher thread of a rank: answers probes for every watched group of the rank.

    Each period it reads the job's probe counter (one store operation); when a stalled rank has bumped it,
    it publishes this rank's status in each of its groups (the answer that tells a live rank from a dead
    one) and flags the groups where another rank raised. One per rank, keyed by the rank's default group:
    ranks that are threads of one process each have their own.
    """

    def __init__(self, base: Any, world: int) -> None:
        self.base = base  # the watch's prefix over the default store
        self.world = world
        self._watches: weakref.WeakSet[GroupWatch] = weakref.WeakSet()
        self._answered = 0
        self._clock = IdleClock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def group_store(self, name: str) -> Any:
        return dist.PrefixStore(f"{name}/", self.base)

    def add(self, watch: GroupWatch) -> None:
        """Watch ``watch``'s group too; its first status goes in now (a rank killed later is then seen silent)."""
        self._watches.add(watch)
        with contextlib.suppress(RuntimeError):
            watch._publish(watch._store, self._answered)
        if self._thread is None and _answering():
            self._thread = threading.Thread(target=_watch_rank, args=(weakref.ref(self), self._stop), daemon=True,
                                            name=f"tensorplay-watch-{watch.name}-{watch.rank}")
            self._thread.start()
            atexit.register(_at_exit, weakref.ref(self), self._stop, self._thread)

    def probe(self) -> int:
        """Ask every live rank to answer; returns the probe's number."""
        return int(self.base.add("probe", 1))

    def period(self) -> float:
        """Seconds between probe reads: ``heartbeat_s``, longer from 5,000 ranks on (the store's load is bounded)."""
        beat = min((watch.options.heartbeat_s for watch in list(self._watches)), default=WatchOptions.heartbeat_s)
        return max(beat, self.world / _PROBE_READS_PER_S)

    def poll(self) -> None:
        """One period's work: sample the rank's thread, read the probe counter; answer a new probe."""
        watches = list(self._watches)
        idle_s = self._clock.sample(_issuing_thread(watches))
        probe = int(self.base.add("probe", 0))
        if probe == self._answered:
            return
        self._answered = probe
        if any(watch.waiting is not None or watch.futures for watch in watches):
            idle_s = None  # in a collective of ours (maybe another group's): not idle outside them
        for watch in watches:
            if watch._store and watch.options.enabled:
                watch._publish(watch._store, probe, idle_s)
                if watch._store.check([watch._key("alarm")]):
                    watch.alarmed = True

    def exit(self) -> None:
        for watch in list(self._watches):
            if watch._store:
                watch._exited = True
                with contextlib.suppress(RuntimeError):
                    watch._publish(watch._store, self._answered)
                watch.linger_at_exit()


def _issuing_thread(watches: list[GroupWatch]) -> int | None:
    """The one thread that issued the rank's collectives (its native id); None when several did, or none yet."""
    threads = {watch.thread for watch in watches if watch.thread is not None}
    return threads.pop() if len(threads) == 1 and _MIXED not in threads else None


def _answering() -> bool:
    """Whether ranks run a watcher thread that answers probes: not under a launcher that watches its workers
    (``torchrun`` / ``tprun``: it ends the job when one dies), unless ``TENSORPLAY_WATCHER=1``; always under
    ``tprun --survive`` (``TENSORPLAY_SURVIVE=1``: the others carry on when a worker dies)."""
    forced = os.environ.get("TENSORPLAY_WATCHER", "").lower()
    if forced in ("0", "1", "on", "off", "true", "false"):
        return forced in ("1", "on", "true")
    return "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("TENSORPLAY_SURVIVE") == "1"


def _at_exit(ref: weakref.ref[_RankWatcher], stop: threading.Event, thread: threading.Thread) -> None:
    """Stop the watcher thread, then say in the store that this rank exited (after which collective).

    The thread is joined first: a daemon thread still inside a store call when the interpreter finalizes is
    killed by ``pthread_exit`` as the call retakes the GIL, and that unwinds through a ``noexcept`` C++ frame:
    "terminate called without an active exception", the process aborts after correct results.
    """
    stop.set()
    thread.join(timeout=_BEAT_JOIN_S)
    watcher = ref()
    if watcher is not None:
        watcher.exit()


def _watch_rank(ref: weakref.ref[_RankWatcher], stop: threading.Event) -> None:
    """The watcher thread: poll every period until stopped, the watcher is gone or the store fails."""
    while not stop.is_set():
        watcher = ref()
        if watcher is None:
            return
        try:
            watcher.poll()
        except RuntimeError:
            return
        period = watcher.period()
        del watcher
        if stop.wait(period):  # set at exit (see _at_exit)
            return


_WATCHERS: weakref.WeakKeyDictionary[ProcessGroup, _RankWatcher] = weakref.WeakKeyDictionary()


def _watcher_for_rank() -> _RankWatcher | None:
    """This rank's watcher (made with the first watched group); None without a default group or store."""
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if default is None:
        return None
    watcher = _WATCHERS.get(default)
    if watcher is None:
        try:
            base = dist.PrefixStore("tensorplay_watch", dist.distributed_c10d._get_default_store())
        except (RuntimeError, ValueError, AttributeError):
            return None
        watcher = _WATCHERS[default] = _RankWatcher(base, dist.get_world_size())
    return watcher


_WATCHES: weakref.WeakKeyDictionary[ProcessGroup, GroupWatch] = weakref.WeakKeyDictionary()


def _resolve(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None:
        return group
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def watch_for(group: ProcessGroup | None, backend: Callable[[], str]) -> GroupWatch | None:
    """The watch of ``group`` (``None``: the default group), or None when watching is off for it.

    ``backend()`` names the backend serving the collective's tensors (asked once, when the watch is made).
    """
    group = _resolve(group)
    if group is None:
        return None
    watch = _WATCHES.get(group)
    if watch is None:
        options = WatchOptions.from_env()
        if backend() not in WATCHED_BACKENDS or dist.get_rank(group) < 0:
            options = replace(options, enabled=False)
        watch = _WATCHES[group] = GroupWatch(group, options)
    if not watch.options.enabled:
        return None
    if watch._store is None:
        watch.store()  # starts the heartbeat
    return watch


def forget(group: ProcessGroup) -> None:
    """Drop the watch of ``group``, and the rank's watcher thread when ``group`` is its default group (a group
    that lost a rank: see ``regroup``). Safe for a group never watched."""
    _WATCHES.pop(group, None)
    watcher = _WATCHERS.pop(group, None)
    if watcher is not None:
        watcher._stop.set()  # the thread ends at its next period; it holds the watcher only weakly
        watcher._watches.clear()  # nothing of the old group to publish or linger for at exit


def configure(group: ProcessGroup | None = None, *, enabled: bool | None = None, stall_s: float | None = None,
              fingerprint_every: int | None = None, heartbeat_s: float | None = None,
              straggler_s: float | None = None, idle_s: float | None = None) -> WatchOptions:
    """Change the watch of ``group`` (``None``: the default group); returns its options (None: unchanged)."""
    resolved = _resolve(group)
    if resolved is None:
        raise ValueError("configure: no process group (call init_process_group first, or pass group)")
    if stall_s is not None and not stall_s > 0:
        raise ValueError(f"configure: stall_s must be > 0 seconds, got {stall_s!r}")
    if heartbeat_s is not None and not 0 < heartbeat_s <= 5:
        raise ValueError(f"configure: heartbeat_s must be in (0, 5] seconds, got {heartbeat_s!r}")
    if straggler_s is not None and not straggler_s > 0:
        raise ValueError(f"configure: straggler_s must be > 0 seconds, got {straggler_s!r}")
    if fingerprint_every is not None and fingerprint_every < 0:
        raise ValueError(f"configure: fingerprint_every must be >= 0 (0: never), got {fingerprint_every!r}")
    if idle_s is not None and not idle_s > 0:
        raise ValueError(f"configure: idle_s must be > 0 seconds (math.inf: never), got {idle_s!r}")
    watch = _WATCHES.get(resolved) or GroupWatch(resolved, WatchOptions.from_env())
    _WATCHES[resolved] = watch
    changes: dict[str, Any] = {"enabled": enabled, "stall_s": stall_s, "heartbeat_s": heartbeat_s,
                               "fingerprint_every": fingerprint_every, "straggler_s": straggler_s, "idle_s": idle_s}
    watch.options = replace(watch.options, **{name: value for name, value in changes.items() if value is not None})
    return watch.options
