"""What an optimizer keeps per parameter, found by stepping it on a small real tensor.

Any optimizer class works: its state after two steps on one parameter of
``PROBE`` elements gives the bytes it keeps per element (tensors shaped like the
parameter: Adam's two moments) and per parameter (scalars: Adam's step); the
live bytes during the second step beyond those give its temporaries per
element of the parameter being updated.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ._estimate_live import LiveBytes

PROBE = 1024


@dataclass(frozen=True)
class OptimizerCost:
    """Bytes an optimizer holds: ``per_element`` x parameter elements + ``per_param`` x parameters;
    ``step_per_element`` x the largest parameter's elements more while it steps (a per-tensor loop, PyTorch's
    default on the CPU), or x all of them (``foreach``: PyTorch's default on accelerators)."""

    per_element: float
    per_param: int
    step_per_element: float
    foreach: bool = False

    def state_bytes(self, numels: list[int]) -> int:
        return int(self.per_element * sum(numels)) + self.per_param * len(numels)

    def step_bytes(self, numels: list[int]) -> int:
        return int(self.step_per_element * (sum(numels) if self.foreach else max(numels, default=0)))


def probe_optimizer(optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                    device_type: str = "cpu") -> OptimizerCost:
    """Step ``optimizer_class(**optimizer_kwargs)`` twice on one fp32 parameter (on the CPU) and read what it keeps.

    For an accelerator (``device_type`` not ``"cpu"``) the optimizer is probed as PyTorch runs it there:
    with ``foreach=True`` unless the arguments choose (``foreach``/``fused``) or the class has no such option.
    """
    foreach = optimizer_kwargs.get("foreach")
    if foreach is None and device_type != "cpu" and not optimizer_kwargs.get("fused") \
            and "foreach" in inspect.signature(optimizer_class).parameters:
        foreach = True
        optimizer_kwargs = {**optimizer_kwargs, "foreach": True}
    param = torch.nn.Parameter(torch.ones(PROBE))
    optimizer = optimizer_class([param], **optimizer_kwargs)
    param.grad = torch.full_like(param, 0.5)
    optimizer.step()
    tracker = LiveBytes("cpu")
    tracker.add([param, param.grad, optimizer.state])
    tracker.reset_peak()
    before = tracker.current
    with tracker:
        optimizer.step()
    state = [t for t in optimizer.state[param].values() if isinstance(t, torch.Tensor)]
    per_element = sum(t.nbytes for t in state if t.numel() == PROBE) / PROBE
    per_param = sum(t.nbytes for t in state if t.numel() != PROBE)
    return OptimizerCost(per_element, per_param, max(tracker.peak - before, 0) / PROBE, bool(foreach))
