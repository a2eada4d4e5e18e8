"""A rejected call changes nothing: fully_shard, classic FSDP and ZeRO that raise leave the module and its
parameters exactly as they were (class, hooks, registrations, parameter objects, storage and values), so
the corrected call works on the same module and trains like the unsharded model.

PyTorch's fully_shard moves buffers and registers state before some of its checks, and its classic FSDP
flattens units before others; there the oracle is the module's own state before the call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

from tests.common import error_of

_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


def _model(odd_dtype: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.BatchNorm1d(3))
    if odd_dtype:
        model[2].double()
    return model


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a sharding call could change on ``model`` and its parameters."""
    return {
        "classes": [type(m) for m in model.modules()],
        "attributes": [sorted(vars(m)) for m in model.modules()],
        "hooks": [[len(getattr(m, table)) for table in _HOOK_TABLES] for m in model.modules()],
        "parameters": [(name, id(p), p.data_ptr(), p.device, p.dtype, p.requires_grad, sorted(vars(p)),
                        len(p._backward_hooks or {}), len(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
                       for name, p in model.named_parameters()],
        "buffers": [(name, id(b), b.data_ptr()) for name, b in model.named_buffers()],
        "values": {k: v.clone() for k, v in model.state_dict().items()},
    }


def same(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The snapshot keys that differ."""
    differ = [key for key in before if key != "values" and before[key] != after[key]]
    values_a, values_b = before["values"], after["values"]
    if values_a.keys() != values_b.keys() or any(type(values_a[k]) is not type(values_b[k])
                                                 or not torch.equal(values_a[k], values_b[k]) for k in values_a):
        differ.append("values")
    return differ


def _loss(model: nn.Module) -> torch.Tensor:
    torch.manual_seed(1 + dist.get_rank())
    return model(tp.randn(4, 4)).square().mean()


def _reference_loss(model: nn.Module) -> float:
    return _loss(copy.deepcopy(model)).item()


def fully_shard_bad_calls() -> dict[str, Callable[[nn.Module], Any]]:
    from tensorplay.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from tensorplay.distributed.tensor import Shard
    return {
        "reshard_after_forward": lambda m: fully_shard(m, reshard_after_forward="yes"),
        "mp_policy": lambda m: fully_shard(m, mp_policy="bf16"),
        "shard_dim_out_of_range": lambda m: fully_shard(m, shard_placement_fn=lambda p: Shard(1)),  # biases are 1D
        "mixed_dtypes": lambda m: fully_shard(m),  # the model is built with one float64 layer
        "list_with_policy_class": lambda m: fully_shard([m[0], m[2]], mp_policy=MixedPrecisionPolicy),
    }


def fully_shard_case(name: str) -> dict[str, Any]:
    from tensorplay.distributed.fsdp import fully_shard
    model = _model(odd_dtype=name == "mixed_dtypes")
    before = snapshot(model)
    error = error_of(fully_shard_bad_calls()[name], model, catch=(TypeError, ValueError))
    changed = same(before, snapshot(model))
    if name == "mixed_dtypes":
        model.float()  # the fix the message asks for
    reference = _reference_loss(model)
    fully_shard(model)
    loss = _loss(model)
    loss.backward()
    return {"error": error, "changed": changed, "loss": loss.item(), "reference": reference}


def classic_bad_calls() -> dict[str, Callable[[nn.Module], Any]]:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    policy = ModuleWrapPolicy({nn.Linear})
    return {
        "cpu_offload": lambda m: FSDP(m, cpu_offload="no"),
        "sharding_strategy": lambda m: FSDP(m, sharding_strategy="FULL_SHARD"),
        "mixed_precision_with_auto_wrap": lambda m: FSDP(m, auto_wrap_policy=policy, mixed_precision="bf16"),
        "device_id": lambda m: FSDP(m, auto_wrap_policy=policy, device_id="gpu0"),
        "mixed_dtypes": lambda m: FSDP(m),
    }


def classic_case(name: str) -> dict[str, Any]:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = _model(odd_dtype=name == "mixed_dtypes")
    before = snapshot(model)
    error = error_of(classic_bad_calls()[name], model, catch=(TypeError, ValueError))
    changed = same(before, snapshot(model))
    if name == "mixed_dtypes":
        model.float()
    reference = _reference_loss(model)
    wrapped = FSDP(model)
    loss = _loss(wrapped)
    loss.backward()
    return {"error": error, "changed": changed, "loss": loss.item(), "reference": reference}


def zero_bad_calls() -> dict[str, Callable[[nn.Module], Any]]:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer as ZeRO
    return {
        "optimizer_class": lambda m: ZeRO(m.parameters(), int, parameters_as_bucket_view=True),
        "lr": lambda m: ZeRO(m.parameters(), tp.optim.SGD, parameters_as_bucket_view=True, lr=-1.0),
        "bucket_view_flag": lambda m: ZeRO(m.parameters(), tp.optim.SGD, parameters_as_bucket_view="yes", lr=0.1),
        # The plan agreement fails after each rank set up (rank 1 lists one parameter less):
        # the bucket views must not have been built yet.
        "different_params": lambda m: ZeRO(list(m.parameters())[: 5 - dist.get_rank()], tp.optim.SGD,
                                           parameters_as_bucket_view=True, lr=0.1),
    }


def zero_case(name: str) -> dict[str, Any]:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer as ZeRO
    model = _model()
    before = snapshot(model)
    error = error_of(zero_bad_calls()[name], model, catch=(TypeError, ValueError))
    changed = same(before, snapshot(model))
    optimizer = ZeRO(model.parameters(), tp.optim.SGD, parameters_as_bucket_view=True, lr=0.1)
    reference = copy.deepcopy(model)
    _loss(model).backward()
    optimizer.step()
    return {"error": error, "changed": changed, "stepped": not torch.equal(model[0].weight, reference[0].weight)}


def all_cases() -> dict[str, dict[str, Any]]:
    results = {f"fully_shard/{n}": fully_shard_case(n) for n in fully_shard_bad_calls()}
    results.update({f"classic/{n}": classic_case(n) for n in classic_bad_calls()})
    results.update({f"zero/{n}": zero_case(n) for n in zero_bad_calls()})
    return results


def test_rejected_calls_change_nothing_and_the_corrected_call_works() -> None:
    per_rank = run_distributed(all_cases, world_size=2, timeout=120)
    for rank, results in enumerate(per_rank):
        for name, result in results.items():
            # Only TypeError/ValueError (and subclasses such as fully_shard's InvalidArgumentError) are caught:
            # anything else fails the rank, so a None here means the call was accepted.
            assert result["error"] is not None, (rank, name)
            assert result["changed"] == [], (rank, name, result["changed"], result["error"])
            if "loss" in result:  # the corrected call trains like the unsharded model
                torch.testing.assert_close(result["loss"], result["reference"], rtol=1e-6, atol=1e-7)
            else:
                assert result["stepped"], (rank, name)
