"""One flat parameter per FSDP unit: the unit's parameters laid end to end, sharded across ranks.

Tensors by role (all 1D):

* ``flat_param`` (sharded): this rank's chunk of the padded flat buffer, full
  precision, on the storage device; the optimizer steps on it.
* ``_unsharded``: the whole padded buffer in the compute dtype on the compute
  device, an autograd leaf whose storage is allocated only while gathered. The
  original parameters are views of it during forward and backward, so its
  ``grad`` is the unit's unsharded gradient.
* ``_gather_out``: the same storage under its own version counter; collectives
  write there (see [Note: re-gathering before backward]).

[Note: re-gathering before backward] FULL_SHARD frees the gathered buffer after
forward while autograd still holds views of it. Freeing resizes the storage to
zero bytes and re-gathering resizes it back and refills it, so those saved views
see the data again. The refill goes through ``_gather_out`` (from ``.data``, a
fresh version counter) so autograd does not see an in-place change of a saved
tensor (see [Note: free and re-allocate storage] in ``_sharding/storage``).

[Note: NO_SHARD without a copy] Unsharded and at full precision on the storage
device, the flat parameter already is the gathered buffer: ``_unsharded`` is a
second tensor on ``flat_param``'s storage (an autograd leaf of its own, so its
``grad`` is the unsharded gradient), never freed and never copied into. The
optimizer's in-place step on ``flat_param`` is what the next forward reads.

[Note: gradients from the views] For NO_SHARD at full precision and for
sharded units, the original parameters are views of ``_unsharded`` made by
:class:`_ViewsOfFlat`, whose backward hands the views' gradients to the handle
(:meth:`FlatParamHandle.receive_view_grads`) instead of concatenating them into
a new flat gradient. A NO_SHARD unit writes them straight into its all-reduce
bucket's slot (``grad_buckets``). A sharded unit whose gradient is reduced now
(not kept for ``no_sync``, no communication hook) keeps them as they are, and
its reduce-scatter stages them straight into the collective's input, cast to
``reduce_dtype`` and divided on the way (:class:`collectives.FlatParts`): no
flat gradient buffer, no full-size cast of one, no separate pass to divide it
(fully_shard's classic counterpart of ``ScatterParts``; PyTorch's FSDP holds
the flat gradient and its cast together). Otherwise they are copied into a new flat
gradient, ``_unsharded.grad``, as autograd's concatenation would.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from enum import Enum, auto

import torch
from torch import nn

from ..._comm.collectives import FlatParts, Pending, all_gather_flat, all_reduce, reduce_scatter_flat
from ..._sharding.layout import FlatLayout, flat_layout
from ..._sharding.storage import alloc_storage, free_storage
from .comm_hook import CommHook
from .optim_in_backward import sharded_grad_ready
from .param_views import ParamSlot, ParamViews
from .placement import Placement, Precision
from .sharding_plan import ShardingPlan


class HandleState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()


class FlatParamHandle:
    """Owns one unit's flat parameter: its layout, gathering, freeing and gradient reduction."""

    flat_param: nn.Parameter       # 1D sharded, full precision, storage device
    layout: FlatLayout             # over the shard group
    unsharded_numel: int           # the gathered buffer's (and the unsharded gradient's): layout.padded_numel
    slots: list[ParamSlot]
    plan: ShardingPlan
    placement: Placement
    precision: Precision
    views: ParamViews
    state: HandleState
    _unsharded: torch.Tensor       # 1D padded, param dtype, compute device
    _gather_out: torch.Tensor      # same storage, own version counter
    _split_sizes: list[int]        # the original parameters' numels, then the padding's
    _shares_storage: bool          # NO_SHARD at full precision: ``_unsharded`` is ``flat_param``'s storage
    _built_dtype: torch.dtype      # flat_param's dtype when built (PyTorch's ``_orig_param_dtype``)
    _pending: Pending | None       # an async gather in flight
    _shown: list[torch.Tensor] | None  # the views of the current gather shown to the modules (None: none yet)
    on_grad_ready: Callable[[FlatParamHandle], None] | None   # set by the unit: its post-backward
    comm_hook: CommHook | None     # replaces the default reduction (register_comm_hook)
    _bucket_key: tuple | None      # what bucket_key() returns without a comm hook, made once
    #: NO_SHARD in place: where the unit's next unsharded gradient should go and by what it is divided on the way
    #: (None: a new buffer, undivided)
    grad_target: Callable[[FlatParamHandle], tuple[torch.Tensor, float] | None] | None
    #: Whether the unit's gradient is reduced as soon as it is complete (False: kept, inside ``no_sync``)
    reduces_on_ready: Callable[[FlatParamHandle], bool] | None
    #: Whether the unit takes a new full-precision dtype now (accelerate's upcast; it then calls take_precision)
    takes_full_dtype: Callable[[FlatParamHandle], bool] | None
    _grads_from_views: bool        # backward hands the views' gradients over (see [Note: gradients from the views])
    _view_grads: FlatParts | None  # a sharded unit's gradient as its views' gradients, until it is reduced

    def __init__(self, params: list[nn.Parameter], slots: list[ParamSlot], plan: ShardingPlan,
                 placement: Placement, precision: Precision, views: ParamViews) -> None:
        self.slots, self.plan, self.placement, self.precision, self.views = slots, plan, placement, precision, views
        self.layout = flat_layout([p.shape for p in params], plan.shard_size)
        self.unsharded_numel = self.layout.padded_numel
        self._split_sizes = [*self.layout.numels, self.unsharded_numel - self.layout.numel]
        self.flat_param = nn.Parameter(self._own_shard(params), requires_grad=any(p.requires_grad for p in params))
        self.flat_param._fqns = tuple(slot.fqn for slot in slots)  # type: ignore[attr-defined]  # as PyTorch's
        self.state, self._pending, self._shown = HandleState.SHARDED, None, None
        self._where = slots[0].fqn if slots else None  # names this unit's collectives (the collective watch)
        self.on_grad_ready, self.comm_hook, self._bucket_key, self.grad_target = None, None, None, None
        self.reduces_on_ready, self.takes_full_dtype, self._view_grads = None, None, None
        self._make_unsharded()

    def _make_unsharded(self) -> None:
        """The gather target for the flat parameter's dtype and ``precision``, and where gradients arrive."""
        precision, placement, requires_grad = self.precision, self.placement, self.flat_param.requires_grad
        self._built_dtype = self.flat_param.dtype
        self._shares_storage = (not self.is_sharded_over_ranks and precision.param_dtype == self.flat_param.dtype
                                and placement.storage_device == placement.compute_device)
        if self._shares_storage:  # see [Note: NO_SHARD without a copy]
            self._unsharded = self.flat_param.data
        else:
            self._unsharded = torch.empty(self.layout.padded_numel, dtype=precision.param_dtype,
                                          device=placement.compute_device)
            free_storage(self._unsharded)
        self._gather_out = self._unsharded.data
        self._unsharded.requires_grad_(requires_grad)
        self._grads_from_views = self._shares_storage or self.is_sharded_over_ranks
        if requires_grad and not self._grads_from_views:  # else receive_view_grads
            self._unsharded.register_post_accumulate_grad_hook(self._grad_ready)

    def _own_shard(self, params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's chunk of the padded flat buffer, copied piece by piece (the whole buffer is never built)."""
        shard_start, _ = self.layout.shard_range(self.plan.shard_rank)
        shard = params[0].new_zeros(self.layout.shard_numel)  # the padding stays zero
        with torch.no_grad():
            for param, offset, (start, end) in zip(params, self.layout.offsets, self.local_ranges(), strict=True):
                source = shard_start + start - offset
                shard[start:end].copy_(param.detach().reshape(-1)[source:source + end - start])
        return self.placement.to_storage(shard)

    def local_ranges(self) -> list[tuple[int, int]]:
        """Each original parameter's ``[start, end)`` within this rank's shard (empty when not held)."""
        shard_start, shard_end = self.layout.shard_range(self.plan.shard_rank)
        ranges = []
        for offset, numel in zip(self.layout.offsets, self.layout.numels, strict=True):
            start, end = max(offset, shard_start), min(offset + numel, shard_end)
            ranges.append((start - shard_start, max(start, end) - shard_start))
        return ranges

    # ---- gather and free -------------------------------------------------------------------------

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        """PyTorch's name for the full-precision dtype, read (and written back) by accelerate's FSDP plugin v1."""
        return self._built_dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        """accelerate's upcast of a model loaded in low precision: it first replaces ``flat_param.data`` with
        ``dtype``, then writes this. Before the model's first forward the unit takes the new dtype, as PyTorch's
        lazy init does (``takes_full_dtype``); otherwise it is refused, with the data put back when that is exact.
        """
        if dtype == self._built_dtype:
            return
        flat, built = self.flat_param, self._built_dtype
        if flat.dtype == dtype and self.takes_full_dtype is not None and self.takes_full_dtype(self):
            return
        restored = flat.dtype != built and flat.dtype.is_floating_point and flat.dtype.itemsize > built.itemsize
        if restored:  # an upcast: the round trip back is exact
            flat.data = flat.data.to(built)
        raise NotImplementedError(
            f"FlatParamHandle._orig_param_dtype: the unit of {self._where!r} was built in {built}; setting it to "
            f"{dtype} is taken only before the model's first forward, with the flat parameter's data already in "
            f"{dtype} (accelerate's upcast); the data is {flat.dtype}" + (f" (put back to {built})" if restored else "")
            + f": load the model in {dtype} before wrapping it")

    def take_precision(self, precision: Precision) -> None:
        """Use ``precision`` and the flat parameter's new dtype from now on (the unit has not run yet)."""
        self.precision, self._bucket_key = precision, None
        self._make_unsharded()
        self.views.expose_sharded(self)  # the originals are shown in (or as views of) the new data

    @property
    def is_sharded_over_ranks(self) -> bool:
        return self.plan.shard_group is not None

    def unshard(self, async_op: bool = False) -> None:
        """Gather the full flat parameter in the compute dtype (``wait_unshard`` completes an async one)."""
        if self.state is HandleState.UNSHARDED:
            if not async_op:
                self.wait_unshard()
            return
        self.state = HandleState.UNSHARDED
        if self._shares_storage:
            return
        alloc_storage(self._unsharded)
        shard = self.placement.to_compute(self.flat_param.detach()).to(self.precision.param_dtype)
        if self.is_sharded_over_ranks:
            self._pending = all_gather_flat(self._gather_out, shard, self.plan.shard_group, async_op=True,
                                            where=self._where, version=self.flat_param._version)
        else:
            self._gather_out.copy_(shard)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()

    def reshard(self) -> None:
        """Free the gathered buffer and show the sharded parameters again."""
        if self.state is HandleState.SHARDED:
            return
        self.wait_unshard()
        if not self._shares_storage:
            free_storage(self._unsharded)
        self.state, self._shown = HandleState.SHARDED, None
        self.views.expose_sharded(self)

    def unsharded_views(self) -> list[torch.Tensor]:
        """Each original parameter as a view of the gathered buffer (one ``split``: one backward op)."""
        # Also from a backward hook (grad mode off there), the views must lead back to the buffer:
        # a reentrant checkpoint recomputes on them and backpropagates through them.
        with torch.enable_grad():
            if self._grads_from_views and self._unsharded.requires_grad:  # see [Note: gradients from the views]
                return list(_ViewsOfFlat.apply(self, self._unsharded))
            pieces = self._unsharded.split_with_sizes(self._split_sizes)
            # The last piece is the padding: it has no parameter.
            return [piece.view(shape) for piece, shape in zip(pieces[:-1], self.layout.shapes, strict=True)]

    def use_unsharded_views(self) -> None:
        """Show the gathered buffer's views; those this gather already showed are kept while still shown."""
        if self._shown is None or not self._still_shown(self._shown):
            self._shown = self.unsharded_views()
            self.views.expose_unsharded(self, self._shown)

    def _still_shown(self, views: list[torch.Tensor]) -> bool:
        return all(module.__dict__.get(name) is view
                   for slot, view in zip(self.slots, views, strict=True) for module, name in slot.places())

    # ---- full-precision copies (summon_full_params, state dicts) ---------------------------------

    def gather_full(self, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """The padded 1D full tensor of a sharded flat ``tensor`` (default: the parameter), full precision.

        Without sharding this is ``tensor`` itself (on the compute device), so writes reach the parameter.
        """
        shard = self.placement.to_compute((self.flat_param if tensor is None else tensor).detach())
        if not self.is_sharded_over_ranks:
            return shard
        full = shard.new_empty(self.layout.padded_numel)
        all_gather_flat(full, shard.contiguous(), self.plan.shard_group, where=self._where)
        return full

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        return self.layout.views(full)

    def own_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a padded 1D full tensor."""
        start, end = self.layout.shard_range(self.plan.shard_rank)
        return full[start:end]

    def write_back(self, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.flat_param.copy_(self.placement.to_storage(self.own_chunk(full)))

    # ---- gradients -------------------------------------------------------------------------------

    def _grad_ready(self, _: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def receive_view_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The views' gradients from backward, into the unsharded gradient (see [Note: gradients from the views]).

        A sharded unit reduced now keeps them as they are, for its reduce-scatter to stage. Into a bucket slot
        (``grad_target``) they are written already divided by the slot's pre-divide factor, fused with the copy
        (the bucket then skips that division).
        """
        kept = self._unsharded.grad
        if kept is None and self._stages_view_grads():
            parts = [(offset, grad.reshape(-1)) for offset, grad in zip(self.layout.offsets, grads, strict=True)
                     if grad is not None]
            self._view_grads = FlatParts(parts, self.layout.shard_numel, self.precision.reduce_dtype,
                                         self.grad_device, divide=self.plan.gradient_divide_factors()[0])
            self._grad_ready(self._unsharded)
            return
        target, divide = kept, 1.0
        if target is None:
            slot = self.grad_target(self) if self.grad_target is not None else None
            target, divide = slot if slot is not None else (torch.empty_like(self._unsharded, requires_grad=False), 1.0)
        pieces = target.split_with_sizes(self._split_sizes)
        with torch.no_grad():
            for piece, grad, shape in zip(pieces[:-1], grads, self.layout.shapes, strict=True):
                if grad is None:
                    if kept is None:
                        piece.zero_()
                elif kept is not None:
                    piece.view(shape).add_(grad)
                elif divide > 1:
                    torch.div(grad, divide, out=piece.view(shape))
                else:
                    piece.view(shape).copy_(grad)
            if kept is None:
                pieces[-1].zero_()  # the padding
                self._unsharded.grad = target
        self._grad_ready(target)

    def _stages_view_grads(self) -> bool:
        """Whether the views' gradients go straight to the reduce-scatter ([Note: gradients from the views])."""
        return (self.is_sharded_over_ranks and self.comm_hook is None
                and self.reduces_on_ready is not None and self.reduces_on_ready(self))

    @property
    def writes_grad_in_place(self) -> bool:
        """Whether backward can write the unsharded gradient into a reduce-dtype bucket slot (``grad_target``)."""
        return (self._shares_storage and self._unsharded.requires_grad
                and self.precision.reduce_dtype == self._unsharded.dtype)

    @property
    def grad_device(self) -> torch.device:
        """Where the unsharded gradient lives (the compute device)."""
        return self._unsharded.device

    def release_stale_grad(self) -> None:
        """Drop a flat gradient the optimizer no longer sees (use_orig_params: its originals' grads were cleared)."""
        if self.flat_param.grad is not None and self.views.sharded_grad(self) is None:
            self.flat_param.grad = None

    def take_unsharded_grad(self) -> torch.Tensor | FlatParts | None:
        """The unit's unsharded gradient, handed over to be reduced (its views' gradients, when kept as such)."""
        if self._view_grads is not None:
            parts, self._view_grads = self._view_grads, None
            return parts
        grad, self._unsharded.grad = self._unsharded.grad, None
        return grad

    def reduce_grad(self, grad: torch.Tensor | FlatParts) -> GradReduction:
        """Start reducing the unsharded gradient; the reduction's ``wait()`` adds the mean to the shard's grad."""
        pre, post = self.plan.gradient_divide_factors()
        if not isinstance(grad, FlatParts):  # views' gradients are pre-divided as they are staged
            if self.comm_hook is not None:
                return self._reduce_with_hook(grad, self.comm_hook)
            grad = grad.to(self.precision.reduce_dtype)
            if pre > 1:
                grad.div_(pre)
        replicate_group = self.plan.replicate_group
        if self.is_sharded_over_ranks:
            shard = torch.empty(self.layout.shard_numel, dtype=self.precision.reduce_dtype, device=self.grad_device)
            first = reduce_scatter_flat(shard, grad, self.plan.shard_group, async_op=True, where=self._where)
        else:  # replicated only: the all-reduce starts now and overlaps the rest of backward
            assert isinstance(grad, torch.Tensor)  # views' gradients are kept as such for sharded units only
            shard, first = grad, all_reduce(grad, replicate_group, async_op=True, where=self._where)
            replicate_group = None

        def finish() -> None:
            if post > 1:
                shard.div_(post)
            self.accumulate_reduced(shard)

        if replicate_group is None:
            return GradReduction(first, finish)
        group = replicate_group  # HYBRID: across replicas, once the shard group's reduction is done
        return GradReduction(first, finish, lambda: all_reduce(shard, group, async_op=True, where=self._where))

    def _reduce_with_hook(self, grad: torch.Tensor, hook: CommHook) -> GradReduction:
        """The user's communication hook reduces (synchronously, as in PyTorch); see ``comm_hook``."""
        if not hook.compresses:
            grad = grad.to(self.precision.reduce_dtype)
        if self.is_sharded_over_ranks:
            shard = hook.reduce_sharded(grad, self.layout.shard_numel)
        else:
            shard = hook.reduce_replicated(grad)
        return GradReduction(Pending(), lambda: self.accumulate_reduced(shard))

    def bucket_key(self) -> Hashable | None:
        """What this unit's gradient all-reduce may share a bucket on (see ``grad_buckets``); None: reduced alone."""
        if self.comm_hook is not None or self.is_sharded_over_ranks or not self._unsharded.requires_grad:
            return None
        if self._bucket_key is None:
            self._bucket_key = (self.precision.reduce_dtype, self._unsharded.device, self.plan.replicate_group,
                                self.plan.gradient_divide_factors())
        return self._bucket_key

    def bucket_name(self, last: FlatParamHandle) -> str | None:
        """Names a bucket from this unit to ``last`` (the collective watch)."""
        return self._where if last is self else f"{self._where}..{last._where}"

    def accumulate_reduced(self, shard: torch.Tensor) -> None:
        """Hand the reduced, divided gradient shard to the optimizer (added to one kept from ``no_sync``)."""
        shard = self.placement.to_storage(shard.to(self.precision.grad_dtype))
        existing = self.views.sharded_grad(self)
        if existing is None:
            self.views.set_sharded_grad(self, shard)
        else:
            existing.add_(shard)
        sharded_grad_ready(self)  # optimizers applied in backward step now (see optim_in_backward)


class _ViewsOfFlat(torch.autograd.Function):
    """The original parameters as views of a unit's flat buffer (NO_SHARD at full precision, or sharded);
    backward hands their gradients to the handle (see [Note: gradients from the views]) instead of to the
    buffer's own ``grad``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, handle: FlatParamHandle,  # type: ignore[override]
                flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.handle = handle  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None (its slot is zeroed)
        pieces = flat.split_with_sizes(handle._split_sizes)
        return tuple(piece.view(shape) for piece, shape in zip(pieces[:-1], handle.layout.shapes, strict=True))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 *grads: torch.Tensor | None) -> tuple[None, None]:
        ctx.handle.receive_view_grads(grads)  # type: ignore[attr-defined]
        return None, None


class GradReduction:
    """One unit's gradient reduction in flight: ``first`` (over the shard group, or the replicas when
    unsharded), then for HYBRID strategies ``second`` across the replicas, then ``finish``.

    ``advance()`` starts the second collective as soon as the first is done, without waiting for it: the
    runtime advances a unit's reduction when the next unit's gradient is ready, so the cross-replica
    all-reduce overlaps the rest of backward instead of running, one unit after another, at its end.
    """

    def __init__(self, first: Pending, finish: Callable[[], None],
                 second: Callable[[], Pending] | None = None) -> None:
        self._stages: list[Pending] = [first]
        self._second, self._finish = second, finish

    def advance(self) -> None:
        if self._second is not None:
            start, self._second = self._second, None
            self._stages[0].wait()
            self._stages.append(start())

    def wait(self) -> None:
        self.advance()
        for stage in self._stages:
            stage.wait()
        self._stages.clear()
        finish, self._finish = self._finish, lambda: None
        finish()
