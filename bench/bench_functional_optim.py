"""Functional optimizers: step time on a ~10M-parameter model.

Ours (``tensorplay.distributed.optim._Functional*.step(grads)``) against the
class optimizer (``tp.optim.X.step()``, gradients in ``.grad``) and PyTorch's
functional optimizer (``torch.distributed.optim._Functional*``), same options
and path. Timings are interleaved round-robin (one step of each in turn) and
the median is printed, in milliseconds; goal: ours within 1.1x of the class.

    .venv/bin/python bench/bench_functional_optim.py
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed.optim as torch_dist_optim

import tensorplay as tp
from _timing import interleaved_median_ms  # bench/ is on sys.path when run as a script
from tensorplay.distributed.optim.utils import functional_optim_from

WARMUP, ITERS = 3, 15
SHAPES = [(1024, 1024)] * 9 + [(1024,)] * 9 + [(1024, 1000)]  # ~10.5M parameters in 19 tensors
CASES: list[tuple[str, dict]] = [
    ("Adam", {"lr": 1e-3, "foreach": True}),
    ("AdamW", {"lr": 1e-3, "foreach": True, "amsgrad": True}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "foreach": True}),
    ("RMSprop", {"lr": 1e-2, "centered": True, "foreach": True}),
    ("Adam", {"lr": 1e-3, "foreach": False}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "foreach": False}),
]


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 1e-2 for shape in SHAPES]


def _steppers(name: str, kwargs: dict) -> dict[str, Callable[[], None]]:
    grads = _tensors(1)
    class_params = [p.requires_grad_() for p in _tensors(0)]
    for p, g in zip(class_params, grads, strict=True):
        p.grad = g
    class_optim = getattr(tp.optim, name)(class_params, **kwargs)
    ours = functional_optim_from(getattr(tp.optim, name), _tensors(0), **kwargs)
    # PyTorch's constructor forces its TorchScript deprecation warning through any filter; mute its output.
    show, warnings.showwarning = warnings.showwarning, lambda *args, **kwargs: None
    try:
        theirs = getattr(torch_dist_optim, f"_Functional{name}")(_tensors(0), **kwargs)
    finally:
        warnings.showwarning = show
    return {"class": class_optim.step, "ours": lambda: ours.step(grads), "pytorch": lambda: theirs.step(grads)}


def main() -> None:
    torch.set_num_threads(1)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    print(f"{numel / 1e6:.1f}M parameters in {len(SHAPES)} tensors, fp32, CPU, 1 thread; "
          f"median of {ITERS} steps (ms)\n")
    print("| optimizer | options | class | ours | PyTorch functional | ours / class | ours / PyTorch |")
    print("|---|---|---|---|---|---|---|")
    for name, kwargs in CASES:
        ms = interleaved_median_ms(_steppers(name, kwargs), warmup=WARMUP, iters=ITERS)
        options = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "lr")
        print(f"| {name} | {options} | {ms['class']:.1f} | {ms['ours']:.1f} | {ms['pytorch']:.1f} | "
              f"{ms['ours'] / ms['class']:.2f}x | {ms['ours'] / ms['pytorch']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
