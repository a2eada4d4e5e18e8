"""All-or-nothing ``load_state_dict``: check every entry first, agree across ranks, then copy.

[Note: all-or-nothing loads]
A ``load_state_dict`` that copies entry by entry and raises at the first bad one
leaves a half-loaded object. Every ``load_state_dict`` we own instead:

1. describes what it expects (key -> :class:`Expected`: shape and, optionally,
   dtype) and calls :func:`load_problems` on the given state dict: every
   missing, unexpected, wrong-shape (both shapes) and wrong-dtype key at once;
2. on one process, :func:`check_load` raises them as one
   :class:`StateDictLoadError`; on several ranks, :func:`check_load_on_all_ranks`
   (or :func:`agree_on_all_ranks` for any other check) exchanges one flag per
   rank first (one agreement, ``_comm.agreement.agree``), so
   that a failure on any rank makes every rank raise, naming the failing
   ranks, and no rank has copied anything;
3. only then copies.

Sharded values are checked by global shape and by what this rank holds
(:func:`local_shard_problem`, :func:`dtensor_problem`): a value's local data
must be what its own metadata says this rank holds (the ``ShardedTensor``'s
shard offsets and sizes, or what the ``DTensor``'s mesh and placements give
this rank), else it was made on another rank or mesh. Where the load would then
use the local shard as this rank's part of the model without resharding (a
classic ``ShardedTensor``: every rank places its shards and the shard group
sums them), the offsets and sizes must also be this rank's part; a ``DTensor``
on the model's mesh may have other placements (``copy_`` / ``full_tensor``
redistribute it), on another mesh it is refused. Each misfit names the key,
both layouts and the rank, instead of loading wrong rows.

:class:`StateDictLoadError` subclasses ``RuntimeError`` (what ``nn.Module.load_state_dict``
raises, whose message layout it follows) and ``ValueError`` (what
``Optimizer.load_state_dict`` raises for a state dict that does not fit), so code
catching either keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._checks.plan_agreement import collective_device
from tensorplay.distributed._comm.agreement import agree
from tensorplay.distributed.tensor import DTensor

__all__ = ["Expected", "LoadProblems", "StateDictLoadError", "agree_on_all_ranks", "check_load",
           "check_load_on_all_ranks", "dtensor_problem", "dtensor_problems", "expected_of", "flatten_state",
           "key_differences", "load_problems", "local_shard_problem", "optimizer_problems", "with_sharding_hint"]


class Expected(NamedTuple):
    """What one state-dict entry must be: a tensor of ``shape`` (``None``: any value) and, when given, ``dtype``."""

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


ExpectedLike = Expected | torch.Tensor | torch.Size | tuple | None


def expected_of(spec: ExpectedLike) -> Expected:
    """``spec`` as an :class:`Expected`: a tensor gives its shape (not its dtype: ``copy_`` casts, as in
    ``nn.Module``), a shape gives itself, ``None`` accepts any value."""
    if isinstance(spec, Expected):
        return spec
    if isinstance(spec, torch.Tensor):
        return Expected(tuple(spec.shape))
    if spec is None:
        return Expected()
    return Expected(tuple(int(s) for s in spec))


@dataclass
class LoadProblems:
    """Everything wrong with a state dict for one object (empty: it loads)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    #: (key, shape given, shape expected); a non-tensor value given has shape ``None``.
    wrong_shape: list[tuple[str, tuple[int, ...] | None, tuple[int, ...]]] = field(default_factory=list)
    #: (key, dtype given, dtype expected).
    wrong_dtype: list[tuple[str, torch.dtype, torch.dtype]] = field(default_factory=list)
    #: Any other problem, one line each (added by callers with checks of their own).
    other: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype or self.other)

    def lines(self) -> list[str]:
        """One line per kind of problem, every key listed (``nn.Module``'s wording)."""
        lines = []
        if self.missing:
            lines.append(f"Missing key(s) in state_dict: {_keys(self.missing)}.")
        if self.unexpected:
            lines.append(f"Unexpected key(s) in state_dict: {_keys(self.unexpected)}.")
        for key, given, want in self.wrong_shape:
            got = "a non-tensor value" if given is None else f"a param with shape {torch.Size(given)}"
            lines.append(f"size mismatch for {key}: copying {got} from checkpoint, the shape in current model "
                         f"is {torch.Size(want)}.")
        for key, given_dtype, want_dtype in self.wrong_dtype:
            lines.append(f"dtype mismatch for {key}: copying a param of dtype {given_dtype} from checkpoint, the "
                         f"dtype in current model is {want_dtype}.")
        lines.extend(self.other)
        return lines


class StateDictLoadError(RuntimeError, ValueError):
    """A state dict that does not fit; raised before anything was copied (see [Note: all-or-nothing loads]).

    ``problems`` is this rank's :class:`LoadProblems` (empty when only other ranks
    failed), ``failed_ranks`` the global ranks whose check failed.
    """

    def __init__(self, where: str, problems: LoadProblems, rank: int | None = None,
                 failed_ranks: list[int] | None = None) -> None:
        self.where = where
        self.problems = problems
        self.rank = rank
        self.failed_ranks = failed_ranks if failed_ranks is not None else ([] if rank is None else [rank])
        super().__init__(self._message())

    def _message(self) -> str:
        on = "" if self.rank is None else f" on rank {self.rank}"
        head = f"Error(s) in loading state_dict for {self.where}{on} (nothing was loaded):"
        body = [f"\n\t{line}" for line in self.problems.lines()]
        others = [r for r in self.failed_ranks if r != self.rank]
        if others:
            body.append(f"\n\tThe check also failed on rank(s) {others} (see their errors); every rank refused "
                        "the load")
        return head + "".join(body)


def load_problems(expected: Mapping[str, ExpectedLike], given: Mapping[str, Any], *,
                  strict: bool = True) -> LoadProblems:
    """Every way ``given`` does not fit ``expected`` (key -> shape spec, see :func:`expected_of`).

    With ``strict=False`` missing and unexpected keys are allowed (a caller that
    returns them gets them from :func:`key_differences`); wrong shapes and dtypes
    are problems either way, as in ``nn.Module``.
    """
    problems = LoadProblems()
    if strict:
        problems.missing = [key for key in expected if key not in given]
        problems.unexpected = [key for key in given if key not in expected]
    for key, spec in expected.items():
        if key not in given:
            continue
        want, value = expected_of(spec), given[key]
        if want.shape is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.wrong_shape.append((key, None, want.shape))
            continue
        if tuple(value.shape) != want.shape:
            problems.wrong_shape.append((key, tuple(value.shape), want.shape))
        elif want.dtype is not None and value.dtype != want.dtype:
            problems.wrong_dtype.append((key, value.dtype, want.dtype))
    return problems


def key_differences(expected: Iterable[str], given: Iterable[str]) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys, in their own order: for a ``strict=False`` caller's return value."""
    expected, given = list(expected), list(given)
    expected_set, given_set = set(expected), set(given)
    return [k for k in expected if k not in given_set], [k for k in given if k not in expected_set]


def check_load(expected: Mapping[str, ExpectedLike], given: Mapping[str, Any], *, where: str,
               strict: bool = True, extra: Iterable[str] = ()) -> None:
    """Raise one :class:`StateDictLoadError` listing every problem of ``given`` (local, no communication);
    ``extra`` adds caller-found problems (one line each)."""
    problems = load_problems(expected, given, strict=strict)
    problems.other.extend(extra)
    if problems:
        raise StateDictLoadError(where, problems)


def check_load_on_all_ranks(expected: Mapping[str, ExpectedLike], given: Mapping[str, Any], *, where: str,
                            strict: bool = True, group: ProcessGroup | None = None,
                            extra: Iterable[str] = ()) -> None:
    """:func:`check_load` on every rank of ``group``, agreed: if any rank's check fails, every rank raises.

    Collective (one control all-gather of a flag per rank) when a process group is
    initialised; ``extra`` adds caller-found problems (one line each).
    """
    problems = load_problems(expected, given, strict=strict)
    problems.other.extend(extra)
    agree_on_all_ranks(StateDictLoadError(where, problems) if problems else None, where=where, group=group)


def agree_on_all_ranks(error: BaseException | None, *, where: str, group: ProcessGroup | None = None) -> None:
    """Raise on every rank of ``group`` if any rank passes an ``error``; return on every rank otherwise.

    Collective: every rank calls it, with its own check's error or ``None``. A
    rank with an error raises it (a :class:`StateDictLoadError` is re-raised
    naming its rank and every failing rank); the others raise a
    :class:`StateDictLoadError` naming the failing ranks. One control all-gather (a flag per rank, see
    see [Note: agreement]); without an initialised group the error is raised as is.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    rank = dist.get_rank(group)
    agreement = agree(f"{where} load check", error is not None, group, device=collective_device(group))
    if not agreement.failed:
        return
    failed = [agreement.global_rank(r) for r in agreement.failed]
    me = agreement.global_rank(rank)
    if isinstance(error, StateDictLoadError):
        raise StateDictLoadError(error.where, error.problems, rank=me, failed_ranks=failed) from None
    if error is not None:
        raise error
    raise StateDictLoadError(where, LoadProblems(), rank=me, failed_ranks=failed)


def flatten_state(state: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state dict as one level, keys joined with ``"."`` (``{"state": {0: {"m": t}}}`` ->
    ``{"state.0.m": t}``): so nested state (an optimizer's) can go through :func:`load_problems`."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_state(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def optimizer_problems(optimizer: torch.optim.Optimizer, state_dict: Any) -> LoadProblems:
    """What would make ``optimizer.load_state_dict(state_dict)`` fail or half-load (a position-keyed state
    dict, as ``Optimizer.state_dict`` returns).

    Checked: the ``state`` / ``param_groups`` entries, the number and sizes of the
    groups, every state index, and per parameter either the keys and shapes of
    its current state or, with no state yet, that a state tensor with as many
    dims as its parameter has its shape (Adafactor's factored state has fewer).
    Keys are named ``state.<index>.<key>`` as in :func:`flatten_state`.
    """
    problems = LoadProblems()
    if not isinstance(state_dict, Mapping):
        problems.other.append(f"expected a dict with 'state' and 'param_groups', got {type(state_dict).__name__}")
        return problems
    problems.missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if problems.missing:
        return problems
    if not isinstance(state_dict["state"], Mapping) or not isinstance(state_dict["param_groups"], list):
        problems.other.append("'state' must be a dict and 'param_groups' a list, as Optimizer.state_dict returns")
        return problems
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    sizes, saved_sizes = [len(g["params"]) for g in groups], [len(g.get("params", ())) for g in saved_groups]
    if sizes != saved_sizes:
        problems.other.append(f"param_groups: the state dict has groups of {saved_sizes} parameters, this "
                              f"optimizer has {sizes}; load a state dict saved from the same parameter groups")
        return problems
    params = [p for g in groups for p in g["params"]]
    ids = [i for g in saved_groups for i in g["params"]]
    by_id = dict(zip(ids, params, strict=True))
    for index, saved in state_dict["state"].items():
        if index not in by_id:
            problems.unexpected.append(f"state.{index}")
            continue
        param = by_id[index]
        if not isinstance(saved, Mapping):
            problems.other.append(f"state.{index}: expected a dict of state values, got {type(saved).__name__}")
            continue
        current = optimizer.state.get(param)
        if current:
            flat = {f"state.{index}.{key}": value for key, value in saved.items()}
            want = {f"state.{index}.{key}": (value if isinstance(value, torch.Tensor) and value.dim() else None)
                    for key, value in current.items()}
            _merge(problems, load_problems(want, flat))
        else:
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.dim() == param.dim() and value.shape != param.shape:
                    problems.wrong_shape.append((f"state.{index}.{key}", tuple(value.shape), tuple(param.shape)))
    return problems


def _merge(into: LoadProblems, other: LoadProblems) -> None:
    into.missing += other.missing
    into.unexpected += other.unexpected
    into.wrong_shape += other.wrong_shape
    into.wrong_dtype += other.wrong_dtype
    into.other += other.other


#: A rank's part of a tensor: the (offsets, sizes) of each non-empty local shard, sorted.
Layout = list[tuple[tuple[int, ...], tuple[int, ...]]]


def _layout(parts: Iterable[tuple[Iterable[int], Iterable[int]]]) -> Layout:
    found = [(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)) for offsets, sizes in parts]
    return sorted(part for part in found if all(part[1]))


def _describe_layout(layout: Layout) -> str:
    if not layout:
        return "no elements"
    return "; ".join(f"offsets {list(offsets)} sizes {list(sizes)}" for offsets, sizes in layout)


def _describe_dtensor(value: DTensor) -> str:
    return f"a DTensor {tuple(value.placements)} on mesh {value.device_mesh.mesh.tolist()}"


def _given_layout(value: Any, rank: int) -> tuple[Layout, str] | str:
    """(this rank's layout in ``value``, how ``value`` is sharded), or why its local data contradicts its own
    metadata (a ``DTensor`` built for another rank or mesh, a ``ShardedTensor`` shard placed on another rank)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, DTensor):
        return _dtensor_layout(value, rank)
    assert isinstance(value, ShardedTensor)
    parts = []
    for shard in value.local_shards():
        meta = shard.metadata
        placed = meta.placement.rank() if meta.placement is not None else rank
        if placed != rank or tuple(shard.tensor.shape) != tuple(meta.shard_sizes):
            return (f"holds a local shard of shape {list(shard.tensor.shape)} placed on rank {placed} whose metadata "
                    f"says sizes {list(meta.shard_sizes)}: it was made on another rank")
        parts.append((meta.shard_offsets, meta.shard_sizes))
    return _layout(parts), "a ShardedTensor"


def _dtensor_layout(value: DTensor, rank: int) -> tuple[Layout, str] | str:
    """:func:`_given_layout` of a ``DTensor``: from this rank's place in its mesh, found from the global rank (a
    mesh unpickled on another rank keeps that rank's coordinate)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = value.device_mesh
    found = (mesh.mesh == rank).nonzero()
    if len(found) == 0:
        return f"is on mesh {mesh.mesh.tolist()}, which does not hold rank {rank}"
    coordinate = found[0].tolist()
    claimed = mesh.get_coordinate()
    if claimed is not None and list(claimed) != coordinate:
        return (f"was made at mesh coordinate {list(claimed)} of {mesh.mesh.tolist()}, this rank is at "
                f"{coordinate}: it holds another rank's part")
    shape, offset = _compute_local_shape_and_global_offset(value.shape, mesh.shape, coordinate, value.placements)
    local = tuple(value.to_local().shape)
    if local != tuple(shape):
        return (f"holds a local tensor of shape {list(local)} where its placements give this rank {list(shape)}: "
                "it was made on another rank or mesh")
    return _layout([(offset, shape)]), _describe_dtensor(value)


def local_shard_problem(key: str, value: Any, want: Iterable[tuple[Iterable[int], Iterable[int]]] | None,
                        want_how: str, rank: int) -> str | None:
    """Why the part of sharded ``value`` on this rank (global ``rank``) does not fit (None: it fits, or ``value``
    is not a ``ShardedTensor`` / ``DTensor``).

    Its local data must be what its own metadata says this rank holds, and, when
    ``want`` is given (``(offsets, sizes)`` of this rank's shards, described as
    ``want_how``), that must be ``want``.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, (DTensor, ShardedTensor)):
        return None
    given = _given_layout(value, rank)
    if isinstance(given, str):
        return f"sharding mismatch for {key} on rank {rank}: the checkpoint's {type(value).__name__} {given}"
    layout, how = given
    if want is None or layout == _layout(want):
        return None
    return (f"sharding mismatch for {key} on rank {rank}: the checkpoint holds {_describe_layout(layout)} ({how}) "
            f"here, this rank's part of the model is {_describe_layout(_layout(want))} ({want_how})")


#: Said once after the ``sharding mismatch`` lines of an error.
SHARDING_HINT = ("A sharded state dict loads only into the sharding it was saved with: save and load with the same "
                 "sharding and world size, or reshard (DTensor.redistribute; tensorplay.distributed.checkpoint "
                 "reshards on load)")


def with_sharding_hint(lines: list[str]) -> list[str]:
    """``lines`` plus :data:`SHARDING_HINT` when one of them is a sharding mismatch."""
    return [*lines, SHARDING_HINT] if any(line.startswith("sharding mismatch") for line in lines) else lines


def dtensor_problem(key: str, value: Any, dest: DTensor, rank: int) -> str | None:
    """Why ``value`` cannot be copied into the ``DTensor`` ``dest`` (None: it can): a plain tensor (``copy_``
    refuses to mix them), another device mesh, or local data its own placements contradict (made on another
    rank or mesh). Other placements on the same mesh are fine: ``copy_`` redistributes them."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(dest.shape):
        return None  # reported as a wrong shape
    if not isinstance(value, DTensor):
        return (f"sharding mismatch for {key} on rank {rank}: copying a plain tensor into {_describe_dtensor(dest)} "
                "(distribute it first, or load a full state dict with set_model_state_dict and "
                "StateDictOptions(full_state_dict=True))")
    if value.device_mesh != dest.device_mesh:
        return (f"sharding mismatch for {key} on rank {rank}: the checkpoint holds {_describe_dtensor(value)}, "
                f"the model {_describe_dtensor(dest)}: another device mesh")
    return local_shard_problem(key, value, None, "", rank)


def dtensor_problems(current: Mapping[str, Any], state_dict: Mapping[str, Any]) -> list[str]:
    """:func:`dtensor_problem` of every key of ``state_dict`` whose value in ``current`` (a module's own
    state dict) is a ``DTensor``: one line per misfit."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    problems = (dtensor_problem(key, state_dict[key], dest, rank) for key, dest in current.items()
                if isinstance(dest, DTensor) and key in state_dict)
    return [problem for problem in problems if problem is not None]


def _keys(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)
