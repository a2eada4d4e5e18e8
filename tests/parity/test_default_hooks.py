"""DDP with our default communication hooks == DDP with PyTorch's (bitwise), on 4 ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_hooks

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks as our_hooks
from tensorplay.testing.distributed import run_distributed

WORLD = 4
STEPS = 3


# No annotations on these wrappers: under ``from __future__ import annotations`` they
# would be strings, which DDP's hook check rejects.
def _torch_bf16_hook(state, bucket):  # noqa: ANN001, ANN201
    # PyTorch's DDP refuses a hook *named* bf16_compress_hook without CUDA+NCCL; calling it is fine.
    return torch_hooks.bf16_compress_hook(state, bucket)


def _torch_bf16_wrapped_allreduce() -> Callable:
    wrapped = torch_hooks.bf16_compress_wrapper(torch_hooks.allreduce_hook)

    def torch_bf16_wrapped(state, bucket):  # noqa: ANN001, ANN202
        return wrapped(state, bucket)

    return torch_bf16_wrapped


def _train(hook: Callable | None, state: Any, wide: bool = False) -> list[torch.Tensor]:
    """``wide``: buckets of 64 KiB and more, so our allreduce_hook sums through shared memory."""
    tp.manual_seed(0)
    if wide:
        model = tp.nn.Sequential(tp.nn.Linear(256, 256), tp.nn.GELU(), tp.nn.Linear(256, 200), tp.nn.GELU(),
                                 tp.nn.Linear(200, 3))
        bucket_cap_mb, batch = 0.25, (8, 256)
    else:
        model = tp.nn.Sequential(tp.nn.Linear(6, 5), tp.nn.ReLU(), tp.nn.Linear(5, 3))
        bucket_cap_mb, batch = 1e-4, (4, 6)  # several buckets
    ddp = tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = tp.optim.SGD(ddp.parameters(), lr=0.1)
    gen = tp.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(tp.randn(*batch, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def hook_runs() -> dict[str, Any]:
    """Per case, (ours, PyTorch's) trained parameters; plus DDP without a hook under "no_hook"."""
    pairs, _ = dist.new_subgroups(group_size=2)
    cases = {
        "allreduce": (our_hooks.allreduce_hook, torch_hooks.allreduce_hook, None),
        "allreduce_subgroup": (our_hooks.allreduce_hook, torch_hooks.allreduce_hook, pairs),
        "fp16": (our_hooks.fp16_compress_hook, torch_hooks.fp16_compress_hook, None),
        "bf16": (our_hooks.bf16_compress_hook, _torch_bf16_hook, None),
        "fp16_wrapper": (our_hooks.fp16_compress_wrapper(our_hooks.allreduce_hook),
                         torch_hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook), None),
        "bf16_wrapper": (our_hooks.bf16_compress_wrapper(our_hooks.allreduce_hook),
                         _torch_bf16_wrapped_allreduce(), pairs),
    }
    results: dict[str, Any] = {name: (_train(ours, state), _train(theirs, state))
                                for name, (ours, theirs, state) in cases.items()}
    results["no_hook"] = _train(None, None)
    return results


def test_default_hooks_match_pytorch_bitwise():
    per_rank = run_distributed(hook_runs, world_size=WORLD)
    for rank, results in enumerate(per_rank):
        no_hook = results.pop("no_hook")
        for name, (ours, theirs) in results.items():
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (name, rank)
        # allreduce_hook is exactly what DDP does without a hook.
        assert all(torch.equal(a, b) for a, b in zip(results["allreduce"][0], no_hook, strict=True)), rank
    # Global averaging keeps every rank identical; pair averaging only within each pair.
    for name in ("allreduce", "fp16", "bf16", "fp16_wrapper"):
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][name][0], per_rank[3][name][0], strict=True)), name
    for name in ("allreduce_subgroup", "bf16_wrapper"):
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][name][0], per_rank[1][name][0], strict=True)), name
        assert not torch.equal(per_rank[0][name][0][0], per_rank[2][name][0][0]), name
    # Compression changes the result (else the test could not tell the hooks apart).
    assert not torch.equal(per_rank[0]["fp16"][0][0], per_rank[0]["allreduce"][0][0])
    assert not torch.equal(per_rank[0]["bf16"][0][0], per_rank[0]["fp16"][0][0])


def wide_buckets_through_shared_memory() -> tuple[bool, bool, int]:
    from unittest import mock

    from tensorplay.distributed._comm.host_memory import HostArena

    issued = HostArena.all_reduce
    with mock.patch.object(HostArena, "all_reduce", autospec=True, side_effect=issued) as counted:
        ours = _train(our_hooks.allreduce_hook, None, wide=True)
    theirs = _train(torch_hooks.allreduce_hook, None, wide=True)
    no_hook = _train(None, None, wide=True)
    same = [all(torch.equal(a, b) for a, b in zip(ours, other, strict=True)) for other in (theirs, no_hook)]
    return same[0], same[1], counted.call_count


@pytest.mark.parametrize("world_size", [2, 4])
def test_allreduce_hook_through_shared_memory_is_bitwise_ddp(world_size):
    for same_as_pytorch_hook, same_as_no_hook, shared_memory_calls in run_distributed(
            wide_buckets_through_shared_memory, world_size=world_size):
        assert same_as_pytorch_hook and same_as_no_hook
        assert shared_memory_calls >= 3  # at least one bucket per step
