"""Post-local SGD vs DDP all-reduce every step: communication and step time, ours vs PyTorch's.

4 Gloo ranks on this machine, pairs as the local subgroups, a ~1M-parameter MLP.
Two schedules, each run with our objects and with PyTorch's in the same processes:

* DDP with ``allreduce_hook``: the gradients are averaged over all ranks every step.
* post-local SGD: ``post_localSGD_hook`` (gradients averaged within the pair) +
  ``PostLocalSGDOptimizer(SGD, PeriodicModelAverager(period=4))`` (parameters
  averaged over all ranks every 4th step).

A third row times ``average_parameters`` of the same model alone (one flat
all-reduce per call), the averaging cost without the training around it.

Communication is counted by patching ``all_reduce`` (bytes per rank per step,
split into the global group and the pairs). Step time is the median over rounds
of 4 steps, ours and PyTorch's back to back in each round; the ratio is the
median of the per-round ratios. Goal: ours within 1.05x of PyTorch's.

    .venv/bin/python bench/bench_localsgd.py
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_default
import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as torch_post_local
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.utils as torch_utils

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks as our_default
from tensorplay.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as our_post_local
from tensorplay.distributed.algorithms.model_averaging import averagers as our_averagers
from tensorplay.distributed.algorithms.model_averaging import utils as our_utils
from tensorplay.distributed.optim.post_localSGD_optimizer import PostLocalSGDOptimizer
from tensorplay.testing.distributed import run_distributed

WORLD, PAIR, PERIOD = 4, 2, 4
WIDTH, DEPTH, BATCH = 512, 4, 32
ROUNDS, WARMUP_ROUNDS = 16, 2


def _torch_optim_module() -> Any:
    # PyTorch's optim package scripts its functional optimizers on import and warns; keep the table clean.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.optim as torch_optim
    return torch_optim


def _model() -> tp.nn.Module:
    tp.manual_seed(0)
    layers: list[tp.nn.Module] = []
    for _ in range(DEPTH):
        layers += [tp.nn.Linear(WIDTH, WIDTH), tp.nn.ReLU()]
    return tp.nn.Sequential(*layers)


class _Trainer:
    """One DDP model with its hook and optimizer; ``step()`` runs one training step."""

    def __init__(self, hook: Callable, state: Any, make_optimizer: Callable[[tp.nn.Module], Any]) -> None:
        self.ddp = tp.nn.parallel.DistributedDataParallel(_model())
        self.ddp.register_comm_hook(state, hook)
        self.optimizer = make_optimizer(self.ddp)
        gen = tp.Generator().manual_seed(dist.get_rank())
        self.batch = tp.randn(BATCH, WIDTH, generator=gen)

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.ddp(self.batch).square().mean().backward()
        self.optimizer.step()


class _AveragingOnly:
    """``step()`` averages the model's parameters over all ranks: the averager's share of a step."""

    def __init__(self, average: Callable[[Any, Any], None]) -> None:
        self.model = _model()
        self.average = average

    def step(self) -> None:
        self.average(self.model.parameters(), None)


def _trainers(pair: dist.ProcessGroup) -> dict[tuple[str, str], _Trainer | _AveragingOnly]:
    torch_optim = _torch_optim_module()

    def sgd(model: tp.nn.Module) -> tp.optim.SGD:
        return tp.optim.SGD(model.parameters(), lr=1e-3)

    def local_sgd(optimizer_cls: type, averager_cls: type) -> Callable[[tp.nn.Module], Any]:
        return lambda model: optimizer_cls(sgd(model), averager_cls(period=PERIOD, warmup_steps=0))

    return {
        ("DDP all-reduce every step", "ours"): _Trainer(our_default.allreduce_hook, None, sgd),
        ("DDP all-reduce every step", "PyTorch"): _Trainer(torch_default.allreduce_hook, None, sgd),
        (f"post-local SGD, period {PERIOD}", "ours"): _Trainer(
            our_post_local.post_localSGD_hook, our_post_local.PostLocalSGDState(None, pair, 0),
            local_sgd(PostLocalSGDOptimizer, our_averagers.PeriodicModelAverager)),
        (f"post-local SGD, period {PERIOD}", "PyTorch"): _Trainer(
            torch_post_local.post_localSGD_hook, torch_post_local.PostLocalSGDState(None, pair, 0),
            local_sgd(torch_optim.PostLocalSGDOptimizer, torch_averagers.PeriodicModelAverager)),
        ("average_parameters alone", "ours"): _AveragingOnly(our_utils.average_parameters),
        ("average_parameters alone", "PyTorch"): _AveragingOnly(torch_utils.average_parameters),
    }


class _AllReduceBytes:
    """Count the bytes each ``all_reduce`` call sends, by group, while active."""

    def __init__(self) -> None:
        self.by_group: dict[str, int] = {"global": 0, "pair": 0}

    def __enter__(self) -> _AllReduceBytes:
        self._original = torch_dist.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            size = dist.get_world_size(group) if group is not None else WORLD
            self.by_group["global" if size == WORLD else "pair"] += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, group=group, **kwargs)

        torch_dist.all_reduce = dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        torch_dist.all_reduce = dist.all_reduce = self._original


def _communication(trainer: _Trainer | _AveragingOnly) -> dict[str, float]:
    with _AllReduceBytes() as counter:
        for _ in range(PERIOD):
            trainer.step()
    return {group: count / PERIOD / 2**20 for group, count in counter.by_group.items()}


def _round_ms(trainer: _Trainer | _AveragingOnly) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(PERIOD):
        trainer.step()
    dist.barrier()
    return (time.perf_counter() - start) * 1e3 / PERIOD


def bench_rank() -> dict[tuple[str, str], dict[str, float]]:
    pair, _ = dist.new_subgroups(group_size=PAIR)
    trainers = _trainers(pair)
    results = {key: _communication(trainer) for key, trainer in trainers.items()}
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in trainers}
    for round_index in range(WARMUP_ROUNDS + ROUNDS):
        order = list(trainers.items()) if round_index % 2 == 0 else list(reversed(trainers.items()))
        for key, trainer in order:
            ms = _round_ms(trainer)
            if round_index >= WARMUP_ROUNDS:
                samples[key].append(ms)
    for (schedule, impl), values in samples.items():
        results[schedule, impl]["ms"] = statistics.median(values)
        # Ours and PyTorch's run back to back in each round: the per-round ratio cancels drift in the load.
        paired = [a / b for a, b in zip(values, samples[schedule, "PyTorch"], strict=True)]
        results[schedule, impl]["ratio"] = statistics.median(paired)
    return results


def main() -> None:
    results = run_distributed(bench_rank, world_size=WORLD, timeout=600)[0]
    params = sum(p.numel() for p in _model().parameters())
    print(f"{WORLD} Gloo ranks (pairs as subgroups), MLP {DEPTH}x{WIDTH} ({params / 1e6:.2f}M fp32 params, "
          f"{params * 4 / 2**20:.1f} MiB), batch {BATCH}, 1 thread per rank; communication per rank per step "
          f"(mean over {PERIOD} steps); step time = median over {ROUNDS} rounds of {PERIOD} steps\n")
    print("| schedule | impl | global all-reduce MiB/step | pair all-reduce MiB/step | step ms | ours / PyTorch "
          "(median per round) |")
    print("|---|---|---|---|---|---|")
    for (schedule, impl), r in results.items():
        ratio = f"{r['ratio']:.3f}x" if impl == "ours" else ""
        print(f"| {schedule} | {impl} | {r['global']:.2f} | {r['pair']:.2f} | {r['ms']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
