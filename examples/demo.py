"""The main job: train one small model three ways across local ranks with tensorplay.

Launched by ``make demo`` as ``python -m tensorplay.distributed.run --nproc-per-node 2 examples/demo.py``.
Every rank draws its own batches of one synthetic regression problem. The same
model, seed and data are trained with

  1. DDP + ZeroRedundancyOptimizer(Adam): each rank keeps half of Adam's state;
  2. PostLocalSGDOptimizer + PeriodicModelAverager: local steps, averaged every 4;
  3. fully_shard + Adam + ShardedGradScaler: parameters, gradients and state sharded.

Rank 0 prints the loss curve of each and what each rank holds. ZeRO and
fully_shard follow the same curve as each other (same arithmetic, different
sharding); post-local SGD takes its own path and its replicas agree right after
each average.
"""

from __future__ import annotations

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.nn as nn
from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from tensorplay.distributed.fsdp import fully_shard
from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tensorplay.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from tensorplay.distributed.tensor import DTensor
from tensorplay.nn.parallel import DistributedDataParallel

STEPS = 31
TARGET = tp.linspace(-1, 1, 32)


def make_model() -> nn.Module:
    tp.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))


def batches(rank: int):
    generator = tp.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        x = tp.randn(64, 32, generator=generator)
        yield x, (x @ TARGET).unsqueeze(1)


def mean_over_ranks(value: tp.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def local_bytes(tensor: tp.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(optimizer: tp.optim.Optimizer) -> int:
    return sum(local_bytes(t) for s in optimizer.state.values()
               for t in s.values() if isinstance(t, tp.Tensor) and t.dim() > 0)


def report(name: str, losses: list[float], held: str) -> None:
    held_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(held_by_rank, held)
    if dist.get_rank() == 0:
        curve = "  ".join(f"{loss:7.3f}" for loss in losses[::10])
        print(f"{name:<44} {curve}")
        for rank, text in enumerate(held_by_rank):
            print(f"{'':<44} rank {rank}: {text}")


def fit(model: nn.Module, optimizer: tp.optim.Optimizer, rank: int) -> list[float]:
    """Plain training loop; returns the mean loss over ranks at each step."""
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(mean_over_ranks(loss))
    return losses


def train_zero(rank: int) -> list[float]:
    model = DistributedDataParallel(make_model())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=tp.optim.Adam, lr=1e-2)
    losses = fit(model, optimizer, rank)
    total = sum(p.numel() for p in model.parameters()) * 2 * 4  # exp_avg + exp_avg_sq, fp32
    report("DDP + ZeroRedundancyOptimizer(Adam)", losses,
           f"Adam state {state_bytes(optimizer.optim)} of {total} bytes")
    return losses


def train_post_local_sgd(rank: int) -> list[float]:
    model = make_model()
    averager = PeriodicModelAverager(period=4, warmup_steps=10)
    optimizer = PostLocalSGDOptimizer(optim=tp.optim.SGD(model.parameters(), lr=0.05), averager=averager)
    losses = fit(model, optimizer, rank)
    first = next(model.parameters()).detach().flatten()[0].item()
    report("PostLocalSGDOptimizer(SGD), period 4", losses,
           f"averager step {averager.step}, w[0] = {first:.6f} (averaged at step 30: equal on every rank)")
    return losses


def train_fully_shard(rank: int) -> list[float]:
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # one all-gather group per layer, bottom-up
    fully_shard(model)
    optimizer = tp.optim.Adam(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cuda" if tp.cuda.is_available() else "cpu")
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skips on every rank together if any rank overflowed
        scaler.update()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    local = sum(local_bytes(p) for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    report("fully_shard + Adam + ShardedGradScaler", losses,
           f"parameter shards {local} of {full} bytes, Adam state {state_bytes(optimizer)} bytes")
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        print(f"training on {dist.get_world_size()} ranks (gloo); mean loss over ranks at step")
        print(f"{'':<44} " + "  ".join(f"{step:>7d}" for step in range(0, STEPS, 10)))
    train_zero(rank)
    train_post_local_sgd(rank)
    train_fully_shard(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
