"""Hierarchical SGD: average within small groups often and within larger groups less often."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Mapping

import tensorplay.distributed as dist

from . import utils
from .averagers import ModelAverager, _check_int, _warn_period_one

__all__ = ["HierarchicalModelAverager", "validate_hierarchy"]

logger = logging.getLogger(__name__)


def validate_hierarchy(period_group_size_dict: Mapping[int, int] | None,
                       overall_size: int) -> list[tuple[int, int]]:
    """Check a ``{period: group_size}`` hierarchy for a group of ``overall_size`` ranks.

    Returns the ``(period, group_size)`` levels in order. Periods must be
    positive and strictly increasing; each group size must be positive and
    divide ``overall_size`` and the next level's size (so each group nests in the
    next level's group), and the last size must be ``overall_size``.

    Example:
        >>> from tensorplay.distributed.algorithms.model_averaging.hierarchical_model_averager import validate_hierarchy
        >>> validate_hierarchy({2: 4, 16: 8}, overall_size=8)     # every 2 steps in groups of 4, every 16 over all 8
        [(2, 4), (16, 8)]
        >>> validate_hierarchy({2: 3, 16: 8}, overall_size=8)
        Traceback (most recent call last):
        ...
        ValueError: ...
    """
    if period_group_size_dict is not None and not isinstance(period_group_size_dict, Mapping):
        raise TypeError(f"Arg ``period_group_size_dict`` must be a dict {{period: group_size}}, got "
                        f"{period_group_size_dict!r} ({type(period_group_size_dict).__name__})")
    if not period_group_size_dict:
        raise ValueError("Arg ``period_group_size_dict`` must not be empty: pass {period: group_size}, "
                         f"e.g. {{4: 2, 16: {overall_size}}}")
    levels = [(_check_int("A period in arg ``period_group_size_dict``", period, minimum=1),
               _check_int(f"The group size of period {period} in arg ``period_group_size_dict``", size, minimum=1))
              for period, size in period_group_size_dict.items()]
    for period, size in levels:
        if overall_size % size != 0:
            raise ValueError(f"Group size {size} (period {period}) in arg ``period_group_size_dict`` must "
                             f"divide the size of arg ``process_group`` ({overall_size})")
    for (period, size), (next_period, next_size) in itertools.pairwise(levels):
        if next_period <= period:
            raise ValueError(f"The periods in arg ``period_group_size_dict`` must be strictly increasing, "
                             f"got {next_period} after {period}: order the entries by period")
        if next_size % size != 0:
            raise ValueError(f"Group size {size} (period {period}) must divide the next level's group size "
                             f"{next_size} (period {next_period}) so that each group nests in a larger one")
    if levels[-1][1] != overall_size:
        raise ValueError(f"The last value in arg ``period_group_size_dict`` ({levels[-1][1]}) must be equal "
                         f"to the size of arg ``process_group`` ({overall_size}): the longest period averages "
                         "over the whole group")
    return levels


class HierarchicalModelAverager(ModelAverager):
    """Average parameters in a hierarchy of groups, each level on its own period.

    ``period_group_size_dict`` maps a period to a group size, e.g.
    ``{2: 4, 8: 16}``: every 2 steps within consecutive groups of 4 ranks, every 8
    steps across all 16. At a step divisible by several periods only the largest
    one's group averages (it contains the smaller ones). Nothing averages before
    ``warmup_steps``; as in PyTorch, the periods count from step 0, not from the
    end of the warm-up. The groups are created here, so every rank of the default
    group must construct the averager.

    Unlike PyTorch, which accepts any order and finds a bad size only when the
    subgroups are created, the hierarchy is checked up front (see
    :func:`validate_hierarchy`).

    Args:
        period_group_size_dict: ordered ``{period: group_size}``; the last size is the size of
            ``process_group``.
        warmup_steps: steps at the start that never average (>= 0).
        process_group: the overall group; ``None`` means the default group.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        ...     HierarchicalModelAverager)
        >>> model = tp.nn.Linear(4, 2)
        >>> # every 2 steps within groups of 1 rank, every 4 steps over all ranks (here: 1), after 6 warm-up steps
        >>> averager = HierarchicalModelAverager(period_group_size_dict={2: 1, 4: 1}, warmup_steps=6)
        >>> for step in range(8):
        ...     averager.average_parameters(model.parameters())
        >>> averager.step
        8
    """

    period_process_group_dict: OrderedDict[int, dist.ProcessGroup]
    warmup_steps: int

    def __init__(self, period_group_size_dict: Mapping[int, int] | None = None, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.warmup_steps = _check_int("Arg ``warmup_steps``", warmup_steps, minimum=0)
        super().__init__(process_group)
        overall_size = dist.get_world_size(self.process_group)
        levels = validate_hierarchy(period_group_size_dict, overall_size)
        if levels[-1][0] == 1:
            _warn_period_one("The largest period in arg ``period_group_size_dict``")
        self.period_process_group_dict = OrderedDict(
            (period, self._level_group(size, overall_size)) for period, size in levels)
        logger.info("Model averaging hierarchy (period: group size): %s", dict(levels))

    def _level_group(self, size: int, overall_size: int) -> dist.ProcessGroup:
        if size == overall_size:
            return self.process_group
        group, _ = dist.new_subgroups(group_size=size, group=self.process_group)
        return group

    def _find_process_group(self) -> dist.ProcessGroup | None:
        """The group of the largest period dividing :attr:`step`, or ``None``."""
        for period in reversed(self.period_process_group_dict):
            if self.step % period == 0:
                return self.period_process_group_dict[period]
        return None

    def average_parameters(self, params: utils.ParamsOrGroups) -> None:
        """Average ``params`` (parameters or optimizer ``param_groups``) in this step's group, then count it."""
        if self.step >= self.warmup_steps:
            group = self._find_process_group()
            if group is not None:
                utils.average_parameters_or_parameter_groups(params, group)
        self.step += 1
