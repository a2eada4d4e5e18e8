"""The deprecation notice PyTorch's functional optimizers give on construction.

PyTorch scripts its ``_Functional*`` classes with TorchScript and warns, on
every construction, that this support is deprecated. Ours are plain Python and
never scripted, but code written against PyTorch may rely on (or filter) that
warning, so each construction gives the same category and phrase. Unlike
PyTorch's, it respects the caller's warning filters.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

__all__: list[str] = []

_PACKAGE = "tensorplay.distributed.optim."

MESSAGE = ("`TorchScript` support for functional optimizers is deprecated and will be removed in a future "
           "PyTorch release. Consider using the `torch.compile` optimizer instead. (tensorplay's functional "
           "optimizers are plain Python and are not scripted; this notice is kept for parity with PyTorch.)")


def _scripted_functional_optimizer_deprecation_warning(stacklevel: int = 0) -> None:
    """Warn ``DeprecationWarning``; ``stacklevel`` counts frames above this function's caller."""
    warnings.warn(MESSAGE, DeprecationWarning, stacklevel=stacklevel + 2)


def warn_on_construction() -> None:
    """The notice, attributed to the first caller outside this package (whoever built the optimizer)."""
    frame: FrameType | None = sys._getframe(1)
    depth = 0
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame, depth = frame.f_back, depth + 1
    # Above the helper's caller (this function): ``depth`` frames of ours, then that caller.
    _scripted_functional_optimizer_deprecation_warning(stacklevel=depth + 1)
