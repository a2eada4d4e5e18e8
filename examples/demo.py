"""The main job: train a small model across local ranks with tensorplay.

Launched by ``make demo`` as ``python -m tensorplay.distributed.run --nproc-per-node 2 examples/demo.py``.
Each rank sees its own slice of a synthetic regression problem; gradients are
averaged by DDP and the loss falls on every rank together.
"""

from __future__ import annotations

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.nn as nn
from tensorplay.nn.parallel import DistributedDataParallel


def main(steps: int = 30) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    optimizer = tp.optim.Adam(ddp.parameters(), lr=1e-2)
    generator = tp.Generator().manual_seed(1000 + rank)
    target_weights = tp.linspace(-1, 1, 16)
    for step in range(steps):
        x = tp.randn(32, 16, generator=generator)
        y = (x @ target_weights).unsqueeze(1)
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"step {step:3d}  mean loss over {world} ranks {mean_loss.item() / world:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
