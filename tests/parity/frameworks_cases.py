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
    return _accelerate(directory, version=2)


def accelerate_fsdp1(directory: str, checkpoint: bool) -> dict[str, Any]:
    """accelerate's FSDP plugin (version 1, classic FSDP): the same run; its load_state is rank0_only.

    PyTorch's classic FSDP cannot take a full state dict with ``offload_to_cpu`` on a CPU-only machine (what
    accelerate's ``get_state_dict`` / ``save_state`` ask for), so its run stops after training (``checkpoint``
    False); both runs show their trained parameters through ``summon_full_params``.
    """
    return _accelerate(directory, version=1, checkpoint=checkpoint)


def _accelerate(directory: str, version: int, checkpoint: bool = True) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="size_based_wrap",
                                            min_num_params=50)
    accelerator = Accelerator(cpu=True)

    def force_fsdp() -> None:  # accelerate keeps FSDP for accelerators; its state decides the path
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        PartialState().device = accelerator.state.device = torch.device("cpu")  # PyTorch's FSDP refuses cpu:0

    force_fsdp()
    model = _tiny_model()
    if version == 1:  # flat parameters (use_orig_params=False): the optimizer is built from the wrapped model
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(tp.optim.AdamW(model.parameters(), lr=0.01))
    else:
        model, optimizer = accelerator.prepare(model, tp.optim.AdamW(model.parameters(), lr=0.01))
    out: dict[str, Any] = {"sharded_by": _sharded_by(model), "losses": [], "norms": []}
    if version == 1:  # what accelerate's upcast reads from each unit (mixed precision on)
        out["flat_fqns"] = [list(unit._flat_param._fqns) for unit in type(model).fsdp_modules(model)
                            if unit._has_params]
        out["orig_dtypes"] = [unit._handle._orig_param_dtype for unit in type(model).fsdp_modules(model)
                              if unit._has_params]
    for step in range(STEPS):
        x = tp.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        out["norms"].append(accelerator.clip_grad_norm_(model.parameters(), 1.0).detach())
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.detach())
    if version == 1:
        with type(model).summon_full_params(model):
            out["params"] = _full(dict(model.named_parameters()))
    if not checkpoint:
        return out
    force_fsdp()
    out["saved"] = _full(accelerator.get_state_dict(model))
    out["saved_optim"] = _optim_state(optimizer)
    accelerator.save_state(directory, safe_serialization=False)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    for state in optimizer.state.values():
        for value in state.values():
            value.zero_()
    accelerator.load_state(directory)
    out["loaded"] = _full(accelerator.get_state_dict(model))
    out["loaded_optim"] = _optim_state(optimizer)
    return out


def _optim_state(optimizer: Any) -> list[torch.Tensor]:
    """This rank's optimizer state tensors, in order (the sharded state the optimizer steps on)."""
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
    return [_full({"v": state[key]})["v"] for state in states for key in sorted(state)]


def _sharded_by(model: torch.nn.Module) -> str:
    """The module of the class that sharded ``model``: fully_shard's (the class it derives) or classic FSDP's."""
    cls = type(model)
    return cls.__module__ if "FullyShardedDataParallel" in cls.__name__ else cls.__mro__[1].__module__


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
            results[("accelerate_fsdp1", impl)] = accelerate_fsdp1(directory[0] + f"/v1_{impl}",
                                                                    checkpoint=impl == "ours")
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

