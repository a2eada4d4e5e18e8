"""Every path under which PyTorch exposes an object of the owned subtrees gives ours.

PyTorch re-exports some owned objects from modules outside the four subtrees (the older
``torch.distributed._composable.fsdp`` path of ``fully_shard``). The walk reads the source of
every module in ``torch.distributed`` (statically, so it imports only the modules that import
from an owned subtree), imports those, and sorts each owned object found there:

* a re-export (the name is in the module's ``__all__``, or the module holds nothing public of
  its own, only owned objects): the same ``tensorplay`` path must give our object;
* an internal use (PyTorch's own feature importing its FSDP to work with it): the module stays
  PyTorch's, aliased, and must be listed in ``INTERNAL_USES`` with the reason, so a new
  re-export path in a later PyTorch fails here instead of silently giving PyTorch's object.
"""

from __future__ import annotations

import ast
import importlib
import os
import types
import warnings

import torch
import torch.distributed

import tensorplay.distributed.fsdp

OWNED = (
    "torch.distributed.optim",
    "torch.distributed.fsdp",
    "torch.distributed.algorithms.model_averaging",
    "torch.distributed.algorithms.ddp_comm_hooks",
)

#: PyTorch's own features that import its owned-subtree objects to work with them. Their
#: ``tensorplay`` paths are aliases of PyTorch's modules and keep PyTorch's objects.
INTERNAL_USES: dict[str, str] = {
    "torch.distributed": "the `fsdp` and `optim` submodule attributes (ours resolve to our packages)",
    "torch.distributed.algorithms": "the `ddp_comm_hooks` and `model_averaging` submodule attributes",
    "torch.distributed._composable.replicate_with_fsdp": "replicate() is built on PyTorch's FSDP internals",
    "torch.distributed._shard.checkpoint.optimizer": "deprecated alias of checkpoint.optimizer",
    "torch.distributed._shard.checkpoint.state_dict": "deprecated alias of checkpoint.state_dict",
    "torch.distributed._tools.fsdp2_mem_tracker": "memory tracker hooks PyTorch's FSDPParamGroup",
    "torch.distributed.algorithms._optimizer_overlap.optimizer_overlap": "private overlap helper",
    "torch.distributed.checkpoint.optimizer": "DCP's sharded-tensor helper from PyTorch's FSDP",
    "torch.distributed.checkpoint.state_dict": "get/set_state_dict special-case PyTorch's FSDP classes",
    "torch.distributed.pipelining.schedules": "pipelining unshards PyTorch's FSDPModule stages",
    "torch.distributed.pipelining.stage": "pipelining checks for PyTorch's FSDPModule stages",
    "torch.distributed.tensor.parallel.fsdp": "TP's FSDP extension for PyTorch's classic FSDP",
}

MUST_FIND = ("torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")


def _is_owned(name: str | None) -> bool:
    return bool(name) and any(name == r or name.startswith(r + ".") for r in OWNED)  # type: ignore[union-attr]


def ours(torch_path: str) -> str:
    return "tensorplay" + torch_path[len("torch"):]


def _module_name(root: str, path: str) -> tuple[str, bool]:
    rel = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
    is_package = rel[-1] == "__init__"
    if is_package:
        rel = rel[:-1]
    return ".".join(["torch.distributed", *rel]), is_package


def _imports_owned(tree: ast.AST, module: str, is_package: bool) -> bool:
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(_is_owned(alias.name) for alias in node.names):
                return True
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if _is_owned(base) or any(_is_owned(f"{base}.{alias.name}") for alias in node.names):
                return True
    return False


def candidate_modules() -> list[str]:
    """Modules of ``torch.distributed`` outside the owned subtrees whose source imports from one."""
    root = os.path.dirname(torch.distributed.__file__)
    found = []
    for folder, _, files in os.walk(root):
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            name, is_package = _module_name(root, path)
            if _is_owned(name):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            if _imports_owned(tree, name, is_package):
                found.append(name)
    return sorted(found)


def _owner(value: object) -> str | None:
    if isinstance(value, types.ModuleType):
        return value.__name__
    owner = getattr(value, "__module__", None)
    return owner if isinstance(owner, str) else None


def owned_objects(module: types.ModuleType) -> dict[str, object]:
    return {
        name: value for name, value in vars(module).items()
        if not name.startswith("__") and _is_owned(_owner(value))
    }


def is_reexport(module: types.ModuleType, name: str) -> bool:
    if name in getattr(module, "__all__", ()):
        return True
    own_public = [
        n for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and not _is_owned(_owner(v))
    ]
    return not own_public and not name.startswith("_")


def our_counterpart(value: object) -> object:
    """Our object for PyTorch's: at the same module path, else at the public path PyTorch
    gives it (``torch.distributed.fsdp.fully_shard`` for ``_fully_shard._fully_shard.fully_shard``)."""
    if isinstance(value, types.ModuleType):
        return importlib.import_module(ours(value.__name__))
    name = value.__name__  # type: ignore[attr-defined]
    for torch_module in (value.__module__, *OWNED):
        try:
            if getattr(importlib.import_module(torch_module), name, None) is not value:
                continue
            return getattr(importlib.import_module(ours(torch_module)), name)
        except (ImportError, AttributeError):
            continue
    raise AssertionError(f"no tensorplay counterpart found for {value.__module__}.{name}")


def test_every_reexport_path_gives_our_object() -> None:
    checked, problems, unlisted = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in candidate_modules():
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue  # an optional dependency PyTorch itself lacks here
            objects = owned_objects(module)
            reexports = {n: v for n, v in objects.items() if is_reexport(module, n)}
            if objects and not reexports and module_name not in INTERNAL_USES:
                unlisted.append(f"{module_name}: {sorted(objects)}")
            for name, value in reexports.items():
                path = f"{ours(module_name)}.{name}"
                mine = getattr(importlib.import_module(ours(module_name)), name)
                expected = our_counterpart(value)
                checked.append(f"{module_name}.{name}")
                if mine is not expected:
                    problems.append(f"{path} is {mine!r}, expected ours {expected!r}")
    assert {c.rpartition(".")[0] for c in checked} >= set(MUST_FIND), checked
    assert not unlisted, "owned objects in modules neither re-exporting nor listed in INTERNAL_USES:\n" + "\n".join(
        unlisted)
    assert not problems, "\n".join(problems)


def test_composable_fsdp_is_ours() -> None:
    import tensorplay.distributed._composable.fsdp as composable_fsdp
    from tensorplay.distributed._composable.fsdp import (
        fully_shard as fully_shard_module,  # noqa: F401
    )
    from tensorplay.distributed._composable.fsdp.fully_shard import (
        FSDPModule,
        UnshardHandle,
        fully_shard,
    )

    fsdp = tensorplay.distributed.fsdp
    assert composable_fsdp.__name__ == "tensorplay.distributed._composable.fsdp"
    assert composable_fsdp.fully_shard is fsdp.fully_shard is fully_shard
    assert composable_fsdp.FSDPModule is fsdp.FSDPModule is FSDPModule and UnshardHandle is fsdp.UnshardHandle
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "register_fsdp_forward_method"):
        assert getattr(composable_fsdp, name) is getattr(fsdp, name), name


def test_rest_of_composable_is_pytorchs() -> None:
    from torch.distributed import _composable

    import tensorplay.distributed._composable as composable

    replicate_module = importlib.import_module("tensorplay.distributed._composable.replicate")

    # As in PyTorch, the package attribute is the function and the submodule lives in sys.modules.
    assert composable.replicate is _composable.replicate
    assert composable.checkpoint is _composable.checkpoint and composable.contract is _composable.contract
    assert replicate_module is importlib.import_module("torch.distributed._composable.replicate")
    # Importing our package must not rebind PyTorch's own attribute.
    torch_composable_fsdp = importlib.import_module("torch.distributed._composable.fsdp")
    assert torch_composable_fsdp.fully_shard is not tensorplay.distributed.fsdp.fully_shard
