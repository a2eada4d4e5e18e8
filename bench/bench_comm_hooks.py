"""DDP comm hooks: step time of ours vs PyTorch's PowerSGD, and of the quantization hooks, vs plain all-reduce.

2 Gloo ranks, a ~1M-parameter MLP (4 Linear 512x512), SGD. Each stepper is its own DDP model stepping
forward + backward + ``SGD.step()``; steppers run round-robin on both ranks (bench/_timing.py) and the
table shows rank 0's median step in ms and the ratio to PyTorch's PowerSGD (same rank) or to plain DDP.
PyTorch's ``powerSGD_hook`` is waited for inside the hook: unwaited, its callback-issued all-reduces
race the next bucket's on Gloo and abort the process (see tests/parity/test_powerSGD_hook.py).
PyTorch's quantization hooks fail on Gloo, so only ours are timed.

    .venv/bin/python bench/bench_comm_hooks.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as torch_powersgd

import tensorplay as tp
import tensorplay.distributed as dist
from _timing import interleaved_median_ms  # bench/ is on sys.path when run as a script
from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as our_powersgd
from tensorplay.distributed.algorithms.ddp_comm_hooks import quantization_hooks as our_quant
from tensorplay.testing.distributed import run_distributed

WIDTH, DEPTH, BATCH = 512, 4, 32
WARMUP, ITERS, ROUNDS = 3, 12, 2


def _torch_powersgd_waited(state, bucket):  # noqa: ANN001, ANN202
    fut = torch_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def ddp_stepper(hook: Any, state: Any, depth: int = DEPTH, bucket_cap_mb: float = 25.0) -> Callable[[], None]:
    """One DDP model (``depth`` x Linear(WIDTH) + ReLU) with ``hook``: a step is zero_grad, forward, backward, SGD."""
    tp.manual_seed(0)
    layers: list[tp.nn.Module] = []
    for _ in range(depth):
        layers += [tp.nn.Linear(WIDTH, WIDTH), tp.nn.ReLU()]
    model = tp.nn.Sequential(*layers)
    ddp = tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = tp.optim.SGD(model.parameters(), lr=1e-3)
    x = tp.randn(BATCH, WIDTH, generator=tp.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()

    return step


def bench_rank() -> dict[str, Any]:
    torch.set_num_threads(1)
    states = {name: module.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
              for name, module, rank in [("ours_r1", our_powersgd, 1), ("torch_r1", torch_powersgd, 1),
                                         ("ours_r4", our_powersgd, 4), ("torch_r4", torch_powersgd, 4)]}
    steppers = {
        "DDP all-reduce": ddp_stepper(None, None),
        "PowerSGD rank 1, ours": ddp_stepper(our_powersgd.powerSGD_hook, states["ours_r1"]),
        "PowerSGD rank 1, PyTorch's": ddp_stepper(_torch_powersgd_waited, states["torch_r1"]),
        "PowerSGD rank 4, ours": ddp_stepper(our_powersgd.powerSGD_hook, states["ours_r4"]),
        "PowerSGD rank 4, PyTorch's": ddp_stepper(_torch_powersgd_waited, states["torch_r4"]),
        "quantize per tensor, ours": ddp_stepper(our_quant.quantization_pertensor_hook, None),
        "quantize per channel, ours": ddp_stepper(our_quant.quantization_perchannel_hook, None),
    }
    times = interleaved_median_ms(steppers, warmup=WARMUP, iters=ITERS, rounds=ROUNDS)
    rates = {name: state.compression_stats()[0] for name, state in states.items()}
    return {"times": times, "rates": rates}


def main() -> None:
    result = run_distributed(bench_rank, world_size=2, timeout=900)[0]
    times, rates = result["times"], result["rates"]
    plain = times["DDP all-reduce"]
    print(f"{'setting':32s} {'ms/step':>9s} {'vs DDP':>8s} {'vs PyTorch':>11s}")
    for name, ms in times.items():
        twin = name.replace("ours", "PyTorch's") if name.endswith("ours") else None
        vs_torch = f"{ms / times[twin]:.2f}x" if twin in times else ""
        print(f"{name:32s} {ms:9.1f} {ms / plain:7.2f}x {vs_torch:>11s}")
    print("compression rate: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))


if __name__ == "__main__":
    main()
