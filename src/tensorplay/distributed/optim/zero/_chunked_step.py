"""Stepping ZeRO's local optimizer over cache-sized pieces of its parameters' storage.

[Note: chunked step]
On CPU an elementwise optimizer's default (single-tensor) step runs about ten
whole-tensor operations one after the other on each parameter, so for a large
parameter every operation streams it (and its state, and a temporary or two)
from memory again. Stepping the same optimizer over slices of the storage small
enough to stay in cache (``CHUNK_NUMEL`` elements) does the same arithmetic on
every element, in the same order, so results are bitwise equal, with about one
trip to memory per tensor. Measured (Adam over the 10M parameters of
6 x Linear(1280), one process, loaded 2-core machine, median / fastest of 12):
per parameter 109 / 76 ms, 64K-element chunks 108 / 94, 256K 82 / 64, 1M 101 /
71, the whole bucket at once 297 / 223 (its temporaries are above glibc's 32 MiB
mmap threshold, so every step faults in fresh pages). Each chunk costs a fixed
~20-50 us of Python, which is why the chunks are not smaller.

Chunks are views: a *split* chunk is a slice of one large parameter, a *merged*
chunk spans several small parameters that lie end to end in memory (bucket
views); any other parameter is a *whole* chunk, the parameter itself. A second
instance of the optimizer class (the chunk optimizer) steps the chunks; its
elementwise state tensors are views of the local optimizer's per-parameter
state, so ``optim.state`` stays the one source of truth. Per-chunk scalar state
(Adam's ``step`` ...) is copied back to the parameters after each step.

Bitwise equality needs each element to run the same code path: chunk
boundaries lie at multiples of :data:`ALIGN` elements from a parameter's start,
and only parameters whose size is a multiple of ``ALIGN`` are merged, so no
element moves between a kernel's vectorised body and its scalar tail.

The chunk optimizer is only used when the step would be single-tensor (CPU,
``foreach`` unset or False, not ``fused``, not ``differentiable``), every cut
parameter has a dense, contiguous gradient and state from an earlier step, and
the local optimizer has no step hooks; otherwise (the first step, a trainable
parameter without a gradient ...) the local optimizer steps as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

#: Optimizers whose update of an element depends only on that element (and
#: per-parameter scalars such as the step count). Exact classes: a subclass may override step.
ELEMENTWISE_OPTIMIZERS: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.ASGD,
})
#: Elements per chunk (a multiple of ``ALIGN``), or None: step per parameter (see [Note: chunked step]).
CHUNK_NUMEL: int | None = 1 << 18
#: Chunk boundaries and merged sizes are multiples of this many elements (wider than any SIMD body).
ALIGN = 64


@dataclass
class Chunk:
    """A 1D (or, for a whole parameter, the parameter itself) view the chunk optimizer steps.

    ``params`` are the parameters it covers; ``start`` is its offset into
    ``params[0]`` (split chunks); merged chunks gather their gradients into ``grad_buffer``.
    """

    tensor: torch.Tensor
    params: list[torch.Tensor]
    start: int = 0
    grad_buffer: torch.Tensor | None = None

    @property
    def whole(self) -> bool:
        return self.tensor is self.params[0]


def is_single_tensor_step(optim: Optimizer) -> bool:
    """Whether ``optim``'s step runs parameter by parameter on CPU (see [Note: chunked step])."""
    if type(optim) not in ELEMENTWISE_OPTIMIZERS:
        return False
    if getattr(optim, "_optimizer_step_pre_hooks", None) or getattr(optim, "_optimizer_step_post_hooks", None):
        return False
    for group in optim.param_groups:
        if group.get("fused") or group.get("differentiable") or group.get("foreach") is True:
            return False
        if any(p.device.type != "cpu" for p in group["params"]):
            return False
    return True


def _adjacent(previous: torch.Tensor, param: torch.Tensor) -> bool:
    return (previous.dtype == param.dtype and previous.device == param.device
            and previous.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
            and param.data_ptr() == previous.data_ptr() + previous.numel() * previous.element_size())


def _mergeable(param: torch.Tensor, chunk_numel: int) -> bool:
    return 0 < param.numel() < chunk_numel and param.numel() % ALIGN == 0


def _span(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1D tensor over the storage of ``params``, which lie end to end."""
    return params[0].detach().as_strided((sum(p.numel() for p in params),), (1,))


def plan_chunks(params: Sequence[torch.Tensor], chunk_numel: int) -> list[Chunk]:
    """Cut one param group's (contiguous) parameters into chunks, in order."""
    chunks: list[Chunk] = []
    run: list[torch.Tensor] = []

    def flush() -> None:
        if len(run) == 1:
            chunks.append(Chunk(run[0], [run[0]]))
        elif run:
            span = _span(run)
            chunks.append(Chunk(span, list(run), grad_buffer=torch.empty_like(span)))
        run.clear()

    for param in params:
        numel = param.numel()
        if not param.requires_grad:  # frozen: never stepped, so never cut
            flush()
            chunks.append(Chunk(param, [param]))
            continue
        if run and _mergeable(param, chunk_numel) and _mergeable(run[-1], chunk_numel) \
                and _adjacent(run[-1], param) and sum(p.numel() for p in run) + numel <= chunk_numel:
            run.append(param)
            continue
        flush()
        if numel > chunk_numel:
            flat = param.detach().view(-1)
            chunks.extend(Chunk(flat[start:start + chunk_numel], [param], start)
                          for start in range(0, numel, chunk_numel))
        else:
            run.append(param)
    flush()
    return chunks


def _elementwise(value: Any, chunk: Chunk) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == chunk.tensor.shape


def _same(values: list[Any]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(v, torch.Tensor) and v.dtype == first.dtype and torch.equal(v, first)
                   for v in values[1:])
    return all(v == first for v in values[1:])


class _RoutedState(dict):
    """The chunk optimizer's state: whole chunks (the parameters themselves) use the local optimizer's entries."""

    def __init__(self, shared: dict[Any, Any], whole: set[int]) -> None:
        super().__init__()
        self.shared, self.whole = shared, whole

    def __missing__(self, key: Any) -> Any:
        if id(key) in self.whole:
            return self.shared[key]  # a defaultdict: created there when new
        value: dict[str, Any] = {}
        self[key] = value
        return value


@dataclass
class ChunkedStep:
    """Steps ``optim`` (an elementwise optimizer over contiguous CPU parameters) chunk by chunk.

    :meth:`step` returns False, having done nothing, when this step must run per parameter.
    """

    optim: Optimizer
    chunk_numel: int
    groups: list[list[Chunk]] = field(init=False)
    chunk_optim: Optimizer = field(init=False)
    _cut: list[Chunk] = field(init=False)  # the split and merged chunks
    _cut_params: list[torch.Tensor] = field(init=False)
    _bound: list[tuple[dict[str, Any], dict[str, Any]]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.groups = [plan_chunks(g["params"], self.chunk_numel) for g in self.optim.param_groups]
        optimizer_class: Any = type(self.optim)  # an ELEMENTWISE_OPTIMIZERS class: every option has a default
        self.chunk_optim = optimizer_class([dict(g, params=[c.tensor for c in chunks])
                                            for g, chunks in zip(self.optim.param_groups, self.groups, strict=True)])
        self._cut = [c for chunks in self.groups for c in chunks if not c.whole]
        self._cut_params = list({id(p): p for c in self._cut for p in c.params}.values())
        whole = {id(c.tensor) for chunks in self.groups for c in chunks if c.whole}
        self.chunk_optim.state = _RoutedState(self.optim.state, whole)  # type: ignore[assignment]

    @classmethod
    def of(cls, optim: Optimizer) -> ChunkedStep | None:
        """A chunked stepper for ``optim``, or None where chunking cannot or need not apply."""
        chunk_numel = CHUNK_NUMEL
        params = [p for g in optim.param_groups for p in g["params"]]
        if chunk_numel is None or not is_single_tensor_step(optim) or not all(p.is_contiguous() for p in params):
            return None
        if chunk_numel % ALIGN:
            raise ValueError(f"CHUNK_NUMEL={chunk_numel} must be a multiple of ALIGN={ALIGN}")
        stepper = cls(optim, chunk_numel)
        return stepper if stepper._cut else None

    # ------------------------------------------------------------------ one step

    def step(self, **kwargs: Any) -> bool:
        """One step over the chunks; False (nothing changed) when it must run per parameter instead."""
        if not self._grads_ready() or not self._bind():
            return False
        for src, dst in zip(self.optim.param_groups, self.chunk_optim.param_groups, strict=True):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value
        self._attach_grads()
        try:
            self.chunk_optim.step(**kwargs)
        finally:
            self._detach_grads()
            self._write_back()
        return True

    def unbind(self) -> None:
        """Forget the chunk state (call after the per-parameter state was replaced or stepped)."""
        self._bound = None
        self.chunk_optim.state.clear()

    def _grads_ready(self) -> bool:
        for param in self._cut_params:
            grad = param.grad
            if grad is None or grad.layout != torch.strided or not grad.is_contiguous():
                return False
        return True

    def _attach_grads(self) -> None:
        for chunk in self._cut:
            if chunk.grad_buffer is not None:
                torch.cat([p.grad.view(-1) for p in chunk.params], out=chunk.grad_buffer)  # type: ignore[union-attr]
                chunk.tensor.grad = chunk.grad_buffer
            else:
                grad = chunk.params[0].grad
                assert grad is not None
                chunk.tensor.grad = grad.view(-1)[chunk.start:chunk.start + chunk.tensor.numel()]

    def _detach_grads(self) -> None:
        for chunk in self._cut:
            chunk.tensor.grad = None  # holds no reference to the parameters' gradients

    # ------------------------------------------------------------------ sharing the state

    def _bind(self) -> bool:
        """Make the chunk optimizer's state views of the per-parameter state; False if it cannot be."""
        state = self.optim.state
        if self._bound is not None:
            if all(state.get(p) is d and all(d.get(k) is v for k, v in snapshot.items())
                   for p, (d, snapshot) in zip(self._cut_params, self._bound, strict=True)):
                return True
            self.unbind()
        if any(not state.get(p) for p in self._cut_params):
            return False  # the first step creates the state, per parameter
        built = {}
        for chunk in self._cut:
            chunk_state = self._chunk_state(chunk)
            if chunk_state is None:
                return False
            built[chunk.tensor] = chunk_state
        self.chunk_optim.state.update(built)
        self._bound = [(state[p], dict(state[p])) for p in self._cut_params]
        return True

    def _chunk_state(self, chunk: Chunk) -> dict[str, Any] | None:
        per_param = [self.optim.state[p] for p in chunk.params]
        keys = list(per_param[0])
        if any(list(d) != keys for d in per_param):
            return None
        built: dict[str, Any] = {}
        for key in keys:
            values = [d[key] for d in per_param]
            if all(isinstance(v, torch.Tensor) and v.shape == p.shape
                   for v, p in zip(values, chunk.params, strict=True)):
                built[key] = self._elementwise_view(chunk, key, values)
            elif _same(values):
                built[key] = values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]
            else:
                return None  # e.g. different step counts: only per-parameter stepping can carry on
        return built

    def _elementwise_view(self, chunk: Chunk, key: str, values: list[torch.Tensor]) -> torch.Tensor:
        if chunk.grad_buffer is None:  # split: a slice of the parameter's own state tensor
            flat = values[0].view(-1) if values[0].is_contiguous() else self._rehome(chunk, key, values)
            return flat[chunk.start:chunk.start + chunk.tensor.numel()]
        contiguous = all(v.is_contiguous() for v in values) and all(
            _adjacent(a, b) for a, b in zip(values, values[1:], strict=False))
        return _span(values) if contiguous else self._rehome(chunk, key, values)

    def _rehome(self, chunk: Chunk, key: str, values: list[torch.Tensor]) -> torch.Tensor:
        """Copy the state of ``chunk``'s parameters into one flat tensor; their state become views of it."""
        flat = torch.cat([v.reshape(-1) for v in values])
        offset = 0
        for param, value in zip(chunk.params, values, strict=True):
            self.optim.state[param][key] = flat[offset:offset + value.numel()].view_as(value)
            offset += value.numel()
        return flat

    def _write_back(self) -> None:
        """Copy each cut chunk's scalar state (step counts ...) to the parameters it covers."""
        for chunk in self._cut:
            if chunk.start:
                continue  # later slices of a split parameter hold the same values as its first
            for key, value in self.chunk_optim.state[chunk.tensor].items():
                if not _elementwise(value, chunk):
                    self._set_scalar(chunk, key, value)

    def _set_scalar(self, chunk: Chunk, key: str, value: Any) -> None:
        for param in chunk.params:
            target = self.optim.state[param]
            old = target.get(key)
            if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == value.shape:
                old.copy_(value)
            else:
                target[key] = value.clone() if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------------- functional optimizers

def functional_step(optim: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``optim.step_params(params, grads)`` for one of our functional optimizers, with each large CPU
    parameter stepped in chunks (see [Note: chunked step]): bitwise the same update."""
    chunk_numel = CHUNK_NUMEL
    whole_params, whole_grads = [], []
    for param, grad in zip(params, grads, strict=True):
        state = optim.state.get(param)
        if chunk_numel is None or state is None or not _chunkable(optim, param, grad, chunk_numel) \
                or not _functional_chunks(optim, param, grad, state, chunk_numel):
            whole_params.append(param)
            whole_grads.append(grad)
    if whole_params:
        optim.step_params(whole_params, whole_grads)


def _chunkable(optim: Any, param: torch.Tensor, grad: torch.Tensor, chunk_numel: int) -> bool:
    return (param.numel() > chunk_numel and param.device.type == "cpu" and not param.is_complex()
            and not getattr(optim, "foreach", False) and not getattr(optim, "fused", False)
            and param.is_contiguous() and grad.layout == torch.strided and grad.is_contiguous()
            and grad.shape == param.shape)


def _functional_chunks(optim: Any, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                       chunk_numel: int) -> bool:
    """Step ``param`` chunk by chunk through ``optim._update``; False (nothing done) if its state does not allow."""
    flat_state = {k: v.view(-1) for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.shape == param.shape and v.is_contiguous()}
    if any(isinstance(v, torch.Tensor) and v.shape == param.shape and k not in flat_state for k, v in state.items()):
        return False
    scalars = {k: v for k, v in state.items() if k not in flat_state}
    flat_param, flat_grad = param.detach().view(-1), grad.view(-1)
    chunk_state: dict[str, Any] = {}
    with torch.no_grad():
        for start in range(0, param.numel(), chunk_numel):
            stop = start + chunk_numel
            views = {k: v[start:stop] for k, v in flat_state.items()}
            chunk_state = {**views, **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}}
            optim._update([flat_param[start:stop]], [flat_grad[start:stop]], [chunk_state])
            for key, view in views.items():
                if chunk_state[key] is not view:  # replaced rather than updated in place
                    view.copy_(chunk_state[key])
    for key, value in scalars.items():
        if isinstance(value, torch.Tensor):
            value.copy_(chunk_state[key])
        else:
            state[key] = chunk_state[key]
    return True
