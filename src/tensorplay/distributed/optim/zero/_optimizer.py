"""ZeroRedundancyOptimizer: each rank keeps the optimizer state of only its own parameters.

Ownership is whole parameters, packed by ``_sharding.partition.sorted_greedy_partition``
(the same partition as PyTorch's; with ``optimizer_class=torch.optim.Muon`` balanced by
Newton-Schulz FLOPs instead of elements). A step updates the local shard and
broadcasts it (``_sync``); checkpoints go through one full state dict
(``_state``); the DDP-overlap mode is driven by the hooks in
``tensorplay.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` (``_overlap``).

Where this differs from PyTorch's (a wart fixed, the API kept):

* parameters of several dtypes are fine (one bucket per device and dtype);
* optionally (``PIPELINE_UNIT_NUMEL``), with bucket views and a per-parameter
  optimizer, the update is pipelined with the broadcasts (see [Note: pipelined
  step] in ``_sync``), same arithmetic;
* without bucket views, small parameters travel packed (see [Note: small
  parameters] in ``_sync``);
* an error on one rank (bad arguments, a failing local step) is raised on every
  rank instead of leaving the others blocked in a broadcast;
* ``step()`` with ``overlap_with_ddp=True`` and no ZeRO hook registered raises
  instead of silently never updating;
* the DDP-overlap hooks work on Gloo;
* ``load_state_dict`` keeps only the local shard (no second copy of it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only

import tensorplay.distributed as dist
from tensorplay.distributed._checks.load_check import StateDictLoadError, agree_on_all_ranks
from tensorplay.distributed._checks.plan_agreement import check_plan_agreement, param_group_entries
from tensorplay.distributed._checks.validation import check_bool, check_process_group
from tensorplay.distributed._comm import objects
from tensorplay.distributed._comm.collectives import Pending, wait_all
from tensorplay.distributed._sharding.devices import collective_device
from tensorplay.distributed._sharding.partition import sorted_greedy_partition
from tensorplay.distributed._sharding.plan import ShardPlan
from tensorplay.distributed._torch_identity import identity_only
from tensorplay.distributed.algorithms.join import Join, Joinable, JoinHook
from tensorplay.distributed.optim import _torch_types as torch_optim
from tensorplay.distributed.optim.matrix import step_cost
from tensorplay.distributed.optim.zero import _checks as checks
from tensorplay.distributed.optim.zero._chunked_step import ELEMENTWISE_OPTIMIZERS, ChunkedStep
from tensorplay.distributed.optim.zero._overlap import Overlap, OverlapResult
from tensorplay.distributed.optim.zero._state import (
    full_state_problems,
    local_part,
    local_state_dict,
    merge_local_states,
    to_device,
)
from tensorplay.distributed.optim.zero._sync import (
    RankBuckets,
    StepStatus,
    Unit,
    restricted_to,
    rounds_of,
    split_units,
)

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

#: Optimizers whose step treats each parameter on its own, so a shard may be
#: stepped in pieces (see [Note: pipelined step] and [Note: chunked step]).
PER_PARAMETER_OPTIMIZERS: frozenset[type] = ELEMENTWISE_OPTIMIZERS
#: Elements per pipelined unit with bucket views (e.g. ``1 << 22``, 16 MiB of fp32),
#: or None: no pipelining. Off by default: on a 2-core machine running 2 ranks
#: there is no spare core for the transfers and it measured slower (see
#: [Note: pipelined step]); set it where each rank has cores to spare.
PIPELINE_UNIT_NUMEL: int | None = None


def copy_hyperparams(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    """Copy every option but ``params`` from each group of ``src`` to the matching group of ``dst``."""
    for src_group, dst_group in zip(src, dst, strict=True):
        for key, value in src_group.items():
            if key != "params":
                dst_group[key] = value


def _functional_classes() -> tuple[dict[Any, type], Callable[..., Any]]:
    from tensorplay.distributed.optim.utils import (
        functional_optim_from,
        functional_optim_map,
    )

    return functional_optim_map, functional_optim_from


_CPU = torch.device("cpu")


def _broadcast_object(obj: Any, src_rank: int, group: dist.ProcessGroup | None = dist.group.WORLD,
                      device: torch.device = _CPU) -> Any:
    """``obj`` from global rank ``src_rank`` to every rank of ``group`` (call on every rank of it).

    The source gets ``obj`` itself back; the others a copy whose tensors (in
    dicts, lists and tuples) are on ``device``, which is also where the
    serialized bytes travel (so it must suit ``group``'s backend).

    Example:
        >>> import tensorplay.distributed as dist
        >>> from tensorplay.distributed.optim.zero_redundancy_optimizer import _broadcast_object
        >>> _broadcast_object({"step": 3} if dist.get_rank() == 0 else None, src_rank=0)
        {'step': 3}
    """
    holder = [obj if dist.get_rank() == src_rank else None]
    group_src = src_rank if group is None or group is dist.group.WORLD else dist.get_group_rank(group, src_rank)
    objects.broadcast_object_list(holder, group_src, group, device=device, where="ZeroRedundancyOptimizer state")
    if dist.get_rank() == src_rank:
        return obj
    return tree_map_only(torch.Tensor, lambda tensor: tensor.to(device), holder[0])


class _ZeROJoinHook(JoinHook):
    """A rank that ran out of inputs keeps stepping, so its shard still reaches the others."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


@identity_only
class ZeroRedundancyOptimizer(torch_optim.ZeroRedundancyOptimizer):  # an Optimizer, Joinable; see _torch_types
    """Wrap ``optimizer_class`` so each rank of ``process_group`` keeps the state of about 1/world_size of the
    parameters (ZeRO stage 1).

    Args:
        params: tensors or param-group dicts, as for any optimizer; all of them, on every rank.
        optimizer_class: the local optimizer (a ``tp.optim.Optimizer`` subclass).
        process_group: the group to shard across (default: the world).
        parameters_as_bucket_view: keep each rank's parameters in one flat buffer per device and
            dtype (parameters become views), so a step needs one broadcast per rank and buffer.
        overlap_with_ddp: run each DDP bucket's update and broadcast inside DDP's backward; needs
            a hook from ``ddp_zero_hook`` registered on the DDP model. The first two iterations
            (three with ``static_graph``) only learn DDP's buckets and update nothing, as in PyTorch.
        **defaults: options for ``optimizer_class`` (``lr`` ...).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        >>> model = tp.nn.Sequential(tp.nn.Linear(16, 32), tp.nn.Linear(32, 4))
        >>> optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=tp.optim.AdamW, lr=1e-3)
        >>> model(tp.randn(8, 16)).sum().backward()        # under DDP, gradients are all-reduced here
        >>> optimizer.step()                                # steps this rank's partition, broadcasts the result
        >>> optimizer.consolidate_state_dict(to=0)          # gathers the full state on rank 0 (or use get_state_dict)
        >>> sorted(optimizer.state_dict()["state"])
        [0, 1, 2, 3]
    """

    def __init__(self, params: Any, optimizer_class: type[Optimizer], process_group: Any | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        self.initialized = False
        check_process_group(process_group, "process_group", "ZeroRedundancyOptimizer")  # before any collective
        group = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(group)  # raises first if there is no default group
        assert group is not None
        self._plan = ShardPlan.over(group)  # ZeRO partitions over one group: no replicas, nothing resharded
        self.process_group: dist.ProcessGroup = group
        self.rank: int = self._plan.shard_rank
        self.global_rank: int = dist.get_global_rank(self.process_group, self.rank)
        self._flags = {"parameters_as_bucket_view": parameters_as_bucket_view, "overlap_with_ddp": overlap_with_ddp}
        self.parameters_as_bucket_view = parameters_as_bucket_view and not overlap_with_ddp
        self._overlap_with_ddp = overlap_with_ddp
        self._optim_defaults = defaults
        self._all_state_dicts: list[dict[str, Any]] = []
        self._vote_device = collective_device(self.process_group)
        self._buckets: RankBuckets | None = None
        self._rounds: list[list[Unit]] = []
        self._owned: Sequence[list[list[int]]] = []
        self._overlap: Overlap | None = None
        self._chunked: ChunkedStep | None = None
        self._status: StepStatus | None = None
        self._all_params: list[torch.Tensor] = []
        error: BaseException | None = None
        try:
            self._setup(params, optimizer_class, defaults)
        except Exception as caught:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = caught
        checks.agree_on_error(error, "ZeroRedundancyOptimizer construction", self.process_group, self._vote_device)
        # Every rank set up: now they must agree on the parameters (see [Note: plan agreement]).
        check_plan_agreement(param_group_entries([g["params"] for g in self.param_groups]), self.process_group,
                             what="ZeroRedundancyOptimizer construction", device=self._vote_device)
        if self._overlap is None:
            self._build_sync()  # the first change to the parameters (bucket views): every check passed
        self.initialized = True

    def _setup(self, params: Any, optimizer_class: type[Optimizer], defaults: dict[str, Any]) -> None:
        for name, flag in self._flags.items():
            check_bool(flag, name, "ZeroRedundancyOptimizer")
        listed = checks.listed_params(params)
        groups = [checks.group_params(g) for g in listed] if isinstance(listed[0], dict) else [listed]
        checks.check_unique(groups)
        checks.check_dense(groups)
        functional_map, self._functional_from = _functional_classes()
        checks.check_optimizer_class(optimizer_class, functional_map, self._overlap_with_ddp)
        self._optim_class = optimizer_class
        Optimizer.__init__(self, listed, defaults)
        Joinable.__init__(self)
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._default_device = self._all_params[0].device
        self._per_parameter = optimizer_class in PER_PARAMETER_OPTIMIZERS
        if self._overlap_with_ddp:
            self._overlap = Overlap(self._all_params, self.process_group, self._new_functional_optim,
                                    lambda: self.param_groups[0], self._adopt_overlap)
            return
        self._owned = self._partition()
        try:  # the options are the local optimizer's to judge; say which call failed
            self.optim: Any = optimizer_class(self._local_groups(), **defaults)
        except (TypeError, ValueError) as error:
            kind = ValueError if isinstance(error, ValueError) else TypeError
            raise kind(f"ZeroRedundancyOptimizer: {optimizer_class.__name__}(params, **defaults) with "
                       f"defaults={defaults!r} failed: {error}") from error
        copy_hyperparams(self.optim.param_groups, self.param_groups)

    def _new_functional_optim(self, params: list[torch.Tensor]) -> Any:
        return self._functional_from(self._optim_class, params, **self._optim_defaults)

    def _adopt_overlap(self, result: OverlapResult) -> None:
        """Keep the partition and local optimizer the DDP-overlap mode built once DDP's buckets were known."""
        self._owned, self.optim = result.owned, result.optim

    # ------------------------------------------------------------------ partition

    def _partition(self) -> Sequence[list[list[int]]]:
        """Whole parameters to ranks, balanced by elements (PyTorch's partition) or, for Muon, by Newton-Schulz
        FLOPs (its step's cost is cubic in a matrix's short side, not linear in its elements)."""
        costs = [[step_cost(self._optim_class, p.shape, {**self._optim_defaults, **g}) for p in g["params"]]
                 for g in self.param_groups]
        return sorted_greedy_partition(costs, self.world_size)

    def _owned_params(self, rank: int) -> list[list[torch.Tensor]]:
        """Rank ``rank``'s parameters, per group, in its local optimizer's order."""
        return [[group["params"][i] for i in positions]
                for group, positions in zip(self.param_groups, self._owned[rank], strict=True)]

    def _local_groups(self) -> list[dict[str, Any]]:
        owned = self._owned_params(self.rank)
        return [dict(group, params=params) for group, params in zip(self.param_groups, owned, strict=True)]

    def _build_sync(self) -> None:
        """(Re)build the buckets and broadcast rounds from the partition and current trainability."""
        trainable = [[p for g in self._owned_params(r) for p in g if p.requires_grad] for r in range(self.world_size)]
        if self.parameters_as_bucket_view:
            self._release_frozen_from_buckets()
            self._buckets = RankBuckets(trainable)
        # Only where a unit is one contiguous broadcast (see [Note: pipelined step]).
        self._pipelined = self._per_parameter and self._buckets is not None and PIPELINE_UNIT_NUMEL is not None
        unit_numel = PIPELINE_UNIT_NUMEL if self._pipelined else None
        self._rounds = rounds_of([split_units(r, params, unit_numel, self._buckets)
                                  for r, params in enumerate(trainable)])
        self._trainable_mask = [p.requires_grad for p in self._all_params]
        self._frozen_owned = [p for g in self._owned_params(self.rank) for p in g if not p.requires_grad]
        self._chunked = None if self._pipelined else ChunkedStep.of(self.optim)
        self._status = StepStatus.of(self._rounds, self._buckets, self.world_size, self.rank)

    def _release_frozen_from_buckets(self) -> None:
        if self._buckets is None:
            return
        for param in self._all_params:
            if not param.requires_grad and self._buckets.holds(param):
                param.data = param.data.clone()

    # ------------------------------------------------------------------ step

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Update this rank's shard, then bring every rank's updated shard to every rank."""
        if self._overlap is not None:
            self._overlap.step_outside_hook()
            return None
        Join.notify_join_context(self)
        if [p.requires_grad for p in self._all_params] != self._trainable_mask:
            logger.warning("ZeroRedundancyOptimizer: trainable parameters changed; rebuilding the broadcasts")
            self._build_sync()
        copy_hyperparams(self.param_groups, self.optim.param_groups)
        loss = self._update_and_broadcast(closure, kwargs)
        copy_hyperparams(self.optim.param_groups, self.param_groups)
        return loss

    def _update_and_broadcast(self, closure: Callable[[], float] | None, kwargs: dict[str, Any]) -> float | None:
        """Run the local step and every broadcast round; then every rank learns whether any step failed.

        A failing local step still sends (unchanged) parameters, so every rank issues the same
        collectives (see [Note: errors must not strand peers]); the outcome rides on the bucket
        broadcasts, else on a small all-reduce queued behind them (see [Note: step errors ride on
        the broadcasts]).
        """
        loss, error = None, None
        status = self._status
        assert status is not None  # made with the broadcast rounds
        pipelined = self._pipelined and closure is None
        if not pipelined:
            loss, error = self._guarded(partial(self._local_step, closure, kwargs))
        works: list[Pending] = []
        for index, unit_round in enumerate(self._rounds):
            if pipelined and error is None:
                params = [p for unit in unit_round if unit.rank == self.rank for p in unit.params]
                # Frozen parameters are in no unit; a plain optimizer would still step any with a grad.
                params += self._frozen_owned if index == len(self._rounds) - 1 else []
                if params:
                    _, error = self._guarded(partial(self._step_only, params, kwargs))
            status.set(error)
            for unit in unit_round:
                works.extend(unit.broadcast(self.process_group, self.rank))
        what = "ZeroRedundancyOptimizer.step (the local optimizer step)"
        vote = None if status.rides else checks.ErrorVote.start(error, what, self.process_group, self._vote_device)
        wait_all(works)
        for unit_round in self._rounds:
            for unit in unit_round:
                unit.finish(self.rank)
        if vote is not None:
            vote.settle()
        else:
            checks.raise_on_failure(error, status.failed_ranks(), what, self.rank)
        return loss

    def _local_step(self, closure: Callable[[], float] | None, kwargs: dict[str, Any]) -> float | None:
        """The local optimizer's step: over cache-sized chunks where it can (see [Note: chunked step])."""
        if closure is None and self._chunked is not None and self._chunked.step(**kwargs):
            return None
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        if self._chunked is not None:
            self._chunked.unbind()
        return loss

    def _step_only(self, params: list[torch.Tensor], kwargs: dict[str, Any]) -> None:
        with restricted_to(self.optim, params):
            self.optim.step(**kwargs)

    @staticmethod
    def _guarded(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        try:
            return fn(), None
        except Exception as error:  # noqa: BLE001 - agreed on with the other ranks, then re-raised
            return None, error

    # ------------------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (on every rank); its parameters are partitioned onto the ranks, earlier ones stay put."""
        if not self.initialized:
            Optimizer.add_param_group(self, param_group)  # past PyTorch's class
            return
        if self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                               "group (DDP's buckets decide the partition); add_param_group is not available")
        new = [checks.group_params(param_group)]
        existing = [g["params"] for g in self.param_groups]
        checks.check_unique(new, first_group_index=len(existing), existing=existing)
        checks.check_dense(new, first_group_index=len(existing))
        Optimizer.add_param_group(self, param_group)  # past PyTorch's class
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._owned = self._partition()
        self.optim.add_param_group(self._local_groups()[-1])
        copy_hyperparams(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._build_sync()

    # ------------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on rank ``to`` (call on every rank), for :meth:`state_dict`."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): to must be a rank of the group, "
                             f"0..{self.world_size - 1}")
        self._check_overlap_ready("consolidate_state_dict")
        copy_hyperparams(self.param_groups, self.optim.param_groups)
        local = to_device(local_state_dict(self.optim), torch.device("cpu"), copy=True)
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        objects.gather_object(local, gathered, to, self.process_group, where="consolidate_state_dict")
        self._all_state_dicts = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state last consolidated on this rank, as a plain optimizer's state dict."""
        self._check_overlap_ready("state_dict")
        if not self._all_state_dicts:
            raise RuntimeError(
                f"rank {self.rank} holds no consolidated optimizer state: call consolidate_state_dict(to={self.rank}) "
                f"on every rank first, then state_dict() on rank {self.rank}; to checkpoint without gathering, use "
                "tensorplay.distributed.checkpoint.state_dict.get_optimizer_state_dict (each rank its own state)")
        return merge_local_states(Optimizer.state_dict(self), self._all_state_dicts, self._owned)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from any world size, or a plain optimizer); this rank keeps only its shard.

        All or nothing (see [Note: all-or-nothing loads]): every group and state entry is checked
        and the ranks agree before anything changes; one error lists every problem.
        """
        self._check_overlap_ready("load_state_dict")
        problems = full_state_problems(state_dict, [g["params"] for g in self.param_groups],
                                       elementwise=self._optim_class in ELEMENTWISE_OPTIMIZERS)
        where = "ZeroRedundancyOptimizer"
        agree_on_all_ranks(StateDictLoadError(where, problems) if problems else None, where=where,
                           group=self.process_group)
        local = local_part(state_dict, self._owned[self.rank])
        if hasattr(self.optim, "load_state_dict"):
            self.optim.load_state_dict(local)
        else:
            self._overlap_load(local)
        copy_hyperparams(state_dict["param_groups"], self.param_groups)
        copy_hyperparams(self.param_groups, self.optim.param_groups)

    def _overlap_load(self, local: dict[str, Any]) -> None:
        params = self.optim.param_groups[0]["params"]
        for index, value in local["state"].items():
            param = params[index]
            self.optim.state[param] = {k: v.to(param.device) if isinstance(v, torch.Tensor) and v.dim() else v
                                       for k, v in value.items()}

    def _check_overlap_ready(self, what: str) -> None:
        if self._overlap is not None:
            self._overlap.check_ready(what)

    # ------------------------------------------------------------------ Join

    def join_hook(self, **_kwargs: Any) -> JoinHook:
        """The hook that keeps a rank with no inputs left stepping (and broadcasting) under ``Join``."""
        return _ZeROJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group
