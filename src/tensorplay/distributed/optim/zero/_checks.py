"""Argument checks for ZeroRedundancyOptimizer, and how ranks agree that one of them failed.

[Note: errors must not strand peers]
A rank that raises while the others enter a broadcast leaves them blocked until
the process-group timeout. So every check that can fail on one rank only runs
before the next collective, and its outcome is shared with one agreement
(:func:`agree_on_error`, see [Note: agreement] in ``_comm/agreement.py``): the
failing rank raises its own error, every other rank raises an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

import tensorplay.distributed as dist
from tensorplay.distributed._comm.agreement import PendingAgreement, start_agreement


def check_optimizer_class(optimizer_class: Any, functional_map: dict[Any, type], overlap_with_ddp: bool) -> None:
    """``optimizer_class`` must be an Optimizer subclass; with ``overlap_with_ddp`` one that has a
    functional form (``functional_map``: class -> functional class), or a functional class itself."""
    functional = set(functional_map.values())
    if overlap_with_ddp and optimizer_class in functional:
        return
    if optimizer_class in functional:
        raise ValueError(
            f"optimizer_class={optimizer_class.__name__} is a functional optimizer, which is only used with "
            f"overlap_with_ddp=True; pass the ordinary optimizer class (e.g. tp.optim.Adam) instead")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"optimizer_class must be a subclass of torch.optim.Optimizer (e.g. tp.optim.Adam), "
            f"got {optimizer_class!r}; pass the class itself, not an instance or a factory")
    if overlap_with_ddp and optimizer_class not in functional_map:
        supported = sorted(k.__name__ for k in functional_map if isinstance(k, type))
        raise ValueError(f"overlap_with_ddp=True steps a functional optimizer inside the DDP hook, and "
                         f"{optimizer_class.__name__} has none; use one of {supported}")


def listed_params(params: Any) -> list[Any]:
    """``params`` as a list of tensors or of param-group dicts, checked for shape."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of Tensors or of param-group dicts, got a single Tensor; "
                        "pass model.parameters() or [tensor]")
    try:
        listed = list(params)
    except TypeError as error:
        raise TypeError(f"params must be an iterable of Tensors or dicts, got {torch.typename(params)}") from error
    if not listed:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    all_tensors = all(isinstance(item, torch.Tensor) for item in listed)
    all_dicts = all(isinstance(item, dict) for item in listed)
    if not (all_tensors or all_dicts):
        raise TypeError("params must be all Tensors or all param-group dicts, not a mix")
    for index, group in enumerate(listed if all_dicts else []):
        if "params" not in group:
            raise ValueError(f"param group {index} has no 'params' key; each group dict needs one")
    return listed


def group_params(group: dict[str, Any]) -> list[torch.Tensor]:
    params = group["params"]
    return [params] if isinstance(params, torch.Tensor) else list(params)


def check_unique(groups: list[list[torch.Tensor]], first_group_index: int = 0,
                 existing: list[list[torch.Tensor]] | None = None) -> None:
    """No tensor may appear twice, within a group or across groups (``existing`` are groups already held)."""
    seen: dict[int, tuple[int, int]] = {}
    for g, params in enumerate(existing or []):
        for i, param in enumerate(params):
            seen[id(param)] = (g, i)
    for g, params in enumerate(groups, start=first_group_index):
        for i, param in enumerate(params):
            if id(param) in seen:
                g0, i0 = seen[id(param)]
                raise ValueError(
                    f"a parameter appears twice: param {i0} of group {g0} is also param {i} of group {g} "
                    f"(shape {tuple(param.shape)}); list each parameter in exactly one group")
            seen[id(param)] = (g, i)


def check_dense(groups: list[list[torch.Tensor]], first_group_index: int = 0) -> None:
    """Every parameter must be a dense (strided) tensor: buckets and broadcasts need flat storage."""
    for g, params in enumerate(groups, start=first_group_index):
        for i, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"param {i} of group {g} is a {torch.typename(param)}, not a Tensor")
            if param.layout != torch.strided:
                raise ValueError(
                    f"ZeroRedundancyOptimizer needs dense (strided) parameters, but param {i} of group {g} "
                    f"has layout {param.layout}; convert it with .to_dense() (parameters of different dtypes "
                    f"or devices are fine: each (device, dtype) gets its own bucket)")


@dataclass
class ErrorVote:
    """An agreement in flight that tells every rank whether any rank failed ``what``.

    ``shape`` (parameter count, total elements) is compared across ranks too: ZeRO
    hangs if ranks disagree on the parameters, so that is caught here as well.
    """

    what: str
    error: BaseException | None
    rank: int
    agreement: PendingAgreement

    @classmethod
    def start(cls, error: BaseException | None, what: str, group: Any, device: torch.device,
              shape: tuple[int, int] = (0, 0)) -> ErrorVote:
        agreement = start_agreement(what, error is not None, group, values=shape, device=device)
        return cls(what, error, dist.get_rank(group), agreement)

    def settle(self) -> None:
        """Wait for the vote; raise this rank's own error, or one naming the ranks that failed."""
        agreement = self.agreement.wait()
        raise_on_failure(self.error, agreement.failed, self.what, self.rank)
        if agreement.differing():
            counts, numels = (sorted({values[i] for values in agreement.values}) for i in range(2))
            raise RuntimeError(
                f"{self.what}: ranks disagree on the parameters (counts {counts[0]}..{counts[-1]}, elements "
                f"{numels[0]}..{numels[-1]}); every rank must pass the same parameters in the same order")


def raise_on_failure(error: BaseException | None, failed_ranks: list[int], what: str, rank: int) -> None:
    """Raise this rank's own ``error``, else one naming ``failed_ranks`` (the other ranks that failed ``what``)."""
    if error is not None:
        raise error
    if failed_ranks:
        ranks = ", ".join(str(r) for r in failed_ranks)
        raise RuntimeError(f"{what} failed on rank {ranks} (see that rank's error); rank {rank} stops too so that "
                           f"no rank waits forever in a collective")


def agree_on_error(error: BaseException | None, what: str, group: Any, device: torch.device,
                   shape: tuple[int, int] = (0, 0)) -> None:
    """Share whether any rank failed ``what`` (see [Note: errors must not strand peers]) and raise if so."""
    ErrorVote.start(error, what, group, device, shape).settle()
