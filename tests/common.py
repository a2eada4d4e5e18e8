"""Helpers every test file shares: tolerances, error capture, strict tensor comparisons."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives

#: fp32 results vs a single-process run on the concatenated batch: the summation order differs.
FP32 = {"rtol": 1e-4, "atol": 2e-5}
#: fp32 results vs PyTorch's implementation of the same API: same arithmetic, reduction order may differ.
ORACLE = {"rtol": 1e-5, "atol": 1e-6}


def error_of(fn: Callable[..., Any], *args: Any, catch: type[BaseException] | tuple = Exception,
             **kwargs: Any) -> tuple[str, str] | None:
    """``(type name, message)`` of what ``fn(*args, **kwargs)`` raises, or ``None`` when it returns.

    Multi-rank tests return this from the rank function instead of raising, which keeps the worker pool.
    """
    try:
        fn(*args, **kwargs)
    except catch as error:
        return type(error).__name__, str(error)
    return None


def assert_equal_tensors(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str = "") -> None:
    """Bitwise equal, element by element; a length difference fails instead of being cut short."""
    assert len(got) == len(want), f"{what}: {len(got)} tensors vs {len(want)}"
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: tensor {index} differs (max |diff| {(a - b).abs().max().item():.3g})"


def assert_close_dicts(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str = "",
                       **tolerance: float) -> None:
    """Same keys, and every value allclose (``tolerance``: rtol/atol; none given means bitwise)."""
    assert set(got) == set(want), f"{what}: keys differ: only got {sorted(set(got) - set(want))}, " \
                                  f"only expected {sorted(set(want) - set(got))}"
    for name in want:
        if tolerance:
            torch.testing.assert_close(got[name], want[name], **tolerance,
                                       msg=lambda message, name=name: f"{what}: {name}: {message}")
        else:
            assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


class SyncAllReduceLog:
    """Log the blocking all-reduces (the averaging ones): PyTorch's ``dist.all_reduce`` and our flat one."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def _logged(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def logged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("async_op", False):
                self.calls.append(tensor.numel())
            return original(tensor, *args, **kwargs)

        return logged

    def __enter__(self) -> SyncAllReduceLog:
        self._originals = dist.all_reduce, collectives.all_reduce
        dist.all_reduce = self._logged(self._originals[0])
        collectives.all_reduce = self._logged(self._originals[1])
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, collectives.all_reduce = self._originals


def fqn_adam_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and Adam state keyed by parameter FQN, for DCP; a fresh optimizer gets zero state to load into."""
    state = {}
    for fqn, param in model.named_parameters():
        if param not in optim.state:
            optim.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                  "exp_avg_sq": torch.zeros_like(param)}
        state[fqn] = optim.state[param]
    return {"model": model.state_dict(), "optim": state}


def disk_full_after(real_write: Callable[[Any, bytes], int], room: int = 4096) -> Callable[[Any, bytes], int]:
    """A ``ChecksummingStream.write`` whose disk fills once an item's file holds ``room`` bytes (ENOSPC)."""
    import errno
    import os

    def write(self: Any, data: bytes) -> int:
        if self._raw.tell() > room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    return write
