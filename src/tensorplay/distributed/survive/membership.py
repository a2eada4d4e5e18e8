"""Settling who survived a lost rank, and from which step they carry on, through the job's store.

[Note: settling membership]
Keys, under ``tensorplay_survive/g<g>/`` of the store (hosted by a process that is not a rank):

- ``pids``: every member of generation ``g`` appends ``"<id> <pid> <host>\\n"`` when the generation starts,
  then counts itself in ``ready``; the last one sets ``ready/all``, which the others wait for;
- ``members``: each survivor of generation ``g - 1`` appends its :class:`Member` (one JSON line), then
  ``add("arrived", 1)``; the survivor that draws ticket 1 is the leader for this generation;
- ``settled``: the leader waits until every member of ``g - 1`` arrived, or every missing one is known dead
  (its pid is gone on this host), or ``settle_s`` passed; then writes the :class:`Settlement` once.
  The others wait for that key and read it.

Store operations per survivor: one append, one add, one wait and one get (the leader: one read of
``pids`` and ``members`` each, and one counter read per poll). A survivor that arrives after the
settlement finds itself missing from it and raises: it was declared lost.

Healing: a replacement draws a ticket from ``join/count``; rank 0 of the running job reads that counter
once per step and puts it in the commit's agreement, so every rank admits the same replacements at the
same step boundary; rank 0 then writes the next generation's ``settled`` (the members, the replacements
last, and the step) and ``join/<ticket>`` = that generation, which the replacement waits for.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from .._comm.regroup import pid_alive

__all__ = ["Member", "Membership", "Settlement"]

NAMESPACE = "tensorplay_survive"
_POLL_S = 0.05
_START_S = 300.0  # how long the members of a generation may take to arrive (process start, imports)


@dataclass(frozen=True)
class Member:
    """What one survivor reports: its id, the steps it completed, whether it was inside the commit (its
    gradients reduced, the optimizer step not yet taken) and what it was doing."""

    id: int
    step: int
    in_commit: bool
    doing: str


@dataclass(frozen=True)
class Settlement:
    """The survivors of a generation, in id order (a survivor's new rank is its index), the ids lost, and
    the step every survivor carries on from."""

    generation: int
    members: list[Member]
    lost: list[int]
    step: int

    def ids(self) -> list[int]:
        return [member.id for member in self.members]


class Membership:
    """This rank's side of the settling protocol (see [Note: settling membership])."""

    def __init__(self, store: Any, settle_s: float) -> None:
        self.store = store
        self.settle_s = settle_s

    def _key(self, generation: int, what: str) -> str:
        return f"{NAMESPACE}/g{generation}/{what}"

    def register(self, generation: int, member_id: int, world: int) -> None:
        """Say that ``member_id`` runs generation ``generation`` here (read only when a rank is lost), and
        wait until all ``world`` members have: the group's own start is then bounded by its timeout, however
        late a process started. The first generation waits for process starts (``_START_S``); a later one
        only for members already running (``settle_s``: one lost meanwhile fails the recovery)."""
        self.store.append(self._key(generation, "pids"), f"{member_id} {os.getpid()} {socket.gethostname()}\n")
        ready = self._key(generation, "ready")
        if self.store.add(ready, 1) == world:
            self.store.set(ready + "/all", "1")
        self.store.wait([ready + "/all"], timedelta(seconds=_START_S if generation == 0 else self.settle_s))

    def settle(self, generation: int, ids: list[int], member: Member) -> Settlement:
        """Report ``member`` as a survivor of ``generation`` (whose members were ``ids``); every survivor
        returns the same :class:`Settlement` of generation ``generation + 1``."""
        upcoming = generation + 1
        self.store.append(self._key(upcoming, "members"), json.dumps(asdict(member)) + "\n")
        if self.store.add(self._key(upcoming, "arrived"), 1) == 1:
            self._lead(generation, ids)
        settled = self._key(upcoming, "settled")
        self.store.wait([settled], timedelta(seconds=self.settle_s + 30))
        record = json.loads(self.store.get(settled))
        return Settlement(upcoming, [Member(**m) for m in record["members"]], record["lost"], record["step"])

    # ---- healing: a replacement joins at a step boundary ------------------------------------------------
    def join(self) -> int:
        """Announce a replacement waiting to join; returns its ticket (1, 2, ...)."""
        return int(self.store.add(f"{NAMESPACE}/join/count", 1))

    def waiting(self) -> int:
        """How many replacements have announced themselves so far (one store operation)."""
        return int(self.store.add(f"{NAMESPACE}/join/count", 0))

    def admit(self, generation: int, ids: list[int], step: int, tickets: range) -> None:
        """Written once, by rank 0 of the running job: generation ``generation`` has members ``ids`` from
        ``step``; the replacements holding ``tickets`` are among them."""
        record = {"members": [asdict(Member(i, step, False, "joining")) for i in ids], "lost": [], "step": step}
        self.store.set(self._key(generation, "settled"), json.dumps(record))
        for ticket in tickets:
            self.store.set(f"{NAMESPACE}/join/{ticket}", str(generation))

    def admission(self, ticket: int) -> Settlement:
        """Wait until the running job admits ticket ``ticket``; the generation it joins."""
        key = f"{NAMESPACE}/join/{ticket}"
        self.store.wait([key], timedelta(seconds=_START_S))
        generation = int(self.store.get(key))
        record = json.loads(self.store.get(self._key(generation, "settled")))
        return Settlement(generation, [Member(**m) for m in record["members"]], record["lost"], record["step"])

    def _lead(self, generation: int, ids: list[int]) -> None:
        upcoming = generation + 1
        deadline = time.monotonic() + self.settle_s
        running = _parse_pids(self.store.get(self._key(generation, "pids")).decode())
        while True:
            members = _parse_members(self.store.get(self._key(upcoming, "members")).decode())
            missing = [i for i in ids if i not in members]
            if not missing or time.monotonic() >= deadline or not any(_maybe_alive(running.get(i)) for i in missing):
                break
            time.sleep(_POLL_S)
        survivors = [members[i] for i in sorted(members) if i in ids]
        step = max(m.step for m in survivors)
        record = {"members": [asdict(m) for m in survivors], "lost": missing, "step": step}
        self.store.set(self._key(upcoming, "settled"), json.dumps(record))


def _parse_pids(text: str) -> dict[int, tuple[int, str]]:
    rows = (line.split(" ", 2) for line in text.splitlines() if line)
    return {int(member): (int(pid), host) for member, pid, host in rows}


def _parse_members(text: str) -> dict[int, Member]:
    found = (Member(**json.loads(line)) for line in text.splitlines() if line)
    return {member.id: member for member in found}


def _maybe_alive(running: tuple[int, str] | None) -> bool:
    """Whether a missing member may still arrive: not known to be gone (another host's pid can't be probed)."""
    if running is None:
        return True
    pid, host = running
    return host != socket.gethostname() or pid_alive(pid)
