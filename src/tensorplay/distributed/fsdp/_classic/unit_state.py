"""The declared state of classic FSDP units: what the runtime, state-dict, summon and optimizer code work on.

Each ``FullyShardedDataParallel`` unit owns one :class:`UnitState`; the units of
one wrapped model share a :class:`RootState`, created by the root's first
forward. The modules that drive a unit (``runtime``, ``state_dict``, ``summon``,
``optim_state_dict``, ``comm_hook``) take these objects as arguments and never
import the wrapper class: :func:`state_of` and :func:`named_states` find the
units of a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, StateDictSettings

if TYPE_CHECKING:
    from .comm_hook import CommHook
    from .flat_param import FlatParamHandle, GradReduction
    from .grad_buckets import GradBuckets
    from .placement import Precision
    from .sharding_plan import ShardingPlan

#: The attribute of a unit (in its instance ``__dict__``) that holds its :class:`UnitState`.
STATE_ATTR = "_fsdp_state"
WRAPPED = "_fsdp_wrapped_module"
WRAPPED_PREFIX = WRAPPED + "."


def clean_fqn(name: str) -> str:
    """``name`` without the wrapper's components (the FQN the unwrapped model uses)."""
    return name.replace(WRAPPED_PREFIX, "")


class TrainingState(Enum):
    """What a unit is doing (PyTorch's public ``training_state``): between forward and backward it is IDLE."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


@dataclass(frozen=True)
class UnitOptions:
    """The constructor's settings a unit keeps (read back through PyTorch's public attributes)."""

    cpu_offload: CPUOffload
    mixed_precision: MixedPrecision | None
    use_orig_params: bool
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool   # only read back (PyTorch's attribute): no effect, see FullyShardedDataParallel


@dataclass(eq=False)
class UnitState:
    """One unit: its flat parameter's handle (None: no parameters of its own), plan, settings and progress."""

    name: str                                  # the wrapped module's class name, for messages
    plan: ShardingPlan
    options: UnitOptions
    precision: Precision
    compute_device: torch.device
    state_dict_settings: StateDictSettings
    device_mesh: Any | None = None             # a DeviceMesh: sharded state dicts then hold DTensors
    dtensor_mesh: Any | None = None            # the 1D DeviceMesh over the shard group, made by the first DTensor save
    handle: FlatParamHandle | None = None
    comm_hook: CommHook | None = None
    root: RootState | None = None              # set by the root's first forward
    is_root: bool | None = None
    sync_gradients: bool = True                # False inside no_sync()
    ran_pre_backward: bool = False             # this iteration's backward has reached the unit
    training_state: TrainingState = TrainingState.IDLE
    #: While a state dict is saved or loaded: the registrations the unit swapped out, to put back after.
    saved_registrations: dict[tuple[nn.Module, str], object] = field(default_factory=dict)
    #: While a full or sharded state dict is loaded: the gathered flat parameter the values go into.
    load_target: torch.Tensor | None = None
    #: While a load is checked (``load_check.check_loadable``): the shape-only placeholders saved so far
    #: (by id, to their unit); None in a real save.
    describing: dict[int, UnitState] | None = None


@dataclass(eq=False)
class RootState:
    """What the units of one wrapped model share, owned by the root."""

    units: list[UnitState]                                          # every unit, root first
    forward_order: list[UnitState] = field(default_factory=list)   # recorded on the first forward
    order_recorded: bool = False
    pending_reductions: list[GradReduction] = field(default_factory=list)
    grad_buckets: GradBuckets | None = None                         # NO_SHARD buckets, kept across iterations
    grad_buckets_checked: bool = False                              # this backward checked their plan
    end_of_backward_queued: bool = False

    def neighbour(self, unit: UnitState, step: int) -> UnitState | None:
        """The unit ``step`` places after ``unit`` in forward order, once the order is known."""
        if not self.order_recorded or unit not in self.forward_order:
            return None
        index = self.forward_order.index(unit) + step
        return self.forward_order[index] if 0 <= index < len(self.forward_order) else None


def state_of(module: nn.Module) -> UnitState | None:
    """``module``'s :class:`UnitState` if it is a classic FSDP unit, else None.

    Read from the instance ``__dict__``: attribute lookup would see through
    wrappers that forward attributes (activation checkpointing's).
    """
    state = module.__dict__.get(STATE_ATTR)
    return state if isinstance(state, UnitState) else None


def named_states(model: nn.Module) -> list[tuple[str, UnitState]]:
    """``(FQN in the unwrapped model, state)`` of every unit in ``model``'s tree, pre-order."""
    found = []
    for name, module in model.named_modules():
        state = state_of(module)
        if state is not None:
            found.append((clean_fqn(name), state))
    return found
