"""Adafactor on sharded parameters: factors reduced over the shard group, no matrix gathered.

[Note: factored Adafactor step]
``torch.optim.Adafactor``'s update of a parameter whose last two dims are R x C (leading dims
are a batch of matrices) needs, besides the gradient's own elements: the row and column sums
of the squared gradient (B*R and B*C numbers, from which its row and column factors, its
whole optimizer state, are updated), the parameter's norm and the update's norm. All are
sums over elements. So each rank sums over its own piece, whatever the front end cut:
a Shard block of DTensor placements, or classic FSDP's contiguous range of the flattened
tensor, which :func:`piece_blocks` cuts into at most five blocks of the (B, R, C) view.
One all-reduce over the group that shards the parameters (every parameter's row sums,
column sums and squared norm in one buffer) makes them whole on every rank; the factors
are then updated identically everywhere and kept whole (the state is torch's, the same on
every rank); each rank computes the update of its piece; a second all-reduce sums the
update norms; each rank applies its piece. A 1-D parameter's second moment is
elementwise: kept sharded like the parameter, and only the two norms are reduced.
Replicas of a piece (HSDP's replicate dim, TP's Replicate) are counted once: only the rank
that ``sends`` it in the layout adds its sums. Per step each rank moves
``sum(B*(R + C)) + 2 * parameters`` numbers through the two all-reduces, against
``2 * R*C`` each way for the owner scheme of ``_exchange.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod, sqrt
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import tensorplay.distributed as dist
from tensorplay.distributed import ProcessGroup
from tensorplay.distributed._comm.collectives import all_reduce

from ._layout import Region, block_region
from ._sources import MatrixSource

Block = tuple[int, Region]   # (first element in the flattened local piece, block of the whole tensor)


def flat_blocks(dims: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(starts, sizes)`` blocks of a tensor of ``dims`` covering its row-major elements ``[start, end)`` in order."""
    if start >= end:
        return []
    if len(dims) == 1:
        return [((start,), (end - start,))]
    inner = prod(dims[1:])
    rest = tuple(dims[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:
        return [((first, *s), (1, *z)) for s, z in flat_blocks(rest, start - first * inner, end - first * inner)]
    blocks = []
    whole_from = first if start % inner == 0 else first + 1
    if start % inner:
        blocks += [((first, *s), (1, *z)) for s, z in flat_blocks(rest, start % inner, inner)]
    whole_to = end // inner
    if whole_to > whole_from:
        blocks.append(((whole_from, *(0,) * len(rest)), (whole_to - whole_from, *rest)))
    if end % inner:
        blocks += [((whole_to, *s), (1, *z)) for s, z in flat_blocks(rest, 0, end % inner)]
    return blocks


def piece_blocks(shape: tuple[int, ...], held: Region) -> list[Block]:
    """The piece ``held`` of a tensor of ``shape`` (``len(shape) >= 2``) as blocks whose last two dims are R, C."""
    if held.numel == 0:
        return []
    if held.view_shape == shape:   # a block of the tensor in its own shape (DTensor placements)
        return [(0, held)]
    dims = (prod(shape[:-2]), shape[-2], shape[-1])   # a flat range (classic FSDP): blocks of the (B, R, C) view
    blocks, cursor = [], 0
    for starts, sizes in flat_blocks(dims, held.starts[0], held.starts[0] + held.sizes[0]):
        region = block_region(dims, starts, sizes)
        blocks.append((cursor, region))
        cursor += region.numel
    return blocks


def _collapse(block: Region, dims: tuple[int, ...]) -> Region:
    """The block of a factor: ``block`` with each dim in ``dims`` (negative) reduced to size 1."""
    view, starts, sizes = list(block.view_shape), list(block.starts), list(block.sizes)
    for dim in dims:
        view[dim], starts[dim], sizes[dim] = 1, 0, 1
    return Region(tuple(view), tuple(starts), tuple(sizes))


ROW, COL, BATCH = (-1,), (-2,), (-2, -1)


@dataclass(frozen=True)
class FactoredPiece:
    """This rank's piece of one parameter, for the factored step."""

    source: MatrixSource
    rank: int                  # this rank in the source's group (0 for a plain tensor)
    blocks: tuple[Block, ...]  # empty for a 1-D parameter (its variance is elementwise)

    @property
    def factored(self) -> bool:
        return len(self.source.shape) > 1

    @property
    def counts(self) -> bool:
        """Whether this rank adds its piece to the sums (not a replica another rank adds)."""
        return self.source.layout.sends[self.rank]

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.source.local(tensor)

    @property
    def factor_sizes(self) -> tuple[int, int]:
        """Numbers of the row and column sums (B*R, B*C); ``(0, 0)`` for a 1-D parameter."""
        shape = self.source.shape
        if not self.factored:
            return 0, 0
        batch = prod(shape[:-2])
        return batch * shape[-2], batch * shape[-1]


def factored_piece(source: MatrixSource) -> FactoredPiece:
    rank = dist.get_rank(source.group) if source.group is not None else 0
    held = source.layout.holds[rank]
    blocks = piece_blocks(source.shape, held) if len(source.shape) > 1 else []
    return FactoredPiece(source, rank, tuple(blocks))


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def init_state(piece: FactoredPiece) -> dict[str, Any]:
    """torch.optim.Adafactor's initial state: whole factors (every rank the same), or a variance like the piece."""
    shape, param = piece.source.shape, piece.source.param
    like = piece.local(param).detach()
    state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=_scalar_dtype())}
    if piece.factored:
        state["row_var"] = like.new_zeros((*shape[:-1], 1))
        state["col_var"] = like.new_zeros((*shape[:-2], 1, shape[-1]))
        return state
    state["variance"] = like_param(piece, torch.zeros_like(like, memory_format=torch.preserve_format))
    return state


#: The state keys whose values are pieces laid out like the parameter's (the others are whole, or scalars).
PIECE_KEYS = frozenset({"variance"})


def like_param(piece: FactoredPiece, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece) as the parameter is: a DTensor with its placements, or the plain piece."""
    param = piece.source.param
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


@dataclass
class _Pending:
    """One parameter's step between the collectives."""

    piece: FactoredPiece
    options: dict[str, Any]
    state: dict[str, Any]
    grad: torch.Tensor          # this rank's piece, flattened, negated under ``maximize``
    rows: torch.Tensor          # the row sums, factor-shaped (a view into the reduced buffer)
    cols: torch.Tensor
    update: torch.Tensor | None = None
    alpha: float = 0.0


def factored_step(work: list[tuple[FactoredPiece, dict[str, Any], dict[str, Any]]],
                  group: ProcessGroup | None) -> None:
    """One Adafactor step of ``(piece, options, state)`` for every parameter of ``group`` with a gradient."""
    if not work:
        return
    reference = work[0][0].local(work[0][0].source.param)
    dtype = torch.promote_types(torch.float32, reference.dtype)
    pending, buffer, norms = _partial_sums(work, dtype, reference.device)
    if group is not None:
        all_reduce(buffer, group, where=work[0][0].source.name)
    update_norms = torch.zeros(len(pending), dtype=dtype, device=reference.device)
    for k, (item, norm) in enumerate(zip(pending, norms.tolist(), strict=True)):   # one read from the device
        item.update = update = _local_update(item, norm)
        if item.piece.counts:
            update_norms[k] = update.square().sum()
    if group is not None:
        all_reduce(update_norms, group, where=work[0][0].source.name)
    for item, update_norm in zip(pending, update_norms.tolist(), strict=True):
        numel = prod(item.piece.source.shape)
        denom = max(1.0, sqrt(update_norm) / (sqrt(numel) * item.options["d"]))
        local = item.piece.local(item.piece.source.param)
        assert item.update is not None
        local.add_(item.update.view(local.shape), alpha=-item.alpha / denom)


def _partial_sums(work: list[tuple[FactoredPiece, dict[str, Any], dict[str, Any]]], dtype: torch.dtype,
                  device: torch.device) -> tuple[list[_Pending], torch.Tensor, torch.Tensor]:
    """This rank's row sums, column sums (of the squared gradient) and squared parameter norm of each piece,
    in one zero-filled buffer laid out as ``[rows, cols of each factored parameter..., norms]``."""
    sizes = [size for piece, _, _ in work for size in piece.factor_sizes]
    buffer = torch.zeros(sum(sizes) + len(work), dtype=dtype, device=device)
    views = buffer.split([*sizes, len(work)])
    norms = views[-1]
    pending = []
    for k, (piece, options, state) in enumerate(work):
        param = piece.source.param
        grad = piece.local(param.grad).reshape(-1) if param.grad is not None else piece.local(param).new_empty(0)
        grad = -grad if options["maximize"] else grad
        shape = piece.source.shape
        rows = views[2 * k].view((*shape[:-1], 1)) if piece.factored else views[2 * k]
        cols = views[2 * k + 1].view((*shape[:-2], 1, shape[-1])) if piece.factored else views[2 * k + 1]
        if piece.counts:
            norms[k] = piece.local(param).detach().to(dtype).square().sum()
            for start, block in piece.blocks:
                squared = grad[start: start + block.numel].view(block.sizes).to(dtype).square()
                _collapse(block, ROW).of(rows).add_(squared.sum(dim=-1, keepdim=True))
                _collapse(block, COL).of(cols).add_(squared.sum(dim=-2, keepdim=True))
        pending.append(_Pending(piece, options, state, grad, rows, cols))
    return pending, buffer, norms


def _local_update(item: _Pending, param_square_norm: float) -> torch.Tensor:
    """Advance ``item``'s state (step, factors or variance), decay the parameter; the unscaled update of the piece."""
    piece, options, state = item.piece, item.options, item.state
    local = piece.local(piece.source.param)
    eps1, eps2 = options["eps"]
    eps1 = torch.finfo(local.dtype).eps if eps1 is None else eps1
    lr = float(options["lr"])
    state["step"] += 1
    step = state["step"].item()
    beta = step ** options["beta2_decay"]
    numel = prod(piece.source.shape)
    item.alpha = max(eps2, sqrt(param_square_norm) / sqrt(numel)) * min(lr, 1 / sqrt(step))
    if options["weight_decay"] != 0:
        local.mul_(1 - lr * options["weight_decay"])
    grad = item.grad.to(local.dtype)
    if not piece.factored:
        variance = piece.local(state["variance"]).view(-1)
        variance.lerp_(grad * grad, beta)
        return variance.clamp(min=eps1 * eps1).rsqrt_().mul_(grad)
    shape = piece.source.shape
    row_var, col_var = state["row_var"], state["col_var"]
    row_var.lerp_(item.rows.to(row_var.dtype).div_(shape[-1]), beta)
    col_var.lerp_(item.cols.to(col_var.dtype).div_(shape[-2]), beta)
    row_mean = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)
    update = torch.empty_like(grad)
    for start, block in piece.blocks:
        estimate = _collapse(block, ROW).of(row_var) @ _collapse(block, COL).of(col_var)
        estimate = estimate.div_(_collapse(block, BATCH).of(row_mean))
        piece_update = update[start: start + block.numel].view(block.sizes)
        torch.mul(estimate.clamp_(min=eps1 * eps1).rsqrt_(), grad[start: start + block.numel].view(block.sizes),
                  out=piece_update)
    return update
