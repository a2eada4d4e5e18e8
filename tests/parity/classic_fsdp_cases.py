"""Classic FullyShardedDataParallel test cases shared by the test_classic_fsdp*.py files.

A tiny transformer, its single-process reference training, the wrapping of it by
ours or PyTorch's FSDP (``fsdp_api``/``wrap_model``: the same arguments for both),
a training run on every rank (``train_fsdp``), and the state comparisons.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.testing.distributed import run_distributed

VOCAB, WIDTH, SEQ, BATCH, STEPS, CLIP = 16, 8, 5, 2, 3, 0.5
FP32 = dict(rtol=1e-5, atol=1e-6)
# Adam with a large eps: the attention key bias gets ~1e-9 rounding-noise gradients that a small eps
# would turn into full-size steps of random sign.


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
            for _ in range(2)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(self.norm(hidden))


def make_model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer()


def global_batch(step: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=generator)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train_reference(world: int, steps: int = STEPS, micro_batches: int = 1,
                    clip: float | None = None) -> tuple[list[float], dict]:
    """The unwrapped model on the whole batch of every rank (micro-batches: accumulated gradients)."""
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for step in range(steps):
        step_losses = []
        for micro in range(micro_batches):
            loss = loss_fn(model, global_batch(step * micro_batches + micro, world))
            loss.backward()
            step_losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()
        losses.append(sum(step_losses) / micro_batches)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


# ---- the FSDP side, run on every rank ----------------------------------------------------------------

def fsdp_api(impl: str) -> Any:
    """The module namespace of ``impl``: ours or PyTorch's (the oracle)."""
    if impl == "ours":
        import tensorplay.distributed.fsdp as api
        from tensorplay.distributed.fsdp import wrap
    else:
        import torch.distributed.fsdp as api
        from torch.distributed.fsdp import wrap
    return api, wrap


def wrap_model(impl: str, config: dict[str, Any]) -> nn.Module:
    api, wrap = fsdp_api(impl)
    mixed = config.get("mp")
    kwargs = dict(
        auto_wrap_policy=functools.partial(wrap.transformer_auto_wrap_policy,
                                           transformer_layer_cls={nn.TransformerEncoderLayer}),
        sharding_strategy=getattr(api.ShardingStrategy, config.get("strategy", "FULL_SHARD")),
        use_orig_params=config.get("orig", False),
        device_id=torch.device("cpu"),
        forward_prefetch=config.get("forward_prefetch", False),
        limit_all_gathers=config.get("limit_all_gathers", True),
        backward_prefetch=getattr(api.BackwardPrefetch, config.get("backward_prefetch", "BACKWARD_PRE")),
    )
    if mixed is not None:
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=getattr(torch, mixed))
    if config.get("offload"):
        kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
    if config.get("hybrid_per_node"):
        # Ours finds the groups from the node layout (LOCAL_WORLD_SIZE); PyTorch's needs an
        # accelerator for that, so it gets the same groups explicitly.
        if impl == "ours":
            saved = os.environ.get("LOCAL_WORLD_SIZE")
            os.environ["LOCAL_WORLD_SIZE"] = "2"
            try:
                return api.FullyShardedDataParallel(make_model(), **kwargs)
            finally:
                if saved is None:
                    del os.environ["LOCAL_WORLD_SIZE"]
                else:
                    os.environ["LOCAL_WORLD_SIZE"] = saved
        kwargs["process_group"] = hybrid_groups()
    if config.get("mesh"):
        kwargs["device_mesh"] = init_device_mesh("cpu", config["mesh"])
    model = make_model()
    if config.get("ignore_head"):
        kwargs["ignored_modules"] = [model.head]
    if config.get("ac") == "outside":  # checkpoint_wrapper(block), then FSDP wraps the block inside it
        checkpoint_blocks(model, config.get("reentrant", False))
    wrapped = api.FullyShardedDataParallel(model, **kwargs)
    if config.get("ac") == "inside":  # FSDP(block), then the block inside the unit is checkpointed
        checkpoint_blocks(wrapped, config.get("reentrant", False))
    if config.get("comm_hook"):
        wrapped.register_comm_hook(*comm_hook(config["comm_hook"]))
    return wrapped


def comm_hook(name: str) -> tuple[Any, Any]:
    """``(state, hook)``: one of PyTorch's FSDP default hooks, or ``sum`` (reduce without averaging)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    if name == "sum":
        return dist.group.WORLD, sum_hook
    state_type = default_hooks.LowPrecisionState if "compress" in name else default_hooks.DefaultState
    return state_type(dist.group.WORLD), getattr(default_hooks, name)


def sum_hook(group: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """A user hook: the gradient summed over ranks, not averaged."""
    if output is None:
        dist.all_reduce(grad, group=group)
    else:
        dist.reduce_scatter_tensor(output, grad, group=group)


def checkpoint_blocks(model: nn.Module, reentrant: bool) -> None:
    """Activation checkpointing on every transformer block, as PyTorch's FSDP recipes apply it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                   checkpoint_impl=impl),
                                   check_fn=lambda module: isinstance(module, nn.TransformerEncoderLayer))


def hybrid_groups() -> tuple[Any, Any]:
    """(shard group, replicate group) on 4 ranks: shard over {0,1} and {2,3}, replicate over {0,2} and {1,3}."""
    rank = dist.get_rank()
    shard = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    replicate = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    return shard, replicate


def full_state(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_fsdp(impl: str, config: dict[str, Any]) -> tuple[list[float], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = wrap_model(impl, config)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    micro_batches = 2 if config.get("no_sync") else 1
    losses, norms = [], []
    for step in range(config.get("steps", STEPS)):
        step_losses = []
        for micro in range(micro_batches):
            tokens = global_batch(step * micro_batches + micro, world)[rank * BATCH:(rank + 1) * BATCH]
            last = micro == micro_batches - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                loss = loss_fn(model, tokens)
                loss.backward()
            step_losses.append(loss.detach())
        if config.get("clip"):
            norms.append(model.clip_grad_norm_(CLIP).item())
        if config.get("eval_forward"):  # a forward without backward between backward and step
            model(tokens[:, :-1])
        optim.step()
        optim.zero_grad(set_to_none=not config.get("keep_grads"))
        mean = torch.stack(step_losses).mean()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses + norms, full_state(impl, model)


def train_grid(impls: list[str], configs: list[dict[str, Any]]) -> list[tuple[list[float], dict]]:
    return [train_fsdp(impl, config) for config in configs for impl in impls]


# ---- assertions --------------------------------------------------------------------------------------

def assert_close_states(actual: dict, expected: dict, **tolerance: float) -> None:
    assert list(actual) == list(expected)
    for key in expected:
        torch.testing.assert_close(actual[key].float(), expected[key].float(), msg=key, **tolerance)


def assert_equal_states(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def ours_and_pytorch(configs: list[dict[str, Any]], world_size: int = 2) -> Iterator[tuple[dict, tuple, tuple]]:
    """Train every config with ours and PyTorch's FSDP; yield (config, ours, PyTorch's) per rank and config."""
    for rank_results in run_distributed(train_grid, ["ours", "torch"], configs, world_size=world_size):
        for index, config in enumerate(configs):
            yield config, rank_results[2 * index], rank_results[2 * index + 1]


def trained(impl: str, config: dict[str, Any], steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = wrap_model(impl, config)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    for step in range(steps):
        loss_fn(model, global_batch(step, world)[rank * BATCH:(rank + 1) * BATCH]).backward()
        optim.step()
        optim.zero_grad()
    return model, optim
