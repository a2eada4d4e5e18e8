"""A training job that survives a lost rank: it owns the step counter, the commit point and the regrouping.

[Note: the step is a commit]
A step changes nothing persistent before :meth:`Job.commit`: forward and backward only fill gradients.
``commit`` is one agreement of ``_comm`` over the default group (every rank's gradients are reduced),
then the optimizer step, which has no collective. A rank lost before the commit leaves every survivor
at the same completed step: they drop their gradients and retry the step. A rank lost inside the
agreement may leave some survivors past it and some not; the settlement's step is the largest any
survivor completed, and one that did not take it still holds its reduced gradients (every rank
contributed to the agreement another survivor finished), so it takes that optimizer step in recovery.
Either way every survivor's parameters, optimizer state and step counter equal the same completed step.

[Note: why a builder]
The front ends bind their process group when they wrap the model (DDP's reducer, the sharded
parameters' plans), so a new group needs a new wrapper: :class:`Job` calls ``build()`` once per
generation and the builder wraps the same module and optimizer again. It is honest about what
changes (the wrapper) and keeps what does not (the module's tensors, the optimizer's state).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._comm.agreement import agree
from .._comm.objects import all_gather_object, broadcast_object_list
from .._comm.regroup import close_groups, open_default_group
from .._comm.watch import CollectiveDivergence
from .buddy import BuddyCopy, buddy_of
from .errors import RankLost, ShardsLost
from .membership import NAMESPACE, Member, Membership, Settlement
from .sampler import Sampler
from .shard_state import FullState, full_state, load_full_state, shard_parts, specs

__all__ = ["Job"]

Build = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]


class Job:
    """The step counter, the commit point and the regrouping of one rank of a job that survives lost ranks.

    ``build()`` returns ``(model, optimizer)`` over the current default group; it is called now and again
    after every regroup (see [Note: why a builder]). ``sampler`` splits each global batch over the ranks
    alive. The job starts the default process group itself, per generation, over the store at
    ``MASTER_ADDR:MASTER_PORT`` (a client: the store lives in a process that is not a rank), with
    ``RANK`` / ``WORLD_SIZE`` of the first generation; ``store`` overrides the connection.
    ``redundancy``: ``None`` when every rank holds everything (DDP); ``"buddy"`` for a 1-D fully_shard model:
    each rank's shard is copied to the next rank every step (see [Note: the buddy copy]) and resharded over
    the survivors in memory when a rank is lost.
    A process started with ``TENSORPLAY_SURVIVE_JOIN=1`` is a replacement: its ``Job`` waits until the running
    job admits it after a commit, then holds its share like any member (healing, see [Note: settling
    membership]).
    ``settle_s``: how long survivors wait for a member that is neither arrived nor known dead; by default
    the group's ``timeout`` plus 5 s, since a survivor blocked in a collective we do not issue (DDP's own
    all-reduce) on a live peer wakes only at the group's timeout (see [Note: regrouping]).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int  # steps completed (committed) on this rank
    generation: int
    member_id: int  # this rank's id for the whole job: its RANK in the first generation

    def __init__(self, build: Build, sampler: Sampler, *, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=30), redundancy: str | None = None,
                 settle_s: float | None = None, store: Any = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("survive.Job starts the default process group itself (it starts a new one per "
                               "generation): create the Job before init_process_group, not after")
        if settle_s is not None and not settle_s > 0:
            raise ValueError(f"survive.Job: settle_s must be > 0 seconds, got {settle_s!r}")
        if redundancy not in (None, "buddy"):
            raise ValueError(f"survive.Job: redundancy must be None (every rank holds everything) or 'buddy', "
                             f"got {redundancy!r}")
        self._buddy = BuddyCopy() if redundancy == "buddy" else None
        self._build, self.sampler, self._backend, self._timeout = build, sampler, backend, timeout
        self._store = store if store is not None else _store_from_env()
        self._membership = Membership(self._store, timeout.total_seconds() + 5 if settle_s is None else settle_s)
        self._first_world = _env_int("WORLD_SIZE")
        self._in_commit, self._doing = False, "between steps"
        self._settlement: Settlement | None = None
        if os.environ.get("TENSORPLAY_SURVIVE_JOIN") == "1":
            self._join()
            return
        self.member_id, self._admitted = _env_int("RANK"), 0
        sampler.check_world(self._first_world)
        self.step, self.generation, self._ids = 0, 0, list(range(self._first_world))
        self._start_generation()

    # ---- the loop's side -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._ids.index(self.member_id)

    @property
    def world_size(self) -> int:
        return len(self._ids)

    def indices(self) -> torch.Tensor:
        """This rank's dataset indices of global batch :attr:`step`."""
        return self.sampler.indices(self.step, self.rank, self.world_size)

    def weight(self) -> float:
        """The factor of a mean loss over this rank's share (see :meth:`Sampler.weight`)."""
        return self.sampler.weight(self.rank, self.world_size)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Run one step's code; a lost rank comes out of it as :class:`RankLost` (after the settlement)."""
        self._doing = f"computing step {self.step} (before its commit)"
        with self._lost_on_failure():
            yield

    def commit(self) -> None:
        """Step :attr:`step` is done on every rank: agree (every rank's gradients are reduced), then take the
        optimizer step and clear the gradients (see [Note: the step is a commit])."""
        self._doing, self._in_commit = f"in the commit of step {self.step}", True
        waiting = self._membership.waiting() if self.rank == 0 else 0  # replacements: rank 0 reads, all agree
        with self._lost_on_failure():
            self._refresh_copy()  # before the agreement: a committed step has every copy (see the buddy note)
            admit = agree(f"survive commit of step {self.step}", False, values=[waiting]).values[0][0]
        self._doing = f"in the optimizer step of step {self.step}"
        self._take_step()
        if admit > self._admitted:
            self._grow(admit)

    def recover(self, lost: RankLost) -> None:
        """Carry on over the survivors that ``lost`` names: the next generation's default group, the step that
        was committed finished here too, ``build()`` called again. The loop then retries :attr:`step`."""
        settlement = self._settlement
        if settlement is None or lost.generation != settlement.generation:
            raise ValueError(f"survive.Job.recover: this rank settled no generation {lost.generation} "
                             f"(pass the RankLost this rank's job raised)")
        self.sampler.check_world(len(settlement.members))
        old_ids, old_rank = self._ids, self.rank
        if self._buddy is not None:
            _check_copies(settlement, old_ids)
        if self.step < settlement.step:
            self._take_step()  # committed by a peer: this rank's gradients are reduced (see the note)
        else:
            self._drop_gradients()
        mine = self._own_shards(old_rank, settlement, old_ids)
        self._ids, self.generation, self._settlement = settlement.ids(), settlement.generation, None
        self._open_generation()
        self._build_model(self._gather_whole(old_ids, mine) if self._buddy is not None else None)

    # ---- healing -------------------------------------------------------------------------------------
    def _join(self) -> None:
        """A replacement (``TENSORPLAY_SURVIVE_JOIN=1``): wait until the running job admits it at a step
        boundary, then take its place in that generation and receive the state from its peers."""
        ticket = self._membership.join()
        self.member_id = self._first_world + ticket - 1
        settlement = self._membership.admission(ticket)
        self._ids, self.generation, self.step = settlement.ids(), settlement.generation, settlement.step
        self._admitted = max(self._ids) - self._first_world + 1
        self._open_generation()
        self._receive_state([i for i in self._ids if i < self.member_id], {})

    def _grow(self, admit: int) -> None:
        """Every member, at the boundary after the commit that admitted tickets up to ``admit``: the next
        generation with the replacements last; the state resharded over it (see [Note: settling membership])."""
        old_ids, old_rank = self._ids, self.rank
        tickets = range(self._admitted + 1, admit + 1)
        new_ids = old_ids + [self._first_world + ticket - 1 for ticket in tickets]
        if old_rank == 0:
            self._membership.admit(self.generation + 1, new_ids, self.step, tickets)
        mine = {old_rank: shard_parts(self.model, self.optimizer)} if self._buddy is not None else {}
        close_groups()
        self._ids, self.generation, self._admitted = new_ids, self.generation + 1, admit
        self._open_generation()
        self._receive_state(old_ids, mine)

    def _receive_state(self, old_ids: list[int], mine: dict[int, Any]) -> None:
        """Build over the grown group; sharded: reshard the members' shards over it; replicated: rank 0 sends
        its module's and optimizer's state to the replacements."""
        if self._buddy is not None:
            self._build_model(self._gather_whole(old_ids, mine))
            return
        self._build_model(None)
        module = getattr(self.model, "module", self.model)  # DDP's wrapped module
        state: list[Any] = [(module.state_dict(), self.optimizer.state_dict()) if self.rank == 0 else None]
        broadcast_object_list(state, 0, where="survive join")
        if self.member_id not in old_ids:
            module.load_state_dict(state[0][0])
            self.optimizer.load_state_dict(state[0][1])

    # ---- the job's side ------------------------------------------------------------------------------
    def _start_generation(self) -> None:
        self._open_generation()
        self._build_model(None)

    def _open_generation(self) -> None:
        self._membership.register(self.generation, self.member_id, self.world_size)
        open_default_group(self._backend, self._store, f"{NAMESPACE}/g{self.generation}/pg", self.rank,
                           self.world_size, self._timeout)

    def _build_model(self, whole: FullState | None) -> None:
        """``build()`` over the current group; load the resharded state into it; give the buddy its copy."""
        self.model, self.optimizer = self._build()
        if whole is not None:
            load_full_state(whole, self.model, self.optimizer, self.rank, self.world_size)
        with self._lost_on_failure():
            self._refresh_copy()
        self._doing = "between steps"

    def _refresh_copy(self) -> None:
        if self._buddy is not None:
            self._buddy.refresh(self.step, self.model, self.optimizer, self.rank, self.world_size)

    def _own_shards(self, old_rank: int, settlement: Settlement, old_ids: list[int]) -> dict[int, Any]:
        """The shards this survivor brings to the reshard, by old rank: its own, and a lost rank's copy."""
        if self._buddy is None:
            return {}
        mine = {old_rank: shard_parts(self.model, self.optimizer)}
        held = self._buddy.held
        if held is not None and held.world == len(old_ids) and old_ids[held.owner] in settlement.lost:
            fqns = {id(param): fqn for fqn, param in self.model.named_parameters()}
            mine[held.owner] = self._buddy.restore(settlement.step, self.optimizer, fqns)
        self._buddy.held = None  # a copy of the old layout: the new generation's follows
        return mine

    def _gather_whole(self, old_ids: list[int], mine: dict[int, Any]) -> FullState:
        """Every parameter and optimizer state whole, from the shards each member brings (``mine``), gathered
        over the new group (O(model) bytes per member: correctness first)."""
        gathered: list[Any] = [None] * self.world_size
        layout = specs(self.model, self.optimizer) if mine else None  # a replacement has no model yet
        all_gather_object(gathered, (mine, layout), where="survive reshard")
        shards = {old: parts for theirs, _ in gathered for old, parts in theirs.items()}
        missing = [old_ids[old] for old in range(len(old_ids)) if old not in shards]
        if missing:
            raise ShardsLost(f"no survivor holds a copy of the shards of rank(s) {missing}; restart the job "
                             "from its last checkpoint")
        shard_specs = next(theirs for _, theirs in gathered if theirs is not None)
        return full_state([shards[old] for old in range(len(old_ids))], shard_specs)

    def _take_step(self) -> None:
        self.optimizer.step()
        self._drop_gradients()
        self.step, self._in_commit, self._doing = self.step + 1, False, "between steps"

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._in_commit = False

    @contextlib.contextmanager
    def _lost_on_failure(self) -> Iterator[None]:
        try:
            yield
        except RankLost:
            raise
        except RuntimeError as error:
            raise self._settle(error) from error

    def _settle(self, error: RuntimeError) -> CollectiveDivergence:
        """A collective failed: close the groups (waking peers still blocked on this rank), settle who is left."""
        close_groups()
        me = Member(self.member_id, self.step, self._in_commit, self._doing)
        settlement = self._membership.settle(self.generation, self._ids, me)
        if self.member_id not in settlement.ids():
            return CollectiveDivergence(
                f"rank {self.member_id} (job id) reached the settlement of generation {settlement.generation} "
                f"after the survivors {settlement.ids()} had settled without it (settle_s: "
                f"{self._membership.settle_s:g} s); it was declared lost and cannot rejoin")
        if not settlement.lost:
            return CollectiveDivergence(
                f"a collective failed ({error}) but no rank of the job was lost: every member reported to the "
                f"settlement of generation {settlement.generation}; the groups are closed and the job must "
                "restart from its checkpoint")
        behind = [m.id for m in settlement.members if m.step < settlement.step - 1 or
                  (m.step == settlement.step - 1 and not m.in_commit)]
        if behind:
            return CollectiveDivergence(f"survivors {behind} are not within one committed step of step "
                                        f"{settlement.step}: the survivors' states differ; restart from the checkpoint")
        self._settlement = settlement
        doing = {m.id: m.doing for m in settlement.members}
        return RankLost(settlement.lost, settlement.step, doing, settlement.generation)


def _check_copies(settlement: Settlement, old_ids: list[int]) -> None:
    """Raise :class:`ShardsLost` on every survivor alike when a lost rank's buddy is lost too."""
    gone = [member for index, member in enumerate(old_ids) if member in settlement.lost and
            old_ids[buddy_of(index, len(old_ids))] in settlement.lost]
    if gone:
        pairs = ", ".join(f"rank {member} and its buddy rank {old_ids[buddy_of(old_ids.index(member), len(old_ids))]}"
                          for member in gone)
        raise ShardsLost(f"both copies of the shards of rank(s) {gone} are lost ({pairs} were lost together); "
                         "the job cannot carry on in-process: restart it from its last checkpoint "
                         "(tprun --max-restarts)")


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise ValueError(f"survive.Job: the environment variable {name} must be set to a non-negative integer "
                         f"(the launcher sets it), got {value!r}")
    return int(value)


def _store_from_env() -> Any:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        raise ValueError(f"survive.Job: MASTER_ADDR and MASTER_PORT must name the job's store (hosted by the "
                         f"launcher, not by a rank), got MASTER_ADDR={host!r} MASTER_PORT={port!r}")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
