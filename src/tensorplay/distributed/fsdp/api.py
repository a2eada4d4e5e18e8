"""Public options of the classic :class:`FullyShardedDataParallel`: enums and small configs.

Names, fields and defaults follow PyTorch's classic FSDP API module; the
objects are defined here. Each config is also an instance of PyTorch's class
of the same name and each enum member equals PyTorch's member of that name,
for the checks frameworks make ([Note: type identity only]); our entry points
accept PyTorch's objects too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import auto

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._checks.validation import check_bool, check_dtype
from .._torch_identity import TorchEqualEnum, identity_only, twin
from . import _torch_types as torch_fsdp

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


@twin(torch_fsdp.ShardingStrategy)
class ShardingStrategy(TorchEqualEnum):
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


@twin(torch_fsdp.BackwardPrefetch)
class BackwardPrefetch(TorchEqualEnum):
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


@twin(torch_fsdp.MixedPrecision)
@identity_only
@dataclass
class MixedPrecision(torch_fsdp.MixedPrecision):
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


@twin(torch_fsdp.CPUOffload)
@identity_only
@dataclass
class CPUOffload(torch_fsdp.CPUOffload):
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


@twin(torch_fsdp.StateDictType)
class StateDictType(TorchEqualEnum):
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


@twin(torch_fsdp.OptimStateKeyType)
class OptimStateKeyType(TorchEqualEnum):
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


@twin(torch_fsdp.StateDictConfig)
@identity_only
@dataclass
class StateDictConfig(torch_fsdp.StateDictConfig):
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


@twin(torch_fsdp.FullStateDictConfig)
@identity_only
@dataclass
class FullStateDictConfig(StateDictConfig, torch_fsdp.FullStateDictConfig):
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


@twin(torch_fsdp.LocalStateDictConfig)
@identity_only
@dataclass
class LocalStateDictConfig(StateDictConfig, torch_fsdp.LocalStateDictConfig):
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


@twin(torch_fsdp.ShardedStateDictConfig)
@identity_only
@dataclass
class ShardedStateDictConfig(StateDictConfig, torch_fsdp.ShardedStateDictConfig):
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


@twin(torch_fsdp.OptimStateDictConfig)
@identity_only
@dataclass
class OptimStateDictConfig(torch_fsdp.OptimStateDictConfig):
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


@twin(torch_fsdp.FullOptimStateDictConfig)
@identity_only
@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig, torch_fsdp.FullOptimStateDictConfig):
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


@twin(torch_fsdp.LocalOptimStateDictConfig)
@identity_only
@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig, torch_fsdp.LocalOptimStateDictConfig):
    """Accepted for compatibility: ``optim_state_dict`` refuses LOCAL_STATE_DICT (use ``optim.state_dict()``).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp import LocalOptimStateDictConfig
        >>> LocalOptimStateDictConfig().offload_to_cpu       # LOCAL_STATE_DICT's optimizer config
        False
    """

    offload_to_cpu: bool = False


@twin(torch_fsdp.ShardedOptimStateDictConfig)
@identity_only
@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig, torch_fsdp.ShardedOptimStateDictConfig):
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


@twin(torch_fsdp.StateDictSettings)
@identity_only
@dataclass
class StateDictSettings(torch_fsdp.StateDictSettings):
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
