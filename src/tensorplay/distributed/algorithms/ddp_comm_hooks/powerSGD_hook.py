"""PowerSGD gradient compression for DDP (Vogels et al., 2019, https://arxiv.org/abs/1905.13727).

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    ddp_model.register_comm_hook(state, powerSGD_hook)

For its first ``start_powerSGD_iter`` iterations a hook averages the bucket
as plain DDP does. Afterwards each gradient ``M`` (viewed as ``n x m``) worth
compressing is replaced by a rank-``r`` approximation ``P Q^T`` agreed on by all
ranks: ``P = M Q`` is summed over the group and orthonormalised, ``Q = M^T P``
is averaged, and the ranks communicate ``(n + m) r`` numbers instead of ``n m``.
Vectors (biases) and matrices too small to gain are averaged uncompressed in
one flat all-reduce. With error feedback, what compression lost on this rank is
added to its next gradient; with warm start, last iteration's ``Q`` seeds this
one's.

Differences from PyTorch's hooks of the same names, none of which changes a
result PyTorch computes:

* ``batched_powerSGD_hook`` works: PyTorch's hands a 2-D matrix to its
  batch-only orthogonalisation and raises ``AssertionError`` on every device.
  Here the matrix is a batch of one; the rank is capped at the matrix side
  (PyTorch asserts there too), and the state's ``orthogonalization_epsilon`` is
  applied (PyTorch's batched hook ignores it; equal at its default, 0).
* A gradient column of zeros is orthogonalised to zeros, not to NaN.
* Every collective of a bucket is issued by the hook itself, in the same order
  on every rank. PyTorch issues the second and third all-reduces from future
  callbacks, whose order against the next bucket's collectives can differ
  between ranks on a backend that matches collectives by issue order (Gloo).
  The ``P`` all-reduce is therefore waited for inside the hook (on an
  accelerator that wait only orders streams).
* 0-d gradients are averaged uncompressed (PyTorch's hook fails on them), and
  ``random_seed`` seeds a private generator instead of forking the global RNG
  (the values drawn are the same).

DDP compares hook annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real annotations.
"""

import logging
import math
import numbers
import operator
from typing import Any

import numpy as np
import torch

import tensorplay.distributed as dist
from tensorplay.distributed._checks.validation import check_bool
from tensorplay.distributed._comm import collectives

from ._low_rank import orthogonalize_, random_factors_
from ._powerSGD_layout import plan_layout
from .default_hooks import _allreduce_fut, _group_or_world

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)

_SEED_BOUND = 1_000_000_000  # each fresh draw of factors seeds torch from rng.randint(_SEED_BOUND)


class PowerSGDState:
    """Hyperparameters and per-bucket memory (errors, factors, statistics) of the PowerSGD hooks.

    Tune ``matrix_approximation_rank`` (start at 1, double until accurate
    enough), ``start_powerSGD_iter`` (about 10% of training; no less than the
    warm-up) and ``min_compression_rate`` (compress a matrix only when
    ``n m > (n + m) r * min_compression_rate``). Keep ``use_error_feedback`` and
    ``warm_start`` on. ``orthogonalization_epsilon`` (e.g. 1e-8) is added to
    column norms; ``batch_tensors_with_same_shape`` compresses equal-shaped
    gradients of a bucket in one batched product. Statistics are logged every
    ``compression_stats_logging_frequency`` iterations; read them with
    :meth:`compression_stats`.

    With error feedback or warm start, ``start_powerSGD_iter`` must be at least
    2: DDP rebuilds its buckets after iteration 1, which would invalidate the
    memory kept per bucket.

    Pickling drops ``process_group``; unpickling sets it to the default group.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, powerSGD_hook)    # rank-1 factors instead of whole gradients after step 10
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """

    # PyTorch's order: pickled states list the slots in it.
    __slots__ = [
        "process_group",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "orthogonalization_epsilon",
        "use_error_feedback",
        "warm_start",
        "batch_tensors_with_same_shape",
        "rng",
        "error_dict",
        "p_memory_dict",
        "q_memory_dict",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "compression_stats_logging_frequency",
        "next_stats_report",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"PowerSGDState: process_group must be a ProcessGroup or None (the default group), "
                            f"got {process_group!r} ({type(process_group).__name__})")
        for name, flag in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start),
                           ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
            check_bool(flag, name, "PowerSGDState")
        rank = _count("matrix_approximation_rank", matrix_approximation_rank, minimum=1)
        start = _count("start_powerSGD_iter", start_powerSGD_iter, minimum=0)
        if (use_error_feedback or warm_start) and start <= 1:
            raise ValueError(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                f"because PowerSGD can only be applied after the first two iterations in DDP; got "
                f"start_powerSGD_iter={start}. Pass start_powerSGD_iter >= 2, or turn both off.")
        self.process_group = process_group
        self.matrix_approximation_rank = rank
        self.start_powerSGD_iter = start
        self.min_compression_rate = _non_negative("min_compression_rate", min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = _non_negative("orthogonalization_epsilon", orthogonalization_epsilon)
        self.rng = np.random.RandomState(_count("random_seed", random_seed, minimum=0))
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        frequency = _count("compression_stats_logging_frequency", compression_stats_logging_frequency)
        self.compression_stats_logging_frequency = max(1, frequency)
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        logger.info(
            "PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; min_compression_rate = %s; "
            "orthogonalization_epsilon = %s; use_error_feedback = %s; warm_start = %s; random_seed = %s; "
            "compression_stats_logging_frequency = %s; batch_tensors_with_same_shape = %s",
            rank, start, min_compression_rate, orthogonalization_epsilon, use_error_feedback, warm_start,
            random_seed, compression_stats_logging_frequency, batch_tensors_with_same_shape)

    def __getstate__(self) -> dict[str, Any]:
        """Every slot but ``process_group``, which cannot be pickled."""
        logger.warning("PowerSGDState: the process group is not pickled; unpickling sets the default group")
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the slots; ``process_group`` becomes the default group (``None`` when none exists yet)."""
        self.process_group = dist.group.WORLD if dist.is_initialized() else None
        logger.warning("PowerSGDState: process_group set to the default group; assign state.process_group "
                       "if another group is wanted")
        for slot, value in state.items():
            setattr(self, slot, value)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count an iteration when its last bucket is reduced."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numel before, numel after)`` summed over every compressed iteration; rate 0 before any."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after


def _count(name: str, value: Any, minimum: int = 0) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"PowerSGDState: {name} must be an int, got {value!r} ({type(value).__name__})") from None
    if number < minimum:
        raise ValueError(f"PowerSGDState: {name} must be >= {minimum}, got {number}")
    return number


def _non_negative(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"PowerSGDState: {name} must be a real number, got {value!r} ({type(value).__name__})")
    if not float(value) >= 0:  # also refuses NaN
        raise ValueError(f"PowerSGDState: {name} must be >= 0, got {value}")
    return value


def _check_state(state: Any, hook: str) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"{hook}: the hook state must be a PowerSGDState, got {type(state).__name__}; register "
                        f"with ddp_model.register_comm_hook(PowerSGDState(process_group=...), {hook})")


def _report_compression_stats(bucket: dist.GradBucket, state: PowerSGDState) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info("Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
                    state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _add_error_feedback(state: PowerSGDState, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
    """Add this rank's remembered error to ``tensor``; return a copy of the result (``None`` without feedback)."""
    if not state.use_error_feedback:
        return None
    error = state.error_dict.get(index)
    if error is not None and error.shape == tensor.shape:
        tensor.add_(error)
    else:
        if error is not None:
            logger.warning("PowerSGD: bucket %s changed size (%s -> %s elements); its error feedback restarts "
                           "from zero", index, error.numel(), tensor.numel())
        state.error_dict[index] = torch.zeros_like(tensor)
    return tensor.detach().clone()


def _factor_memory(state: PowerSGDState, index: int, p_numel: int, q_numel: int,
                   like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """The bucket's flat P and Q memory, and the seed to draw a fresh Q from (``None``: warm-start from the last Q)."""
    p_memory, q_memory = state.p_memory_dict.get(index), state.q_memory_dict.get(index)
    if (state.warm_start and p_memory is not None and q_memory is not None
            and p_memory.numel() == p_numel and q_memory.numel() == q_numel):
        return p_memory, q_memory, None
    if state.warm_start:
        logger.info("Allocating contiguous memory of length %s for Ps, and of length %s for Qs, respectively.",
                    p_numel, q_numel)
    p_memory = like.new_empty(p_numel)
    q_memory = like.new_empty(q_numel)
    state.p_memory_dict[index], state.q_memory_dict[index] = p_memory, q_memory
    return p_memory, q_memory, int(state.rng.randint(_SEED_BOUND))


def _all_reduce_now(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    if tensor.numel() > 0:
        collectives.watched_all_reduce_future(tensor, group, where="PowerSGD").wait()


def _all_reduce_future(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
    if tensor.numel() == 0:  # every rank has the same layout, so every rank skips it
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([tensor])
        return done
    return collectives.watched_all_reduce_future(tensor, group, where="PowerSGD")


def _finish_iteration(state: PowerSGDState, bucket: dist.GradBucket, index: int,
                      local: torch.Tensor | None, approximated: torch.Tensor) -> None:
    if local is not None:
        state.error_dict[index] = local - approximated
    if not state.warm_start:
        # Only this bucket's memory: another bucket's hook may be using its own right now.
        state.p_memory_dict.pop(index, None)
        state.q_memory_dict.pop(index, None)
    state.maybe_increase_iter(bucket)


def _begin(state: PowerSGDState, bucket: dist.GradBucket, hook: str
           ) -> tuple[dist.ProcessGroup, torch.Tensor, torch.futures.Future[torch.Tensor] | None]:
    """The group and bucket buffer of one hook call, and the plain all-reduce when still warming up."""
    _check_state(state, hook)
    group = _group_or_world(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return group, buffer, _allreduce_fut(group, buffer)
    return group, buffer, None


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients with PowerSGD: each large matrix as a rank-``r`` product, the rest exactly.

    Plain averaging for the first ``state.start_powerSGD_iter`` iterations.
    Register with ``ddp_model.register_comm_hook(PowerSGDState(...), powerSGD_hook)``.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, powerSGD_hook)    # rank-1 factors instead of whole gradients after step 10
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    group, buffer, warm_up = _begin(state, bucket, "powerSGD_hook")
    if warm_up is not None:
        return warm_up

    index = bucket.index()
    local = _add_error_feedback(state, index, buffer)
    layout = plan_layout(bucket.gradients(), state.matrix_approximation_rank, state.min_compression_rate,
                         state.batch_tensors_with_same_shape)
    state.total_numel_before_compression += layout.numel_before
    state.total_numel_after_compression += layout.numel_after
    _report_compression_stats(bucket, state)

    p_memory, q_memory, seed = _factor_memory(state, index, layout.p_numel, layout.q_numel, buffer)
    ps, qs = layout.factor_views(p_memory, q_memory)
    if seed is not None:
        random_factors_(qs, seed)
    for q in qs:  # fresh, or last iteration's average (warm start)
        orthogonalize_(q, state.orthogonalization_epsilon)
    for matrices, q, p in zip(layout.batches, qs, ps, strict=True):
        torch.bmm(matrices, q, out=p)

    uncompressed = layout.flat_uncompressed(buffer)
    uncompressed_fut = _all_reduce_future(uncompressed, group)
    _all_reduce_now(p_memory, group)  # summed, not averaged: orthonormalisation removes the scale
    for p in ps:
        orthogonalize_(p, state.orthogonalization_epsilon)
    for matrices, p, q in zip(layout.batches, ps, qs, strict=True):
        torch.bmm(matrices.transpose(1, 2), p, out=q)
    q_fut = _all_reduce_future(q_memory, group)
    world_size = group.size()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        for done in fut.value():
            done.value()  # re-raise a failed all-reduce
        layout.unpack_uncompressed(uncompressed.div_(world_size))
        q_memory.div_(world_size)
        for p, q, matrices in zip(ps, qs, layout.batches, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=matrices)
        layout.copy_back_batches()
        _finish_iteration(state, bucket, index, local, buffer)
        return buffer

    return torch.futures.collect_all([uncompressed_fut, q_fut]).then(decompress)


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the whole bucket, zero-padded to a square matrix, as one rank-``r`` PowerSGD product.

    Faster than :func:`powerSGD_hook` but usually much less accurate unless
    ``matrix_approximation_rank`` is 1 (a flat bucket has no low-rank
    structure to keep). Plain averaging for the first ``start_powerSGD_iter``
    iterations.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.nn.parallel import DistributedDataParallel as DDP
        >>> from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        ...     PowerSGDState, batched_powerSGD_hook)
        >>> model = DDP(tp.nn.Linear(16, 4))
        >>> state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        >>> model.register_comm_hook(state, batched_powerSGD_hook)   # each bucket compressed as one square matrix
        >>> model(tp.randn(8, 16)).sum().backward()     # the hook reduces each gradient bucket
    """
    group, buffer, warm_up = _begin(state, bucket, "batched_powerSGD_hook")
    if warm_up is not None:
        return warm_up

    total = buffer.numel()
    side = math.ceil(math.sqrt(total))
    rank = min(state.matrix_approximation_rank, side)
    state.total_numel_before_compression += total
    state.total_numel_after_compression += side * rank * 2
    _report_compression_stats(bucket, state)

    padded = buffer.new_zeros(side * side)
    padded[:total].copy_(buffer)
    index = bucket.index()
    local = _add_error_feedback(state, index, padded)
    matrix = padded.view(side, side)

    p_flat, q_flat, seed = _factor_memory(state, index, side * rank, side * rank, buffer)
    p, q = p_flat.view(1, side, rank), q_flat.view(1, side, rank)
    if seed is not None:
        random_factors_([q_flat.view(side, rank)], seed)
    orthogonalize_(q, state.orthogonalization_epsilon)
    torch.matmul(matrix, q[0], out=p[0])
    _all_reduce_now(p_flat, group)
    orthogonalize_(p, state.orthogonalization_epsilon)
    torch.matmul(matrix.t(), p[0], out=q[0])
    world_size = group.size()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raise a failed all-reduce
        q_flat.div_(world_size)
        torch.matmul(p[0], q[0].t(), out=matrix)
        _finish_iteration(state, bucket, index, local, padded)
        return buffer.copy_(padded[:total])

    return _all_reduce_future(q_flat, group).then(decompress)
