"""FSDPParam: one parameter's sharded DTensor, its unsharded tensor, and the swap between them."""

from __future__ import annotations

import weakref
from math import prod

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tensorplay.distributed._sharding.layout import RankSlice, chunk_size, rank_slice
from tensorplay.distributed._sharding.placement import Placement
from tensorplay.distributed._sharding.storage import alloc_storage, free_storage, own_storage_view

from ._fsdp_common import MeshInfo, ShardedState
from ._fsdp_spmd import ShardedLayout, local_tensor


class FSDPParam:
    """One managed parameter.

    Sharded form: ``sharded_param``, an ``nn.Parameter`` holding a DTensor whose
    local tensor views this rank's padded shard, a slice of the group's flat
    shard buffer. Unsharded form: ``unsharded_param``, a plain ``nn.Parameter``
    viewing a padded buffer whose storage is freed on reshard and re-allocated
    on unshard, so tensors autograd saved in forward see the re-gathered data.
    A DTensor parameter (tensor parallelism) is sharded by its local tensor; see
    [Note: fully_shard over tensor parallelism] in ``_fsdp_spmd``.
    """

    fqn: str  # in the root once one is known (error messages), else in the module fully_shard was called on
    group_fqn: str  # in the module fully_shard was called on
    owners: list[tuple[nn.Module, str]]
    orig_size: torch.Size  # of the tensor sharded: the parameter, or a DTensor parameter's local tensor
    layout: ShardedLayout  # the sharded DTensor's mesh and placements (and the TP DTensor's, if any)
    orig_dtype: torch.dtype
    shard_dim: int
    shard_shape: torch.Size  # ND, padded: the same on every rank
    rank_slice: RankSlice  # this rank's real rows along shard_dim
    sharded_param: nn.Parameter
    padded_shard: torch.Tensor  # ND view into the group's 1D flat shard
    unsharded_param: nn.Parameter | None
    _unsharded_padded: torch.Tensor | None  # ND, shard_dim padded to world * chunk
    #: ``_unsharded_padded`` as ``(world, shard_numel)`` for an all-gather to fill, made with it (views stay valid
    #: across free and re-allocate); None when rank-major shards are not contiguous there.
    #:
    #: [Note: writing the unsharded memory]
    #: Autograd saves the unsharded parameter in forward and checks in backward
    #: that its version did not change, yet backward's all-gather rewrites it.
    #: The all-gather writes through a ``.data`` alias: the same storage with a
    #: version counter of its own, so the parameter's stays as autograd saved
    #: it. That needs no guard per write (``_unsafe_preserve_version_counter``
    #: cost more than the copy itself for small parameters) and no ``no_grad``
    #: (the alias never requires grad).
    _gather_view: torch.Tensor | None
    accumulated_grad: torch.Tensor | None  # unsharded, in reduce_dtype: no-sync backwards summed there
    state: ShardedState
    _orig: nn.Parameter | None  # the original parameter, until init_sharded

    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], fqn: str,
                 mesh_info: MeshInfo, group_module: nn.Module, shard_dim: int, layout: ShardedLayout) -> None:
        self.fqn, self.group_fqn, self.owners, self.mesh_info = fqn, fqn, owners, mesh_info
        self.group_module, self.layout = group_module, layout
        self.orig_size, self.orig_dtype = local_tensor(param).shape, param.dtype
        self.requires_grad = param.requires_grad
        self.shard_dim = shard_dim
        world = mesh_info.shard_size
        length = self.orig_size[shard_dim]
        self.rank_slice = rank_slice(length, world, mesh_info.shard_rank)
        shape = list(self.orig_size)
        shape[shard_dim] = chunk_size(length, world)
        self.shard_shape = torch.Size(shape)
        self._shard_dims = tuple(shape)  # ``view(*dims)``: a torch.Size argument costs ~1.5 us more per call
        self.unsharded_param, self._unsharded_padded, self._gather_view = None, None, None
        self.accumulated_grad = None
        self.state = ShardedState.SHARDED
        self._orig = param

    @property
    def _param_fqn(self) -> str:
        """PyTorch's name for :attr:`fqn`."""
        return self.fqn

    @property
    def shard_numel(self) -> int:
        return prod(self.shard_shape)

    # ---- sharded form -------------------------------------------------------------------------
    def init_sharded(self, flat_view: torch.Tensor) -> None:
        """Copy this rank's rows of the original parameter into ``flat_view`` and register the DTensor."""
        self.padded_shard = flat_view.view(self.shard_shape)
        orig, self._orig = self._orig, None
        assert orig is not None  # init_sharded runs once
        # Still registered wherever it was shared outside this group's modules: a later call must refuse it.
        orig._fsdp_sharded_as = (self.fqn, weakref.ref(self.group_module))  # type: ignore[attr-defined]  # our marker
        with torch.no_grad():
            self.padded_shard.zero_()
            rows = local_tensor(orig).narrow(self.shard_dim, self.rank_slice.start, self.rank_slice.size)
            self._local_view().copy_(rows)
        self.sharded_param = nn.Parameter(self._to_dtensor(self._sharded_local()), requires_grad=self.requires_grad)
        self.register(self.sharded_param)

    def rebind_sharded(self, flat_view: torch.Tensor) -> None:
        """Point the sharded parameter at ``flat_view`` after ``module.to()``/``to_empty()`` replaced it."""
        registered = self.owners[0][0]._parameters[self.owners[0][1]]
        assert registered is not None  # module._apply replaces a parameter, never removes it
        local = registered.to_local() if isinstance(registered, DTensor) else registered
        self.padded_shard = flat_view.view(self.shard_shape)
        self.orig_dtype = flat_view.dtype  # ``module.to(dtype)``: sharded gradients follow the new dtype
        with torch.no_grad():
            self.padded_shard.zero_()
            if local.device.type != "meta":
                self._local_view().copy_(local)
        if registered is not self.sharded_param:
            self.sharded_param = nn.Parameter(self._to_dtensor(self._sharded_local()),
                                              requires_grad=self.requires_grad)
        else:  # same object (``.data`` was set): re-point its local tensor at our buffer
            sharded = self.sharded_param
            assert isinstance(sharded, DTensor)  # nn.Parameter(DTensor) is a DTensor
            sharded._local_tensor = self._sharded_local()
        self.register(self.sharded_param)

    def _local_view(self) -> torch.Tensor:
        return self.padded_shard.narrow(self.shard_dim, 0, self.rank_slice.size)

    def _sharded_local(self) -> torch.Tensor:
        """The sharded parameter's local tensor: :meth:`_local_view` with a storage of its own, see
        [Note: a parameter's own storage] in ``_sharding.storage``."""
        return own_storage_view(self._local_view())

    def _to_dtensor(self, local: torch.Tensor) -> DTensor:
        return self.layout.wrap(local)

    def to_sharded(self) -> None:
        if self._unsharded_padded is not None:
            free_storage(self._unsharded_padded)  # see [Note: free and re-allocate storage]
        self.register(self.sharded_param)
        self.state = ShardedState.SHARDED

    # ---- unsharded form -----------------------------------------------------------------------
    def to_unsharded(self, gathered: torch.Tensor | None = None) -> None:
        """Fill the unsharded parameter from ``gathered`` (ND, ``(world, *shard_shape)``) and register it.

        None: the all-gather wrote it already (into :meth:`gather_destination`).
        """
        if gathered is not None:
            padded = self._alloc_unsharded(gathered.dtype, gathered.device)
            with torch.no_grad():  # see [Note: writing the unsharded memory]
                self._rank_major(padded.data).copy_(gathered)
        assert self.unsharded_param is not None  # made by _alloc_unsharded
        self.register(self.unsharded_param)
        self.state = ShardedState.UNSHARDED

    def gather_destination(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The unsharded parameter's memory (allocated now) as ``(world, shard_numel)``, for an all-gather to fill;
        None when rank-major shards are not contiguous there (a shard dim other than the outermost)."""
        self._alloc_unsharded(dtype, device)
        return self._gather_view

    def free_unsharded(self) -> None:
        """Release the unsharded memory an all-gather was to fill (its result will not be used)."""
        if self._unsharded_padded is not None and self.state == ShardedState.SHARDED:
            free_storage(self._unsharded_padded)

    def _alloc_unsharded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        padded = self._unsharded_padded
        if padded is None or padded.dtype != dtype or padded.device != device:
            shape = list(self.orig_size)
            shape[self.shard_dim] = self.shard_shape[self.shard_dim] * self.mesh_info.shard_size
            padded = torch.empty(shape, dtype=dtype, device=device)
            self._unsharded_padded = padded
            grad = self.unsharded_param.grad if self.unsharded_param is not None else None
            unpadded = padded.narrow(self.shard_dim, 0, self.orig_size[self.shard_dim])
            if self.layout.tp is not None:  # compute sees the TP DTensor again
                with torch.no_grad():
                    unpadded = self.layout.tp.wrap(unpadded)
            self.unsharded_param = nn.Parameter(unpadded, requires_grad=self.requires_grad)
            self.unsharded_param.grad = grad
            rank_major = self._rank_major(padded.data)  # see [Note: writing the unsharded memory]
            self._gather_view = rank_major.view(rank_major.shape[0], -1) if rank_major.is_contiguous() else None
        else:
            alloc_storage(padded)
        return padded

    def _rank_major(self, padded: torch.Tensor) -> torch.Tensor:
        """``padded`` viewed as ``(world, *shard_shape)``: rank r's shard at index r."""
        world = self.mesh_info.shard_size
        return padded.unflatten(self.shard_dim, (world, self.shard_shape[self.shard_dim])).movedim(self.shard_dim, 0)

    @property
    def unsharded_grad(self) -> torch.Tensor | None:
        """The gradient to reduce: the reduce-dtype accumulation of no-sync backwards, else ``.grad``."""
        if self.accumulated_grad is not None:
            return self.accumulated_grad
        return self._local_grad()

    def _local_grad(self) -> torch.Tensor | None:
        """``unsharded_param.grad`` as a plain tensor (a TP DTensor's local tensor, in the TP placements)."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is not None and self.layout.tp is not None:
            grad = self.layout.tp.local_grad(grad)
        return grad

    def clear_unsharded_grad(self) -> None:
        self.accumulated_grad = None
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None

    def accumulate_grad(self, reduce_dtype: torch.dtype, start: bool) -> None:
        """After a backward: add ``.grad`` to the ``reduce_dtype`` accumulation, or with ``start`` (a
        no-sync backward) begin one when ``.grad`` has another dtype, so gradients kept across no-sync
        backwards sum in ``reduce_dtype``, as in PyTorch."""
        grad = self._local_grad()
        if grad is None or (self.accumulated_grad is None and (not start or grad.dtype == reduce_dtype)):
            return
        assert self.unsharded_param is not None  # it holds the gradient read above
        self.unsharded_param.grad = None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self.accumulated_grad += grad

    # ---- gradients ----------------------------------------------------------------------------
    def set_sharded_grad(self, reduced: torch.Tensor, placement: Placement | None) -> None:
        """Accumulate ``reduced`` (this rank's padded shard, 1D or ``shard_shape``) into ``sharded_param.grad``,
        moved to ``placement``'s storage (None: it is there already)."""
        local = reduced.view(*self._shard_dims)
        if self.rank_slice.size != self.shard_shape[self.shard_dim]:  # this rank's shard has padding
            local = local.narrow(self.shard_dim, 0, self.rank_slice.size)
        if local.dtype != self.orig_dtype:
            local = local.to(self.orig_dtype)
        if placement is not None:
            local = placement.to_storage(local)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = self._grad_dtensor(local)
        else:
            assert isinstance(grad, DTensor)  # the gradient of a DTensor parameter
            grad._local_tensor.add_(local)

    def _grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` as the sharded parameter's gradient: its DTensor metadata is the parameter's.

        Built straight from the parameter's spec: ``DTensor.from_local`` re-derives
        and re-checks the spec, a Python cost paid per parameter per step. Only the
        constructor's ``__new__`` runs (it builds the whole object): its ``__init__``
        does nothing but pass through two tracing wrappers, the larger part of the cost.
        """
        sharded = self.sharded_param
        assert isinstance(sharded, DTensor)  # nn.Parameter(DTensor) is a DTensor
        spec = sharded._spec
        if spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
            return self._to_dtensor(local)
        return DTensor.__new__(DTensor, local, spec, requires_grad=False)

    # ---- registration -------------------------------------------------------------------------
    def register(self, param: nn.Parameter) -> None:
        if param is self.sharded_param:
            # Our marker: lets a later fully_shard call spot a wrong order.
            param._fsdp_owner = self.group_module  # type: ignore[attr-defined]
        for module, name in self.owners:
            module._parameters[name] = param

