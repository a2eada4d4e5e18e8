"""ZeRO: uneven inputs under Join, memory per rank, step hooks, checkpoints across world sizes."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorplay as tp
from tensorplay.distributed.optim.zero_redundancy_optimizer import (
    ZeroRedundancyOptimizer,
)
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors
from tests.parity.zero_common import batch, build, make_model


def train_join(impl: str, bucket: bool) -> list[torch.Tensor]:
    model = make_model()
    ddp = DDP(model)
    optimizer = build(impl, model.parameters(), "adam", parameters_as_bucket_view=bucket)
    with Join([ddp, optimizer]):
        for step in range(2 + 2 * dist.get_rank()):  # rank r has 2 + 2r batches
            optimizer.zero_grad()
            ddp(batch(step)).pow(2).sum().backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def join_runs() -> dict:
    return {(impl, bucket): train_join(impl, bucket) for impl in ("ours", "torch") for bucket in (False, True)}


def test_uneven_inputs_under_join_match_pytorch():
    # DDP + a plain optimizer has no Join support for the optimizer step, so PyTorch's ZeRO is the reference.
    results = run_distributed(join_runs, world_size=3)
    reference = results[0][("torch", False)]
    for rank, runs in enumerate(results):
        for key, params in runs.items():
            assert_equal_tensors(params, reference, f"rank {rank}, {key}")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def memory_per_rank() -> dict:
    torch.manual_seed(0)
    model = tp.nn.Sequential(tp.nn.Linear(40, 30), tp.nn.Linear(30, 20), tp.nn.Linear(20, 50), tp.nn.Linear(50, 7))
    zero = ZeroRedundancyOptimizer(model.parameters(), tp.optim.Adam, lr=0.01)
    plain = tp.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 40)).sum().backward()
    plain.step()
    zero.step()
    own = {id(p) for p in zero.optim.state}
    owned = {id(p) for g in zero._owned_params(zero.rank) for p in g}
    largest = max(state_bytes_of(plain, p) for p in model.parameters())
    return {"local": state_bytes(zero.optim), "total": state_bytes(plain), "largest": largest,
            "own_only": own == owned, "wrapper_state": len(zero.state)}


def state_bytes_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    return sum(v.numel() * v.element_size() for v in optimizer.state[param].values())


def test_each_rank_keeps_only_its_share_of_the_state():
    for world_size in (2, 3):
        results = run_distributed(memory_per_rank, world_size=world_size)
        assert sum(r["local"] for r in results) == results[0]["total"]
        for r in results:
            assert r["own_only"] and r["wrapper_state"] == 0
            assert r["local"] <= r["total"] / world_size + r["largest"]


def step_hooks_and_closure() -> dict:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), tp.optim.SGD, lr=0.1)
    calls = []
    zero.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    zero.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))

    def closure() -> torch.Tensor:
        zero.zero_grad()
        loss = model(batch(0)).pow(2).sum()
        loss.backward()
        return loss

    loss = zero.step(closure)
    zero.zero_grad()
    return {"calls": calls, "loss": float(loss), "grads": [p.grad for p in model.parameters()]}


def test_step_hooks_closure_and_zero_grad():
    for result in run_distributed(step_hooks_and_closure, world_size=2):
        assert result["calls"] == ["pre", "post"] and result["loss"] > 0
        assert all(g is None for g in result["grads"])


# ---------------------------------------------------------------- checkpoints across world sizes

ROWS = 6  # global batch, split evenly over 1, 2 or 3 ranks


def global_batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(step))


def local_loss(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    rows = global_batch(step).chunk(world)[rank]
    return model(rows).pow(2).sum(dim=1).mean()  # DDP's average over equal chunks = the global mean


def train_then_save(path: str, steps: int) -> None:
    model = make_model()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), tp.optim.Adam, parameters_as_bucket_view=True, lr=0.01)
    for step in range(steps):
        zero.zero_grad()
        local_loss(ddp, step, dist.get_rank(), dist.get_world_size()).backward()
        zero.step()
    zero.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        tmp = f"{path}.tmp"
        tp.save({"model": model.state_dict(), "optim": zero.state_dict()}, tmp)
        os.replace(tmp, path)  # atomic: a reader never sees half a checkpoint
    dist.barrier()


def load_and_continue(path: str, first: int, steps: int) -> list[torch.Tensor]:
    checkpoint = tp.load(path)
    model = make_model(seed=123)
    model.load_state_dict(checkpoint["model"])
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), tp.optim.Adam, lr=0.5)  # lr comes from the checkpoint
    zero.load_state_dict(checkpoint["optim"])
    for step in range(first, first + steps):
        zero.zero_grad()
        local_loss(ddp, step, dist.get_rank(), dist.get_world_size()).backward()
        zero.step()
    return [p.detach().clone() for p in model.parameters()]


def uninterrupted(steps: int, resume_at: int, checkpoint_path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process, the global batch, plain Adam; and the same resumed from the checkpoint with plain Adam."""
    model = make_model()
    adam = tp.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        adam.zero_grad()
        local_loss(model, step, 0, 1).backward()
        adam.step()
    checkpoint = tp.load(checkpoint_path)
    resumed = make_model(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    plain = tp.optim.Adam(resumed.parameters(), lr=0.5)
    plain.load_state_dict(checkpoint["optim"])  # a consolidated ZeRO checkpoint is a plain one
    for step in range(resume_at, steps):
        plain.zero_grad()
        local_loss(resumed, step, 0, 1).backward()
        plain.step()
    return [p.detach() for p in model.parameters()], [p.detach() for p in resumed.parameters()]


def test_checkpoint_saved_at_two_ranks_resumes_at_three():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "zero.pt")
        run_distributed(train_then_save, path, 3, world_size=2)
        assert os.listdir(tmp) == ["zero.pt"]
        results = run_distributed(load_and_continue, path, 3, 3, world_size=3)
        reference, resumed_plain = uninterrupted(6, 3, path)
    for params in results:
        for got, want, plain in zip(params, reference, resumed_plain, strict=True):
            # Summation order differs between 1, 2 and 3 ranks: a few float32 ulps.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
        assert_equal_tensors(params, results[0], "vs rank 0")


def freeze_midway(impl: str) -> list[torch.Tensor]:
    model = make_model()  # no DDP: every rank computes the same gradients from the same batch
    optimizer = build(impl, model.parameters(), "adam", **({} if impl == "plain" else
                                                           {"parameters_as_bucket_view": True}))
    for step in range(5):
        if step == 2:  # trainability changes: the buckets are rebuilt without the frozen layer
            for p in model.body[2].parameters():
                p.requires_grad_(False)
        optimizer.zero_grad()
        model(global_batch(step)).pow(2).sum().backward()
        optimizer.step()
    if impl == "ours":  # the frozen layer left the buckets; the rest are still views of them
        assert [optimizer._buckets.holds(p) for p in model.parameters()] == [True, True, False, False, True, True]
    return [p.detach().clone() for p in model.parameters()]


def freeze_runs() -> dict:
    return {impl: freeze_midway(impl) for impl in ("ours", "torch", "plain")}


def test_freezing_parameters_midway_rebuilds_buckets():
    results = run_distributed(freeze_runs, world_size=2)
    reference = results[0]["plain"]
    for runs in results:
        for impl, params in runs.items():
            assert_equal_tensors(params, reference, impl)
