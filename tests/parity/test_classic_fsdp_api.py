"""Classic FullyShardedDataParallel: summon_full_params, sync_module_states, and errors for bad inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed.fsdp import (
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import global_batch, loss_fn, make_model, wrap_model

CPU = torch.device("cpu")


def summon_and_sync() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = wrap_model("ours", dict(orig=True))
    with FSDP.summon_full_params(model), torch.no_grad():
        names = [name for name, _ in model.named_parameters()]
        out["summoned"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        model.module.embed.weight.add_(1.0)
    out["names"] = names
    out["after_writeback"] = model.state_dict()["embed.weight"].clone()
    with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        model.module.embed.weight.add_(1.0)
    out["after_no_writeback"] = model.state_dict()["embed.weight"].clone()
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        out["rank0_only_shape"] = tuple(model.module.head.weight.shape) if dist.get_rank() == 0 else None

    torch.manual_seed(dist.get_rank())  # a different model on every rank
    synced = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=CPU, sync_module_states=True)
    out["synced"] = synced.state_dict()

    # apply() sees full parameters and writes them back (flat parameters here).
    initialised = wrap_model("ours", dict())
    initialised.apply(lambda m: nn.init.constant_(m.weight, 0.25) if isinstance(m, nn.Linear) else None)
    out["applied"] = initialised.state_dict()

    # with_grads: the full gradients show on the original parameters.
    trained = wrap_model("ours", dict(orig=True))
    loss_fn(trained, global_batch(0, dist.get_world_size())).backward()
    with FSDP.summon_full_params(trained, with_grads=True):
        out["full_grads"] = {name: p.grad.clone() for name, p in trained.named_parameters()}

    # A model built on the meta device is materialised (reset_parameters) and synced from rank 0.
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    lazy = FSDP(lazy, device_id=CPU, sync_module_states=True)
    out["materialised"] = lazy.state_dict()
    out["materialised_output"] = lazy(torch.ones(1, 4)).detach()

    half = MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
    scaled = FSDP(Scaled(), device_id=CPU, mixed_precision=half)
    out["output_dtype"] = scaled(torch.ones(2, 4)).dtype
    out["buffer_dtypes"] = (scaled.module.scale.dtype, scaled.state_dict()["scale"].dtype)
    return out


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_summon_full_params_and_sync_module_states():
    results = run_distributed(summon_and_sync)
    reference = make_model().state_dict()
    for result in results:
        assert result["names"] == list(reference)  # the unwrapped names inside the context (no buffers here)
        for name in reference:
            assert torch.equal(result["summoned"][name], reference[name]), name
        assert torch.equal(result["after_writeback"], reference["embed.weight"] + 1)
        assert torch.equal(result["after_no_writeback"], reference["embed.weight"] + 1)
    assert results[0]["rank0_only_shape"] == (16, 8)
    linear_weights = {f"{name}.weight" for name, m in make_model().named_modules() if isinstance(m, nn.Linear)}
    for key, value in results[0]["applied"].items():
        assert torch.equal(value, torch.full_like(value, 0.25)) == (key in linear_weights), key
    reference_model = make_model()
    loss_fn(reference_model, global_batch(0, 2)).backward()
    for result in results:
        assert list(result["full_grads"]) == [name for name, _ in reference_model.named_parameters()]
        for name, param in reference_model.named_parameters():
            torch.testing.assert_close(result["full_grads"][name], param.grad, rtol=1e-5, atol=1e-6)
    for key, value in results[0]["materialised"].items():
        assert value.device.type == "cpu" and torch.isfinite(value).all(), key
        assert torch.equal(results[1]["materialised"][key], value), key
    assert torch.equal(results[0]["materialised_output"], results[1]["materialised_output"])
    assert results[0]["output_dtype"] == torch.float16  # the root cast its input, the buffer was cast
    assert results[0]["buffer_dtypes"] == (torch.float16, torch.float32)
    torch.manual_seed(0)
    rank0 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).state_dict()
    for result in results:
        for key, value in rank0.items():
            assert torch.equal(result["synced"][key], value), key


# ---- bad inputs ------------------------------------------------------------------------------------

def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError, KeyError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_inputs() -> dict[str, str]:
    world = dist.group.WORLD
    linear = lambda: nn.Linear(2, 2)  # noqa: E731
    wrapped = FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), device_id=CPU)
    inner = FSDP(nn.Linear(2, 2), device_id=CPU)
    outer = FSDP(nn.Sequential(inner, nn.Linear(2, 2)), device_id=CPU)
    outer(torch.ones(1, 2)).sum().backward()
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    other = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)
    return {
        "tuple_group": _error(lambda: FSDP(linear(), process_group=(world, world), device_id=CPU)),
        "hybrid_one_group": _error(lambda: FSDP(linear(), process_group=world, device_id=CPU,
                                                sharding_strategy=ShardingStrategy.HYBRID_SHARD)),
        "hybrid_triple": _error(lambda: FSDP(linear(), process_group=(world, world, world), device_id=CPU,
                                             sharding_strategy=ShardingStrategy.HYBRID_SHARD)),
        "strategy_type": _error(lambda: FSDP(linear(), sharding_strategy="FULL_SHARD", device_id=CPU)),
        "mixed_dtypes": _error(lambda: FSDP(mixed, device_id=CPU)),
        "rewrap": _error(lambda: FSDP(wrapped, device_id=CPU)),
        "ignored_both": _error(lambda: FSDP(linear(), ignored_modules=[], ignored_states=[], device_id=CPU)),
        "config_type": _error(lambda: FSDP.set_state_dict_type(wrapped, StateDictType.LOCAL_STATE_DICT,
                                                               FullStateDictConfig())),
        "clip_not_root": _error(lambda: inner.clip_grad_norm_(1.0)),
        "summon_rank0_writeback": _error(lambda: FSDP.summon_full_params(wrapped, rank0_only=True).__enter__()),
        "summon_grads_flat": _error(lambda: FSDP.summon_full_params(wrapped, with_grads=True).__enter__()),
        "optim_other_model": _error(lambda: FSDP.optim_state_dict(wrapped, other)),
        "local_wrong_shape": _error(lambda: _load_local(wrapped)),
        "shard_bad_optim_input": _error(lambda: FSDP.shard_full_optim_state_dict({}, wrapped, optim_input=[1, 2])),
        "offload_cpu_works": _error(lambda: FSDP(linear(), cpu_offload=CPUOffload(True), device_id=CPU)),
        "tensor_parallel": _error(_classic_over_tensor_parallel),
    }


def _classic_over_tensor_parallel() -> None:
    """The TP tutorial's line: classic FSDP over a tensor-parallel model (refused: fully_shard composes)."""
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    model_tp = parallelize_module(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), mesh["tp"],
                                  {"0": ColwiseParallel(), "1": RowwiseParallel()})
    FSDP(model_tp, device_mesh=mesh["dp"], use_orig_params=True)


def _load_local(model: nn.Module) -> None:
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
        state = model.state_dict()
        state["_flat_param"] = torch.zeros(99)
        model.load_state_dict(state)


def test_bad_inputs_raise_errors_that_say_how_to_fix():
    messages = run_distributed(bad_inputs)[0]
    expected = {
        "tuple_group": "ValueError: a (shard_group, replicate_group) tuple is only valid with HYBRID_SHARD, "
                       "got FULL_SHARD",
        "hybrid_one_group": "ValueError: HYBRID_SHARD takes process_group=(shard_group, replicate_group), "
                            "a 2D device_mesh, or neither",
        "hybrid_triple": "ValueError: HYBRID_SHARD process_group must be a (shard_group, replicate_group) tuple, "
                         "got a tuple of 3",
        "strategy_type": "TypeError: FullyShardedDataParallel: sharding_strategy must be one of "
                         "ShardingStrategy.FULL_SHARD,",
        "mixed_dtypes": "ValueError: FSDP unit 'Sequential' mixes parameter dtypes ['torch.float32', "
                        "'torch.float64']",
        "rewrap": "ValueError: module is already a FullyShardedDataParallel",
        "ignored_both": "ValueError: pass ignored_modules or ignored_states, not both",
        "config_type": "ValueError: LOCAL_STATE_DICT takes a LocalStateDictConfig, got FullStateDictConfig",
        "clip_not_root": "RuntimeError: clip_grad_norm_ must be called on the root FSDP module",
        "summon_rank0_writeback": "SummonArgumentError: summon_full_params: rank0_only=True needs writeback=False",
        "summon_grads_flat": "SummonArgumentError: summon_full_params(with_grads=True) needs use_orig_params=True",
        "optim_other_model": "ValueError: the optimizer holds a parameter of shape (3, 3) that is not in the model",
        "local_wrong_shape": "StateDictLoadError: Error(s) in loading state_dict for FullyShardedDataParallel on "
                             "rank 0 (nothing was loaded):\n\tsize mismatch for _flat_param: copying a param with "
                             "shape torch.Size([99]) from checkpoint, rank 0's flat shard is torch.Size([6])",
        "shard_bad_optim_input": "TypeError: optim_input must be the parameters or the param-group dicts the "
                                 "optimizer was built from, got items of types ['int']",
        "offload_cpu_works": "no error",
        "tensor_parallel": "NotImplementedError: FullyShardedDataParallel: parameter '0.weight' is a DTensor "
                           "([Shard(dim=0)] on the ('tp',) mesh of shape (2,)): tensorplay's classic FSDP does not "
                           "shard tensor-parallel parameters. Use fully_shard, which composes with tensor "
                           "parallelism: fully_shard(module, mesh=mesh_2d['dp'])",
    }
    for name, start in expected.items():
        assert messages[name].startswith(start), (name, messages[name])
