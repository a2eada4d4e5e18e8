"""``use_as_torch()``: PyTorch's public FSDP, ZeRO and hook modules resolve to ours, for the rest of the process.

For frameworks that build PyTorch's objects themselves (accelerate calls
``torch.distributed.fsdp.fully_shard``): after ``use_as_torch()``,
``import torch.distributed.fsdp`` (and ``.fully_sharded_data_parallel``,
``.wrap``, ``.api``, ``.sharded_grad_scaler``, ``torch.distributed.optim``,
``torch.distributed.algorithms.ddp_comm_hooks``, ``.model_averaging`` and
their public submodules, ``torch.distributed._composable.fsdp``) gives our
module of the same path. PyTorch's private modules stay PyTorch's (DCP and
pipelining import them), and they are all imported first, so a later import
of one never finds ours under PyTorch's name. Names a module already bound
(``from torch.distributed.fsdp import FSDPModule`` before the call) keep
PyTorch's object: call it first thing in the script, before importing the
framework. ``use_as_torch(False)`` puts PyTorch's modules back.

Off by default; ``TENSORPLAY_AS_TORCH=1`` under ``tprun`` calls it in every
worker before the training script runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import runpy
import sys
from types import ModuleType

__all__ = ["AS_TORCH_ENV", "launch_as_torch", "use_as_torch"]

#: ``tprun`` calls :func:`use_as_torch` in each worker when this is "1".
AS_TORCH_ENV = "TENSORPLAY_AS_TORCH"

#: Our package -> PyTorch's package of the same role.
_SUBTREES = {
    "tensorplay.distributed.fsdp": "torch.distributed.fsdp",
    "tensorplay.distributed.optim": "torch.distributed.optim",
    "tensorplay.distributed.algorithms.ddp_comm_hooks": "torch.distributed.algorithms.ddp_comm_hooks",
    "tensorplay.distributed.algorithms.model_averaging": "torch.distributed.algorithms.model_averaging",
    "tensorplay.distributed._composable.fsdp": "torch.distributed._composable.fsdp",
}

#: PyTorch's packages that import PyTorch's FSDP internals: imported before the switch so they keep them.
_IMPORT_FIRST = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                 "torch.distributed.tensor.parallel")

#: PyTorch's modules replaced by the switch, to put back (the switch is process-wide, as sys.modules is).
_REPLACED: dict[str, ModuleType] = {}


def use_as_torch(enable: bool = True) -> None:
    """Make PyTorch's public FSDP / ZeRO / hook modules resolve to ours (``enable=False``: undo it).

    Example:
        >>> import tensorplay.distributed as dist
        >>> dist.use_as_torch()
        >>> import torch.distributed.fsdp
        >>> torch.distributed.fsdp.fully_shard.__module__
        'tensorplay.distributed.fsdp._fully_shard._fully_shard'
        >>> dist.use_as_torch(False)
        >>> torch.distributed.fsdp.fully_shard.__module__
        'torch.distributed.fsdp'
    """
    if not isinstance(enable, bool):
        raise TypeError(f"use_as_torch: enable must be a bool, got {enable!r} ({type(enable).__name__})")
    if not enable:
        for name in sorted(_REPLACED):
            _bind(name, _REPLACED.pop(name))
        return
    if _REPLACED:
        return  # already switched
    for name in _IMPORT_FIRST:
        importlib.import_module(name)
    pairs = [pair for ours, theirs in _SUBTREES.items() for pair in _public_pairs(ours, theirs)]
    for _, theirs in pairs:
        _import_private_modules(theirs)
    for ours, theirs in pairs:
        _REPLACED[theirs] = sys.modules[theirs]
        _bind(theirs, importlib.import_module(ours))


def _public_pairs(ours: str, theirs: str) -> list[tuple[str, str]]:
    """(our module, PyTorch's module) for the package and each public submodule PyTorch also has (imported)."""
    importlib.import_module(theirs)
    pairs = [(ours, theirs)]
    for info in pkgutil.iter_modules(importlib.import_module(ours).__path__):
        name = f"{theirs}.{info.name}"
        if not info.name.startswith("_") and importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
            pairs.append((f"{ours}.{info.name}", name))
    return pairs


def _import_private_modules(theirs: str) -> None:
    """Load PyTorch's private submodules of ``theirs`` now, while the name still leads to PyTorch's package."""
    package = sys.modules[theirs]
    for info in pkgutil.walk_packages(getattr(package, "__path__", []), prefix=f"{theirs}.",
                                      onerror=lambda name: None):
        if "._" in info.name[len(theirs):] and info.name not in sys.modules:
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - a module PyTorch itself cannot import here (a missing extra)
                continue


def _bind(name: str, module: ModuleType) -> None:
    """``name`` -> ``module`` in ``sys.modules`` and as the attribute of its parent package."""
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)


def launch_as_torch(argv: list[str]) -> None:
    """``python -m tensorplay.distributed._as_torch [-m] TARGET ARGS...``: switch, then run TARGET as ``__main__``.

    What ``tprun`` runs in each worker when ``TENSORPLAY_AS_TORCH=1``.
    """
    as_module = argv[:1] == ["-m"]
    target, *rest = argv[1:] if as_module else argv
    use_as_torch()
    sys.argv = [target, *rest]
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    # The package's copy of this module, not this ``__main__`` one: use_as_torch(False) must find its record.
    importlib.import_module("tensorplay.distributed._as_torch").launch_as_torch(sys.argv[1:])
