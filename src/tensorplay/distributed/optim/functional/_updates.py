"""One optimizer step, computed from state tensors passed as arguments.

Each ``<name>_step`` function updates ``params`` (and the state lists) in place
from ``grads``, for one of the eight optimizers of ``tensorplay.distributed.optim``.
The functional optimizer classes own the state and call these; the DDP
optimizer-overlap hook, ZeRO's DDP overlap and the RPC DistributedOptimizer
reach them through those classes.

Each optimizer is written once, as a sequence of list operations (:class:`ListOps`):

* ``foreach=True`` runs each operation as one multi-tensor kernel over every
  parameter of a (device, dtype) group;
* ``foreach=False`` runs the same sequence parameter by parameter with per-tensor
  kernels, so peak memory stays at one parameter's temporaries;
* ``fused=True`` (Adam, AdamW, SGD, Adagrad) hands each group to the fused ATen
  kernel.

[Note: bitwise parity] The operation order is the one ``torch.optim`` uses for
the same path, so a functional step and the class optimizer's step give bitwise
equal results. Adagrad is the one optimizer whose per-tensor and foreach paths
order their arithmetic differently in ``torch.optim`` (the step size scales the
numerator first under foreach, which may round differently on accelerators); its
function follows each path's order.

Complex parameters are stepped as real views (real and imaginary parts are
independent coordinates), except SGD, which is linear and runs on them directly.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from tensorplay.distributed.optim.functional._list_ops import ListOps, groups

__all__ = [
    "adadelta_step",
    "adagrad_step",
    "adam_step",
    "adamax_step",
    "rmsprop_step",
    "rprop_step",
    "sgd_step",
]

def _step_values(steps: list[Tensor]) -> list[float]:
    return [step.item() for step in steps]


def _prepare_grads(ops: ListOps, params: list[Tensor], grads: list[Tensor], maximize: bool,
                   weight_decay: float) -> tuple[list[Tensor], bool]:
    """Negate (maximize) and add L2 weight decay; return the grads and whether they are ours to modify."""
    owned = False
    if maximize:
        grads, owned = ops.neg(grads), True
    if weight_decay != 0:
        if owned:
            ops.add_(grads, params, alpha=weight_decay)
        else:
            grads, owned = ops.add(grads, params, alpha=weight_decay), True
    return grads, owned


# --------------------------------------------------------------------------- Adam / AdamW

def adam_step(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], steps: list[Tensor], *, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float, amsgrad: bool, maximize: bool, decoupled_weight_decay: bool = False,
    foreach: bool = False, fused: bool = False,
) -> None:
    """Adam (AdamW with ``decoupled_weight_decay``); ``max_exp_avg_sqs`` is used only with amsgrad.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_adam import adam_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> state = [tp.zeros(2)], [tp.zeros(2)], [], [tp.tensor(0.0)]   # exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        >>> adam_step([param], [grad], *state, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        ...           amsgrad=False, maximize=False)
        >>> param, state[3][0]
        (tensor([0.9000, 0.9000]), tensor(1.))
    """
    if fused:
        kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        for _, (p, g, m, v, vmax, s) in groups(True, params, grads, exp_avgs, exp_avg_sqs,
                                                max_exp_avg_sqs if amsgrad else [], steps, real=False):
            torch._foreach_add_(s, 1)
            kernel(p, g, m, v, vmax, s, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                   eps=eps, amsgrad=amsgrad, maximize=maximize)
        return
    ops = ListOps.for_step(foreach, params, grads)
    for _, (p, g, m, v, vmax, s) in ops.groups(params, grads, exp_avgs, exp_avg_sqs,
                                               max_exp_avg_sqs if amsgrad else [], steps):
        ops.increment_(s)
        if decoupled_weight_decay:
            if weight_decay != 0:
                ops.mul_(p, 1 - lr * weight_decay)
            g, _ = _prepare_grads(ops, p, g, maximize, 0.0)
        else:
            g, _ = _prepare_grads(ops, p, g, maximize, weight_decay)
        ops.lerp_(m, g, 1 - beta1)
        ops.mul_(v, beta2)
        ops.addcmul_(v, g, g, 1 - beta2)
        t = _step_values(s)
        step_sizes = [-(lr / (1 - beta1**k)) for k in t]
        bias_correction2_sqrt = [(1 - beta2**k) ** 0.5 for k in t]
        if amsgrad:
            ops.maximum_(vmax, v)
        denom = ops.sqrt(vmax if amsgrad else v)
        ops.div_(denom, bias_correction2_sqrt)
        ops.add_scalar_(denom, eps)
        ops.addcdiv_(p, m, denom, step_sizes)


# --------------------------------------------------------------------------- SGD

def sgd_step(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor | None], *, lr: float,
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
    foreach: bool = False, fused: bool = False,
) -> None:
    """SGD with optional momentum. ``momentum_buffers`` (unused when momentum is 0) may hold
    ``None`` for a parameter without a buffer yet; it is filled with the new buffer in place.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_sgd import sgd_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> sgd_step([param], [grad], [None], lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
        ...          nesterov=False, maximize=False)
        >>> param
        tensor([0.9500, 0.9500])
    """
    if fused:
        _fused_sgd(params, grads, momentum_buffers, lr=lr, momentum=momentum, dampening=dampening,
                   weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        return
    if any(g.is_sparse for g in grads):
        foreach = False  # sparse tensors take the per-tensor kernels
    ops = ListOps.for_step(foreach, params, grads)
    buffers = momentum_buffers if momentum != 0 else []
    steady = (momentum != 0 and not (maximize or weight_decay != 0 or nesterov)
              and all(b is not None for b in buffers))
    for indices, (p, g, bufs) in ops.groups(params, grads, buffers, real=False):
        if steady:
            _steady_momentum_step(ops, p, g, bufs, lr=lr, momentum=momentum, dampening=dampening)
            continue
        g, owned = _prepare_grads(ops, p, g, maximize, weight_decay)
        if momentum != 0:
            bufs = _update_momentum(ops, g, bufs, momentum, dampening)
            for i, buf in zip(indices, bufs, strict=True):
                momentum_buffers[i] = buf
            if not nesterov:
                g = bufs
            elif owned:
                ops.add_(g, bufs, alpha=momentum)
            else:
                g = ops.add(g, bufs, alpha=momentum)
        ops.add_(p, g, alpha=-lr)


def _steady_momentum_step(ops: ListOps, params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], *,
                          lr: float, momentum: float, dampening: float) -> None:
    """SGD with existing momentum buffers, no weight decay, maximize or Nesterov: three in-place
    operations, nothing to prepare or store back. A one-tensor CPU batch (a large parameter) calls the
    tensor's own kernels, which a foreach call would loop over anyway (Note: CPU batches)."""
    if ops.foreach and not (len(params) == 1 and params[0].is_cpu):
        ops.add_(params, _update_momentum(ops, grads, bufs, momentum, dampening), alpha=-lr)
        return
    for param, grad, buf in zip(params, grads, bufs, strict=True):  # one tensor at a time: it stays in cache
        assert buf is not None  # steady: every buffer exists
        param.add_(buf.mul_(momentum).add_(grad, alpha=1 - dampening), alpha=-lr)


def _update_momentum(ops: ListOps, grads: list[Tensor], bufs: list[Tensor | None], momentum: float,
                     dampening: float) -> list[Tensor]:
    if all(b is not None for b in bufs):
        present = cast(list[Tensor], bufs)  # every buffer checked just above
        ops.mul_(present, momentum)
        ops.add_(present, grads, alpha=1 - dampening)
        return present
    # A first step starts the buffer at the gradient itself (no dampening).
    fresh = []
    for g, buf in zip(grads, bufs, strict=True):
        if buf is None:
            buf = g.detach().clone()
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        fresh.append(buf)
    return fresh


def _fused_sgd(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor | None], *,
               lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
               maximize: bool) -> None:
    has_momentum = momentum != 0
    # The kernel takes one is_first_step flag per call: split parameters with and without a buffer.
    first = [has_momentum and momentum_buffers[i] is None for i in range(len(params))]
    for is_first in (True, False):
        chosen = [i for i in range(len(params)) if first[i] == is_first]
        if not chosen:
            continue
        if is_first:
            for i in chosen:
                momentum_buffers[i] = torch.empty_like(grads[i])
        sub = [[lst[i] for i in chosen] for lst in (params, grads)]
        bufs = [momentum_buffers[i] for i in chosen] if has_momentum else []
        for _, (p, g, b) in groups(True, sub[0], sub[1], bufs, real=False):
            torch._fused_sgd_(p, g, b, weight_decay=weight_decay, momentum=momentum, lr=lr,
                              dampening=dampening, nesterov=nesterov, maximize=maximize,
                              is_first_step=is_first)


# --------------------------------------------------------------------------- RMSprop

def rmsprop_step(
    params: list[Tensor], grads: list[Tensor], square_avgs: list[Tensor], grad_avgs: list[Tensor],
    momentum_buffers: list[Tensor], steps: list[Tensor], *, lr: float, alpha: float, eps: float,
    weight_decay: float, momentum: float, centered: bool, maximize: bool, foreach: bool = False,
) -> None:
    """RMSprop; ``grad_avgs`` is used only when centered, ``momentum_buffers`` only with momentum > 0.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_rmsprop import rmsprop_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> rmsprop_step([param], [grad], [tp.zeros(2)], [], [], [tp.tensor(0.0)], lr=0.01, alpha=0.99, eps=1e-8,
        ...              weight_decay=0.0, momentum=0.0, centered=False, maximize=False)
        >>> param.round(decimals=4)
        tensor([0.9000, 0.9000])
    """
    ops = ListOps.for_step(foreach, params, grads)
    for _, (p, g, sq, gavg, bufs, s) in ops.groups(params, grads, square_avgs,
                                                   grad_avgs if centered else [],
                                                   momentum_buffers if momentum > 0 else [], steps):
        ops.increment_(s)
        g, _ = _prepare_grads(ops, p, g, maximize, weight_decay)
        ops.mul_(sq, alpha)
        ops.addcmul_(sq, g, g, 1 - alpha)
        if centered:
            ops.lerp_(gavg, g, 1 - alpha)
            avg = ops.addcmul(sq, gavg, gavg, -1)
            ops.sqrt_(avg)
        else:
            avg = ops.sqrt(sq)
        ops.add_scalar_(avg, eps)
        if momentum > 0:
            ops.mul_(bufs, momentum)
            ops.addcdiv_(bufs, g, avg)
            ops.add_(p, bufs, alpha=-lr)
        else:
            ops.addcdiv_(p, g, avg, -lr)


# --------------------------------------------------------------------------- Adagrad

def adagrad_step(
    params: list[Tensor], grads: list[Tensor], state_sums: list[Tensor], steps: list[Tensor], *,
    lr: float, lr_decay: float, weight_decay: float, eps: float, maximize: bool, foreach: bool = False,
    fused: bool = False,
) -> None:
    """Adagrad; sparse gradients are supported (without weight decay, not fused).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_adagrad import adagrad_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> adagrad_step([param], [grad], [tp.zeros(2)], [tp.tensor(0.0)], lr=0.1, lr_decay=0.0, weight_decay=0.0,
        ...              eps=1e-10, maximize=False)
        >>> param.round(decimals=4)
        tensor([0.9000, 0.9000])
    """
    if fused:
        for _, (p, g, sums, s) in groups(True, params, grads, state_sums, steps, real=False):
            torch._foreach_add_(s, 1)
            torch._fused_adagrad_(p, g, sums, s, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                  eps=eps, maximize=maximize)
        return
    if any(g.is_sparse for g in grads):
        if weight_decay != 0:
            raise RuntimeError("adagrad_step: weight_decay is not supported with sparse gradients; "
                               "set weight_decay=0 or pass dense gradients")
        foreach = False
    ops = ListOps.for_step(foreach, params, grads)
    for _, (p, g, sums, s) in ops.groups(params, grads, state_sums, steps):
        ops.increment_(s)
        neg_clrs = [-(lr / (1 + (k - 1) * lr_decay)) for k in _step_values(s)]
        if g[0].is_sparse:
            g, _ = _prepare_grads(ops, p, g, maximize, 0.0)
            _sparse_adagrad(p[0], g[0], sums[0], neg_clrs[0], eps)
            continue
        g, owned = _prepare_grads(ops, p, g, maximize, weight_decay)
        ops.addcmul_(sums, g, g, 1)
        std = ops.sqrt(sums)
        ops.add_scalar_(std, eps)
        if not foreach:
            ops.addcdiv_(p, g, std, neg_clrs)
            continue
        # The foreach path scales the numerator first (see [Note: bitwise parity]).
        if owned:
            ops.mul_(g, neg_clrs)
        else:
            g = ops.mul(g, neg_clrs)
        ops.addcdiv_(p, g, std)


def _sparse_adagrad(param: Tensor, grad: Tensor, state_sum: Tensor, neg_clr: float, eps: float) -> None:
    # The update is not linear in the gradient, so repeated indices must be summed first.
    grad = grad.coalesce()
    indices, values = grad._indices(), grad._values()

    def sparse_like(vals: Tensor) -> Tensor:
        return torch.sparse_coo_tensor(indices, vals, grad.size())

    state_sum.add_(sparse_like(values.pow(2)))
    std_values = state_sum.sparse_mask(grad)._values().sqrt_().add_(eps)
    param.add_(sparse_like(values / std_values), alpha=neg_clr)


# --------------------------------------------------------------------------- Adadelta

def adadelta_step(
    params: list[Tensor], grads: list[Tensor], square_avgs: list[Tensor], acc_deltas: list[Tensor],
    steps: list[Tensor], *, lr: float, rho: float, eps: float, weight_decay: float, maximize: bool,
    foreach: bool = False,
) -> None:
    """Adadelta.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_adadelta import adadelta_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> adadelta_step([param], [grad], [tp.zeros(2)], [tp.zeros(2)], [tp.tensor(0.0)], lr=1.0, rho=0.9, eps=1e-6,
        ...               weight_decay=0.0, maximize=False)
        >>> bool((param < 1).all())
        True
    """
    ops = ListOps.for_step(foreach, params, grads)
    for _, (p, g, sq, acc, s) in ops.groups(params, grads, square_avgs, acc_deltas, steps):
        ops.increment_(s)
        g, _ = _prepare_grads(ops, p, g, maximize, weight_decay)
        ops.mul_(sq, rho)
        ops.addcmul_(sq, g, g, 1 - rho)
        std = ops.add_scalar(sq, eps)
        ops.sqrt_(std)
        deltas = ops.add_scalar(acc, eps)
        ops.sqrt_(deltas)
        ops.div_(deltas, std)
        ops.mul_(deltas, g)
        ops.mul_(acc, rho)
        ops.addcmul_(acc, deltas, deltas, 1 - rho)
        ops.add_(p, deltas, alpha=-lr)


# --------------------------------------------------------------------------- Adamax

def adamax_step(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_infs: list[Tensor],
    steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, foreach: bool = False,
) -> None:
    """Adamax (Adam with the infinity norm).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_adamax import adamax_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> adamax_step([param], [grad], [tp.zeros(2)], [tp.zeros(2)], [tp.tensor(0.0)], lr=0.1, beta1=0.9,
        ...             beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False)
        >>> param.round(decimals=4)
        tensor([0.9000, 0.9000])
    """
    ops = ListOps.for_step(foreach, params, grads)
    for _, (p, g, m, u, s) in ops.groups(params, grads, exp_avgs, exp_infs, steps):
        ops.increment_(s)
        g, _ = _prepare_grads(ops, p, g, maximize, weight_decay)
        ops.lerp_(m, g, 1 - beta1)
        ops.mul_(u, beta2)
        bound = ops.abs(g)
        ops.add_scalar_(bound, eps)
        ops.maximum_(u, bound)
        step_sizes = [-(lr / (1 - beta1**k)) for k in _step_values(s)]
        ops.addcdiv_(p, m, u, step_sizes)


# --------------------------------------------------------------------------- Rprop

def rprop_step(
    params: list[Tensor], grads: list[Tensor], prevs: list[Tensor], step_sizes: list[Tensor],
    steps: list[Tensor], *, step_size_min: float, step_size_max: float, etaminus: float, etaplus: float,
    maximize: bool, foreach: bool = False,
) -> None:
    """Rprop: per-element step sizes grown or shrunk by the sign agreement of successive gradients.

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.optim.functional_rprop import rprop_step
        >>> param, grad = tp.ones(2), tp.full((2,), 0.5)
        >>> rprop_step([param], [grad], [tp.zeros(2)], [tp.full((2,), 0.01)], [tp.tensor(0.0)], step_size_min=1e-6,
        ...            step_size_max=50.0, etaminus=0.5, etaplus=1.2, maximize=False)
        >>> param
        tensor([0.9900, 0.9900])
    """
    ops = ListOps.for_step(foreach, params, grads)
    for _, (p, g, prev, sizes, s) in ops.groups(params, grads, prevs, step_sizes, steps):
        ops.increment_(s)
        g, _ = _prepare_grads(ops, p, g, maximize, 0.0)
        factors = ops.mul(g, prev)
        for factor in factors:
            factor.sign_()
            factor[factor.gt(0)] = etaplus
            factor[factor.lt(0)] = etaminus
            factor[factor.eq(0)] = 1
        ops.mul_(sizes, factors)
        for size in sizes:
            size.clamp_(step_size_min, step_size_max)
        # After a sign change the gradient is forgotten: no move now, nothing to compare next step.
        kept = [torch.where(f.eq(etaminus), 0, grad) for f, grad in zip(factors, g, strict=True)]
        ops.addcmul_(p, [k.sign() for k in kept], sizes, -1)
        ops.copy_(prev, kept)
