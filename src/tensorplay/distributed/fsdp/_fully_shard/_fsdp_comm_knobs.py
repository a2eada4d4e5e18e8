"""The communication knobs a fully_shard module gains (PyTorch's ``FSDPModule.set_*`` names and signatures)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._comm.watch import group_timeout_s

from ._fsdp_api import AllGather, ReduceScatter

if TYPE_CHECKING:
    from ._fsdp_param_group import FSDPParamGroup


class CommKnobs:
    """Mixed into :class:`FSDPModule`: how this module's group all-gathers and reduce-scatters."""

    def _fsdp_groups(self, recurse: bool) -> list[FSDPParamGroup]:
        raise NotImplementedError  # FSDPModule's

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """All-gather this module's group with ``comm`` (it allocates the output and runs the collective)."""
        _check_comm(comm, AllGather, "set_custom_all_gather")
        for group in self._fsdp_groups(recurse=False):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Reduce-scatter this module's gradients with ``comm``, called with ``op=ReduceOp.SUM`` (ours divides by
        the data-parallel size afterwards, on every backend)."""
        _check_comm(comm, ReduceScatter, "set_custom_reduce_scatter")
        for group in self._fsdp_groups(recurse=False):
            group.reduce_scatter_comm = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: torch.cuda.Stream | None = None) -> None:
        """Call ``hook(reduce_output)`` on this module's reduced sharded gradient (1D, reduce dtype), in place.

        ``reduce_output`` is the reduce-scatter's output (FSDP) or the
        all-reduce's (HSDP), summed over the ranks; the division by the
        data-parallel size follows the hook. ``stream``: where the hook runs on
        a GPU (not allowed with HSDP, as in PyTorch); ours runs it on the
        reduce-scatter's stream, and on the CPU there are no streams.
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable as hook(reduce_output: Tensor) -> None, "
                            f"got {type(hook).__name__}")
        for group in self._fsdp_groups(recurse=False):
            if stream is not None and group.mesh_info.replicate_group is not None:
                raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP (a 2D mesh); "
                                 "the hook runs after the HSDP all-reduce")
            group.all_reduce_hook = hook

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this module's parameters (False when backward does not need them,
        e.g. an embedding whose weight gradient needs only the indices)."""
        _check_bool(unshard_in_backward, "set_unshard_in_backward", "unshard_in_backward")
        for group in self._fsdp_groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Give every parameter a gradient, zeros where no rank used it (PyTorch: for ranks that used different
        parameters). Ours already agrees across ranks on which parameters any rank used (see
        [Note: used-parameter counts]); this makes the unused ones get zeros instead of None."""
        _check_bool(reduce_scatter_unused_params, "set_reduce_scatter_unused_params", "reduce_scatter_unused_params")
        for group in self._fsdp_groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters (with their input buffers) may stay in flight: more overlap, more memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be a positive int, got "
                             f"{max_input_buffers}")
        for group in self._fsdp_groups(recurse):
            group.max_input_buffers = max_input_buffers

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for compatibility; stores nothing: ours reduces with ``ReduceOp.SUM`` only, always.

        PyTorch switches its reduce-scatter from ``AVG`` / ``PREMUL_SUM`` to a sum
        with a separate scaling (NCCL's zero-copy transfers need sums). Ours always
        sums and then divides once by the data-parallel size, on every backend, so
        there is nothing to switch; results are the same either way.
        """
        _check_bool(enable, "set_force_sum_reduction_for_comms", "enable")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run the gradient reduce-scatter on a group of its own over the shard ranks (``False``: the shard group).

        The all-gathers of the next groups and the reduce-scatters of the previous
        ones then travel on separate connections (Gloo) or communicators (NCCL)
        instead of queueing behind each other on one. The group is created here,
        one per set of shard ranks and reused, so call it on every rank in the same
        order, as any process-group creation; it gets the shard group's timeout.
        The gradients are bitwise the same.
        """
        _check_bool(enable, "set_separate_reduce_scatter_group", "enable")
        made: dict[tuple[int, ...], ProcessGroup] = {}
        for group in self._fsdp_groups(recurse):
            group.reduce_scatter_group = _own_group(group, made) if enable else None

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility; stores nothing: our transport allocates its staging buffers itself.

        PyTorch then allocates its staging buffers from the process group's
        allocator (NCCL zero-copy over SHARP). Ours gathers and scatters through
        its own buffers (the shared-memory slots or a reused scratch pool; the
        device allocator on accelerators), which no process-group allocator backs.
        """
        _check_bool(enable, "set_allocate_memory_from_process_group_for_comm", "enable")

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Accepted for compatibility (``backend`` is checked); stores nothing: ours has no symmetric-memory path.

        PyTorch then allocates its all-gather buffers in NCCL symmetric memory
        (copy-engine / symmetric-kernel all-gathers on GPUs); our transport uses
        its own buffers and the native collectives.
        """
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: backend must be 'NCCL' (the only symmetric memory backend), "
                             f"got {backend!r}")


def _own_group(group: FSDPParamGroup, made: dict[tuple[int, ...], ProcessGroup]) -> ProcessGroup:
    """A process group over ``group``'s shard ranks, other than the shard group (one per rank set and call)."""
    shard_group = group.mesh_info.shard_group
    ranks = tuple(dist.get_process_group_ranks(shard_group))
    if ranks not in made:  # already separate: kept (idempotent), else a new group with the shard group's timeout
        timeout = timedelta(seconds=group_timeout_s(shard_group))
        made[ranks] = group.reduce_scatter_group or dist.new_group(list(ranks), timeout=timeout,
                                                                   use_local_synchronization=True)
    return made[ranks]


def _check_bool(value: Any, method: str, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} must be a bool, got {value!r}")


def _check_comm(comm: Any, kind: type, method: str) -> None:
    if not isinstance(comm, kind):
        raise TypeError(f"{method}: comm must be an instance of a subclass of {kind.__name__} (implementing "
                        f"allocate() and __call__()), got {type(comm).__name__}")
