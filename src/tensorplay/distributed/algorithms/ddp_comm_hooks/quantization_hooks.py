"""8-bit quantised gradient averaging for DDP: quantize, all-gather, dequantize and average locally.

    ddp_model.register_comm_hook(process_group, quantization_pertensor_hook)
    ddp_model.register_comm_hook(process_group, quantization_perchannel_hook)

Each rank quantizes its bucket to ``uint8`` with affine parameters (scale,
zero point) from the bucket's own range, as a min/max observer computes them
(range widened to include 0, scale at least float32's epsilon), all-gathers the
quantized bucket and the parameters, then dequantizes every rank's bucket and
averages them. The per-channel hook cuts the bucket into channels of
``bucket_size`` elements, each with its own parameters, for a finer resolution
on large buckets. Experimental, as PyTorch's: all-gather moves more data than
an all-reduce for more than a few ranks.

Unlike PyTorch's hooks of the same names, these work on every backend: PyTorch's
read the all-gather results from the future's value in the layout NCCL gives it,
and fail with IndexError on Gloo. Here the results are read from the output
lists the all-gathers fill, and both all-gathers are issued by the hook itself
(a rank's own parameters are known before any communication). The arithmetic
is PyTorch's, so results are equal.

DDP compares hook annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real annotations.
"""

import operator

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives

from .default_hooks import _group_or_world

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]

_QUANT_MIN, _QUANT_MAX = 0, 255  # quint8


def _affine_qparams(min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for ``uint8`` covering ``[min(min_val, 0), max(max_val, 0)]``, elementwise."""
    min_neg = torch.minimum(min_val, torch.zeros_like(min_val))
    max_pos = torch.maximum(max_val, torch.zeros_like(max_val))
    scale = (max_pos - min_neg) / float(_QUANT_MAX - _QUANT_MIN)
    scale = torch.maximum(scale, torch.tensor(torch.finfo(torch.float32).eps, device=scale.device))
    zero_point = _QUANT_MIN - torch.round(min_neg / scale).to(torch.int)
    return scale, torch.clamp(zero_point, _QUANT_MIN, _QUANT_MAX)


def _quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    # Each step is computed in float32 and rounded to x's dtype: what PyTorch's per-element arithmetic with
    # 0-d float32 parameters does to a 16-bit bucket (exact no-ops for float32).
    steps = torch.round((x.to(torch.float32) / scale).to(x.dtype))
    shifted = (steps.to(torch.float32) + zero_point).to(x.dtype)
    return torch.clamp(shifted, _QUANT_MIN, _QUANT_MAX).to(torch.uint8)


def _dequantize(y: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return scale * (y.to(torch.float32) - zero_point)


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[list[torch.Tensor], torch.futures.Future]:
    """All-gather ``tensor``: the list it fills (rank order) and the future of the work."""
    return collectives.all_gather_future(tensor, group, where="quantization hook")


def _average_quantized(group: dist.ProcessGroup, qparams: torch.Tensor, quantized: torch.Tensor,
                       per_channel: bool) -> torch.futures.Future[torch.Tensor]:
    """Gather every rank's ``[scale, zero_point]`` rows and quantized tensor; resolve to their dequantized mean."""
    all_qparams, qparams_fut = _gather(qparams, group)
    all_quantized, quantized_fut = _gather(quantized, group)

    def dequantize_and_average(fut: torch.futures.Future) -> torch.Tensor:
        for done in fut.value():
            done.value()  # re-raise a failed all-gather
        total = torch.zeros_like(all_quantized[0], dtype=torch.float32)
        for rank_qparams, rank_quantized in zip(all_qparams, all_quantized, strict=True):
            scale, zero_point = _broadcastable(rank_qparams, per_channel)
            total += _dequantize(rank_quantized, scale, zero_point)
        return total

    return torch.futures.collect_all([qparams_fut, quantized_fut]).then(dequantize_and_average)


def _broadcastable(qparams: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if per_channel:  # (2, channels) -> one column per channel
        return qparams[0].unsqueeze(1), qparams[1].unsqueeze(1)
    return qparams[0], qparams[1]


def _check_group(process_group: object, hook: str) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{hook}: the hook state must be a ProcessGroup or None (the default group), got "
                        f"{type(process_group).__name__}; register with ddp_model.register_comm_hook(group, {hook})")


def quantization_pertensor_hook(process_group: dist.ProcessGroup | None,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket through ``uint8`` with one scale and zero point per rank (all-gather, not all-reduce).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.quantization_hooks import quantization_pertensor_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> model.register_comm_hook(None, quantization_pertensor_hook)   # uint8, one scale per tensor
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    _check_group(process_group, "quantization_pertensor_hook")
    group = _group_or_world(process_group)
    buffer = bucket.buffer()
    observed = buffer.detach().to(torch.float32)
    min_val, max_val = torch.aminmax(observed)
    scale, zero_point = _affine_qparams(min_val, max_val)
    qparams = torch.stack([scale, zero_point.to(torch.float32)])
    quantized = _quantize(buffer, qparams[0], qparams[1])

    def write_back(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        return buffer.copy_(fut.value() / group.size())

    return _average_quantized(group, qparams, quantized, per_channel=False).then(write_back)


def quantization_perchannel_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket,
                                 bucket_size: int = 512) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket through ``uint8`` with a scale and zero point per ``bucket_size`` elements and rank.

    For another ``bucket_size``, register a function that passes it (DDP logs a hook's ``__qualname__``,
    which a bare ``functools.partial`` lacks).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.quantization_hooks import (
        ...     quantization_perchannel_hook)
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> model.register_comm_hook(None, quantization_perchannel_hook)   # uint8, one scale per 512 values
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    _check_group(process_group, "quantization_perchannel_hook")
    size = _channel_size(bucket_size)
    group = _group_or_world(process_group)
    buffer = bucket.buffer()
    length = buffer.numel()
    channels = torch.nn.functional.pad(buffer, (0, -length % size)).view(-1, size)
    min_val, max_val = torch.aminmax(channels.detach().to(torch.float32), dim=1)
    scale, zero_point = _affine_qparams(min_val, max_val)
    qparams = torch.stack([scale, zero_point.to(torch.float32)])
    quantized = _quantize(channels, *_broadcastable(qparams, per_channel=True))

    def write_back(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        return buffer.copy_(fut.value().flatten()[:length] / group.size())

    return _average_quantized(group, qparams, quantized, per_channel=True).then(write_back)


def _channel_size(bucket_size: object) -> int:
    try:
        size = operator.index(bucket_size)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"quantization_perchannel_hook: bucket_size must be an int (elements per channel), "
                        f"got {type(bucket_size).__name__}") from None
    if size < 1:
        raise ValueError(f"quantization_perchannel_hook: bucket_size must be >= 1 (elements per channel), got {size}")
    return size
