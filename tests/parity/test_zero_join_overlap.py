"""ZeRO overlapped with DDP under ``Join([ddp, zero])`` with uneven inputs (2 ranks, Gloo).

A rank that runs out of inputs keeps shadowing DDP's all-reduces (DDP's join
hook runs the comm hook on zero gradients), so inside the ZeRO hook it still
updates its shard with the averaged gradients and broadcasts it; ZeRO's own join
hook calls ``step()``, which does nothing in overlap mode (as in PyTorch's).
Oracles: PyTorch's ZeRO + ``hook_with_zero_step`` with its Gloo refusal bypassed
(as in ``test_zero_overlap.py``), and DDP + the plain optimizer under
``Join([ddp])`` skipping the two warm-up iterations, whose last joiner's
parameters DDP broadcasts at the end.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tensorplay.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
)
from tensorplay.distributed.algorithms.join import Join
from tensorplay.testing.distributed import run_distributed

from tests.parity.zero_common import batch, build, make_model

WARMUP = 2  # iterations before DDP's buckets are final: the overlap hooks update nothing
STEPS = {0: 7, 1: 4}  # inputs per rank: rank 1 joins early


def _hooked(impl: str, kind: str, ddp: DDP, zero) -> object:
    if impl == "ours":
        return getattr(ddp_zero_hook, kind)(allreduce_hook, ddp, zero)
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as theirs
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        allreduce_hook as their_allreduce,
    )
    with mock.patch.object(theirs.dist, "get_backend", return_value="nccl"):
        return getattr(theirs, kind)(their_allreduce, ddp, zero)


def train_uneven(impl: str, kind: str) -> list[torch.Tensor]:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.0001)  # several buckets after DDP's rebuild
    if impl == "plain":
        ddp.register_comm_hook(None, allreduce_hook)
        optimizer = build("plain", model.parameters(), "adam")
        joinables = [ddp]
    else:
        optimizer = build(impl, model.parameters(), "adam", overlap_with_ddp=True)
        ddp.register_comm_hook(None, _hooked(impl, kind, ddp, optimizer))
        joinables = [ddp, optimizer]
    with Join(joinables):
        for step in range(STEPS[dist.get_rank()]):
            ddp(batch(step)).pow(2).sum().backward()
            if impl == "plain" and step >= WARMUP:
                optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def join_runs(kind: str, with_torch: bool) -> dict[str, list[torch.Tensor]]:
    impls = ("ours", "torch", "plain") if with_torch else ("ours", "plain")
    return {impl: train_uneven(impl, kind) for impl in impls}


# PyTorch's interleaved hook hangs on Gloo, so it is no oracle there.
@pytest.mark.parametrize("kind, with_torch", [("hook_with_zero_step", True),
                                               ("hook_with_zero_step_interleaved", False)])
def test_join_overlap_uneven_inputs(kind: str, with_torch: bool) -> None:
    results = run_distributed(join_runs, kind, with_torch, world_size=2, timeout=120)
    reference = results[0]["plain"]
    initial = [p.detach() for p in make_model().parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(reference, initial, strict=True))
    for rank, runs in enumerate(results):
        for impl, params in runs.items():
            for index, (got, want) in enumerate(zip(params, reference, strict=True)):
                assert torch.equal(got, want), f"rank {rank} {impl}: param {index} differs"
