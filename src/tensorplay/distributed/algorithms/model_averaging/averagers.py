"""Model averagers: average parameters across ranks on a schedule of steps."""

from __future__ import annotations

import operator
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import tensorplay.distributed as dist
from tensorplay.distributed._checks.load_check import check_load

from ..._comm.watch import site
from . import utils

__all__ = ["ModelAverager", "PeriodicModelAverager"]


def _check_int(what: str, value: Any, minimum: int) -> int:
    """``value`` as an int no smaller than ``minimum``, or a ValueError/TypeError that starts with ``what``."""
    try:
        number = operator.index(value)  # ints and int-likes (numpy ints); floats are refused
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})") from None
    if number < minimum:
        kind = "a positive value" if minimum == 1 else "a non-negative number"
        raise ValueError(f"{what} must be {kind} (>= {minimum}), got {number}")
    return number


def _warn_period_one(what: str) -> None:
    warnings.warn(
        f"{what} is 1: averaging parameters every step costs at least as much communication as "
        "DistributedDataParallel's gradient all-reduce, so use DistributedDataParallel alone instead",
        UserWarning, stacklevel=3)


class ModelAverager(ABC):
    """Base of the model averagers: a process group and a step counter.

    :meth:`state_dict` / :meth:`load_state_dict` save and restore the step counter
    (PyTorch's averagers have neither), so an averager can be checkpointed as a
    ``Stateful`` and a resumed run does not warm up again.

    Args:
        process_group: the group to average over; ``None`` means the default group.

    Example:
        >>> from tensorplay.distributed.algorithms.model_averaging.averagers import ModelAverager, PeriodicModelAverager
        >>> issubclass(PeriodicModelAverager, ModelAverager)     # subclass it for another averaging schedule
        True
    """

    process_group: dist.ProcessGroup
    step: int

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = utils.resolve_group(process_group)
        self.step = 0

    @abstractmethod
    def average_parameters(self, params: utils.ParamsOrGroups) -> None:
        """Average ``params`` if this step is an averaging step, then count the step."""

    def state_dict(self) -> dict[str, Any]:
        """``{"step": the step counter}``."""
        return {"step": self.step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step counter, all or nothing: a missing or unexpected key, or a step that is not a
        non-negative int, raises one :class:`StateDictLoadError` and leaves the averager unchanged."""
        where = f"{type(self).__name__}"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}.load_state_dict: state_dict must be a dict like state_dict() returns "
                            f"({{'step': int}}), got {type(state_dict).__name__}")
        step = state_dict.get("step", 0)
        bad = [] if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else [
            f"step: expected a non-negative int, got {step!r}"]
        check_load({"step": None}, state_dict, where=where, extra=bad)
        self.step = step


class PeriodicModelAverager(ModelAverager):
    """Average parameters every ``period`` steps once ``warmup_steps`` steps have passed.

    Call :meth:`average_parameters` once per training step, after the optimizer
    step. The steps counted from 0 that average are ``warmup_steps``,
    ``warmup_steps + period``, ... Combined with DDP on subgroups (the
    post-local SGD hook), this runs post-local SGD.

    Args:
        period: steps between two averagings (>= 1; 1 warns, DDP alone is cheaper).
        warmup_steps: steps at the start that never average (>= 0).
        process_group: the group to average over; ``None`` means the default group.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        >>> model = tp.nn.Linear(4, 2)
        >>> optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
        >>> averager = PeriodicModelAverager(period=4, warmup_steps=10)
        >>> for step in range(12):
        ...     model(tp.randn(8, 4)).sum().backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     averager.average_parameters(model.parameters())   # all-reduces only every 4th step after 10
        >>> averager.step
        12
    """

    period: int
    warmup_steps: int

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.warmup_steps = _check_int("Arg ``warmup_steps``", warmup_steps, minimum=0)
        self.period = _check_int("Arg ``period``", period, minimum=1)
        if self.period == 1:
            _warn_period_one("period")
        super().__init__(process_group)

    def is_averaging_step(self) -> bool:
        """Whether the current :attr:`step` averages."""
        since_warmup = self.step - self.warmup_steps
        return since_warmup >= 0 and since_warmup % self.period == 0

    def average_parameters(self, params: utils.ParamsOrGroups) -> None:
        """Average ``params`` (parameters or optimizer ``param_groups``) if due, then count the step.

        Only parameters that have a gradient are averaged, as in PyTorch.
        """
        if self.is_averaging_step():
            with site(f"model averaging at averager step {self.step}"):
                utils.average_parameters_or_parameter_groups(params, self.process_group)
        self.step += 1
