"""Classic FullyShardedDataParallel state dicts and optimizer state dicts.

Full state dicts carry the unwrapped model's keys (their values equal PyTorch's
FSDP after the same training: see test_classic_fsdp); local and sharded ones
round-trip into a freshly wrapped model; optimizer state dicts equal PyTorch's
and load into a plain optimizer on the unwrapped model.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import (
    BATCH,
    FP32,
    assert_equal_states,
    fsdp_api,
    global_batch,
    loss_fn,
    make_model,
    trained,
    wrap_model,
)


def fresh(impl: str, config: dict[str, Any]) -> nn.Module:
    """A wrapped model whose parameters differ from a trained one's."""
    model = wrap_model(impl, config)
    api, _ = fsdp_api(impl)
    with api.FullyShardedDataParallel.summon_full_params(model), torch.no_grad():
        for name, _ in make_model().named_parameters():  # through the wrappers' attribute forwarding
            functools.reduce(getattr, name.split("."), model.module).fill_(0.5)
    return model


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def state_dict_round_trips(config: dict[str, Any]) -> dict[str, Any]:
    api, _ = fsdp_api("ours")
    FSDP, Type = api.FullyShardedDataParallel, api.StateDictType
    model, _ = trained("ours", config)
    expected = full(model)
    out: dict[str, Any] = {"full": expected}

    target = fresh("ours", config)
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in full(target).values())
    target.load_state_dict(expected)
    out["full_round_trip"] = full(target)

    partial = fresh("ours", config)
    incompatible = partial.load_state_dict({k: v for k, v in expected.items() if k != "head.bias"}, strict=False)
    out["missing"], out["partial"] = incompatible.missing_keys, full(partial)

    with FSDP.state_dict_type(model, Type.FULL_STATE_DICT, api.FullStateDictConfig(offload_to_cpu=True,
                                                                                   rank0_only=True)):
        out["rank0_only"] = model.state_dict()

    with FSDP.state_dict_type(model, Type.LOCAL_STATE_DICT):
        local = model.state_dict()
    target = fresh("ours", config)
    with FSDP.state_dict_type(target, Type.LOCAL_STATE_DICT):
        target.load_state_dict(local)
    out["local_keys"] = list(local)
    out["local"] = {k: local_value(v) for k, v in local.items()}
    out["local_round_trip"] = full(target)

    with FSDP.state_dict_type(model, Type.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    out["sharded_types"] = sorted({type(v).__name__ for v in sharded.values()})
    out["sharded_local"] = {k: v.local_shards()[0].tensor.clone() if v.local_shards() else torch.empty(0)
                            for k, v in sharded.items()}
    target = fresh("ours", config)
    with FSDP.state_dict_type(target, Type.SHARDED_STATE_DICT):
        target.load_state_dict(sharded)
    out["sharded_round_trip"] = full(target)

    as_dtensor = api.ShardedStateDictConfig(_use_dtensor=True)
    with FSDP.state_dict_type(model, Type.SHARDED_STATE_DICT, as_dtensor):
        sharded = model.state_dict()
    out["dtensor_types"] = sorted({type(v).__name__ for v in sharded.values()})
    target = fresh("ours", config)
    with FSDP.state_dict_type(target, Type.SHARDED_STATE_DICT, as_dtensor):
        target.load_state_dict(sharded)
    out["dtensor_round_trip"] = full(target)
    return out


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A local state dict value as a plain tensor: the local shard of a ShardedTensor."""
    return value.local_shards()[0].tensor.detach().clone() if hasattr(value, "local_shards") else value.clone()


def pytorch_local_and_sharded(config: dict[str, Any]) -> dict[str, Any]:
    api, _ = fsdp_api("torch")
    FSDP, Type = api.FullyShardedDataParallel, api.StateDictType
    model, _ = trained("torch", config)
    with FSDP.state_dict_type(model, Type.LOCAL_STATE_DICT):
        local = {k: local_value(v) for k, v in model.state_dict().items()}
    with FSDP.state_dict_type(model, Type.SHARDED_STATE_DICT):
        sharded = {k: v.local_shards()[0].tensor.detach().clone() if v.local_shards() else torch.empty(0)
                   for k, v in model.state_dict().items()}
    return {"local": local, "sharded_local": sharded}


def test_state_dicts_round_trip_and_match_pytorch():
    config = dict(strategy="FULL_SHARD")
    ours = run_distributed(state_dict_round_trips, config)
    theirs = run_distributed(pytorch_local_and_sharded, config)
    unwrapped_keys = list(make_model().state_dict())
    for rank, (result, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert list(result["full"]) == unwrapped_keys
        assert_equal_states(result["full_round_trip"], result["full"])
        assert result["missing"] == ["head.bias"]  # named as in the unwrapped model, and left as it was:
        assert torch.equal(result["partial"]["head.bias"], torch.full((16,), 0.5))
        assert torch.equal(result["partial"]["head.weight"], result["full"]["head.weight"])
        assert_equal_states(result["local_round_trip"], result["full"])
        assert_equal_states(result["sharded_round_trip"], result["full"])
        assert result["dtensor_types"] == ["DTensor"]
        assert_equal_states(result["dtensor_round_trip"], result["full"])
        if rank == 0:
            assert_equal_states(result["rank0_only"], result["full"])
            assert all(v.device.type == "cpu" for v in result["rank0_only"].values())
        else:
            assert result["rank0_only"] == {}
        # Same keys and values as PyTorch's: ShardedTensors over the unpadded flat parameters.
        assert result["local_keys"] == list(reference["local"])
        for key, shard in reference["local"].items():
            assert torch.equal(result["local"][key], shard), key
        assert result["sharded_types"] == ["ShardedTensor"]  # PyTorch's default form
        assert list(result["sharded_local"]) == list(reference["sharded_local"])
        for key, shard in reference["sharded_local"].items():
            assert torch.equal(result["sharded_local"][key], shard), key
    plain = make_model()
    plain.load_state_dict(ours[0]["full"])  # strict: loads into the unwrapped model


# ---- optimizer state dicts ---------------------------------------------------------------------------

def optimizer_state_dicts(impl: str, config: dict[str, Any]) -> dict[str, Any]:
    api, _ = fsdp_api(impl)
    FSDP = api.FullyShardedDataParallel
    model, optim = trained(impl, config)
    out = {"osd": FSDP.optim_state_dict(model, optim), "full_osd": FSDP.full_optim_state_dict(model, optim)}
    if impl != "ours":
        return out
    rank, world = dist.get_rank(), dist.get_world_size()
    # Rank 0's full state dict, scattered: each rank gets what its optimizer holds now.
    scattered = FSDP.scatter_full_optim_state_dict(out["full_osd"] if rank == 0 else None, model, optim=optim)
    out["scattered"], out["held"] = scattered["state"], copy.deepcopy(optim.state_dict()["state"])
    # The sharded (DTensor) form flattens back to the same per-rank state.
    out["unflattened"] = FSDP.flatten_sharded_optim_state_dict(FSDP.sharded_optim_state_dict(model, optim),
                                                               model, optim)["state"]
    # Round trip: a fresh model and optimizer resume from the saved state and take the same step.
    target = fresh(impl, config)
    target.load_state_dict(model.state_dict())
    target_optim = torch.optim.Adam(target.parameters(), lr=1e-2, eps=1e-3)
    target_optim.load_state_dict(FSDP.optim_state_dict_to_load(target, target_optim, out["osd"]))
    tokens = global_batch(7, world)[rank * BATCH:(rank + 1) * BATCH]
    for m, o in ((model, optim), (target, target_optim)):
        loss_fn(m, tokens).backward()
        o.step()
    out["continued"], out["resumed"] = model.state_dict(), target.state_dict()
    out["rekeyed"] = FSDP.rekey_optim_state_dict(out["full_osd"], api.OptimStateKeyType.PARAM_ID, make_model()) \
        if rank == 0 else None
    return out


def reference_optimizer(world: int, steps: int = 2) -> torch.optim.Optimizer:
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    for step in range(steps):
        loss_fn(model, global_batch(step, world)).backward()
        optim.step()
        optim.zero_grad()
    return optim


def assert_same_osd(actual: dict, expected: dict) -> None:
    # Same contents; dict order is not part of the format (with use_orig_params=True PyTorch sorts
    # FQNs per unit and keeps each parameter's own key order; we always follow the optimizer).
    assert sorted(actual["state"]) == sorted(expected["state"])
    for fqn, state in expected["state"].items():
        assert sorted(actual["state"][fqn]) == sorted(state), fqn
        for key, value in state.items():
            assert torch.equal(actual["state"][fqn][key], value), (fqn, key)
    assert actual["param_groups"] == expected["param_groups"]


def test_optimizer_state_dicts_match_pytorch_and_load_into_plain_optimizer():
    reference = reference_optimizer(world=2).state_dict()
    for config in (dict(), dict(orig=True)):
        ours = run_distributed(optimizer_state_dicts, "ours", config)
        # PyTorch 2.13 on CPU with use_orig_params=True returns exp_avg_sq's values under exp_avg too,
        # so there only the single-process reference below is the oracle.
        theirs = run_distributed(optimizer_state_dicts, "torch", config) if not config else [None, None]
        for rank, (result, expected) in enumerate(zip(ours, theirs, strict=True)):
            assert_equal_states(result["resumed"], result["continued"])
            for index, state in result["held"].items():
                for key, value in state.items():
                    assert torch.equal(result["scattered"][index][key], value), (index, key)
                    assert torch.equal(result["unflattened"][index][key], value), (index, key)
            if rank != 0:
                assert result["full_osd"] == {}
            if expected is None:
                continue
            assert_same_osd(result["osd"], expected["osd"])
            if rank == 0:
                assert_same_osd(result["full_osd"], expected["full_osd"])
            else:
                assert expected["full_osd"] == {}
        plain_model = make_model()
        plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2, eps=1e-3)
        plain.load_state_dict(ours[0]["rekeyed"])
        loaded = plain.state_dict()
        for index, state in reference["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(loaded["state"][index][key], value, **FP32)
