"""Shared timing loop for the bench scripts: interleaved steps, median in milliseconds; peak-RSS runs' heap.

[Note: peak RSS with a fixed mmap threshold]
glibc raises its mmap threshold (up to 32 MiB) each time a large block that was
mapped is freed; from then on large tensors come from the heap, whose freed
pages stay resident. When that happens depends on timing, so the peak RSS of
the same code moved by up to ~50 MiB between fresh runs (ZeRO, 2 ranks: 637 and
713 MiB): ``--mem-runs`` takes the median of several. With ``--fixed-heap``
the peak-RSS runs start their fresh processes with the threshold fixed at its
default start (``MALLOC_MMAP_THRESHOLD_=131072``): every block of 128 KiB or
more is its own mapping, returned when freed, and the peak is what each
implementation holds live (the same ZeRO rows: within 1 MiB run to run). The
default stays the allocator users run with; both implementations are measured
alike either way.
"""

from __future__ import annotations

import argparse
import os
import resource
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


FIXED_MMAP_THRESHOLD = "131072"


def add_heap_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fixed-heap", action="store_true",
                        help="peak RSS with glibc's mmap threshold fixed: live memory, not heap reuse (see _timing.py)")


@contextmanager
def fixed_heap(enabled: bool = True) -> Iterator[None]:
    """Processes started inside keep glibc's mmap threshold fixed (see [Note: peak RSS with a fixed mmap threshold])."""
    if not enabled:
        yield
        return
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = FIXED_MMAP_THRESHOLD
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def peak_memory_mib() -> dict[str, float]:
    """This process's peak RSS, and its share of the host's memory at that peak (MiB).

    Shared-memory collectives map slot files that every rank of a group maps: each rank's RSS counts every
    page of them it touched, though the host holds each page once. The share counts a slot file's touched
    pages divided among the ranks that map it (as PSS does); touched pages are spread over the files by
    their size. Without shared memory (PyTorch's Gloo) the two are equal.
    """
    from tensorplay.distributed._comm.host_memory import mapped_slots

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/status") as status:
        shared = next((int(line.split()[1]) / 1024 for line in status if line.startswith("RssShmem:")), 0.0)
    slots = mapped_slots()
    mapped = sum(nbytes for nbytes, _ in slots)
    excess = sum(shared * nbytes / mapped * (1 - 1 / ranks) for nbytes, ranks in slots) if mapped else 0.0
    return {"peak": peak, "share": peak - excess}
