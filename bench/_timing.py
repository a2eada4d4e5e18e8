"""Shared timing loop for the bench scripts: interleaved steps, median in milliseconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist


def interleaved_median_ms(steppers: dict[str, Callable[[], None]], *, warmup: int, iters: int,
                          rounds: int = 1) -> dict[str, float]:
    """Per stepper, the median step time in ms; with ``rounds > 1``, the lowest of the rounds' medians.

    Steps run round-robin (one of each in turn), so background load on a shared machine hits
    every stepper alike; the first ``warmup`` steps of each round are not counted.
    """
    best = {key: float("inf") for key in steppers}
    for _ in range(rounds):
        samples: dict[str, list[float]] = {key: [] for key in steppers}
        for i in range(warmup + iters):
            for key, step in steppers.items():
                start = time.perf_counter()
                step()
                if i >= warmup:
                    samples[key].append((time.perf_counter() - start) * 1e3)
        for key, values in samples.items():
            best[key] = min(best[key], statistics.median(values))
    return best


@contextmanager
def rank_step_timer(samples_ms: list[float] | None, barrier: Callable[[], None] | None = None) -> Iterator[None]:
    """Time the block in ms once every rank has reached ``barrier``; append to ``samples_ms`` unless it is None.

    Pass ``None`` for warm-up steps. ``barrier`` defaults to ``torch.distributed.barrier`` (all ranks start together,
    so one rank's slow step is not hidden in another's wait).
    """
    (barrier or dist.barrier)()
    start = time.perf_counter()
    yield
    if samples_ms is not None:
        samples_ms.append((time.perf_counter() - start) * 1e3)
