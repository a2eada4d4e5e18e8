"""Public options of the classic :class:`FullyShardedDataParallel`: enums and small frozen configs.

Names, fields and defaults follow PyTorch's classic FSDP API module; the
objects are defined here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._checks.validation import check_bool, check_dtype

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]


class ShardingStrategy(Enum):
    """What is sharded and when parameters are freed again.

    FULL_SHARD: parameters, gradients and optimizer state sharded; parameters
    freed after forward and after backward. SHARD_GRAD_OP: same, but parameters
    stay gathered from forward until the end of backward. NO_SHARD: replicated,
    gradients all-reduced (DDP). HYBRID_SHARD: FULL_SHARD inside a shard group,
    replicated across groups. _HYBRID_SHARD_ZERO2: SHARD_GRAD_OP inside a group,
    replicated across groups.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import ShardingStrategy
        >>> model = FSDP(tp.nn.Linear(8, 4), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        >>> model.sharding_strategy
        <ShardingStrategy.NO_SHARD: 3>
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When the next unit's parameters are gathered during backward.

    BACKWARD_PRE: when the current unit's backward starts (most overlap, most
    memory). BACKWARD_POST: once the current unit's gradient is ready.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import BackwardPrefetch
        >>> model = FSDP(tp.nn.Linear(8, 4), backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        >>> model(tp.randn(2, 8)).sum().backward()
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for computation, gradient reduction and buffers.

    ``param_dtype`` is the dtype parameters are gathered and computed in;
    ``reduce_dtype`` the dtype gradients are reduced in (``param_dtype`` when
    unset); ``buffer_dtype`` the dtype buffers are cast to. Sharded parameters
    and (unless ``keep_low_precision_grads``) their gradients stay in full
    precision. ``cast_root_forward_inputs`` casts the root's floating-point
    inputs to ``param_dtype``; ``cast_forward_inputs`` does so for every unit.
    With an ``auto_wrap_policy``, modules of ``_module_classes_to_ignore``
    (batch norms by default) become their own units without mixed precision,
    computing in float32 and handing their output back in the input's dtype.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import MixedPrecision
        >>> policy = MixedPrecision(param_dtype=tp.bfloat16, reduce_dtype=tp.float32)
        >>> model = FSDP(tp.nn.Linear(8, 4), mixed_precision=policy)
        >>> model(tp.randn(2, 8)).dtype               # computed in bfloat16
        torch.bfloat16
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)

    def __post_init__(self) -> None:
        _check_fields(self, dtypes=("param_dtype", "reduce_dtype", "buffer_dtype"),
                      bools=("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"))


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps parameter shards and their gradients in host memory.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import CPUOffload
        >>> model = FSDP(tp.nn.Linear(8, 4), cpu_offload=CPUOffload(offload_params=True))   # works without a GPU too
        >>> model(tp.randn(2, 8)).sum().backward()
    """

    offload_params: bool = False

    def __post_init__(self) -> None:
        _check_fields(self, bools=("offload_params",))


class StateDictType(Enum):
    """Shape of ``state_dict()``: full tensors, this rank's flat shard, or per-parameter shards.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import FullStateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        ...     state = model.state_dict()             # full tensors, under the original names
        >>> sorted(state)
        ['bias', 'weight']
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(Enum):
    """How an optimizer state dict names parameters: by integer ID or by FQN.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import OptimStateKeyType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> optimizer = tp.optim.Adam(model.parameters())
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> optimizer.step()
        >>> full = FSDP.optim_state_dict(model, optimizer)          # keyed by parameter names
        >>> plain = tp.nn.Linear(8, 4)
        >>> plain_optimizer = tp.optim.Adam(plain.parameters())
        >>> plain_optimizer.load_state_dict(FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, plain))
        >>> len(plain_optimizer.state)                              # the state of both parameters
        2
    """

    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass
class StateDictConfig:
    """Options shared by every state-dict type: ``offload_to_cpu`` moves the values to host memory.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import StateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        StateDictSettings(...)
        >>> isinstance(FSDP.get_state_dict_type(model).state_dict_config, StateDictConfig)   # the base of all three
        True
    """

    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        _check_fields(self, bools=("offload_to_cpu", "rank0_only", "_use_dtensor"))


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only=True``: only rank 0 returns the full state dict, the others an empty dict.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import FullStateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        ...     state = model.state_dict()             # full tensors, under the original names
        >>> sorted(state)
        ['bias', 'weight']
    """

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Values are each unit's flat parameter as a ``ShardedTensor`` (no padding): each rank's shard, as stored.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import LocalStateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
        ...     state = model.state_dict()             # each unit's flat shard (1 rank: NO_SHARD, full tensors)
        >>> sorted(state)
        ['bias', 'weight']
    """


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Values sharded along dim 0: ``ShardedTensor`` s as in PyTorch, ``DTensor`` s with ``_use_dtensor=True``
    (or when the model was wrapped with a ``device_mesh``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import ShardedStateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        ...     state = model.state_dict()             # each rank its shard, as DTensors (1 rank: the full tensors)
        >>> sorted(state)
        ['bias', 'weight']
    """

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Options for optimizer state dicts; ``offload_to_cpu`` defaults to True as in PyTorch.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import FullOptimStateDictConfig, OptimStateDictConfig
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> optimizer = tp.optim.Adam(model.parameters())
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> optimizer.step()
        >>> issubclass(FullOptimStateDictConfig, OptimStateDictConfig)
        True
    """

    offload_to_cpu: bool = True

    def __post_init__(self) -> None:
        _check_fields(self, bools=("offload_to_cpu", "rank0_only", "_use_dtensor"))


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``rank0_only=True``: only rank 0 returns the full optimizer state dict, the others an empty dict.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> optimizer = tp.optim.Adam(model.parameters())
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> optimizer.step()
        >>> FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
        ...                          FullOptimStateDictConfig(rank0_only=False))
        StateDictSettings(...)
        >>> sorted(FSDP.optim_state_dict(model, optimizer)['state'])     # full state, keyed by parameter names
        ['bias', 'weight']
    """

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Accepted for compatibility: ``optim_state_dict`` refuses LOCAL_STATE_DICT (use ``optim.state_dict()``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import LocalOptimStateDictConfig
        >>> LocalOptimStateDictConfig().offload_to_cpu       # LOCAL_STATE_DICT's optimizer config
        False
    """

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Optimizer state sharded along dim 0, as ``ShardedTensor`` s (``DTensor`` s with ``_use_dtensor=True``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> optimizer = tp.optim.Adam(model.parameters())
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> optimizer.step()
        >>> FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
        ...                          ShardedOptimStateDictConfig())
        StateDictSettings(...)
        >>> sorted(FSDP.optim_state_dict(model, optimizer)['state'])     # each rank's shard of the state
        ['bias', 'weight']
    """

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """The state-dict type and configs in force on a model (returned by ``get_state_dict_type``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import StateDictType
        >>> model = FSDP(tp.nn.Linear(8, 4))
        >>> settings = FSDP.get_state_dict_type(model)
        >>> settings.state_dict_type
        <StateDictType.FULL_STATE_DICT: 1>
    """

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


def _check_fields(config: object, dtypes: tuple[str, ...] = (), bools: tuple[str, ...] = ()) -> None:
    """A clear TypeError for a field of the wrong type (``MixedPrecision(param_dtype="bf16")``)."""
    where = type(config).__name__
    for name in dtypes:
        check_dtype(getattr(config, name), name, where)
    for name in bools:
        if hasattr(config, name):
            check_bool(getattr(config, name), name, where)
