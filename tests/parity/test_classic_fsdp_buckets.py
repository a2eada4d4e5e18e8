"""Classic FSDP NO_SHARD: units' gradient all-reduces share buckets whose buffers are reused.

See [Note: bucketed NO_SHARD reduction] in ``fsdp/_classic/grad_buckets.py``. The
collectives of one backward are counted: gradients written in place (full precision)
share buckets whatever their size, copied ones (mixed precision) only small ones.
Training matches PyTorch's FSDP (which all-reduces per unit): bitwise at 2 ranks
(tests/parity/test_classic_fsdp.py's NO_SHARD rows, whose three units share one
bucket), also when the optimizer keeps its gradients (``zero_grad(set_to_none=False)``,
so a bucket's buffer can't be reused), allclose at 4, where a sum of four may associate
differently, and allclose with the single-process run.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed._comm import watch
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import (
    BATCH,
    FP32,
    assert_close_states,
    assert_equal_states,
    global_batch,
    loss_fn,
    ours_and_pytorch,
    train_reference,
    wrap_model,
)


def _mixed_model() -> nn.Sequential:
    """Five Linear units in backward order small, small, large (>= 1 MiB of gradient), small, small."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 8),
                         nn.Linear(8, 8))


def count_all_reduces(impl: str, mixed: bool = False) -> tuple[int, list[torch.Tensor]]:
    """All-reduces one NO_SHARD backward issues, and the gradients it leaves (flat, in parameter order).

    ``mixed``: float16 parameters in forward and backward, reduced in float32 (gradients copied into buckets).
    """
    if impl == "ours":
        from tensorplay.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp import (  # type: ignore[assignment]
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[assignment]
    precision = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD's deprecation notice
        model = FullyShardedDataParallel(_mixed_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                         sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"),
                                         mixed_precision=precision if mixed else None)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    if mixed:
        x = x.half()
    model(x).sum().backward()  # the first iteration also works out the bucket plan
    model.zero_grad()
    if impl == "ours":  # ours may all-reduce through shared memory: count the collectives the watch recorded
        recorded = watch.watch_for(None, lambda: "gloo")
        assert recorded is not None
        first = recorded.seq
        model(x).sum().backward()
        count = sum(record.op == "all-reduce" for record in recorded.records if record.seq >= first)
        return count, [p.grad.detach().reshape(-1).clone() for p in model.parameters()]
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


def test_no_shard_gradients_share_all_reduces():
    for in_place, copied in run_distributed(both_counts):
        for (_, ours_grads), (theirs, their_grads) in (in_place, copied):
            assert theirs == 5  # one per unit
            # Two ranks: a bucket's sums are the per-unit ones, bitwise.
            assert torch.equal(torch.cat(ours_grads), torch.cat(their_grads))
        assert in_place[0][0] == 1  # written in place: one bucket for all five units
        assert copied[0][0] == 3    # [8x8, 8x512]'s bucket, the 512x512 unit alone, [512x8, 8x8]'s bucket


def both_counts() -> list[tuple[tuple[int, list[torch.Tensor]], tuple[int, list[torch.Tensor]]]]:
    return [(count_all_reduces("ours", mixed), count_all_reduces("torch", mixed)) for mixed in (False, True)]


KEPT_GRADS_CONFIGS = [dict(strategy="NO_SHARD", keep_grads=True), dict(strategy="NO_SHARD", keep_grads=True, orig=True),
                      dict(strategy="NO_SHARD", keep_grads=True, no_sync=True)]


def test_kept_gradients_are_not_overwritten():
    """With zero_grad(set_to_none=False) the optimizer's gradients live on: the next backward takes new buffers."""
    reference = train_reference(world=2)
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(KEPT_GRADS_CONFIGS):
        assert ours_losses == torch_losses, config
        assert_equal_states(ours_state, torch_state)
        if not config.get("no_sync"):
            torch.testing.assert_close(ours_losses, reference[0], **FP32)


def grad_addresses(orig: bool) -> list[list[int]]:
    """Per iteration, where the flat gradients live (the optimizer drops them with zero_grad())."""
    model = wrap_model("ours", dict(strategy="NO_SHARD", orig=orig))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    addresses = []
    for step in range(3):
        loss_fn(model, global_batch(step, world)[rank * BATCH:(rank + 1) * BATCH]).backward()
        addresses.append([p.grad.data_ptr() for p in model.parameters() if p.grad is not None])
        optim.step()
        optim.zero_grad()
    return addresses


def test_bucket_buffers_are_reused_across_iterations():
    for orig in (False, True):
        for addresses in run_distributed(grad_addresses, orig):
            assert addresses[0] and addresses[0] == addresses[1] == addresses[2]


def grad_storages_with_one_unit_per_bucket() -> list[tuple[int, list[int]]]:
    """Per iteration, with every unit in a bucket of its own: the all-reduces, and where each flat gradient's
    storage starts."""
    from tensorplay.distributed.fsdp._classic import grad_buckets

    saved, grad_buckets.BUCKET_BYTES = grad_buckets.BUCKET_BYTES, 1
    try:
        model = wrap_model("ours", dict(strategy="NO_SHARD"))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        recorded = watch.watch_for(None, lambda: "gloo")
        assert recorded is not None
        rank, world = dist.get_rank(), dist.get_world_size()
        seen = []
        for step in range(3):
            first = recorded.seq
            loss_fn(model, global_batch(step, world)[rank * BATCH:(rank + 1) * BATCH]).backward()
            count = sum(record.op == "all-reduce" for record in recorded.records if record.seq >= first)
            seen.append((count, [p.grad.untyped_storage().data_ptr() for p in model.parameters()]))
            optim.step()
            optim.zero_grad()
        return seen
    finally:
        grad_buckets.BUCKET_BYTES = saved


def test_in_place_buckets_share_one_buffer_kept_across_iterations():
    """See [Note: reusing a bucket's buffer]: one allocation for all in-place buckets, reused every iteration."""
    for seen in run_distributed(grad_storages_with_one_unit_per_bucket):
        counts, storages = zip(*seen, strict=True)
        assert counts[0] >= 3 and len(set(counts)) == 1  # a bucket per unit, each all-reduced on its own
        assert len(storages[0]) == counts[0] and len(set(storages[0])) == 1  # ... all in one buffer
        assert storages[0] == storages[1] == storages[2]


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
