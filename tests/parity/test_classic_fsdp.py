"""Classic FullyShardedDataParallel: training parity per strategy and option.

Each configuration trains a tiny transformer for a few Adam steps on 2 ranks
(HYBRID_SHARD: 4) and is compared with (a) the unwrapped model trained in one
process on the concatenated batch (allclose, fp32) and (b) PyTorch's
``torch.distributed.fsdp.FullyShardedDataParallel`` with the same arguments
(bitwise: the same arithmetic in the same order). Where PyTorch fails on CPU
(``CPUOffload(offload_params=True)``) only (a) applies.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
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
        optim.zero_grad()
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


STRATEGY_CONFIGS = [dict(strategy=s, orig=o) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
                    for o in (False, True)]


def test_strategies_match_single_process_and_pytorch():
    ref_losses, ref_state = train_reference(world=2)
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(STRATEGY_CONFIGS):
        assert ours_losses == torch_losses, config
        assert_equal_states(ours_state, torch_state)
        torch.testing.assert_close(ours_losses, ref_losses, **FP32)
        assert_close_states(ours_state, ref_state, **FP32)


OPTION_CONFIGS = [
    dict(backward_prefetch="BACKWARD_POST", forward_prefetch=True, clip=True),
    dict(strategy="NO_SHARD", clip=True),
    dict(strategy="SHARD_GRAD_OP", forward_prefetch=True, orig=True, clip=True),
    dict(no_sync=True),
    dict(eval_forward=True, strategy="SHARD_GRAD_OP"),
    dict(no_sync=True, strategy="NO_SHARD", orig=True),
]


def test_prefetch_and_no_sync_match_single_process_and_pytorch():
    plain = train_reference(world=2)
    clipped = train_reference(world=2, clip=CLIP)
    accumulated = train_reference(world=2, micro_batches=2)
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(OPTION_CONFIGS):
        # With clip, the losses are followed by clip_grad_norm_'s returned norms.
        if not config.get("eval_forward"):
            # PyTorch's FSDP keeps the parameters that forward-without-backward left gathered and runs
            # the next iteration on them, stale after optimizer.step(); only the reference applies there.
            assert ours_losses == torch_losses, config
            assert_equal_states(ours_state, torch_state)
        ref_losses, ref_state = accumulated if config.get("no_sync") else clipped if config.get("clip") else plain
        torch.testing.assert_close(ours_losses[:STEPS], ref_losses, **FP32)
        assert_close_states(ours_state, ref_state, **FP32)


MIXED_CONFIGS = [dict(mp="float16"), dict(mp="bfloat16", orig=True), dict(mp="float16", strategy="NO_SHARD")]


def test_mixed_precision_matches_pytorch():
    ref_losses, ref_state = train_reference(world=2)
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(MIXED_CONFIGS):
        assert ours_losses == torch_losses, config
        assert_equal_states(ours_state, torch_state)
        # Low-precision compute drifts from the fp32 run, but only by rounding.
        assert all(value.dtype == torch.float32 for value in ours_state.values())
        torch.testing.assert_close(ours_losses, ref_losses, rtol=2e-2, atol=2e-2)
        assert_close_states(ours_state, ref_state, rtol=5e-2, atol=5e-2)


IGNORED_CONFIGS = [dict(ignore_head=True), dict(ignore_head=True, orig=True, mesh=(2,))]


def test_ignored_modules_and_device_mesh_match_pytorch():
    # The ignored head is neither sharded nor reduced, so each rank trains its own copy: only the
    # oracle applies (the single-process run has one head).
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(IGNORED_CONFIGS):
        assert ours_losses == torch_losses, config
        assert_equal_states(ours_state, torch_state)


OFFLOAD_CONFIGS = [dict(offload=True), dict(offload=True, orig=True, strategy="SHARD_GRAD_OP")]


def test_cpu_offload_matches_single_process():
    # PyTorch's FSDP cannot run CPUOffload(offload_params=True) without an accelerator.
    results = run_distributed(train_grid, ["ours"], OFFLOAD_CONFIGS)
    ref_losses, ref_state = train_reference(world=2)
    for rank_results in results:
        for losses, state in rank_results:
            torch.testing.assert_close(losses, ref_losses, **FP32)
            assert_close_states(state, ref_state, **FP32)


HYBRID_CONFIGS = [dict(strategy="HYBRID_SHARD", hybrid_per_node=True),
                  dict(strategy="_HYBRID_SHARD_ZERO2", mesh=(2, 2), orig=True)]


def test_hybrid_shard_on_four_ranks_matches_single_process_and_pytorch():
    ref_losses, ref_state = train_reference(world=4)
    for _config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(HYBRID_CONFIGS, 4):
        # Sums of four gradients may associate differently from PyTorch's, so not bitwise.
        torch.testing.assert_close(ours_losses, torch_losses, **FP32)
        assert_close_states(ours_state, torch_state, **FP32)
        torch.testing.assert_close(ours_losses, ref_losses, **FP32)
        assert_close_states(ours_state, ref_state, **FP32)


def train_with_scaler(impl: str) -> tuple[list[float], dict]:
    """fp16 MixedPrecision with the implementation's own ShardedGradScaler; at this scale some steps overflow."""
    if impl == "ours":
        from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    rank, world = dist.get_rank(), dist.get_world_size()
    model = wrap_model(impl, dict(mp="float16"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 16, growth_interval=1)
    scales = []
    for step in range(5):
        loss = loss_fn(model, global_batch(step, world)[rank * BATCH:(rank + 1) * BATCH])
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        scales.append(scaler.get_scale())
    return scales, full_state(impl, model)


def test_sharded_grad_scaler_with_fp16_matches_pytorch():
    ours = run_distributed(train_with_scaler, "ours")
    theirs = run_distributed(train_with_scaler, "torch")
    for (our_scales, our_state), (their_scales, their_state) in zip(ours, theirs, strict=True):
        assert our_scales == their_scales
        pairs = list(itertools.pairwise([2.0 ** 16] + our_scales))  # (previous scale, scale) per step
        assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)  # steps taken and steps skipped
        assert_equal_states(our_state, their_state)


def train_low_precision_grads(impl: str) -> tuple[list[torch.dtype], dict]:
    """MixedPrecision(keep_low_precision_grads=True): fp16 gradients reach the optimizer (SGD here)."""
    api, _ = fsdp_api(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = api.FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"),
                                         mixed_precision=api.MixedPrecision(param_dtype=torch.float16,
                                                                            keep_low_precision_grads=True))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    dtypes = []
    for step in range(2):
        loss_fn(model, global_batch(step, world)[rank * BATCH:(rank + 1) * BATCH]).backward()
        dtypes += [p.grad.dtype for p in model.parameters()]
        optim.step()
        optim.zero_grad()
    return dtypes, full_state(impl, model)


def test_keep_low_precision_grads_matches_pytorch():
    ours = run_distributed(train_low_precision_grads, "ours")
    theirs = run_distributed(train_low_precision_grads, "torch")
    for (our_dtypes, our_state), (their_dtypes, their_state) in zip(ours, theirs, strict=True):
        assert our_dtypes == their_dtypes == [torch.float16] * len(our_dtypes)
        assert_equal_states(our_state, their_state)
