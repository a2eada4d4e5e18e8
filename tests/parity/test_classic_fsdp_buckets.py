"""Classic FSDP NO_SHARD: small units' gradient all-reduces share buckets, large ones go alone.

See [Note: bucketed NO_SHARD reduction] in ``fsdp/_classic/grad_buckets.py``. The
collectives of one backward are counted, and training matches PyTorch's FSDP (which
all-reduces per unit): bitwise at 2 ranks (tests/parity/test_classic_fsdp.py's
NO_SHARD rows, whose three units share one bucket), allclose at 4, where a sum of four
may associate differently, and allclose with the single-process run.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import FP32, assert_close_states, ours_and_pytorch, train_reference


def _mixed_model() -> nn.Sequential:
    """Five Linear units in backward order small, small, large (>= 1 MiB of gradient), small, small."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 8),
                         nn.Linear(8, 8))


def count_all_reduces(impl: str) -> tuple[int, list[torch.Tensor]]:
    """All-reduces one NO_SHARD backward issues, and the gradients it leaves (flat, in parameter order)."""
    if impl == "ours":
        from tensorplay.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy  # type: ignore[assignment]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD's deprecation notice
        model = FullyShardedDataParallel(_mixed_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                         sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()  # the first iteration also works out the bucket plan
    model.zero_grad()
    calls = []
    real = torch.distributed.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        model(x).sum().backward()
    finally:
        torch.distributed.all_reduce = real
    return len(calls), [p.grad.detach().reshape(-1).clone() for p in model.parameters()]


def test_small_no_shard_gradients_share_an_all_reduce():
    for (ours, ours_grads), (theirs, their_grads) in run_distributed(both_counts):
        assert theirs == 5  # one per unit
        assert ours == 3    # [8x8, 8x512]'s bucket, the 512x512 unit alone, [512x8, 8x8]'s bucket
        # Two ranks: a bucket's sums are the per-unit ones, bitwise.
        assert torch.equal(torch.cat(ours_grads), torch.cat(their_grads))


def both_counts() -> tuple[tuple[int, list[torch.Tensor]], tuple[int, list[torch.Tensor]]]:
    return count_all_reduces("ours"), count_all_reduces("torch")


NO_SHARD_CONFIGS = [dict(strategy="NO_SHARD"), dict(strategy="NO_SHARD", orig=True, no_sync=True)]


def test_no_shard_on_four_ranks_matches_single_process_and_pytorch():
    plain, accumulated = train_reference(world=4), train_reference(world=4, micro_batches=2)
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(NO_SHARD_CONFIGS, 4):
        # A bucket's sum of four may associate differently from PyTorch's per-unit all-reduce.
        torch.testing.assert_close(ours_losses, torch_losses, **FP32)
        assert_close_states(ours_state, torch_state, **FP32)
        ref_losses, ref_state = accumulated if config.get("no_sync") else plain
        torch.testing.assert_close(ours_losses, ref_losses, **FP32)
        assert_close_states(ours_state, ref_state, **FP32)
