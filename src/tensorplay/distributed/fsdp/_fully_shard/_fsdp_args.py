"""fully_shard's argument checks, run before it changes anything (a rejected call leaves the module as it was)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tensorplay.distributed._checks.validation import (
    check_bool,
    check_callable,
    check_instance,
    check_int,
    check_iterable,
    check_real,
)

from ._fsdp_api import MixedPrecisionPolicy, OffloadPolicy

_WHERE = "fully_shard"


def check_fully_shard_args(mesh: Any, reshard_after_forward: Any, shard_placement_fn: Any, mp_policy: Any,
                           offload_policy: Any, ignored_params: Any) -> set[nn.Parameter] | None:
    """A TypeError/ValueError naming the first bad argument and its value; else ``ignored_params`` as a set."""
    check_instance(mesh, DeviceMesh, "mesh", _WHERE, optional=True,
                   hint="build one with init_device_mesh(device_type, (world_size,))")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        try:
            check_int(reshard_after_forward, "reshard_after_forward", _WHERE, minimum=1)
        except TypeError:
            raise TypeError(f"{_WHERE}: reshard_after_forward must be a bool, an int or None, got "
                            f"{reshard_after_forward!r} ({type(reshard_after_forward).__name__})") from None
    check_callable(shard_placement_fn, "shard_placement_fn", _WHERE)
    check_instance(mp_policy, MixedPrecisionPolicy, "mp_policy", _WHERE,
                   hint="e.g. MixedPrecisionPolicy(param_dtype=tp.bfloat16)")
    check_instance(offload_policy, OffloadPolicy, "offload_policy", _WHERE,
                   hint="pass OffloadPolicy() or CPUOffloadPolicy()")
    ignored = check_iterable(ignored_params, "ignored_params", _WHERE, item_types=nn.Parameter)
    return set(ignored) if ignored is not None else None


def check_setter_bool(value: Any, name: str, method: str) -> bool:
    return check_bool(value, name, f"FSDPModule.{method}")


def check_divide_factor(value: Any, method: str) -> float:
    return check_real(value, "factor", f"FSDPModule.{method}", above=0.0)


def check_prefetch_modules(modules: Any, method: str) -> list[Any]:
    checked = check_iterable(modules, "modules", f"FSDPModule.{method}", optional=False)
    assert checked is not None  # optional=False: None was refused
    return checked
