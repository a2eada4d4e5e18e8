"""ZeRO overlapped with DDP's backward (both hooks, whole and sharded buckets) on Gloo.

PyTorch's hooks refuse a Gloo group, so the reference is DDP (with the same
inner all-reduce hook) + the plain optimizer skipping the two warm-up iterations; PyTorch's ``hook_with_zero_step``
is also run with its backend check bypassed (it does not hang when every rank
issues the same order), as a second oracle for that hook.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorplay as tp
from tensorplay.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
)
from tensorplay.distributed.optim.zero import _chunked_step as chunked_step
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors
from tests.parity.zero_common import batch, build, make_model

STEPS = 6


def _torch_hooked(kind: str, ddp: DDP, zero, shard_buckets: bool):
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as theirs
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        allreduce_hook as their_allreduce,
    )

    with mock.patch.object(theirs.dist, "get_backend", return_value="nccl"):
        return getattr(theirs, kind)(their_allreduce, ddp, zero, shard_buckets=shard_buckets)


def train_overlap(impl: str, kind: str, shard_buckets: bool, static_graph: bool, schedule: bool,
                  opt: str = "adam") -> dict:
    model = make_model()
    # A tiny bucket cap gives several DDP buckets (after DDP's rebuild) for the partition to follow.
    ddp = DDP(model, bucket_cap_mb=0.0001, static_graph=static_graph)
    warmup = 3 if static_graph else 2  # iterations before DDP's buckets are final, as in PyTorch
    if impl == "plain":
        # The same averaging as the hooked runs (divide, then sum: not bitwise DDP's default for 3 ranks).
        ddp.register_comm_hook(None, allreduce_hook)
        optimizer = build("plain", model.parameters(), opt)
    else:
        optimizer = build(impl, model.parameters(), opt, overlap_with_ddp=True)
        if impl == "ours":
            ddp.register_comm_hook(None, getattr(ddp_zero_hook, kind)(allreduce_hook, ddp, optimizer,
                                                                      shard_buckets=shard_buckets))
        else:
            ddp.register_comm_hook(None, _torch_hooked(kind, ddp, optimizer, shard_buckets))
    # An lr schedule from the first update on reaches the functional optimizer inside the hook.
    sched = tp.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** max(0, epoch - warmup))
    for step in range(STEPS):
        ddp(batch(step)).pow(2).sum().backward()
        if impl == "plain" and step >= warmup:
            optimizer.step()
        optimizer.zero_grad()
        if schedule:
            sched.step()
    params = [p.detach().clone() for p in model.parameters()]
    if impl == "torch":
        return {"params": params}
    if impl == "ours":
        optimizer.consolidate_state_dict(to=0)
    full = optimizer.state_dict() if dist.get_rank() == 0 else None
    if impl == "plain":
        return {"params": params, "state": full}
    check_reload(optimizer, full)
    return {"params": params, "state": full, "buckets": len(optimizer._overlap.bucket_params)}


def check_reload(zero, full: dict | None) -> None:
    """Loading the consolidated state back gives every rank its own shard of it, unchanged."""
    box = [full]
    dist.broadcast_object_list(box, src=0)
    before = {p: {k: v.clone() for k, v in state.items()} for p, state in zero.optim.state.items()}
    zero.load_state_dict(box[0])
    assert before and {id(p) for p in before} == {id(p) for p in zero.optim.state}
    for param, state in before.items():
        assert all(torch.equal(zero.optim.state[param][k], v) for k, v in state.items())


def overlap_runs(kind: str, shard_buckets: bool, static_graph: bool, with_torch: bool) -> dict:
    # PyTorch's functional optimizers ignore an lr set on param_groups: schedule only without it.
    impls = ("ours", "plain", "torch") if with_torch else ("ours", "plain")
    return {impl: train_overlap(impl, kind, shard_buckets, static_graph, not with_torch) for impl in impls}


# PyTorch's interleaved hook hangs on Gloo, so it is no oracle there.
CASES = [
    ("hook_with_zero_step", False, False, 2, True),
    ("hook_with_zero_step", True, False, 3, True),
    ("hook_with_zero_step", False, True, 2, True),
    ("hook_with_zero_step_interleaved", False, False, 3, False),
    ("hook_with_zero_step_interleaved", True, True, 2, False),
]


def overlap_runs_chunked(kind: str, shard_buckets: bool, static_graph: bool, with_torch: bool) -> dict:
    """:func:`overlap_runs` with the large parameters (here: over 64 elements) updated in chunks."""
    default = chunked_step.CHUNK_NUMEL
    chunked_step.CHUNK_NUMEL = 64
    try:
        return overlap_runs(kind, shard_buckets, static_graph, with_torch)
    finally:
        chunked_step.CHUNK_NUMEL = default


@pytest.mark.parametrize("kind,shard_buckets,static_graph,world_size,with_torch", CASES)
def test_overlap_matches_ddp_with_warmup(kind, shard_buckets, static_graph, world_size, with_torch):
    check(run_distributed(overlap_runs, kind, shard_buckets, static_graph, with_torch, world_size=world_size,
                          timeout=120))


def test_overlap_with_chunked_updates_matches_ddp_and_pytorch():
    check(run_distributed(overlap_runs_chunked, "hook_with_zero_step", True, False, True, world_size=2,
                          timeout=300))


def check(results: list[dict]) -> None:
    reference = results[0]["plain"]["params"]
    initial = [p.detach() for p in make_model().parameters()]
    moved = any(not torch.equal(p, q) for p, q in zip(reference, initial, strict=True))
    assert moved and results[0]["ours"]["buckets"] >= 3
    for rank, runs in enumerate(results):
        for impl, run in runs.items():
            assert_equal_tensors(run["params"], reference, f"rank {rank} {impl}")
    # The consolidated state is the plain optimizer's state.
    ours, plain = results[0]["ours"]["state"], results[0]["plain"]["state"]
    assert sorted(ours["state"]) == sorted(plain["state"]) == list(range(6))
    for index, state in plain["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(ours["state"][index][key]), value), (index, key)
    assert ours["param_groups"][0]["lr"] == plain["param_groups"][0]["lr"]
