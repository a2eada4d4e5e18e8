"""The examples of seeds/distributed-optim.txt, as written, on 2 Gloo ranks.

Only the init line differs (the harness's ranks already run in a default Gloo
group) and ``.cuda()`` applies only where CUDA exists. Each example is then
trained a few steps and checked against PyTorch's implementation of the same
API with the same seed and per-rank data.
"""

from __future__ import annotations

import torch

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed


def _train(model: torch.nn.Module, optimizer, steps: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(4, model.in_features, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        for p in model.parameters():  # a data-parallel step: average the gradients first
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def zero_seed_example() -> tuple[torch.Tensor, torch.Tensor]:
    # ---- seeds/distributed-optim.txt, "Zero-redundancy optimizer" ----
    import tensorplay as tp
    import tensorplay.distributed as dist  # noqa: F401
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    tp.manual_seed(0)
    model = tp.nn.Linear(1024, 1024)
    if tp.cuda.is_available():
        model = model.cuda()

    optimizer = ZeroRedundancyOptimizer(  # shards the Adam state across ranks
        model.parameters(),
        optimizer_class=tp.optim.Adam,
        lr=1e-3,
    )
    # ---- end of the seed ----
    ours = _train(model, optimizer)

    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    torch.manual_seed(0)
    reference = torch.nn.Linear(1024, 1024).to(next(model.parameters()).device)
    theirs = _train(reference, TorchZeRO(reference.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3))
    return ours, theirs


def test_zero_seed_example_matches_pytorch():
    for ours, theirs in run_distributed(zero_seed_example, world_size=2):
        assert torch.equal(ours, theirs)


def _local_sgd_run(PostLocalSGDOptimizer, PeriodicModelAverager, warmup_steps: int, steps: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    local_optim = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer = PostLocalSGDOptimizer(optim=local_optim,
                                      averager=PeriodicModelAverager(period=4, warmup_steps=warmup_steps))
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=generator)).square().mean().backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def post_local_sgd_seed_example() -> dict[str, torch.Tensor]:
    # ---- seeds/distributed-optim.txt, "Post-local-SGD optimizer" ----
    import tensorplay as tp
    from tensorplay.distributed.algorithms.model_averaging.averagers import (
        PeriodicModelAverager,
    )
    from tensorplay.distributed.optim import PostLocalSGDOptimizer

    model = tp.nn.Linear(8, 8)
    local_optim = tp.optim.SGD(model.parameters(), lr=0.01)
    optimizer = PostLocalSGDOptimizer(
        optim=local_optim,
        averager=PeriodicModelAverager(period=4, warmup_steps=100),
    )
    # ---- end of the seed ----
    assert optimizer.averager.period == 4 and optimizer.averager.warmup_steps == 100
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager as TorchAverager
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD

    # A short warm-up so averaging happens within the test: steps 2, 6 and 10 of 11 are averaged.
    return {"ours": _local_sgd_run(PostLocalSGDOptimizer, PeriodicModelAverager, 2, 11),
            "theirs": _local_sgd_run(TorchPostLocalSGD, TorchAverager, 2, 11),
            "ours_unaveraged": _local_sgd_run(PostLocalSGDOptimizer, PeriodicModelAverager, 2, 12)}


def test_post_local_sgd_seed_example_matches_pytorch():
    rank0, rank1 = run_distributed(post_local_sgd_seed_example, world_size=2)
    for result in (rank0, rank1):
        assert torch.equal(result["ours"], result["theirs"])
    assert torch.equal(rank0["ours"], rank1["ours"])  # step 10 averaged: replicas agree
    assert not torch.equal(rank0["ours_unaveraged"], rank1["ours_unaveraged"])  # step 11 was local


def functional_seed_example() -> tuple[torch.Tensor, torch.Tensor]:
    # ---- seeds/distributed-optim.txt, "Functional optimizers" ----
    import tensorplay as tp
    from tensorplay.distributed.optim import as_functional_optim

    functional_adam = as_functional_optim(tp.optim.Adam, lr=1e-2)
    # ---- end of the seed ----
    torch.manual_seed(0)
    ours = torch.randn(5, requires_grad=True)
    reference = ours.detach().clone().requires_grad_(True)
    plain = torch.optim.Adam([reference], lr=1e-2)
    for step in range(3):
        grad = torch.full((5,), float(step + 1))
        functional_adam.step_param(ours, grad)
        reference.grad = grad.clone()
        plain.step()
    return ours.detach(), reference.detach()


def test_functional_seed_example_matches_the_class_optimizer():
    ours, reference = run_distributed(functional_seed_example, world_size=2)[0]
    assert torch.equal(ours, reference)
