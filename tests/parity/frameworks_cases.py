"""Framework runs for test_frameworks.py: each case runs PyTorch's first, then ours after ``use_as_torch()``.

One fresh set of 4 processes runs every case (framework imports are slow);
``use_as_torch()`` lasts for the rest of the process, so PyTorch's run of a case
comes before the switch and ours after it. Accelerate refuses FSDP on a CPU-only
machine, so the FSDP path is forced on the accelerator's state, as accelerate's
own CPU tests force their paths.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist

STEPS = 2


def _tiny_model() -> torch.nn.Module:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.ReLU(), tp.nn.Linear(16, 4))


def equal_nested(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors nested in dicts and lists (other values by ``==``)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal_nested(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(equal_nested(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def accelerate_fsdp2(directory: str) -> dict[str, Any]:
    """accelerate's FSDP plugin (version 2): prepare, train, clip, save_state / load_state, get_state_dict."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=50)
    accelerator = Accelerator(cpu=True)

    def force_fsdp() -> None:  # accelerate keeps FSDP for accelerators; its state decides the path
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin

    force_fsdp()
    model = _tiny_model()
    optimizer = tp.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    out: dict[str, Any] = {"sharded_by": type(model).__mro__[1].__module__, "losses": [], "norms": []}
    for step in range(STEPS):
        x = tp.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        out["norms"].append(accelerator.clip_grad_norm_(model.parameters(), 1.0).detach())
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.detach())
    force_fsdp()
    out["saved"] = _full(accelerator.get_state_dict(model))
    accelerator.save_state(directory, safe_serialization=False)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    accelerator.load_state(directory)
    out["loaded"] = _full(accelerator.get_state_dict(model))
    return out


def lightning_model_parallel(directory: str) -> dict[str, Any]:
    """Fabric's ModelParallelStrategy: fully_shard in parallelize_fn, no_backward_sync, save / load (DCP)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        import torch.distributed.fsdp as fsdp

        for layer in (model[0], model[2]):
            fsdp.fully_shard(layer, mesh=mesh["data_parallel"])
        return fsdp.fully_shard(model, mesh=mesh["data_parallel"])

    world = dist.get_world_size()
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # the processes exist already (LOCAL_RANK is set): nothing is launched
    model = fabric.setup(_tiny_model())
    optimizer = fabric.setup_optimizers(tp.optim.AdamW(model.parameters(), lr=0.01))
    out: dict[str, Any] = {"sharded_by": type(model.module).__mro__[1].__module__, "losses": []}
    for step in range(STEPS):
        x = tp.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        with fabric.no_backward_sync(model, enabled=step == 0):  # accumulate locally on the first step
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.detach())
    state = {"model": model, "optimizer": optimizer}
    out["saved"] = _full(model.state_dict())
    fabric.save(directory, state)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    fabric.load(directory, state)
    out["loaded"] = _full(model.state_dict())
    return out


def transformers_generate() -> dict[str, Any]:
    """A tiny Llama from a config, fully_shard per layer, greedy ``generate(synced_gpus=True)``."""
    import torch.distributed.fsdp as fsdp
    from transformers import LlamaConfig, LlamaForCausalLM

    tp.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    length = 3 + dist.get_rank()  # ranks stop at different lengths: synced_gpus keeps the collectives in step
    prompt = torch.tensor([[1, 5, 7]])
    tokens = model.generate(prompt, max_new_tokens=length, min_new_tokens=length, do_sample=False,
                            synced_gpus=True, pad_token_id=0)
    return {"sharded_by": type(model).__mro__[1].__module__, "tokens": tokens}


def all_cases() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for impl in ("torch", "ours"):
        if impl == "ours":
            dist.use_as_torch()  # pipelining, imported by PyTorch's run, keeps PyTorch's names: still ours
        for schedule in ("ScheduleGPipe", "Schedule1F1B"):
            results[("pipelining_" + schedule, impl)] = pipelining(schedule)
        with tempfile.TemporaryDirectory() as scratch:
            directory = [scratch]
            dist.broadcast_object_list(directory, src=0)  # one checkpoint folder for both ranks
            results[("accelerate_fsdp2", impl)] = accelerate_fsdp2(directory[0] + f"/{impl}")
            results[("lightning_model_parallel", impl)] = lightning_model_parallel(directory[0] + f"/l_{impl}")
            dist.barrier()
        results[("transformers_generate", impl)] = transformers_generate()
    dist.use_as_torch(False)
    return results


def pipelining(schedule_name: str) -> dict[str, Any]:
    """2 stages x dp 2 (4 ranks): each stage fully_shard over its dp ranks, PyTorch's schedule drives it."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    tp.manual_seed(0)
    layers = [tp.nn.Linear(8, 8) for _ in range(4)]
    stage_module = tp.nn.Sequential(*layers[2 * stage_index: 2 * stage_index + 2])
    for layer in stage_module:
        fsdp.fully_shard(layer, mesh=mesh["dp"])
    fsdp.fully_shard(stage_module, mesh=mesh["dp"])
    stage = pipelining.PipelineStage(stage_module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=2,
                                                  loss_fn=lambda out, y: (out - y).pow(2).mean())
    optimizer = tp.optim.SGD(stage_module.parameters(), lr=0.1)
    losses: list[torch.Tensor] = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + dp_rank)
        x, y = tp.randn(4, 8, generator=g), tp.randn(4, 8, generator=g)
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
    return {"sharded_by": type(stage_module).__mro__[1].__module__, "losses": [t.detach() for t in losses],
            "params": _full(dict(stage_module.named_parameters()))}

