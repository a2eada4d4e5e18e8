"""PyTorch's optimizer state-dict methods of ``FullyShardedDataParallel``, a base class of the wrapper.

All are static and take the model: the current ones (``optim_state_dict``,
``optim_state_dict_to_load``), the deprecated full/sharded/scatter forms, and
re-keying. The work is in :mod:`.optim_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed._comm import objects

from ..api import OptimStateKeyType
from . import deprecation
from . import optim_state_dict as optim_sd


class OptimStateDictMethods:
    """The optimizer state-dict static methods (keyed by the unwrapped model's parameter FQNs)."""

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None,
                         group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """``optim``'s state keyed by the unwrapped model's parameter FQNs, in the model's state-dict type.

        The state is read from ``optim`` itself; ``optim_state_dict`` and ``group`` are accepted for
        compatibility with PyTorch's signature.
        """
        return optim_sd.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict[str, Any], is_named_optimizer: bool = False,
                                 load_directly: bool = False,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The inverse of :meth:`optim_state_dict`: a state dict ``optim.load_state_dict`` accepts.

        When ``model``'s optimizer state-dict config is a full one with ``rank0_only`` (as accelerate's FSDP
        plugin sets it), rank 0's ``optim_state_dict`` is broadcast over ``group`` (default: every rank) and the
        others may pass ``None``, as in PyTorch; otherwise every rank passes the state dict.
        """
        optim_state_dict = optim_sd.from_rank0_if_rank0_only(model, optim_state_dict, group)
        loadable = optim_sd.optim_state_dict_to_load(model, optim_sd.param_groups(model, optim), optim_state_dict)
        if load_directly:
            optim.load_state_dict(loadable)
        return loadable

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                    optim_input: Any = None,
                                    optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict, loadable with ``optim.load_state_dict``.

        Without ``optim``, the optimizer is taken to be over ``optim_input`` (or ``model.parameters()``).
        """
        deprecation.legacy_optim_state_dict("shard_full_optim_state_dict", "optim_state_dict_to_load")
        deprecation.optim_input(optim_input)
        groups = optim_sd.param_groups(model, optim, optim_input)
        return optim_sd.optim_state_dict_to_load(model, groups, full_optim_state_dict)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                         optim: torch.optim.Optimizer) -> dict[str, Any]:
        """Like :meth:`shard_full_optim_state_dict`, from a :meth:`sharded_optim_state_dict` (collective)."""
        deprecation.legacy_optim_state_dict("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
        return optim_sd.optim_state_dict_to_load(model, optim_sd.param_groups(model, optim),
                                                 sharded_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                      optim_input: Any = None, optim: torch.optim.Optimizer | None = None,
                                      group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Send rank 0's full optimizer state dict to every rank of ``group``; return each rank's part."""
        deprecation.legacy_optim_state_dict("scatter_full_optim_state_dict", "optim_state_dict_to_load")
        deprecation.optim_input(optim_input)
        groups = optim_sd.param_groups(model, optim, optim_input)
        holder = [full_optim_state_dict]
        objects.broadcast_object_list(holder, 0, group, where="scatter_full_optim_state_dict")
        full = holder[0]
        assert full is not None, "rank 0 must pass full_optim_state_dict"
        return optim_sd.optim_state_dict_to_load(model, groups, full)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Full, FQN-keyed optimizer state (an empty dict on ranks other than 0 when ``rank0_only``)."""
        deprecation.legacy_optim_state_dict("full_optim_state_dict", "optim_state_dict")
        deprecation.optim_input(optim_input)
        return optim_sd.full_optim_state_dict(model, optim, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """FQN-keyed optimizer state whose tensors are ``ShardedTensor`` s sharded along dim 0."""
        deprecation.legacy_optim_state_dict("sharded_optim_state_dict", "optim_state_dict")
        return optim_sd.sharded_optim_state_dict(model, optim)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                               model: nn.Module, optim_input: Any = None,
                               optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Re-key a full optimizer state dict by parameter ID (for an unwrapped model) or by FQN.

        IDs are positions in ``optim``'s parameters (else ``optim_input``'s, else ``model.parameters()``).
        """
        deprecation.optim_input(optim_input)
        groups = optim_sd.param_groups(model, optim, optim_input)
        return optim_sd.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, groups)
