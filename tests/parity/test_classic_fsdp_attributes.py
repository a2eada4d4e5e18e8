"""Classic FullyShardedDataParallel's public attributes and home module, against PyTorch's.

Every public attribute PyTorch's wrapper instances carry (``process_group``,
``rank``, ``world_size``, ``sharding_strategy``, ``mixed_precision``,
``cpu_offload``, ``limit_all_gathers``, ``backward_prefetch``,
``forward_prefetch``, ``compute_device``, ``params``, ``training_state``,
``module``) has the same value on ours for the same arguments, per unit, and
``training_state`` goes through the same states during forward, backward and
``summon_full_params``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import fsdp_api, make_model

ATTRIBUTES = ("rank", "world_size", "sharding_strategy", "mixed_precision", "cpu_offload", "limit_all_gathers",
              "backward_prefetch", "forward_prefetch", "compute_device")


def comparable(value: Any) -> Any:
    """Enum and config values by name and fields (ours and PyTorch's are different classes)."""
    if hasattr(value, "name") and hasattr(value, "value"):
        return value.name
    if hasattr(value, "__dataclass_fields__"):
        return {field: comparable(getattr(value, field)) for field in value.__dataclass_fields__}
    return value


def attributes(impl: str, config: dict[str, Any]) -> dict[str, Any]:
    api, wrap = fsdp_api(impl)
    FSDP = api.FullyShardedDataParallel
    kwargs = dict(auto_wrap_policy=functools.partial(wrap.transformer_auto_wrap_policy,
                                                     transformer_layer_cls={nn.TransformerEncoderLayer}),
                  device_id=torch.device("cpu"), sharding_strategy=getattr(api.ShardingStrategy, config["strategy"]),
                  use_orig_params=config.get("orig", False), limit_all_gathers=config.get("limit", True),
                  forward_prefetch=config.get("forward_prefetch", False))
    if config.get("mp"):
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
    if config.get("no_prefetch"):
        kwargs["backward_prefetch"] = None
    model = FSDP(make_model(), **kwargs)
    units = FSDP.fsdp_modules(model)
    out: dict[str, Any] = {"units": [{name: comparable(getattr(unit, name)) for name in ATTRIBUTES} for unit in units]}
    out["groups"] = [dist.get_process_group_ranks(unit.process_group) for unit in units]
    out["params"] = [[tuple(p.shape) for p in unit.params] for unit in units]
    out["module"] = [type(unit.module).__name__ for unit in units]
    states: list[tuple[str, list[str]]] = []
    record = lambda phase: states.append((phase, [unit.training_state.name for unit in units]))  # noqa: E731
    record("init")
    model.module.layers[0].register_forward_pre_hook(lambda *_: record("forward"))
    output = model(torch.zeros(2, 3, dtype=torch.long))
    record("between")
    output.register_hook(lambda grad: record("backward"))
    output.float().sum().backward()
    record("after")
    with FSDP.summon_full_params(model):
        record("summon")
    record("after_summon")
    out["states"] = states
    return out


CONFIGS = [dict(strategy="FULL_SHARD"), dict(strategy="SHARD_GRAD_OP", orig=True, limit=False, mp=True),
           dict(strategy="NO_SHARD", forward_prefetch=True, no_prefetch=True)]


def all_attributes(impl: str) -> list[dict[str, Any]]:
    return [attributes(impl, config) for config in CONFIGS]


def test_public_attributes_and_training_states_equal_pytorchs():
    ours = run_distributed(all_attributes, "ours")
    theirs = run_distributed(all_attributes, "torch")
    for rank, (our_configs, their_configs) in enumerate(zip(ours, theirs, strict=True)):
        for config, mine, expected in zip(CONFIGS, our_configs, their_configs, strict=True):
            for key in expected:
                assert mine[key] == expected[key], (rank, config, key)
    assert their_configs[0]["states"][1] == ("forward", ["FORWARD_BACKWARD", "IDLE", "IDLE"])


def test_home_module_exposes_our_objects_under_pytorchs_names():
    import torch.distributed.fsdp.fully_sharded_data_parallel as theirs

    import tensorplay.distributed.fsdp as fsdp
    import tensorplay.distributed.fsdp.fully_sharded_data_parallel as home
    from tensorplay.distributed.fsdp import api, wrap

    assert home.__all__ == theirs.__all__
    for name in ("FullyShardedDataParallel", "OptimStateKeyType", "ShardingStrategy", "BackwardPrefetch",
                 "MixedPrecision", "CPUOffload", "StateDictType", "StateDictConfig", "FullStateDictConfig",
                 "LocalStateDictConfig", "ShardedStateDictConfig", "OptimStateDictConfig",
                 "FullOptimStateDictConfig", "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig",
                 "StateDictSettings"):
        ours = getattr(home, name)
        assert ours is getattr(fsdp, name), name
        assert ours.__module__.startswith("tensorplay."), name
        assert hasattr(theirs, name), name
    assert home.CustomPolicy is wrap.CustomPolicy and home.ModuleWrapPolicy is wrap.ModuleWrapPolicy
    assert home.OptimStateKeyType is api.OptimStateKeyType
    for name in ("FLAT_PARAM", "FSDP_PREFIX", "FSDP_WRAPPED_MODULE"):
        assert getattr(home, name) == getattr(theirs, name), name
    assert [s.name for s in home.HYBRID_SHARDING_STRATEGIES] == [s.name for s in theirs.HYBRID_SHARDING_STRATEGIES]
    assert list(home.TrainingState.__members__) == list(theirs.TrainingState.__members__)
