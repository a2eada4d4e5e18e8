"""FSDPParamGroup: the parameters of one fully_shard call, all-gathered and reduce-scattered together.

[Note: flat buffers]
The group's shards live back to back in one 1D buffer per rank (``flat_shard``,
``shard_numel`` elements: each parameter's padded shard in order). The
all-gather input is that buffer itself (no copy-in unless a dtype cast or a
device move is needed) and the output is ``(world, shard_numel)``, rank-major;
each parameter's unsharded tensor is filled from its column block with one
copy. The reduce-scatter input is built in the same rank-major layout with one
``_chunk_cat`` (which also pads and casts), so each rank's result is exactly
the layout of its flat shard.

[Note: reshard to a smaller group]
With ``reshard_after_forward=N``, a rank keeps, after forward, the N-th part of
the all-gather output that its position in its row of N ranks selects. Because
the output is rank-major, gathering those parts across the row in order
rebuilds the whole output: backward needs one all-gather over N ranks.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._comm import collectives
from tensorplay.distributed._sharding.layout import flat_layout
from tensorplay.distributed._sharding.storage import BufferPool

from ._fsdp_api import AllGather, MixedPrecisionPolicy, OffloadPolicy, ReduceScatter
from ._fsdp_common import MeshInfo, PostForwardInfo, ShardedState, TrainingState, comm_streams
from ._fsdp_optim_in_backward import sharded_grads_ready
from ._fsdp_param import FSDPParam
from ._fsdp_spmd import local_tensor


@dataclass
class GradReduction:
    """One group's gradient reduction in flight: the reduce-scatter, then with HSDP the all-reduce across replicas.

    [Note: the all-reduce across replicas stays in flight]
    With HSDP the reduce-scatter's finishing step starts the all-reduce of the
    summed shard over the replicate group and leaves it running;
    :meth:`advance` (called to bound the reduce-scatters in flight)
    returns without waiting for it, so it overlaps the next groups' backward,
    as PyTorch's does on its reduce-scatter stream. :meth:`wait` (end of
    backward) waits for both and hands the gradients out.
    """

    scatter: collectives.Pending
    replicas: collectives.Pending | None = None  # started by the reduce-scatter's finishing step (HSDP)

    def advance(self) -> None:
        """Finish the reduce-scatter (its input buffer is free again); the all-reduce may still run."""
        self.scatter.wait()

    def wait(self) -> None:
        self.scatter.wait()
        if self.replicas is not None:
            self.replicas.wait()

    def discard(self) -> None:
        """Wait for whatever was issued but hand no gradient out (a step that raised)."""
        self.scatter.discard()
        if self.replicas is not None:
            self.replicas.discard()


@dataclass
class _GatherInFlight:
    """A group's issued all-gather: the handle to wait on, and where its result lands."""

    pending: collectives.Pending
    output: torch.Tensor | None = None  # (world, shard_numel); None: straight into the unsharded parameters
    give_back: Callable[[torch.Tensor], None] | None = None  # returns ``output`` to the pool that lent it
    #: On an accelerator: the all-gather stream's event after this all-gather was issued. The copy-out waits for
    #: it, not for the whole stream, which by then holds the next group's prefetch too.
    issued: torch.Event | None = None

    def release_output(self) -> None:
        """The output is copied out: hand it back to its pool (a user's all-gather's is simply dropped)."""
        if self.output is not None and self.give_back is not None:
            self.give_back(self.output.view(-1))
        self.output = None


class FSDPParamGroup:
    """One all-gather / reduce-scatter unit: the parameters one ``fully_shard`` call manages."""

    fsdp_params: list[FSDPParam]
    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo
    post_forward_info: PostForwardInfo | None
    device: torch.device
    flat_shard: torch.Tensor  # 1D, shard_numel, original dtype, on the sharded device
    sharded_state: ShardedState
    training_state: TrainingState
    reshard_after_forward: bool
    reshard_after_backward: bool
    requires_gradient_sync: bool
    requires_all_reduce: bool
    gradient_divide_factor: float | None
    module_fqn: str | None = None  # the group's modules in the root ("" for the root), set by its lazy init
    unshard_in_backward: bool  # False: backward runs without the unsharded parameters (not needed there)
    reduce_scatter_unused_params: bool  # True: every parameter gets a gradient, zeros where no rank used it
    max_input_buffers: int  # reduce-scatters (and their input buffers) left in flight after this group's
    all_gather_comm: AllGather | None  # a user's all-gather (set_custom_all_gather), else ours
    reduce_scatter_comm: ReduceScatter | None
    all_reduce_hook: Callable[[torch.Tensor], None] | None  # on the summed sharded gradient, before dividing
    #: The reduce-scatter's own group over the shard ranks (set_separate_reduce_scatter_group), else None: the
    #: shard group, shared with the all-gather.
    reduce_scatter_group: ProcessGroup | None

    def __init__(self, fsdp_params: list[FSDPParam], modules: tuple[nn.Module, ...], mesh_info: MeshInfo,
                 post_forward: PostForwardInfo | None, device: torch.device, mp_policy: MixedPrecisionPolicy,
                 offload_policy: OffloadPolicy, reshard_after_forward: bool) -> None:
        self.fsdp_params, self.modules, self.mesh_info = fsdp_params, modules, mesh_info
        self.post_forward_info, self.device = post_forward, device
        self.mp_policy, self.offload_policy = mp_policy, offload_policy
        self.placement = offload_policy.placement(device)
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor = None
        self.unshard_in_backward, self.reduce_scatter_unused_params = True, False
        self.max_input_buffers = 1
        self.all_gather_comm, self.reduce_scatter_comm, self.all_reduce_hook = None, None, None
        self.reduce_scatter_group = None
        self.sharded_state, self.training_state = ShardedState.SHARDED, TrainingState.IDLE
        self.layout = flat_layout([(p.shard_numel,) for p in fsdp_params], world_size=1)
        self._hand_out_sizes = [*self.layout.numels, len(fsdp_params)]  # a reduced shard: gradients, used counts
        #: Whether a reduced gradient moves to its storage (offload, pinning); else it stays where it was reduced.
        self._grads_move = self.placement.storage_device != device or self.placement.pin_memory
        self.streams = comm_streams(device)
        self._all_gather: _GatherInFlight | None = None
        #: Scratch for collectives; the root's lazy init shares its pool with every group under it.
        self.buffers = BufferPool()
        self._post_forward_part: torch.Tensor | None = None  # 1D, see [Note: reshard to a smaller group]
        self.post_backward_done = False
        self._partial_reduce: torch.Tensor | None = None  # 1D, HSDP with requires_all_reduce off
        self._gathered_version = -1  # the flat shard's version when it was last all-gathered
        self._gather_parts_made: collectives.GatherParts | None = None  # see _gather_parts
        self._all_used_rows: dict[torch.dtype, torch.Tensor] = {}  # see _used_rows
        #: What the post-backward autograd node calls; the module state points it at its own handler.
        self.on_post_backward: Callable[[], object] = self.post_backward
        self._init_flat_shard()

    def _init_flat_shard(self) -> None:
        first = self.fsdp_params[0]._orig if self.fsdp_params else None  # not yet sharded: the original
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None and first.device.type == "meta" else \
            self.placement.storage_device
        self.flat_shard = self._new_flat_shard(dtype, device)
        for fsdp_param, view in zip(self.fsdp_params, self.layout.views(self.flat_shard), strict=True):
            fsdp_param.init_sharded(view)

    def _new_flat_shard(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized flat shard buffer, placed by the offload policy unless on the meta device."""
        flat = torch.empty(self.layout.numel, dtype=dtype, device=device)
        return flat if device.type == "meta" else self.placement.to_storage(flat)

    def rebind_sharded(self) -> None:
        """Adopt the parameters ``module._apply`` (``to``, ``to_empty``) registered in place of ours."""
        self.reshard()
        first = self.fsdp_params[0]
        registered = first.owners[0][0]._parameters[first.owners[0][1]]
        assert registered is not None  # module._apply replaces a parameter, never removes it
        flat = self._new_flat_shard(registered.dtype, registered.device)
        self.flat_shard = flat
        for fsdp_param, view in zip(self.fsdp_params, self.layout.views(flat), strict=True):
            fsdp_param.rebind_sharded(view)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self.flat_shard.dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.param_dtype

    # ---- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start (and unless ``async_op``, finish) the all-gather of this group's parameters."""
        if self._all_gather is not None:  # issued already (a prefetch): nothing to do, and never stale
            return
        if self._is_stale():
            self.reshard()
        if self.sharded_state == ShardedState.UNSHARDED or not self.fsdp_params:
            return
        self._check_materialized()
        with self.streams.on(self.streams.all_gather):
            if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
                info, source = self.post_forward_info, self._post_forward_part
                assert info is not None and source is not None  # kept by the forward's reshard
                group, world = info.group, info.size
            else:
                source = self.flat_shard.to(device=self.device, dtype=self.param_dtype, non_blocking=True)
                group, world = self.mesh_info.shard_group, self.mesh_info.shard_size
            self._gathered_version = self._shard_version()
            self._all_gather = self._start_all_gather(source, group, world)
            self._all_gather.issued = self.streams.mark(self.streams.all_gather)
        if not async_op:
            self.wait_for_unshard()

    def _start_all_gather(self, source: torch.Tensor, group: Any, world: int) -> _GatherInFlight:
        """Issue the all-gather of ``source`` into the unsharded parameters, or into a buffer where they cannot
        take it directly; which transport carries it is the collectives' choice."""
        comm = self.all_gather_comm
        if comm is not None:  # a user's all-gather writes one buffer of its own
            output = comm.allocate((world * source.numel(),), dtype=source.dtype, device=self.device)
            work = comm(output, source, group, async_op=True)
            return _GatherInFlight(collectives.Pending(works=[work] if work is not None else []),
                                   output.view(self.mesh_info.shard_size, -1))
        parts = self._gather_parts(source)
        where = self.module_fqn or "(root)"
        if parts is not None:
            return _GatherInFlight(collectives.all_gather_flat(parts, source, group, async_op=True, where=where,
                                                               version=self._gathered_version))
        output = self.buffers.take(world * source.numel(), source.dtype, self.device)  # see BufferPool
        pending = collectives.all_gather_flat(output, source, group, async_op=True, where=where,
                                              version=self._gathered_version)
        # Rank-major over the shard group also when gathered over the post-forward group: see [Note: reshard to a
        # smaller group].
        return _GatherInFlight(pending, output.view(self.mesh_info.shard_size, -1), self.buffers.give)

    def _gather_parts(self, source: torch.Tensor) -> collectives.GatherParts | None:
        """The unsharded parameters' memory as the all-gather's destinations, where they can be.

        [Note: all-gather straight into the parameters]
        The gathered shards are written into each unsharded parameter
        (allocated at issue), not into a buffer that is then copied again:
        through shared memory they are copied straight from the slot (one copy
        of the whole group less per all-gather, and no buffer held); through
        another transport the collectives gather into a scratch buffer lent by
        ``buffers`` and copy from there. Not when forward keeps a post-forward
        part (that part is cut from a buffer), when a parameter's rank-major
        shards are not contiguous in it (a shard dim other than 0), nor on an
        accelerator (the buffer comes from its allocator on the all-gather
        stream, and the copy-out is part of the join).
        """
        if self.streams.all_gather is not None or self.post_forward_info is not None:
            return None
        destinations = [p.gather_destination(source.dtype, self.device) for p in self.fsdp_params]
        if any(d is None for d in destinations):
            return None
        cached = self._gather_parts_made
        if cached is None or cached.pool is not self.buffers or not all(
                map(operator.is_, destinations, (d for _, d in cached.parts))):
            # Made again only when a parameter's unsharded memory was (a dtype or device change, a load).
            cached = self._gather_parts_made = collectives.GatherParts(
                [(offset, d) for offset, d in zip(self.layout.offsets, destinations, strict=True) if d is not None],
                pool=self.buffers, own_versions=True)  # see [Note: writing the unsharded memory] in _fsdp_param
        return cached

    def _is_stale(self) -> bool:
        """Whether the shards changed (an optimizer step, a load) since the gathered copy was made.

        PyTorch does not check: a group kept unsharded after a ``no_grad``
        forward (the root) serves stale parameters to the next forward if the
        optimizer stepped in between.
        """
        return self.sharded_state != ShardedState.SHARDED and self._all_gather is None \
            and self._gathered_version != self._shard_version()

    def _shard_version(self) -> int:
        """Grows with every in-place write to a shard.

        An optimizer's update bumps the DTensor parameter's version counter, not
        its local tensor's (DTensor runs the local op below autograd); a write
        through ``to_local()`` bumps the local tensor's. Both only grow.
        """
        version = self.flat_shard._version
        for fsdp_param in self.fsdp_params:
            version += fsdp_param.sharded_param._version + local_tensor(fsdp_param.sharded_param)._version
        return version

    def wait_for_transfer(self) -> None:
        """Wait until this group's in-flight all-gather has arrived, without copying it out yet.

        The caller issues the next group's prefetch in between, so the
        collectives never wait on this group's copy-out (see ``FSDPState``).
        """
        if self._all_gather is not None:
            self._all_gather.pending.wait()

    def wait_for_unshard(self) -> None:
        """Finish the in-flight all-gather and register the unsharded parameters."""
        gather, self._all_gather = self._all_gather, None
        if gather is None:
            return
        gather.pending.wait()
        self.streams.join_at(gather.issued)  # not the prefetch queued behind it: see _GatherInFlight.issued
        output = gather.output
        if output is None:  # see [Note: all-gather straight into the parameters]
            self._post_forward_part = None
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_unsharded()
            self.sharded_state = ShardedState.UNSHARDED
            return
        if self.post_forward_info is not None and self.training_state == TrainingState.FORWARD:
            part = output.numel() // self.post_forward_info.size
            self._post_forward_part = output.view(-1)[self.post_forward_info.rank * part:][:part].clone()
        else:
            self._post_forward_part = None
        self._copy_out(output)
        gather.release_output()
        self.sharded_state = ShardedState.UNSHARDED

    def _copy_out(self, output: torch.Tensor) -> None:
        """Fill and register the unsharded parameters from ``output`` (``(world, shard_numel)``, rank-major).

        One ``split_with_sizes_copy`` into every parameter where their rank-major shards are contiguous (a
        shard dim of 0), instead of a slice, a view and a copy per parameter.
        """
        destinations = [p.gather_destination(output.dtype, output.device) for p in self.fsdp_params]
        views = [d for d in destinations if d is not None]
        if len(views) == len(destinations) and output.shape[1] == self.layout.numel:
            # Version counters of their own: see [Note: writing the unsharded memory] in _fsdp_param.
            torch.split_with_sizes_copy(output, self.layout.numels, dim=1, out=views)
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_unsharded()
            return
        spans = zip(self.layout.offsets, self.layout.numels, strict=True)
        for fsdp_param, (offset, numel) in zip(self.fsdp_params, spans, strict=True):
            gathered = output[:, offset: offset + numel].view(-1, *fsdp_param.shard_shape)
            fsdp_param.to_unsharded(gathered)

    def _discard_all_gather(self) -> None:
        """Finish an all-gather whose output nobody will read (an unused prefetch, a step that raised)."""
        gather, self._all_gather = self._all_gather, None
        if gather is None:
            return
        gather.pending.wait()
        if gather.output is not None:
            gather.release_output()
        else:
            for fsdp_param in self.fsdp_params:
                fsdp_param.free_unsharded()

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        self._discard_all_gather()  # a prefetch nobody used
        if self.sharded_state == ShardedState.SHARDED:
            return
        to_post_forward = self._post_forward_part is not None and self.training_state == TrainingState.FORWARD
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
        if to_post_forward:
            self.sharded_state = ShardedState.SHARDED_POST_FORWARD
        else:
            self.sharded_state, self._post_forward_part = ShardedState.SHARDED, None

    def adopt_replaced_params(self) -> None:
        """Adopt parameters registered in place of our sharded ones since ``fully_shard``.

        The user may re-create a parameter between ``fully_shard`` and the first
        forward (``module.w = nn.Parameter(...)`` from sharded inputs, after
        ``to_empty``): the root's lazy init takes those, as ``load_state_dict`` does.
        """
        if self.sharded_state == ShardedState.SHARDED and any(
                mod._parameters[name] is not p.sharded_param for p in self.fsdp_params for mod, name in p.owners):
            self.rebind_sharded()

    @property
    def _module_fqn(self) -> str | None:
        """PyTorch's name for :attr:`module_fqn`."""
        return self.module_fqn

    def _check_materialized(self) -> None:
        if self.flat_shard.device.type == "meta":
            fqns = ", ".join(p.fqn for p in self.fsdp_params[:3])
            raise RuntimeError(f"fully_shard({type(self.modules[0]).__name__}): parameters ({fqns}, ...) are still on "
                               f"the meta device; call "
                               f"module.to_empty(device=...) and initialize them before the first forward")

    # ---- forward ----------------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Register the unsharded parameters (the module state issued their all-gather) and hook backward."""
        self.training_state = TrainingState.FORWARD
        self.wait_for_unshard()
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.fsdp_params):
            args, kwargs = _attach_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        if self.reshard_after_forward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    # ---- backward ---------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        # Also after this group's post-backward: a list group's earlier module may still need its parameters.
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:  # the module state issued the all-gather
            self.wait_for_unshard()

    def post_backward(self) -> GradReduction | None:
        """Reduce-scatter the unsharded gradients (unless sync is off) and reshard; return the reduction."""
        self.training_state = TrainingState.POST_BACKWARD
        self.post_backward_done = True
        for fsdp_param in self.fsdp_params:
            fsdp_param.accumulate_grad(self.reduce_dtype, start=not self.requires_gradient_sync)
        pending = self._reduce_grads() if self.requires_gradient_sync else None
        if self.reshard_after_backward:
            self.reshard()
        return pending

    def _reduce_grads(self) -> GradReduction | None:
        """Reduce-scatter the group's gradients, and with them which ranks used each parameter.

        [Note: used-parameter counts] Each rank's chunk of the input ends with
        one element per parameter, 1 where this rank has a gradient for it. The
        reduction sums them, so every rank learns which parameters any rank
        used: those get a gradient (zeros from the ranks that did not use them),
        the rest keep ``.grad`` None, as on a single process. PyTorch decides
        per rank, so ranks that took different branches step different
        parameters.
        """
        grads = [p.unsharded_grad for p in self.fsdp_params]
        if all(g is None for g in grads):
            return None
        if len({g.dtype for g in grads if g is not None}) > 1:  # some accumulated in reduce_dtype, some not
            grads = [g.to(self.reduce_dtype) if g is not None else None for g in grads]
        numel = self.layout.numel
        grad_dtype = next(g.dtype for g in grads if g is not None)  # _chunk_cat wants one input dtype
        # With reduce_scatter_unused_params, zeros are reduced for unused parameters, which then get (zero) gradients.
        all_used = self.reduce_scatter_unused_params or all(g is not None for g in grads)
        used_rows = self._used_rows(grads, grad_dtype, all_used)
        with self.streams.on(self.streams.reduce_scatter):
            shard = self._alloc_comm(self.reduce_scatter_comm, numel + len(grads))
            pending = self._start_reduce_scatter(shard, grads, used_rows)
            self.streams.keep_alive(grads, self.streams.reduce_scatter)
            for fsdp_param in self.fsdp_params:
                fsdp_param.clear_unsharded_grad()
        reduction = GradReduction(pending)
        pending.then(lambda: self._finish_reduce(shard, all_used, reduction))
        return reduction

    def _used_rows(self, grads: list[torch.Tensor | None], dtype: torch.dtype, all_used: bool) -> torch.Tensor:
        """The used flags as ``(world, len(grads))`` rows (see [Note: used-parameter counts]); the all-used rows
        are made once per dtype and only read after."""
        world = self.mesh_info.shard_size
        if not all_used:
            used = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
            return used.to(self.device).expand(world, -1)
        rows = self._all_used_rows.get(dtype)
        if rows is None:
            rows = torch.ones(len(grads), dtype=dtype, device=self.device).expand(world, -1)
            self._all_used_rows[dtype] = rows
        return rows

    def _alloc_comm(self, comm: ReduceScatter | None, numel: int) -> torch.Tensor:
        if comm is None:
            return torch.empty(numel, dtype=self.reduce_dtype, device=self.device)
        return comm.allocate((numel,), dtype=self.reduce_dtype, device=self.device)

    def _start_reduce_scatter(self, shard: torch.Tensor, grads: list[torch.Tensor | None], used_rows: torch.Tensor
                              ) -> collectives.Pending:
        """Issue the reduce-scatter of ``grads`` and the used flags into ``shard``.

        [Note: gradients straight into the reduce-scatter]
        Ours is handed the gradients as parts (``collectives.ScatterParts``):
        through shared memory each is copied into the slots as its columns are
        staged, instead of into a rank-major buffer that is then copied again
        (one copy of the group less, and no input buffer); through another
        transport the collectives pack them into a scratch buffer lent by
        ``buffers`` with one ``_chunk_cat``. A user's reduce-scatter gets the
        rank-major buffer it allocates.
        """
        group, comm = self.reduce_scatter_group or self.mesh_info.shard_group, self.reduce_scatter_comm
        world = self.mesh_info.shard_size
        if comm is None:
            parts = _scatter_parts(self.fsdp_params, grads, used_rows, self.reduce_dtype)
            parts.pack = functools.partial(_rank_major_grads, self.fsdp_params, grads, used_rows)
            parts.pool = self.buffers if self.streams.reduce_scatter is None else None  # accelerators: their allocator
            return collectives.reduce_scatter_flat(shard, parts, group, async_op=True,
                                                   where=self.module_fqn or "(root)")
        full = self._alloc_comm(comm, world * shard.numel())
        _rank_major_grads(self.fsdp_params, grads, used_rows, full.view(world, -1))
        # A sum: the division by the data-parallel size follows, as for ours.
        work = comm(shard, full, group, dist.ReduceOp.SUM, async_op=True)
        # ``full`` stays referenced until the reduction is finished (the collective reads it).
        return collectives.Pending(works=[work] if work is not None else []).then(functools.partial(_hold, full))

    def _finish_reduce(self, shard: torch.Tensor, all_used: bool, reduction: GradReduction) -> None:
        """After the reduce-scatter: (HSDP) start the all-reduce across replicas, else hand the gradients out."""
        self.streams.join(self.streams.reduce_scatter)
        info = self.mesh_info
        if info.replicate_group is not None:
            if self._partial_reduce is not None:  # earlier micro-batches reduced over the shard dim only
                shard.add_(self._partial_reduce)
                self._partial_reduce = None
            if not self.requires_all_reduce:
                self._partial_reduce = shard  # all-reduced, divided and handed out with a later backward
                return
            # See [Note: the all-reduce across replicas stays in flight].
            reduction.replicas = collectives.all_reduce(shard, info.replicate_group, async_op=True,
                                                        where=self.module_fqn or "(root)")
            reduction.replicas.then(lambda: self._hand_out_grads(shard, all_used))
            return
        self._hand_out_grads(shard, all_used)

    def _hand_out_grads(self, shard: torch.Tensor, all_used: bool) -> None:
        """Divide the fully reduced ``shard`` and accumulate it into the sharded parameters' ``.grad``."""
        numel = self.layout.numel
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(shard[:numel])
        factor = self.gradient_divide_factor or self.mesh_info.data_parallel_size
        # Used here means used everywhere; otherwise read the counts (a device sync, only then). When they
        # are not read, they are divided with the gradients: one kernel on the whole shard, no slice.
        if all_used:
            if factor != 1:
                shard.div_(factor)
            used = [True] * len(self.fsdp_params)
        else:
            if factor != 1:
                shard[:numel].div_(factor)
            used = (shard[numel:] > 0).tolist()
        # 1D views, one call (not Tensor.split's Python); the last piece is the used counts.
        pieces = torch.split_with_sizes(shard, self._hand_out_sizes)
        placement = self.placement if self._grads_move else None
        for fsdp_param, view, any_rank_used in zip(self.fsdp_params, pieces, used, strict=False):  # (+ counts)
            if any_rank_used:  # see [Note: used-parameter counts]
                fsdp_param.set_sharded_grad(view, placement)
        sharded_grads_ready(self.fsdp_params, used)  # optimizers applied in backward step now

    def finalize_backward(self) -> None:
        """End of backward: reshard what is still unsharded and get ready for the next step."""
        if self.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE
        self.post_backward_done = False


    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: drop in-flight work and local gradients, reshard."""
        self._discard_all_gather()
        for fsdp_param in self.fsdp_params:
            fsdp_param.clear_unsharded_grad()
        self._partial_reduce = None
        self.training_state = TrainingState.IDLE
        self.reshard()
        self.post_backward_done = False


def _hold(*_: object) -> None:
    """A finishing step that only holds its arguments alive until the collective is done."""


def _scatter_parts(fsdp_params: list[FSDPParam], grads: list[torch.Tensor | None], used: torch.Tensor,
                   dtype: torch.dtype) -> collectives.ScatterParts:
    """The reduce-scatter input :func:`_rank_major_grads` would write, as one ``(world, n)`` source per parameter
    (made only if the transport reads them part by part)."""
    columns = sum(p.shard_numel for p in fsdp_params) + used.shape[1]
    make = functools.partial(_scatter_part_list, fsdp_params, grads, used)
    return collectives.ScatterParts(make, columns, dtype, device=used.device)


def _scatter_part_list(fsdp_params: list[FSDPParam], grads: list[torch.Tensor | None], used: torch.Tensor
                       ) -> list[tuple[int, torch.Tensor]]:
    world = used.shape[0]
    parts, offset = [], 0
    for fsdp_param, grad in zip(fsdp_params, grads, strict=True):
        parts.append((offset, _rank_major_grad(fsdp_param, grad, world, used)))
        offset += fsdp_param.shard_numel
    parts.append((offset, used))
    return parts


def _rank_major_grad(fsdp_param: FSDPParam, grad: torch.Tensor | None, world: int, like: torch.Tensor
                     ) -> torch.Tensor:
    """``grad`` as ``(world, shard_numel)``, rank r's padded shard in row r (zeros for None; a view when it can)."""
    if grad is None:
        return like.new_zeros(1).expand(world, fsdp_param.shard_numel)
    if fsdp_param.shard_dim != 0:  # even split, no padding
        return grad.unflatten(fsdp_param.shard_dim, (world, -1)).movedim(fsdp_param.shard_dim, 0).reshape(world, -1)
    if grad.shape[0] == world * fsdp_param.shard_shape[0] and grad.is_contiguous():
        return grad.view(world, -1)
    return torch._chunk_cat([grad], 0, world)  # pads dim 0


def _rank_major_grads(fsdp_params: list[FSDPParam], grads: list[torch.Tensor | None], used: torch.Tensor,
                      out: torch.Tensor) -> None:
    """Write ``grads`` (zeros where None), then ``used`` (2D ``(world, n)``), into ``out`` (2D, rank-major).

    Each row of ``out`` is one rank's chunk: every parameter's padded shard, then its ``used`` flags.
    """
    if all(p.shard_dim == 0 for p in fsdp_params):
        filled = [g if g is not None else torch.zeros(p.orig_size, dtype=used.dtype, device=out.device)
                  for p, g in zip(fsdp_params, grads, strict=True)]
        torch._chunk_cat([*filled, used], 0, out.shape[0], out=out)  # pads dim 0, casts, one kernel
        return
    _scatter_parts(fsdp_params, grads, used, out.dtype).write(0, out.shape[1], out)


class _PostBackward(torch.autograd.Function):
    """Identity on a forward's inputs whose backward runs when their gradients are done: the group's post-backward."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], object], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


def _attach_post_backward(group: FSDPParamGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    plain = not kwargs and all(type(x) is torch.Tensor for x in args)  # the common call: no pytree walk
    leaves, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs
    outputs = _PostBackward.apply(group.on_post_backward, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs, strict=True):
        leaves[i] = out
    return (tuple(leaves), kwargs) if spec is None else tree_unflatten(leaves, spec)
