"""PostLocalSGDOptimizer: a local optimizer step, then a model averager step."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tensorplay.distributed._checks.load_check import StateDictLoadError, optimizer_problems
from tensorplay.distributed._checks.validation import check_instance
from tensorplay.distributed._torch_identity import identity_only
from tensorplay.distributed.algorithms.model_averaging.averagers import ModelAverager
from tensorplay.distributed.optim import _torch_types as torch_optim

__all__ = ["PostLocalSGDOptimizer"]

#: The ``state_dict`` entry that holds the averager's step counter.
AVERAGER_STEP_KEY = "step"


@identity_only
class PostLocalSGDOptimizer(torch_optim.PostLocalSGDOptimizer):  # a torch.optim.Optimizer; see _torch_types
    """Run `post-local SGD <https://arxiv.org/abs/1808.07217>`_ around any optimizer.

    Every :meth:`step` runs ``optim.step()`` on this rank, then hands the
    parameter groups to ``averager``, which decides whether this step averages
    (e.g. :class:`~tensorplay.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`:
    every ``period`` steps after ``warmup_steps``). Pair it with DDP and the
    post-local SGD hook, whose ``start_localSGD_iter`` equals the averager's
    ``warmup_steps``.

    ``param_groups``, ``state``, ``zero_grad`` and ``add_param_group`` are the
    local optimizer's; ``state_dict`` adds the averager's step so that a resumed
    run does not warm up again.

    Args:
        optim: the local optimizer.
        averager: decides when and over which group the parameters are averaged.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        >>> from tensorplay.distributed.optim import PostLocalSGDOptimizer
        >>> model = tp.nn.Linear(16, 4)
        >>> optimizer = PostLocalSGDOptimizer(optim=tp.optim.SGD(model.parameters(), lr=0.01),
        ...                                   averager=PeriodicModelAverager(period=4, warmup_steps=2))
        >>> for step in range(6):
        ...     model(tp.randn(8, 16)).sum().backward()
        ...     optimizer.step()           # the local step, then the parameters averaged every 4th step after 2
        ...     optimizer.zero_grad()
        >>> optimizer.state_dict()["step"]
        6
    """

    optim: torch.optim.Optimizer
    averager: ModelAverager

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        check_instance(optim, torch.optim.Optimizer, "optim", "PostLocalSGDOptimizer",
                       hint="pass the local optimizer, e.g. tp.optim.SGD(model.parameters(), lr=0.1)")
        check_instance(averager, ModelAverager, "averager", "PostLocalSGDOptimizer",
                       hint="e.g. PeriodicModelAverager(period=4, warmup_steps=100)")
        # Not Optimizer.__init__: the parameter groups and state are the local optimizer's.
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The local optimizer's per-parameter state."""
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The local optimizer's default options."""
        return self.optim.defaults

    def __repr__(self) -> str:
        return repr(self.optim)

    def step(self) -> None:  # type: ignore[override]
        """One local optimizer step, then the averager's step (no closure, as in PyTorch)."""
        self.optim.step()
        self.averager.average_parameters(params=self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The local optimizer's ``zero_grad``."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the local optimizer (the averager sees it from the next step)."""
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict plus ``"step"``: the averager's step counter."""
        state_dict = self.optim.state_dict()
        state_dict[AVERAGER_STEP_KEY] = self.averager.step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and restore the averager's step, all or nothing.

        A state dict without ``"step"`` (e.g. saved from the bare local
        optimizer) warns and resets the averager's step to 0, as PyTorch does.
        Unlike PyTorch's, every problem (group sizes, unknown state indices,
        state keys and shapes, a step that is not a non-negative int) is listed
        in one :class:`StateDictLoadError` before anything changes.
        """
        check_instance(state_dict, dict, "state_dict", "PostLocalSGDOptimizer.load_state_dict")
        local_state = {key: value for key, value in state_dict.items() if key != AVERAGER_STEP_KEY}
        problems = optimizer_problems(self.optim, local_state)
        step = state_dict.get(AVERAGER_STEP_KEY, 0)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            problems.other.append(f"{AVERAGER_STEP_KEY}: expected the averager's step (a non-negative int), "
                                  f"got {step!r}")
        if problems:
            raise StateDictLoadError("PostLocalSGDOptimizer", problems)
        self.optim.load_state_dict(local_state)
        if AVERAGER_STEP_KEY in state_dict:
            self.averager.step = state_dict[AVERAGER_STEP_KEY]
        else:
            warnings.warn(
                "Loaded state dict does not contain a step counter for an averager "
                f"(no {AVERAGER_STEP_KEY!r} entry): setting the averager's step counter to 0, so warm-up "
                "restarts. Save the state dict of the PostLocalSGDOptimizer, not of its local optimizer.",
                UserWarning, stacklevel=2)
            self.averager.step = 0
