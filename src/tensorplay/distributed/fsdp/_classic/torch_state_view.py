"""What PyTorch's own FSDP helpers read of our classic wrapper ([Note: PyTorch's helpers on classic FSDP]).

[Note: PyTorch's helpers on classic FSDP]
Our ``FullyShardedDataParallel`` is also PyTorch's (type identity only), so
PyTorch's code takes it for its own: ``_get_module_fsdp_state`` returns the
wrapper, and PyTorch's static methods called with it
(``torch...FullyShardedDataParallel.state_dict_type(model, ...)``,
``optim_state_dict``, ``summon_full_params``, ``fsdp_modules``) read the
instance attributes of PyTorch's ``_FSDPState`` from it. Each answers in one of
two ways:

* The state-dict settings (``_state_dict_type``, ``_state_dict_config``,
  ``_optim_state_dict_config``, and ``_device_mesh``, which they read) are offered: read and written through the unit's
  own settings, in PyTorch's types (PyTorch checks ``type(config) is ...``). So
  PyTorch's ``state_dict_type`` / ``set_state_dict_type`` / ``get_state_dict_type``
  set what our ``state_dict`` hooks use, and give PyTorch's result.
* Every other one refuses (:func:`.foreign_helpers.helper_refusal`), naming the
  PyTorch helper on the stack and ours to call instead. Every PyTorch helper that
  would run PyTorch's runtime on the wrapper reads one of them (``_is_root`` in
  ``_lazy_init``, ``_use_orig_params`` in the optimizer state-dict paths,
  ``_device_handle`` in ``summon_full_params``) before it changes anything.

``_FSDPState``'s public attributes (``rank``, ``world_size``, ``process_group``,
``sharding_strategy``, ``compute_device``, ``training_state``) and ``_handle``
are the wrapper's own properties.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

from tensorplay.distributed._torch_identity import as_ours, as_torchs

from ..api import OptimStateDictConfig, StateDictConfig, StateDictType
from .foreign_helpers import helper_refusal
from .unit_state import UnitState

__all__ = ["REFUSED", "TorchStateView"]

#: ``_FSDPState``'s instance attributes (and those PyTorch's wrapper adds in its ``__init__``) that PyTorch's
#: helpers read and that ours refuse.
REFUSED = (
    "_is_root", "_use_orig_params", "_all_handles", "_all_fsdp_states", "_comm_hook", "_comm_hook_state",
    "_device_handle", "_fsdp_extension", "_fully_sharded_module_to_handle",
    "_gradient_predivide_factor", "_gradient_postdivide_factor", "_ignored_buffer_names", "_ignored_modules",
    "_ignored_params", "_unshard_event", "_unshard_params_ctx", "_sync_gradients", "_zero_scalar",
    "_exec_order_data",
)


def _refusing(name: str) -> property:
    def refuse(self: Any, value: Any = None) -> NoReturn:
        raise helper_refusal(f"_FSDPState.{name}")
    return property(refuse, refuse, doc=f"PyTorch's ``_FSDPState.{name}``: refused (see the module's note).")


def _setting(field: str, our_cls: type) -> property:
    """PyTorch's ``_FSDPState._<field>``: the unit's state-dict setting ``field``, in PyTorch's type."""
    def get(self: TorchStateView) -> Any:
        return as_torchs(getattr(self._fsdp_state.state_dict_settings, field))

    def put(self: TorchStateView, value: Any) -> None:
        state = self._fsdp_state
        state.state_dict_settings = dataclasses.replace(state.state_dict_settings, **{field: as_ours(value, our_cls)})
    return property(get, put)


class TorchStateView:
    """The ``_FSDPState`` attributes PyTorch's helpers read, answered from the unit's own state (a wrapper base)."""

    _fsdp_state: UnitState
    _state_dict_type = _setting("state_dict_type", StateDictType)
    _state_dict_config = _setting("state_dict_config", StateDictConfig)
    _optim_state_dict_config = _setting("optim_state_dict_config", OptimStateDictConfig)

    @property
    def _device_mesh(self) -> Any:
        """The ``device_mesh`` given (PyTorch's state-dict settings turn on DTensors for it)."""
        return self._fsdp_state.device_mesh


for _name in REFUSED:
    setattr(TorchStateView, _name, _refusing(_name))
