"""Classic FullyShardedDataParallel: training parity per strategy and option.

Each configuration trains a tiny transformer for a few Adam steps on 2 ranks
(HYBRID_SHARD: 4) and is compared with (a) the unwrapped model trained in one
process on the concatenated batch (allclose, fp32) and (b) PyTorch's
``torch.distributed.fsdp.FullyShardedDataParallel`` with the same arguments
(bitwise: the same arithmetic in the same order). Where PyTorch fails on CPU
(``CPUOffload(offload_params=True)``) only (a) applies.
"""

from __future__ import annotations

import itertools
import warnings

import torch

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import (
    BATCH,
    CLIP,
    FP32,
    STEPS,
    assert_close_states,
    assert_equal_states,
    fsdp_api,
    full_state,
    global_batch,
    loss_fn,
    make_model,
    ours_and_pytorch,
    train_fsdp,
    train_grid,
    train_reference,
    wrap_model,
)

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


ONE_RANK_CONFIGS = [dict(strategy="FULL_SHARD"), dict(strategy="SHARD_GRAD_OP", orig=True),
                    dict(strategy="NO_SHARD", clip=True)]


def strategies_on_one_rank(impl: str) -> list[tuple[str, list[str], tuple[list[float], dict]]]:
    """Each strategy on a group of one rank: the strategy it reports, the warnings, and the training."""
    results = []
    for config in ONE_RANK_CONFIGS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy = wrap_model(impl, config).sharding_strategy
        said = sorted({str(w.message) for w in caught if "NO_SHARD" in str(w.message)})
        results.append((strategy.name, said, train_fsdp(impl, config)))
    return results


def test_strategies_on_one_rank_switch_to_no_shard_as_pytorch_does():
    """PyTorch's FSDP runs every flat strategy as NO_SHARD on one rank and says so; ours too, bitwise."""
    [ours] = run_distributed(strategies_on_one_rank, "ours", world_size=1)
    [theirs] = run_distributed(strategies_on_one_rank, "torch", world_size=1)
    ref_losses, ref_state = train_reference(world=1)
    clipped = train_reference(world=1, clip=CLIP)
    for config, (our_name, our_said, (our_losses, our_state)), (their_name, their_said, (their_losses, their_state)) \
            in zip(ONE_RANK_CONFIGS, ours, theirs, strict=True):
        assert our_name == their_name == "NO_SHARD", config
        assert our_said == their_said, config
        assert our_losses == their_losses, config
        assert_equal_states(our_state, their_state)
        losses, state = clipped if config.get("clip") else (ref_losses, ref_state)
        torch.testing.assert_close(our_losses[:STEPS], losses, **FP32)
        assert_close_states(our_state, state, **FP32)


def hybrid_with_one_rank_per_shard_group(impl: str) -> tuple[str, list[torch.Tensor]]:
    """HYBRID_SHARD over shard groups of one rank each, replicated across the two: strategy and gradients."""
    api, _ = fsdp_api(impl)
    rank = dist.get_rank()
    shard_group = [dist.new_group([r]) for r in range(2)][rank]
    replicate_group = dist.new_group([0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's switch to NO_SHARD
        model = api.FullyShardedDataParallel(make_model(), process_group=(shard_group, replicate_group),
                                             sharding_strategy=api.ShardingStrategy.HYBRID_SHARD,
                                             device_id=torch.device("cpu"))
    loss_fn(model, global_batch(0, 2)[rank * BATCH:(rank + 1) * BATCH]).backward()
    return model.sharding_strategy.name, [p.grad.detach().clone() for p in model.parameters()]


def test_hybrid_shard_with_single_rank_shard_groups_still_averages_across_replicas():
    """PyTorch's FSDP runs HYBRID_SHARD over one-rank shard groups as NO_SHARD over the shard group, so it never
    all-reduces across replicas: each rank keeps its own gradient. Ours keeps both groups: the gradient is the
    single-process one of the whole batch, the same on every rank."""
    ours = run_distributed(hybrid_with_one_rank_per_shard_group, "ours")
    theirs = run_distributed(hybrid_with_one_rank_per_shard_group, "torch")
    model = make_model()
    loss_fn(model, global_batch(0, 2)).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for name, grads in ours:
        assert name == "HYBRID_SHARD"
        torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads])[:expected.numel()], expected, **FP32)
    assert [name for name, _ in theirs] == ["NO_SHARD", "NO_SHARD"]
    assert not torch.equal(theirs[0][1][0], theirs[1][1][0])  # PyTorch's ranks hold different gradients


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
