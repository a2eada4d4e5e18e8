"""Framework runs for test_frameworks.py: each case runs PyTorch's first, then ours (after ``use_as_torch()``).

One fresh set of 4 processes runs every case (framework imports are slow).
Cases where ours must pass the framework's own checks with nothing switched
(Lightning's ``FSDPStrategy`` and transformers given our classic FSDP) run both
implementations first; ``use_as_torch()`` then lasts for the rest of the process,
so PyTorch's run of every other case comes before the switch and ours after it.
Accelerate refuses FSDP on a CPU-only machine, so the FSDP path is forced on the
accelerator's state, as accelerate's own CPU tests force their paths; Lightning's
Trainer refuses ``FSDPStrategy`` without CUDA, so the strategy is driven directly,
with a mock LightningModule, as Lightning's own strategy tests do.
"""

from __future__ import annotations

import functools
import importlib
import tempfile
from collections.abc import Callable
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


def classic_fsdp(impl: str, model: torch.nn.Module, policy: Callable[[Any], Any]) -> torch.nn.Module:
    """``model`` in classic FSDP, ours or PyTorch's (which needs the CPU as device_id); ``policy(wrap)`` makes the
    auto-wrap policy from that implementation's ``fsdp.wrap`` module."""
    api = importlib.import_module(("tensorplay" if impl == "ours" else "torch") + ".distributed.fsdp")
    extra = {} if impl == "ours" else {"device_id": torch.device("cpu")}
    wrap = importlib.import_module(api.__name__ + ".wrap")
    return api.FullyShardedDataParallel(model, auto_wrap_policy=policy(wrap), **extra)


def local_shards(value: Any) -> Any:
    """``value`` with every ShardedTensor replaced by its global size and this rank's shards (offsets, values)."""
    if hasattr(value, "local_shards"):
        return [list(value.size())] + [[s.metadata.shard_offsets, s.tensor.clone()] for s in value.local_shards()]
    if isinstance(value, dict):
        return {k: local_shards(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local_shards(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def accelerate_fsdp2(directory: str) -> dict[str, Any]:
    """accelerate's FSDP plugin (version 2): prepare, train, clip, save_state / load_state, get_state_dict."""
    return _accelerate(directory, version=2)


def accelerate_fsdp1(directory: str, checkpoint: bool) -> dict[str, Any]:
    """accelerate's FSDP plugin (version 1, classic FSDP): the same run; its load_state is rank0_only.

    The model is loaded in bf16 with bf16 mixed precision, so ``prepare`` upcasts each unit's flat parameter to
    fp32 after wrapping (its ``_handle._orig_param_dtype`` write). PyTorch's classic FSDP cannot take a full state
    dict with ``offload_to_cpu`` on a CPU-only machine (what accelerate's ``get_state_dict`` / ``save_state`` ask
    for), so its run stops after training (``checkpoint`` False); both runs show their trained parameters through
    ``summon_full_params``.
    """
    return _accelerate(directory, version=1, checkpoint=checkpoint, low_precision=True)


def _accelerate(directory: str, version: int, checkpoint: bool = True, low_precision: bool = False) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="size_based_wrap",
                                            min_num_params=50)
    if low_precision:
        plugin.set_mixed_precision("bf16")  # what accelerate derives from mixed_precision="bf16"
    accelerator = Accelerator(cpu=True)

    def force_fsdp() -> None:  # accelerate keeps FSDP for accelerators; its state decides the path
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        PartialState().device = accelerator.state.device = torch.device("cpu")  # PyTorch's FSDP refuses cpu:0
        accelerator.state._mixed_precision = "bf16" if low_precision else "no"  # one state per process

    force_fsdp()
    model = _tiny_model().to(torch.bfloat16) if low_precision else _tiny_model()
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
        out["flat_dtypes"] = [unit._flat_param.dtype for unit in type(model).fsdp_modules(model) if unit._has_params]
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


def lightning_fsdp_strategy(directory: str, impl: str, checkpoint: bool = True) -> dict[str, Any]:
    """Lightning's FSDPStrategy given a model already in classic FSDP: it must not wrap it again; 2 steps with the
    unit's ``clip_grad_norm_``; its sharded checkpoint of the model saved, zeroed, loaded; its optimizer state.

    Lightning calls PyTorch's ``FSDP.state_dict_type`` and ``FSDP.optim_state_dict`` on the model: on ours the
    first sets our settings; the second refuses unless ``use_as_torch()`` made PyTorch's name ours (then it is
    ours): the refusal is returned. ``checkpoint`` False: no model checkpoint (the switched run's).
    """
    from unittest.mock import Mock

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy(parallel_devices=[torch.device("cpu")] * dist.get_world_size(),
                            cluster_environment=LightningEnvironment(), state_dict_type="sharded")
    wrapped = classic_fsdp(impl, _tiny_model(), lambda wrap: functools.partial(wrap.size_based_auto_wrap_policy,
                                                                                min_num_params=50))
    model = strategy._setup_model(wrapped)
    out: dict[str, Any] = {"sharded_by": type(model).__module__, "not_wrapped_again": model is wrapped,
                           "losses": [], "norms": []}
    optimizer = tp.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = tp.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x).pow(2).mean()
        loss.backward()
        out["norms"].append(model.clip_grad_norm_(1.0))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.detach())
    strategy.model, strategy._lightning_module = model, Mock(strict_loading=True)
    if checkpoint:
        state = strategy.lightning_module_state_dict()
        out["saved"] = local_shards(state)
        strategy.save_checkpoint({"state_dict": state}, directory)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        strategy.load_checkpoint(directory)
        out["loaded"] = local_shards(strategy.lightning_module_state_dict())
    try:
        out["optimizer_state"] = local_shards(strategy.optimizer_state(optimizer))
    except RuntimeError as error:  # ours without use_as_torch(): PyTorch's FSDP.optim_state_dict refuses
        out["optimizer_state"] = f"{type(error).__name__}: {error}"
    return out


def transformers_fsdp1(impl: str) -> dict[str, Any]:
    """A tiny Llama in classic FSDP (a unit per decoder layer): transformers' ``is_fsdp_managed_module`` check,
    a training step, and greedy ``generate(synced_gpus=True)`` inside the root unit's ``summon_full_params``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    tp.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = classic_fsdp(impl, LlamaForCausalLM(config), lambda wrap: functools.partial(
        wrap.transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}))
    optimizer = tp.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    out = {"sharded_by": type(model).__module__, "fsdp_managed": is_fsdp_managed_module(model),
           "loss": loss.detach(), "norm": model.clip_grad_norm_(1.0)}
    optimizer.step()
    length = 3 + dist.get_rank()  # ranks stop at different lengths: synced_gpus keeps the collectives in step
    with type(model).summon_full_params(model, recurse=False, writeback=False):
        out["tokens"] = model.module.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=length,
                                              min_new_tokens=length, do_sample=False, synced_gpus=True,
                                              pad_token_id=0)
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
    with tempfile.TemporaryDirectory() as scratch:
        directory = [scratch]
        dist.broadcast_object_list(directory, src=0)  # one checkpoint folder for every rank
        for impl in ("torch", "ours"):  # nothing switched: the frameworks' checks must take ours for PyTorch's
            results[("lightning_fsdp", impl)] = lightning_fsdp_strategy(directory[0] + f"/lfsdp_{impl}", impl)
            results[("transformers_fsdp1", impl)] = transformers_fsdp1(impl)
        dist.barrier()
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
            if impl == "ours":  # Lightning's FSDP.optim_state_dict (imported where it is called) is ours now
                results[("lightning_fsdp_switched", impl)] = lightning_fsdp_strategy("", impl, checkpoint=False)
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

