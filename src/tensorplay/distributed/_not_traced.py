"""Our hooks run eagerly under ``torch.compile``, as PyTorch's FSDP hooks do.

Dynamo cannot trace communication, process groups or the watch around each
collective, and should not: the hooks are the host-side glue between compiled
regions. :func:`not_traced` marks a hook entry point so dynamo skips it and
everything it calls (a graph break at the hook, never a trace into it). Called
eagerly (no dynamo tracing), it calls the hook straight: the skip is only for
dynamo, and entering it costs a few microseconds per hook per module per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["not_traced"]

F = TypeVar("F", bound=Callable[..., Any])


def not_traced(hook: F) -> F:
    """``hook``, skipped by dynamo (built on first call: importing torch._dynamo costs about a second)."""
    skipped: Callable[..., Any] | None = None

    @functools.wraps(hook)
    def eager(*args: Any, **kwargs: Any) -> Any:
        nonlocal skipped
        if not torch.compiler.is_compiling():  # eager: the skip's own frame handling is a cost per call
            return hook(*args, **kwargs)
        if skipped is None:
            skipped = torch._dynamo.disable(hook, recursive=True, reason="tensorplay's sharding hook")
        return skipped(*args, **kwargs)

    return eager  # type: ignore[return-value]
