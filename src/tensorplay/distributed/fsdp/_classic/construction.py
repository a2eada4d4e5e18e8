"""What the constructor resolves: ignored states, the compute device, materialisation, the managed parameters.

:func:`build_unit` runs these steps in order and returns the unit's :class:`UnitState`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..._comm.collectives import broadcast
from ..._sharding.devices import current_accelerator
from .._torch_types import mark_flat_param
from ..api import MixedPrecision, StateDictSettings
from .flat_param import FlatParamHandle
from .param_views import FlatParamViews, OrigParamViews, ParamSlot
from .placement import Precision, compute_in_full_precision, placement_for
from .plan_agreement import check_unit_plan
from .sharding_plan import ShardingPlan
from .unit_state import UnitOptions, UnitState

IsUnit = Callable[[nn.Module], bool]


def build_unit(module: nn.Module, plan: ShardingPlan, options: UnitOptions, settings: StateDictSettings,
               device_id: int | torch.device | None, param_init_fn: Callable[[nn.Module], None] | None,
               sync: bool, ignored: tuple[set[nn.Module], set[nn.Parameter]], is_unit: IsUnit) -> UnitState:
    """Flatten ``module``'s own parameters (not those of nested units or ignored ones) into a new unit."""
    ignored_modules, ignored_params = ignored
    name = type(module).__name__
    device = compute_device(module, device_id, ignored_params)
    modules = own_modules(module, is_unit, ignored_modules)
    # Refuse a bad unit before anything below changes the module (materialize, move, flatten).
    check_uniform(*managed_params(modules, ignored_params, is_flat), options.use_orig_params, name)
    materialize(module, modules, device, param_init_fn)
    placement = placement_for(device, options.cpu_offload)
    move_to(modules, device)
    params, slots = managed_params(modules, ignored_params, is_flat)
    if sync:
        check_unit_plan(params, slots, plan, name)
        sync_module_states(params, modules, plan)
    precision = Precision.resolve(options.mixed_precision, params[0].dtype if params else torch.float32)
    unit = UnitState(name, plan, options, precision, device, settings)
    if params:
        check_uniform(params, slots, options.use_orig_params, name)
        views = OrigParamViews(params) if options.use_orig_params else FlatParamViews()
        unit.handle = FlatParamHandle(params, slots, plan, placement, precision, views)
        unit.handle.flat_param._fsdp_flattened = True  # type: ignore[attr-defined]  # PyTorch's marker attribute
        mark_flat_param(unit.handle.flat_param)
        views.register(unit.handle, module)
    return unit


def is_flat(param: nn.Parameter) -> bool:
    """Whether ``param`` is a unit's flat parameter (nested units flatten first)."""
    return getattr(param, "_fsdp_flattened", False)


def full_precision_classes(module: nn.Module, mixed_precision: MixedPrecision | None,
                           ignored: set[nn.Module]) -> tuple[type[nn.Module], ...]:
    """The module classes auto-wrapping gives their own unit without mixed precision (PyTorch's BatchNorm rule)."""
    if mixed_precision is None:
        return ()
    classes = tuple(dict.fromkeys(mixed_precision._module_classes_to_ignore))
    found = [m for m in module.modules() if isinstance(m, classes) and m not in ignored]
    if found:
        warnings.warn("Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
                      f"module has submodules of type {sorted({type(m).__name__ for m in found})}: they are "
                      "wrapped as separate FSDP units with mixed precision disabled (set "
                      "MixedPrecision(_module_classes_to_ignore=()) to keep them in the surrounding units)",
                      UserWarning, stacklevel=4)
    for found_module in found:
        compute_in_full_precision(found_module)
    return classes


def resolve_ignored(module: nn.Module, ignored_modules: Iterable[nn.Module] | None,
                    ignored_states: Iterable[nn.Module | nn.Parameter] | None
                    ) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (with their descendants) and every parameter FSDP must leave alone."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("pass ignored_modules or ignored_states, not both (ignored_states accepts modules too)")
    states = list(ignored_modules if ignored_modules is not None else ignored_states or [])
    modules: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for state in states:
        if isinstance(state, nn.Parameter):
            params.add(state)
        elif isinstance(state, nn.Module):
            if state is module:
                raise ValueError("ignored_modules cannot contain the module being wrapped itself")
            modules.update(state.modules())
        else:
            raise TypeError(f"ignored_states must hold nn.Module or nn.Parameter objects, got {type(state).__name__}")
    for ignored in modules:
        params.update(ignored.parameters())
    return modules, params


def refuse_tensor_parallel(module: nn.Module, ignored_params: set[nn.Parameter]) -> None:
    """Refuse DTensor (tensor-parallel) parameters: the classic wrapper flattens plain tensors only.

    PyTorch's classic FSDP composes with TP through its DTensor extension; ours does not, and
    would fail at the first forward (an all-gather of mixed tensors and DTensors). ``fully_shard``
    does compose with TP: the error says how.
    """
    for fqn, param in module.named_parameters():
        if param in ignored_params or not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        raise NotImplementedError(
            f"FullyShardedDataParallel: parameter {fqn!r} is a DTensor ({list(param.placements)} on the "
            f"{mesh.mesh_dim_names or 'unnamed'} mesh of shape {tuple(mesh.shape)}): tensorplay's classic FSDP does "
            "not shard tensor-parallel parameters. Use fully_shard, which composes with tensor parallelism: "
            "fully_shard(module, mesh=mesh_2d['dp']) on each block and on the root, after parallelize_module "
            "(see docs/strategies.md), or pass the parameter in ignored_states to keep it out of FSDP")


def compute_device(module: nn.Module, device_id: int | torch.device | None,
                   ignored_params: set[nn.Parameter]) -> torch.device:
    """``device_id`` if given, else the device of the module's accelerator parameters, else the CPU."""
    if device_id is not None:
        if isinstance(device_id, int):
            accelerator = current_accelerator()
            if accelerator is None:
                raise ValueError(f"device_id={device_id} names an accelerator index but none is available; "
                                 "pass device_id=torch.device('cpu') or None")
            return torch.device(accelerator.type, device_id)
        return torch.device(device_id)
    devices = {p.device for p in module.parameters()
               if p not in ignored_params and p.device.type not in ("cpu", "meta")}
    if len(devices) > 1:
        raise ValueError(f"module parameters span devices {sorted(map(str, devices))}; move them to one device "
                         "or pass device_id")
    return devices.pop() if devices else torch.device("cpu")


def own_modules(module: nn.Module, is_unit: IsUnit, ignored: set[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(fqn, submodule)`` of ``module``'s tree in pre-order, not entering nested units or ignored modules.

    An explicit stack, not a recursive closure (a reference cycle that would hold the tree until a full GC pass).
    """
    found: list[tuple[str, nn.Module]] = []
    stack = [("", module)]
    while stack:
        prefix, current = stack.pop()
        found.append((prefix.rstrip("."), current))
        children = [(f"{prefix}{name}.", child) for name, child in current.named_children()
                    if not is_unit(child) and child not in ignored]
        stack.extend(reversed(children))
    return found


def materialize(module: nn.Module, modules: list[tuple[str, nn.Module]], device: torch.device,
                param_init_fn: Callable[[nn.Module], None] | None) -> None:
    """Give meta-device parameters and buffers real storage (``param_init_fn`` or ``reset_parameters``)."""
    on_meta = [m for _, m in modules
               if any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])]
    if not on_meta:
        return
    if param_init_fn is not None:
        param_init_fn(module)
        return
    for submodule in on_meta:
        submodule.to_empty(device=device, recurse=False)
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            reset()


def move_to(modules: list[tuple[str, nn.Module]], device: torch.device) -> None:
    with torch.no_grad():
        for _, module in modules:
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is not None and tensor.device != device:
                        if isinstance(tensor, nn.Parameter):
                            tensor.data = tensor.data.to(device)
                        else:
                            table[name] = tensor.to(device)  # type: ignore[assignment]  # a buffer, not a Parameter


def managed_params(modules: list[tuple[str, nn.Module]], ignored_params: set[nn.Parameter],
                   already_flat: Callable[[nn.Parameter], bool]) -> tuple[list[nn.Parameter], list[ParamSlot]]:
    """The unit's parameters in registration order, and where each one lives (tied ones once, with aliases)."""
    params: list[nn.Parameter] = []
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for prefix, module in modules:
        for name, param in module._parameters.items():
            if param is None or param in ignored_params or already_flat(param):
                continue
            if id(param) not in places:
                params.append(param)
                places[id(param)] = []
            places[id(param)].append((f"{prefix}.{name}" if prefix else name, module, name))
    slots = []
    for param in params:
        (fqn, module, name), *aliases = places[id(param)]
        slots.append(ParamSlot(fqn, module, name, tuple((m, n) for _, m, n in aliases),
                               tuple(alias_fqn for alias_fqn, _, _ in aliases)))
    return params, slots


def check_uniform(params: list[nn.Parameter], slots: list[ParamSlot], use_orig_params: bool, unit_name: str) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"FSDP unit {unit_name!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                         "cast the module to one dtype or wrap the odd parameters in their own unit")
    if not use_orig_params and len({p.requires_grad for p in params}) > 1:
        frozen = [s.fqn for s, p in zip(slots, params, strict=True) if not p.requires_grad]
        raise ValueError(f"FSDP unit {unit_name!r} mixes frozen and trainable parameters (frozen: {frozen}); "
                         "pass use_orig_params=True or wrap the frozen ones in their own unit")


def sync_module_states(params: list[nn.Parameter], modules: list[tuple[str, nn.Module]], plan: ShardingPlan) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    tensors = [p.detach() for p in params]
    tensors += [b for _, m in modules for b in m.buffers(recurse=False)]
    for group in (plan.shard_group, plan.replicate_group):
        if group is None:
            continue
        for tensor in tensors:
            broadcast(tensor, group_src=0, group=group)
