"""The order in which Gloo's ring all-reduce adds the ranks' values, so a sum elsewhere can be bitwise Gloo's.

[Note: Gloo's summation order]
Gloo's all-reduce on CPU (the ring algorithm, ``gloo/allreduce.cc``) splits the
buffer into equal segments: as many as 1 MiB pieces need, at least two per
rank, the count rounded up to a multiple of the world size, each rounded up to
whole elements. Rank ``c`` gets a run of them, chunk ``c``, whose partial sum
starts at rank ``c - 1`` and travels down the ring:
``((x[c-1] + x[c-2]) + ...) + x[c]`` (ranks modulo the world size).
Floating-point addition is not associative, so from three ranks on the order
shows in the last bits; at two ranks either order gives the same sum.
``test_host_memory_collectives.py`` checks these orders against Gloo itself.
"""

from __future__ import annotations

__all__ = ["ring_sum_orders"]

_MAX_SEGMENT_BYTES = 1024 * 1024  # Gloo's AllreduceOptions::kMaxSegmentSize


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _chunk_elements(numel: int, element_size: int, world: int) -> int:
    """Elements in one rank's chunk of Gloo's ring for a buffer of ``numel`` elements."""
    total = numel * element_size
    max_segment = element_size * max(1, _MAX_SEGMENT_BYTES // element_size)
    segments = _round_up(max(-(-total // max_segment), 2 * world), world)
    segment = _round_up(-(-total // segments), element_size)
    return segments // world * segment // element_size


def ring_sum_orders(numel: int, element_size: int, world: int, start: int, stop: int
                    ) -> list[tuple[int, int, list[int]]]:
    """``(begin, end, ranks)`` runs covering elements ``[start, stop)`` of a ``numel``-element all-reduce.

    Gloo sums every element of a run by adding the ranks' values in the order ``ranks``, left to right.
    """
    chunk = _chunk_elements(numel, element_size, world)
    runs = []
    begin = start
    while begin < stop:
        owner = begin // chunk
        end = min(stop, (owner + 1) * chunk)
        runs.append((begin, end, [(owner - 1 - k) % world for k in range(world)]))
        begin = end
    return runs
