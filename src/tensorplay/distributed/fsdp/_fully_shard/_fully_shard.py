"""fully_shard: shard a module's parameters in place; FSDPModule: the methods it gains."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from tensorplay.distributed._sharding.devices import current_accelerator
from tensorplay.distributed._torch_identity import as_ours, identity_only

from .. import _torch_types as torch_fsdp
from .._load_guard import check_loads_through_parents
from ._fsdp_api import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_args import check_divide_factor, check_fully_shard_args, check_prefetch_modules, check_setter_bool
from ._fsdp_comm_knobs import CommKnobs
from ._fsdp_common import (
    InvalidArgumentError,
    MeshInfo,
    ShardPlacementFnResult,
    ShardPlacementResult,
    default_mesh,
    device_from_mesh,
    mesh_info_from,
    with_reshard,
)
from ._fsdp_join import FSDPJoinable
from ._fsdp_load_check import check_load
from ._fsdp_param import FSDPParam
from ._fsdp_param_group import FSDPParamGroup
from ._fsdp_shared_params import check_shared_across_groups, is_sharded_elsewhere
from ._fsdp_spmd import local_tensor, sharded_layout
from ._fsdp_state import FSDPState

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]

ShardPlacementFn = Callable[[nn.Parameter], "ShardPlacementFnResult"]


@overload
def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = ..., reshard_after_forward: bool | int | None = ...,
                shard_placement_fn: ShardPlacementFn | None = ..., mp_policy: MixedPrecisionPolicy = ...,
                offload_policy: OffloadPolicy = ..., ignored_params: set[nn.Parameter] | None = ...,
                dp_mesh_dims: DataParallelMeshDims | None = ...) -> FSDPModule: ...


@overload
def fully_shard(module: list[nn.Module], *, mesh: DeviceMesh | None = ...,
                reshard_after_forward: bool | int | None = ...,
                shard_placement_fn: ShardPlacementFn | None = ..., mp_policy: MixedPrecisionPolicy = ...,
                offload_policy: OffloadPolicy = ..., ignored_params: set[nn.Parameter] | None = ...,
                dp_mesh_dims: DataParallelMeshDims | None = ...) -> list[FSDPModule]: ...


def fully_shard(module, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: ShardPlacementFn | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (PyTorch's signature; a frozen dataclass)
                offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008  (PyTorch's signature; a frozen dataclass)
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None):
    """Shard ``module``'s parameters across ``mesh`` in place; one call forms one communication group.

    Every parameter of ``module`` not already managed by an earlier call on a
    submodule becomes an ``nn.Parameter`` holding a DTensor sharded on dim 0
    (``shard_placement_fn`` may choose another dim), padded so every rank holds
    an equal chunk; FQNs stay the same. ``module``'s class becomes a subclass of
    its class and :class:`FSDPModule`. Forward all-gathers the group in one
    collective; backward reduce-scatters its gradients in one collective into
    sharded ``.grad`` DTensors, averaged over the data-parallel ranks. Apply it
    bottom-up: blocks first, then the root.

    ``mesh``: 1D (FSDP) or 2D (HSDP: replicate on dim 0, shard on dim 1);
    default: a 1D mesh over the default group. ``reshard_after_forward``: free
    the unsharded parameters after forward (True), keep them (False), or keep
    them sharded over groups of this many ranks (int); None means True except
    for the root. ``module`` may be a list of modules that form one group.

    Tensor parallelism composes: a parameter that already is a DTensor (from
    ``parallelize_module(..., mesh["tp"])``) is sharded over ``mesh["dp"]`` by
    its local TP shard and becomes a DTensor on the ``dp x tp`` mesh, with
    PyTorch's placements (see [Note: fully_shard over tensor parallelism] in
    ``_fsdp_spmd``); one whose mesh is not a sub-mesh of the same mesh is refused.
    With ``dp_mesh_dims`` (a :class:`DataParallelMeshDims`), ``mesh`` is the full
    SPMD mesh instead, every parameter a DTensor on it with ``Replicate()`` on
    the named data-parallel dims, and the shard dim's Replicate becomes the
    data-parallel shard. ``shard_placement_fn`` may return ``None``, a
    ``Shard`` or a :class:`ShardPlacementResult`. ``fully_shard.state(module)``
    returns the state a call attached to ``module`` (None if none).

    Where it differs from PyTorch's ``fully_shard`` (PyTorch's behaviour is a
    wart there): on Gloo the all-gather and reduce-scatter are composed from
    faster collectives (see ``tensorplay.distributed._comm.collectives``);
    ``CPUOffloadPolicy(pin_memory=True)`` works without an accelerator;
    ``set_gradient_divide_factor`` works on Gloo; and running a sharded child's
    forward before its parent is sharded is allowed (the parent's
    ``fully_shard`` reshards the child and makes it a non-root again) instead
    of failing at the parent's first forward. A group that kept its unsharded
    parameters (the root after a ``no_grad`` forward, say) re-gathers when its
    shards changed since (an optimizer step), where PyTorch serves stale ones.
    A parameter shared by two calls' modules (a tied embedding and head) is refused
    at the first call that contains both, naming both FQNs, where PyTorch refuses it
    at the first forward naming one.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import fully_shard
        >>> model = tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.ReLU(), tp.nn.Linear(16, 4))
        >>> for layer in (model[0], model[2]):
        ...     _ = fully_shard(layer)              # one all-gather / reduce-scatter unit per layer
        >>> model = fully_shard(model)              # the root: the class becomes FSDP<Name>
        >>> type(model).__name__, type(model[0].weight).__name__
        ('FSDPSequential', 'DTensor')
        >>> optimizer = tp.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> optimizer.step()
    """
    modules = _as_modules(module)
    mp_policy, offload_policy = as_ours(mp_policy, MixedPrecisionPolicy), as_ours(offload_policy, OffloadPolicy)
    dp_mesh_dims = as_ours(dp_mesh_dims, DataParallelMeshDims)  # PyTorch's policies are taken as ours
    ignored_params = check_fully_shard_args(mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                                            offload_policy, ignored_params)
    mesh = mesh if mesh is not None else default_mesh()
    _check_mesh_available(mesh, modules)
    mesh_info = mesh_info_from(mesh, dp_mesh_dims)
    device = device_from_mesh(mesh)
    auto = reshard_after_forward is None
    if dp_mesh_dims is not None and isinstance(reshard_after_forward, int) \
            and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"fully_shard: reshard_after_forward={reshard_after_forward} (an int) is not "
                                  f"supported with dp_mesh_dims; pass True or False")
    after_forward = True if reshard_after_forward is None else reshard_after_forward
    if not isinstance(after_forward, bool) and after_forward == mesh_info.shard_size:
        after_forward = True
    mesh_info = with_reshard(mesh_info, after_forward)
    _check_not_managed(modules)
    nested_states = _nested_states(modules)
    ignored = frozenset(ignored_params or ())
    check_shared_across_groups(modules, ignored.union(*(nested.ignored_params for nested in nested_states)))
    owners, fqns = _managed_params(modules, set(ignored))
    for param in owners:
        _check_device(param, fqns[param], device)
    _check_one_dtype(owners, fqns, modules)
    fsdp_params = _fsdp_params(owners, fqns, mesh_info, modules[0], shard_placement_fn)
    _move_buffers(modules, device)  # the first change to the module: every check above has passed
    for nested in nested_states:
        nested.reset_root()
    state = FSDPState(modules, mp_policy, auto, ignored)
    group = None
    if fsdp_params:
        group = FSDPParamGroup(fsdp_params, modules, mesh_info, mesh_info.post_forward, device, mp_policy,
                               offload_policy, reshard_after_forward=mesh_info.reshard_after_forward)
    state.attach(group)
    for mod in modules:
        mod.__dict__["_fsdp_state"] = state
        check_loads_through_parents(mod)  # first: [Note: load through a plain parent]
        torch_fsdp.expose_state(mod, state)
        _register_state_dict_hooks(mod, state)
        mod.__class__ = _fsdp_class(type(mod))
    return module


def _nested_states(modules: tuple[nn.Module, ...]) -> list[FSDPState]:
    """Every fully_shard state at or below ``modules``, each once, in module order."""
    states: list[FSDPState] = []
    for mod in modules:
        for sub in mod.modules():
            state = sub.__dict__.get("_fsdp_state")
            if state is not None and state not in states:
                states.append(state)
    return states


def _as_modules(module: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard expects an nn.Module or a non-empty list of them, got {module!r}")
    for mod in modules:
        if isinstance(mod, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(mod).__name__}; apply it once per module")
    return modules


def _check_not_managed(modules: tuple[nn.Module, ...]) -> None:
    """Refuse a module whose parameters an earlier call (on an ancestor) already sharded."""
    for mod in modules:
        for param in mod.parameters():
            owner = getattr(param, "_fsdp_owner", None)
            if owner is None or any(owner is sub for sub in mod.modules()):
                continue  # unmanaged, or managed by a nested group (bottom-up order)
            fqn = next((name for name, sub in owner.named_modules() if sub is mod), "?")
            raise ValueError(
                f"fully_shard: module '{fqn}' ({type(mod).__name__}) is already inside the fully_shard group "
                f"of its ancestor {type(owner).__name__}; apply fully_shard bottom-up (this module first, "
                f"then its parent)")


def _managed_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]
                    ) -> tuple[dict[nn.Parameter, list[tuple[nn.Module, str]]], dict[nn.Parameter, str]]:
    """Each parameter this call manages, every (module, name) it is registered under, and its FQN.

    A walk in pre-order with an explicit stack, not a recursive closure: a closure
    that calls itself is a reference cycle, and it would keep the original
    (unsharded) parameters alive until the garbage collector's next full pass.
    """
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    fqns: dict[nn.Parameter, str] = {}
    seen: set[int] = set()
    stack = [(mod, "", True) for mod in reversed(modules)]
    while stack:
        mod, prefix, is_top = stack.pop()
        if id(mod) in seen or (not is_top and "_fsdp_state" in mod.__dict__):
            continue  # a nested fully_shard module's parameters belong to its own group
        seen.add(id(mod))
        for name, param in mod._parameters.items():
            if param is None or param in ignored or hasattr(param, "_fsdp_owner"):
                continue  # ignored, or a nested group's (shared with a module outside it)
            if is_sharded_elsewhere(param):
                continue  # an earlier sibling call's: see [Note: naming a parameter shared across groups]
            owners.setdefault(param, []).append((mod, name))
            fqns.setdefault(param, prefix + name)
        children = [(child, f"{prefix}{name}.", False) for name, child in mod._modules.items() if child is not None]
        stack.extend(reversed(children))
    return owners, fqns


def _fsdp_params(owners: dict[nn.Parameter, list[tuple[nn.Module, str]]], fqns: dict[nn.Parameter, str],
                 mesh_info: MeshInfo, group_module: nn.Module, placement_fn: ShardPlacementFn | None
                 ) -> list[FSDPParam]:
    meshes: dict[int, DeviceMesh] = {}  # one ``dp x tp`` mesh per TP mesh of this call
    fsdp_params = []
    for param, param_owners in owners.items():
        fqn = fqns[param]
        shard_dim = _shard_dim(param, fqn, placement_fn, mesh_info)
        layout = sharded_layout(param, fqn, mesh_info, shard_dim, meshes)
        fsdp_params.append(FSDPParam(param, param_owners, fqn, mesh_info, group_module, shard_dim, layout))
    return fsdp_params


def _move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    """Buffers stay replicated but move to the mesh's device (parameters move as they are sharded)."""
    for mod in modules:
        for sub in mod.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and buf.device.type not in ("meta", device.type):
                    sub._buffers[name] = buf.to(device)


def _check_one_dtype(owners: dict, fqns: dict, modules: tuple[nn.Module, ...]) -> None:
    """A group's shards live in one flat buffer, so its parameters must share a dtype."""
    first: dict[torch.dtype, str] = {}
    for param in owners:
        first.setdefault(param.dtype, fqns[param])
    if len(first) > 1:
        found = ", ".join(f"'{fqn}' is {dtype}" for dtype, fqn in first.items())
        raise ValueError(f"fully_shard({type(modules[0]).__name__}): one group's parameters must share a dtype, "
                         f"but {found}; convert them to one dtype (and use MixedPrecisionPolicy(param_dtype=...) "
                         f"to compute in lower precision), or call fully_shard on each part separately")


def _check_mesh_available(mesh: DeviceMesh, modules: tuple[nn.Module, ...]) -> None:
    kind = mesh.device_type
    if kind == "cpu":
        return
    current = current_accelerator()
    if current is None or current.type != kind:
        devices = sorted({str(p.device) for m in modules for p in m.parameters()})
        raise ValueError(f"fully_shard({type(modules[0]).__name__}): the mesh's device type is '{kind}', but no "
                         f"'{kind}' device is available here (parameters are on {', '.join(devices) or 'no device'});"
                         f" build the mesh with init_device_mesh('cpu', ...) or run where '{kind}' exists")


def _check_device(param: nn.Parameter, fqn: str, device: torch.device) -> None:
    if param.device.type in ("meta", "cpu", device.type):
        return
    raise ValueError(f"fully_shard: parameter '{fqn}' is on {param.device} but the mesh's device type is "
                     f"'{device.type}'; move the module to {device.type} or pass a mesh for {param.device.type}")


def _shard_dim(param: nn.Parameter, fqn: str, placement_fn: ShardPlacementFn | None, mesh_info: MeshInfo) -> int:
    placement = placement_fn(param) if placement_fn is not None else None
    if isinstance(placement, ShardPlacementResult):
        placement = _same_mesh_placement(placement, fqn, mesh_info)
    if placement is None:
        placement = Shard(0)
    if not isinstance(placement, Shard):
        raise TypeError(f"fully_shard: shard_placement_fn returned {placement!r} for parameter '{fqn}'; "
                        f"expected a Shard(dim), a ShardPlacementResult or None")
    local = local_tensor(param)  # a DTensor parameter's local tensor is what is sharded
    if param.dim() == 0:
        raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with numel "
                         f"equal to 1. (parameter '{fqn}' cannot be sharded; or pass it in ignored_params)")
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise InvalidArgumentError(f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: "
                                   f"shard_placement_fn returned Shard({placement.dim}) for parameter '{fqn}' "
                                   f"of shape {tuple(param.shape)} (fully_shard)")
    world = mesh_info.shard_size
    if dim != 0 and local.shape[dim] % world:
        raise ValueError(f"fully_shard: parameter '{fqn}' has local size {local.shape[dim]} on dim {dim}, which does "
                         f"not split evenly across {world} ranks, and only dim 0 is padded; choose Shard(0) or "
                         f"a dim divisible by {world}")
    return dim


def _same_mesh_placement(result: ShardPlacementResult, fqn: str, mesh_info: MeshInfo) -> Shard | None:
    """The placement of a :class:`ShardPlacementResult` whose mesh is the one passed to fully_shard."""
    mesh = getattr(result.mesh_info, "mesh", None)
    if mesh is None or mesh != mesh_info.mesh:
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn returned a ShardPlacementResult for parameter '{fqn}' on the mesh "
            f"{mesh}, not the mesh passed to fully_shard ({mesh_info.mesh}); sharding one group's parameters over "
            f"different meshes is not supported: call fully_shard separately on the modules that use that mesh")
    return result.placement


def _register_state_dict_hooks(module: nn.Module, state: FSDPState) -> None:
    """State dicts always hold the sharded DTensors; a load that replaced them is adopted."""

    def before_save(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        if state.group is not None:
            state.group.reshard()

    def before_load(*args: Any) -> None:
        if state.group is not None:
            state.group.reshard()

    def after_load(mod: nn.Module, incompatible: Any) -> None:
        group = state.group
        if group is not None and any(mod_._parameters[name] is not p.sharded_param
                                     for p in group.fsdp_params for mod_, name in p.owners):
            group.rebind_sharded()

    module.register_state_dict_pre_hook(before_save)
    module._register_load_state_dict_pre_hook(before_load)
    module.register_load_state_dict_post_hook(after_load)


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import fully_shard
        >>> model = fully_shard(tp.nn.Linear(8, 4))
        >>> handle = model.unshard(async_op=True)     # an UnshardHandle: the all-gather is in flight
        >>> handle.wait()                             # the full parameters are in place
        >>> model.reshard()
    """

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


@identity_only
class FSDPModule(FSDPJoinable, CommKnobs, torch_fsdp.FSDPModule):  # PyTorch's: isinstance only
    """The methods a module gains from :func:`fully_shard` (its class becomes a subclass of this one).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FSDPModule, fully_shard
        >>> model = fully_shard(tp.nn.Linear(8, 4))
        >>> isinstance(model, FSDPModule)
        True
        >>> model.set_requires_gradient_sync(False)   # accumulate locally, e.g. on all but the last micro-batch
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> model.set_requires_gradient_sync(True)
        >>> model.unshard()                           # gather the full parameters ahead of use; reshard() frees them
        >>> model.reshard()
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return super(torch_fsdp.FSDPModule, cls).__new__(cls)  # the module class's own, past PyTorch's

    @property
    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def _get_fsdp_state(self) -> FSDPState:
        """This module's fully_shard state (PyTorch's accessor of the same name)."""
        return self._fsdp_state

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        return _nested_states((cast(nn.Module, self),)) if recurse else [self._fsdp_state]

    def _fsdp_groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.group for s in self._fsdp_states(recurse) if s.group is not None]

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing on every rank.

        Every key and shape is checked first, on every rank, and the ranks agree:
        a state dict that does not fit on any rank raises one ``StateDictLoadError``
        (a ``RuntimeError``) listing every missing / unexpected / wrong-shape key
        with both shapes, on every rank, and no parameter changes anywhere.
        ``strict=False`` allows missing and unexpected keys, never a wrong shape.
        PyTorch's fully_shard copies every key that fits before raising.
        """
        check_load(cast(nn.Module, self), state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)  # type: ignore[misc]  # nn.Module's

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones."""
        group = self._fsdp_state.group
        if group is not None:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters; with ``async_op`` return a handle to ``wait()`` on."""
        group = self._fsdp_state.group
        if group is not None:
            group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """Recover after a forward or backward raised: discard that step's communication and local gradients.

        Also done automatically when the root's next forward finds the last
        backward unfinished.
        """
        for state in self._fsdp_states(recurse=True):
            state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward ends the step: if False, the last reduce-scatter is left in flight."""
        check_setter_bool(is_last_backward, "is_last_backward", "set_is_last_backward")
        self._fsdp_state.ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction off to accumulate unsharded gradients locally (no communication)."""
        check_setter_bool(requires_gradient_sync, "requires_gradient_sync", "set_requires_gradient_sync")
        for group in self._fsdp_groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """For HSDP: whether to all-reduce across the replicate dim after the reduce-scatter."""
        check_setter_bool(requires_all_reduce, "requires_all_reduce", "set_requires_all_reduce")
        for group in self._fsdp_groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) the unsharded parameters after forward."""
        check_setter_bool(reshard_after_forward, "reshard_after_forward", "set_reshard_after_forward")
        for state in self._fsdp_states(recurse):
            state.auto_reshard_after_forward = False
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward
                state.group.post_forward_info = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free (True) or keep (False) the unsharded parameters after backward."""
        check_setter_bool(reshard_after_backward, "reshard_after_backward", "set_reshard_after_backward")
        for group in self._fsdp_groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups, asynchronously, right after this module's forward all-gather."""
        modules = check_prefetch_modules(modules, "set_modules_to_forward_prefetch")
        self._fsdp_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups, asynchronously, right after this module's backward all-gather."""
        modules = check_prefetch_modules(modules, "set_modules_to_backward_prefetch")
        self._fsdp_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_post_optim_event(self, event: Any) -> None:
        """Make the next forward's all-gathers wait for ``event`` (recorded after the optimizer step)."""
        self._fsdp_state.ctx.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        factor = check_divide_factor(factor, "set_gradient_divide_factor")
        for group in self._fsdp_groups(recurse=True):
            group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Same as :meth:`set_gradient_divide_factor` (PyTorch's older name)."""
        self.set_gradient_divide_factor(factor)

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError(f"copy.deepcopy of a fully_shard module ({type(self).__name__}) is not supported: its "
                           f"parameters are shards tied to process groups; deep-copy the module before fully_shard")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``to()``/``to_empty()`` replace the sharded parameters; adopt the new ones into our buffers.
        group = self._fsdp_state.group
        if group is not None:
            group.reshard()
        # FSDPModule is only mixed in before an nn.Module class, which mypy cannot see.
        result = super(torch_fsdp.FSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]  # past PyTorch's
        if group is not None:
            group.rebind_sharded()
        return result


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several fully_shard roots (pipeline stages) share their communication streams.

    Ours already shares them: every group on a device uses that device's one
    all-gather and one reduce-scatter stream. Checks that ``modules`` are
    fully_shard modules, as PyTorch does.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import fully_shard, share_comm_ctx
        >>> stages = [fully_shard(tp.nn.Linear(8, 8)), fully_shard(tp.nn.Linear(8, 8))]
        >>> share_comm_ctx(stages)
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx: expects a list of FSDPModules (fully_shard modules), got "
                             f"{type(module).__name__}")


def _get_state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state a fully_shard call attached to ``module``, or None."""
    return module.__dict__.get("_fsdp_state")


# PyTorch's composable-API accessor: an attribute on the function, which mypy does not model.
fully_shard.state = _get_state  # type: ignore[attr-defined]


def _state_of(module: Any, method: str) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{method}: {type(module).__name__} is not a fully_shard module; "
                         f"call fully_shard on it first")
    return module._fsdp_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` all-gather and reshard like ``forward`` (no-op if not fully_shard).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import fully_shard, register_fsdp_forward_method
        >>> class Encoder(tp.nn.Linear):
        ...     def encode(self, x):
        ...         return self(x).relu()
        >>> model = fully_shard(Encoder(8, 4))
        >>> register_fsdp_forward_method(model, "encode")   # encode() now gathers the parameters like forward()
        >>> model.encode(tp.randn(2, 8)).shape
        torch.Size([2, 4])
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")
    state = module._fsdp_state
    method = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, method(*args, **kwargs))

    module.__dict__[method_name] = wrapped
