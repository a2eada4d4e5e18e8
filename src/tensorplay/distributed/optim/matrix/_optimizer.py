"""``ShardedMatrixOptimizer``: whole-matrix optimizers (Muon, Adafactor) on sharded parameters.

``torch.optim.Muon`` and ``torch.optim.Adafactor`` update a matrix from the whole
matrix. Given the shards that ``fully_shard`` (DTensors) or classic FSDP
(``use_orig_params=True``: 1D views of a flat shard) leave on each rank, they
compute on a piece: PyTorch's Muon silently orthogonalises each DTensor piece's
product instead of the matrix, and Adafactor fails in sharding propagation; on
classic FSDP's 1D views Muon refuses every matrix. The usual construction cannot
see the whole matrices, so this wrapper does it. Muon (and any other class): each
matrix gets one owner rank (balanced by the owner's FLOPs), the owner runs the
user's optimizer class on the whole matrix, and the updated pieces go back (see
[Note: owner-per-matrix optimizer step] in ``_layout.py``). Adafactor: every
rank updates its own piece from row and column factors reduced over the shard group,
no matrix is gathered (see [Note: factored Adafactor step] in ``_factored.py``).
The result equals one-process training with the same optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from ._exchange import GroupExchange
from ._factored import FactoredPiece, factored_piece, factored_step, init_state
from ._full_state import check_loadable, whole_states
from ._layout import assign_owners, step_cost
from ._sources import MatrixSource, classic_layouts, describe

__all__ = ["ShardedMatrixOptimizer"]

_NOT_OPTIONS = ("params", "param_names")


class ShardedMatrixOptimizer(Optimizer):
    """Run ``optimizer_class`` (e.g. ``torch.optim.Muon``) on whole matrices of sharded parameters.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass whose update needs the whole tensor
            (``torch.optim.Muon``, ``torch.optim.Adafactor``; any other works too).
        params: parameters or parameter groups, as for ``optimizer_class``; ``(name, parameter)``
            pairs (``model.named_parameters()``) name them in errors.
        module: the root module, needed only for classic ``FullyShardedDataParallel``
            (``use_orig_params=True``), whose parameters are 1D views that do not say how they are split.
        **defaults: ``optimizer_class``'s keyword arguments.

    Parameters may be DTensors (``fully_shard``, HSDP, fully_shard over tensor parallelism: Shard,
    _StridedShard and Replicate placements), classic FSDP views (with ``module``), or plain tensors
    (updated on every rank, without communication). Every rank constructs and steps it. With
    ``torch.optim.Adafactor`` (the class itself, not a subclass) each rank updates its piece and the
    state is torch's: whole row and column factors, the same on every rank, and a 1-D parameter's
    second moment sharded like it; per step two all-reduces move the factors and norms (``B*(R+C)``
    numbers per matrix), no matrix. With any other class a matrix's state lives whole on its owner
    rank, and each step moves every parameter and gradient element to the owners and back. Through
    the checkpoint package (``get_state_dict(model, optimizers)`` + ``dcp.save`` / ``dcp.load`` +
    ``set_state_dict``) the state is saved as whole tensors under the parameters' FQNs and any world
    size loads it (fully_shard, HSDP, plain, classic FSDP); a full state dict (``full_state_dict=True``) has
    every matrix's state on every rank, sent by its owner. ``torch.optim.Muon(model.parameters())`` on
    ``fully_shard``'s parameters trains wrong, ours as PyTorch's: nothing of ours runs in a torch optimizer's
    construction or step, and we install no global optimizer hook to catch it (behaviour must not depend on
    what was imported), so build whole-matrix optimizers on sharded parameters through this class.

    Example (after ``fully_shard(model)`` the same lines train as in one process)::

        >>> import torch
        >>> from tensorplay.distributed.optim import ShardedMatrixOptimizer
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
        >>> others = [p for n, p in model.named_parameters() if p.ndim != 2]
        >>> muon = ShardedMatrixOptimizer(torch.optim.Muon, matrices, lr=0.02, momentum=0.95)
        >>> adamw = torch.optim.AdamW(others, lr=3e-4)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> muon.step(); adamw.step()
        >>> sorted(muon.state_dict()["state"][0])
        ['momentum_buffer']
    """

    inner: Optimizer | None            # owner scheme: optimizer_class over the whole tensors (meta off the owner)
    sources: list[MatrixSource]
    exchanges: list[GroupExchange]     # owner scheme: one per shard group
    pieces: dict[int, FactoredPiece]   # factored Adafactor: id(parameter) -> this rank's piece
    _full: bool                         # inside full_state(): state_dict() holds every matrix's state

    def __init__(self, optimizer_class: type[Optimizer], params: Iterable[Any], *, module: nn.Module | None = None,
                 **defaults: Any) -> None:
        self._full = False
        groups = _normalize_groups(params)
        classic = classic_layouts(module) if module is not None else {}
        self.sources = [describe(param, name, classic) for group in groups for name, param in group["named"]]
        for source in self.sources:
            _check_accepted(optimizer_class, source, defaults)
        if optimizer_class is torch.optim.Adafactor:   # see [Note: factored Adafactor step]
            for source in self.sources:
                if torch.is_complex(source.param):
                    raise ValueError(f"Adafactor does not support complex parameters (parameter {source.name!r})")
            self.inner, self.exchanges = None, []
            self.pieces = {id(source.param): factored_piece(source) for source in self.sources}
            probe = optimizer_class([torch.empty(0, device="meta")], **defaults)
            super().__init__([{**{k: v for k, v in group.items() if k != "named"},
                               "params": [p for _, p in group["named"]]} for group in groups], probe.defaults)
            return
        self.pieces = {}
        self.exchanges = self._plan_exchanges(optimizer_class, defaults)
        wholes = self._whole_tensors()
        inner_groups, cursor = [], 0
        for group in groups:
            count = len(group["named"])
            options = {key: value for key, value in group.items() if key != "named"}
            inner_groups.append({**options, "params": wholes[cursor: cursor + count]})
            cursor += count
        self.inner = optimizer_class(inner_groups, **defaults)
        outer_groups = [{**{k: v for k, v in inner.items() if k not in _NOT_OPTIONS},
                         "params": [p for _, p in group["named"]]}
                        for group, inner in zip(groups, self.inner.param_groups, strict=True)]
        super().__init__(outer_groups, self.inner.defaults)

    # ---- construction --------------------------------------------------------------------------

    def _plan_exchanges(self, optimizer_class: type[Optimizer], defaults: dict[str, Any]) -> list[GroupExchange]:
        by_group: dict[ProcessGroup, list[int]] = {}
        for index, source in enumerate(self.sources):
            if source.group is not None:
                by_group.setdefault(source.group, []).append(index)
        exchanges = []
        for group, indices in by_group.items():
            world = dist.get_world_size(group)
            costs = [step_cost(optimizer_class, self.sources[i].shape, defaults) for i in indices]
            exchanges.append(GroupExchange(group, dist.get_rank(group), world, [self.sources[i] for i in indices],
                                           assign_owners(costs, world), []))
        return exchanges

    def _whole_tensors(self) -> list[torch.Tensor]:
        """The tensors ``inner`` updates, in ``sources`` order: whole on owners, meta elsewhere."""
        wholes: list[torch.Tensor | None] = [None] * len(self.sources)
        position = {id(source): i for i, source in enumerate(self.sources)}
        for exchange in self.exchanges:
            for source, owner in zip(exchange.sources, exchange.owners, strict=True):
                local = source.local(source.param).detach()
                device = local.device if owner == exchange.rank else torch.device("meta")
                whole = torch.zeros(source.shape, dtype=local.dtype, device=device)
                exchange.wholes.append(whole)
                wholes[position[id(source)]] = whole
        return [whole if whole is not None else self.sources[i].param for i, whole in enumerate(wholes)]

    # ---- step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Adafactor: the factored step. Others: gather each matrix to its owner, step it there, scatter it back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.inner is None:
            self._factored_step()
            return loss
        self._sync_options()
        presence = [[_present(source, exchange.rank) for source in exchange.sources] for exchange in self.exchanges]
        for exchange, present in zip(self.exchanges, presence, strict=True):
            for whole, here in zip(exchange.wholes, present, strict=True):
                if not here:
                    whole.grad = None
            exchange.gather_to_owners(present)
        self.inner.step()
        for exchange, present in zip(self.exchanges, presence, strict=True):
            exchange.scatter_from_owners(present)
        self._mirror_state()
        return loss

    def _factored_step(self) -> None:
        """Adafactor's step on every piece, its sums reduced over each shard group (no matrix gathered)."""
        by_group: dict[ProcessGroup | None, list[tuple[FactoredPiece, dict[str, Any], dict[str, Any]]]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                piece = self.pieces[id(param)]
                if not _present(piece.source, piece.rank):
                    continue
                if param.grad is not None and param.grad.is_sparse:
                    raise RuntimeError(f"Adafactor does not support sparse gradients (parameter {piece.source.name!r})")
                if not self.state.get(param):
                    self.state[param] = init_state(piece)
                by_group.setdefault(piece.source.group, []).append((piece, group, self.state[param]))
        for process_group, work in by_group.items():
            factored_step(work, process_group)

    def _mirror_state(self) -> None:
        """Show ``inner``'s state under this optimizer's parameters (empty where another rank owns the matrix).

        Every rank then has an entry per parameter once any step ran, so the checkpoint API's "has this
        optimizer stepped?" test (a non-empty ``state``) answers the same on every rank.
        """
        assert self.inner is not None
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            for param, whole in zip(group["params"], inner_group["params"], strict=True):
                self.state[param] = self.inner.state.get(whole, {})

    def _sync_options(self) -> None:
        """Carry hyperparameters set on this optimizer's groups (an LR scheduler's ``lr``) to ``inner``."""
        assert self.inner is not None
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in outer.items():
                if key not in _NOT_OPTIONS:
                    inner[key] = value

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's optimizer state: the whole-matrix state of the matrices it owns, ``{}`` for the others.

        Keyed like ``optimizer_class``'s; the checkpoint API keys it by FQN, and a matrix's state is saved
        by its owner as a plain tensor, which any owner at any world size loads whole. The empty entries
        tell it that the other matrices are stepped elsewhere (not that their state is missing). Inside
        :meth:`full_state` every matrix's state instead, on every rank (collective).
        Adafactor: torch's state of every parameter (whole factors; a 1-D parameter's variance as its piece).
        """
        if self.inner is None:
            return super().state_dict()
        self._sync_options()
        state_dict = self.inner.state_dict()
        if self.state:   # stepped or loaded: every rank has an entry per parameter (see _mirror_state)
            for group in state_dict["param_groups"]:
                for index in group["params"]:
                    state_dict["state"].setdefault(index, {})
        if self._full:
            state_dict["state"].update({index: state for index, state in enumerate(self.whole_states()) if state})
        return state_dict

    @contextmanager
    def full_state(self) -> Iterator[None]:
        """Inside, :meth:`state_dict` holds every matrix's whole state on every rank (full state dicts)."""
        self._full = True
        try:
            yield
        finally:
            self._full = False

    def whole_states(self) -> list[dict[str, Any]]:
        """Every parameter's state, in ``param_groups`` order, whole on every rank: each owner sends its
        matrices' state over their shard group (collective; Adafactor's state as :attr:`state` holds it)."""
        params = [param for group in self.param_groups for param in group["params"]]
        states = [self.state.get(param, {}) for param in params]
        position = {id(source): i for i, source in enumerate(self.sources)}
        for exchange in self.exchanges:
            indices = [position[id(source)] for source in exchange.sources]
            for i, whole in zip(indices, whole_states(exchange, [states[i] for i in indices]), strict=True):
                states[i] = whole
        return states

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict keyed like :meth:`state_dict`'s (or by FQN); each rank keeps the state of the
        matrices it owns and drops the rest (a full state dict holds every matrix's)."""
        check_loadable(state_dict, "ShardedMatrixOptimizer.load_state_dict")
        if self.inner is None:
            super().load_state_dict(state_dict)
            return
        self.inner.load_state_dict(self._owned_here(state_dict))
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            outer.update({k: v for k, v in inner.items() if k not in _NOT_OPTIONS})
        self._mirror_state()

    def _owned_here(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` without the state of matrices another rank owns (their whole tensors would land on meta)."""
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        elsewhere = {id(source) for exchange in self.exchanges
                     for source, owner in zip(exchange.sources, exchange.owners, strict=True) if owner != exchange.rank}
        dropped = {key for key, source in zip(saved_keys, self.sources, strict=False) if id(source) in elsewhere}
        return {**state_dict, "state": {key: value for key, value in state_dict["state"].items()
                                        if key not in dropped}}

    def owner_of(self, param: torch.Tensor) -> int | None:
        """The group rank that updates ``param`` (None: every rank updates its piece: a plain tensor, or Adafactor)."""
        for exchange in self.exchanges:
            for source, owner in zip(exchange.sources, exchange.owners, strict=True):
                if source.param is param:
                    return owner
        return None


def _normalize_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameter groups as dicts whose ``named`` holds ``(name, parameter)`` pairs (names made up if absent)."""
    items = list(params)
    if not items:
        raise ValueError("ShardedMatrixOptimizer got an empty parameter list")
    raw_groups = items if isinstance(items[0], dict) else [{"params": items}]
    groups = []
    for g, raw in enumerate(raw_groups):
        entries = raw["params"]
        entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
        named = [entry if isinstance(entry, tuple) else (f"param_groups[{g}][{i}]", entry)
                 for i, entry in enumerate(entries)]
        groups.append({**{k: v for k, v in raw.items() if k != "params"}, "named": named})
    return groups


def _check_accepted(optimizer_class: type[Optimizer], source: MatrixSource, defaults: dict[str, Any]) -> None:
    """``optimizer_class``'s own checks on the whole shape, re-raised naming the parameter."""
    probe = torch.empty(source.shape, dtype=source.param.dtype, device="meta")
    try:
        optimizer_class([probe], **defaults)
    except ValueError as error:
        raise ValueError(f"{error} (parameter {source.name!r})") from None


def _present(source: MatrixSource, rank: int) -> bool:
    """Whether the matrix has a gradient this step (an empty classic piece has none but takes part)."""
    return source.param.grad is not None or source.layout.holds[rank].numel == 0
