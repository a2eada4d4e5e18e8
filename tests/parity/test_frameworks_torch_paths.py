"""PyTorch's own code paths on our sharded models, and torch.compile of a whole model (2 ranks, ours vs PyTorch's).

Now that ours pass PyTorch's isinstance checks, torch.compile, ``clip_grad_norm_`` and
DCP's ``get_state_dict`` / ``set_state_dict`` take them for PyTorch's: each must give
PyTorch's result, bitwise. PyTorch's compiled classic FSDP cannot run on a CPU-only
machine, so our compiled classic FSDP is compared with our eager one. PyTorch's
helpers called on PyTorch's class with our classic FSDP (``FSDP.state_dict_type``,
``get_state_dict_type``, ``fsdp_modules``) and ``torch.nn.utils.clip_grad_norm_`` on it
give what they give on PyTorch's classic FSDP (the helpers that refuse are in
tests/unit/test_torch_type_identity.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity._fsdp_models import build, loss_fn, parts_batch
from tests.parity.frameworks_cases import classic_fsdp, equal_nested, local_shards

IMPLS = ("ours", "torch")
STEPS = 2


def _api(impl: str) -> Any:
    if impl == "ours":
        import tensorplay.distributed.fsdp as api
    else:
        import torch.distributed.fsdp as api
    return api


def _sharded(impl: str) -> torch.nn.Module:
    api, model = _api(impl), build()
    for layer in model.layers:
        api.fully_shard(layer)
    return api.fully_shard(model)


def _classic() -> torch.nn.Module:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel
    from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build()
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.layers[0])}),
                                    use_orig_params=True)


def torch_classic_helpers(impl: str) -> dict[str, Any]:
    """PyTorch's class's static methods and ``torch.nn.utils.clip_grad_norm_`` on a classic FSDP model."""
    import torch.distributed.fsdp as torch_fsdp

    fsdp_cls = torch_fsdp.FullyShardedDataParallel
    model = build()
    model = classic_fsdp(impl, model, lambda wrap: wrap.ModuleWrapPolicy({type(model.layers[0])}))
    optimizer = tp.optim.Adam(model.parameters(), lr=0.1)
    x, y = parts_batch(0, [dist.get_rank()])
    loss_fn(model(x), y).backward()
    out: dict[str, Any] = {"norm": torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),  # rank-local, as FSDP1's
                           "units": len(fsdp_cls.fsdp_modules(model))}
    optimizer.step()
    full = torch_fsdp.FullStateDictConfig(rank0_only=False)
    with fsdp_cls.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, full):
        out["full"] = {k: v.clone() for k, v in model.state_dict().items()}
        out["full_settings"] = fsdp_cls.get_state_dict_type(model)
    with fsdp_cls.state_dict_type(model, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
        out["sharded"] = local_shards(model.state_dict())
        out["sharded_settings"] = fsdp_cls.get_state_dict_type(model)
    out["restored_settings"] = fsdp_cls.get_state_dict_type(model)
    return out


def _train(model: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = parts_batch(step, [dist.get_rank()])
        loss = loss_fn(forward(x), y)
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def compiled_vs_eager(make: Callable[[], torch.nn.Module]) -> dict[str, Any]:
    from torch._dynamo.testing import CompileCounter

    eager_model = make()
    eager = _train(eager_model, eager_model)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = make()
    compiled = _train(model, torch.compile(model, backend=counter))
    torch._dynamo.reset()
    return {"eager": eager, "compiled": compiled, "graphs": counter.frame_count}  # graph breaks + 1


def torch_helpers(impl: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _sharded(impl)
    optimizer = tp.optim.Adam(model.parameters(), lr=0.1)
    x, y = parts_batch(0, [dist.get_rank()])
    loss_fn(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    fresh = _sharded(impl)
    fresh_optimizer = tp.optim.Adam(fresh.parameters(), lr=0.1)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return {"norm": _full(norm), "model": _full(model_sd), "optim": _full(optim_sd["state"]),
            "reloaded": _full(dict(fresh.state_dict())), "reloaded_optim": _full(fresh_optimizer.state_dict()["state"])}


def _full(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def scenarios() -> dict[str, Any]:
    out = {("compile", impl): compiled_vs_eager(lambda impl=impl: _sharded(impl)) for impl in IMPLS}
    out[("compile", "classic")] = compiled_vs_eager(_classic)
    out.update({("helpers", impl): torch_helpers(impl) for impl in IMPLS})
    out.update({("classic helpers", impl): torch_classic_helpers(impl) for impl in IMPLS})
    return out


def test_torch_paths_on_ours_give_pytorchs_results() -> None:
    for result in run_distributed(scenarios, world_size=2, timeout=300):
        ours, theirs, classic = (result[("compile", k)] for k in ("ours", "torch", "classic"))
        assert 1 <= ours["graphs"] <= theirs["graphs"] and classic["graphs"] >= 1  # compiled; no more breaks
        assert equal_nested(ours["compiled"], ours["eager"])            # whole-model compile equals eager, bitwise
        assert equal_nested(ours["eager"], theirs["eager"]) and equal_nested(ours["compiled"], theirs["compiled"])
        assert equal_nested(classic["compiled"], classic["eager"])
        helpers = result[("helpers", "ours")]
        assert equal_nested(helpers, result[("helpers", "torch")])
        assert equal_nested(helpers["reloaded"], helpers["model"])      # DCP's set_state_dict round trip
        classic, torch_classic = result[("classic helpers", "ours")], result[("classic helpers", "torch")]
        assert classic["units"] == 4 and classic["sharded"]  # three blocks and the root; a shard on every rank
        assert equal_nested(classic, torch_classic)
