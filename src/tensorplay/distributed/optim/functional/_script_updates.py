"""TorchScript forms of the per-tensor SGD and Adam updates, for steps that run without Python.

An RPC owner of a :class:`~tensorplay.distributed.optim.DistributedOptimizer`
steps its parameters once per training step; run in Python, the functional
optimizer's bookkeeping (argument checks, state lookup, grouping) costs more
than the update itself for small parameters. These modules hold the parameters
and references to the functional optimizer's state tensors, and run the update
as TorchScript. They never create state: a step that meets a parameter without
its state yet (its first step), a sparse gradient or a gradient of the wrong
shape returns False before touching anything, and the caller runs the Python
step instead, which creates the state (or raises its error), then hands the new
state over with ``set_state``.

[Note: script parity] Each update is the per-tensor (``foreach=False``) path of
``_updates`` written out in TorchScript, operation by operation in the same
order, so its results are bitwise those of the Python step, of the
``tp.optim`` class optimizer and of PyTorch's functional optimizers. The
scalars (``1 - beta1``, the bias corrections) are computed in double precision
from the same formulas, as Python does.
"""

# No ``from __future__ import annotations`` here: TorchScript reads the class-level attribute annotations
# as live objects (it cannot resolve them as strings).
import torch
from torch import Tensor

__all__: list[str] = []


def _ready(params: list[Tensor], grads: list[Tensor | None], has_state: list[bool]) -> bool:
    """Whether every parameter with a gradient has its state and a dense gradient of its shape."""
    for i in range(len(params)):
        grad = grads[i]
        if grad is not None and (not has_state[i] or grad.is_sparse or grad.shape != params[i].shape):
            return False
    return True


class _ScriptUpdate(torch.nn.Module):
    """The step loop both updates share; a subclass steps one parameter in ``_step_index``."""

    params: list[Tensor]
    has_state: list[bool]

    @torch.jit.export
    def step(self, grads: list[Tensor | None]) -> bool:
        """One step of the parameters with a gradient; False (nothing done) if one is not ready."""
        if not _ready(self.params, grads, self.has_state):
            return False
        with torch.no_grad():
            for i in range(len(self.params)):
                grad = grads[i]
                if grad is not None:
                    self._step_index(i, grad)
        return True

    def _step_index(self, i: int, grad: Tensor) -> None:
        raise NotImplementedError


class ScriptSGD(_ScriptUpdate):
    """SGD (momentum, dampening, Nesterov, weight decay, maximize) over fixed parameters."""

    params: list[Tensor]
    momentum_buffers: list[Tensor | None]
    has_state: list[bool]

    def __init__(self, params: list[Tensor], lr: float, momentum: float, dampening: float, weight_decay: float,
                 nesterov: bool, maximize: bool) -> None:
        super().__init__()
        self.params = params
        self.momentum_buffers = [None for _ in params]
        # Without momentum SGD keeps no state: every parameter is ready.
        self.has_state = [momentum == 0.0 for _ in params]
        self.lr, self.momentum, self.dampening, self.weight_decay = lr, momentum, dampening, weight_decay
        self.nesterov, self.maximize = nesterov, maximize

    @torch.jit.export
    def set_state(self, states: list[dict[str, Tensor]]) -> None:
        """Take the functional optimizer's per-parameter state (an empty dict: none yet)."""
        for i in range(len(states)):
            if self.momentum != 0.0:
                buf = states[i].get("momentum_buffer")
                self.momentum_buffers[i] = buf
                self.has_state[i] = buf is not None

    def _step_index(self, i: int, grad: Tensor) -> None:
        param, buf = self.params[i], self.momentum_buffers[i]
        if self.maximize:
            grad = torch.neg(grad)
        if self.weight_decay != 0.0:
            grad = grad.add(param, alpha=self.weight_decay)
        if buf is not None:  # momentum != 0: the buffer exists (checked by _ready)
            buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            if self.nesterov:
                grad = grad.add(buf, alpha=self.momentum)
            else:
                grad = buf
        param.add_(grad, alpha=-self.lr)


class ScriptAdam(_ScriptUpdate):
    """Adam (AdamW with ``decoupled_weight_decay``, amsgrad, maximize) over fixed real parameters."""

    params: list[Tensor]
    steps: list[Tensor | None]
    exp_avgs: list[Tensor | None]
    exp_avg_sqs: list[Tensor | None]
    max_exp_avg_sqs: list[Tensor | None]
    has_state: list[bool]

    def __init__(self, params: list[Tensor], lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, amsgrad: bool, maximize: bool, decoupled_weight_decay: bool) -> None:
        super().__init__()
        self.params = params
        self.steps = [None for _ in params]
        self.exp_avgs = [None for _ in params]
        self.exp_avg_sqs = [None for _ in params]
        self.max_exp_avg_sqs = [None for _ in params]
        self.has_state = [False for _ in params]
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, beta1, beta2, eps, weight_decay
        self.amsgrad, self.maximize, self.decoupled_weight_decay = amsgrad, maximize, decoupled_weight_decay

    @torch.jit.export
    def set_state(self, states: list[dict[str, Tensor]]) -> None:
        """Take the functional optimizer's per-parameter state (an empty dict: none yet)."""
        for i in range(len(states)):
            state = states[i]
            self.steps[i] = state.get("step")
            self.exp_avgs[i] = state.get("exp_avg")
            self.exp_avg_sqs[i] = state.get("exp_avg_sq")
            self.max_exp_avg_sqs[i] = state.get("max_exp_avg_sq")
            self.has_state[i] = "step" in state and (not self.amsgrad or "max_exp_avg_sq" in state)

    def _step_index(self, i: int, grad: Tensor) -> None:
        param, step, exp_avg, exp_avg_sq = self.params[i], self.steps[i], self.exp_avgs[i], self.exp_avg_sqs[i]
        max_exp_avg_sq = self.max_exp_avg_sqs[i]
        if step is None or exp_avg is None or exp_avg_sq is None:  # not reached: _ready checked the state
            return
        step += 1
        if self.maximize:
            grad = torch.neg(grad)
        if self.weight_decay != 0.0:
            if self.decoupled_weight_decay:
                param.mul_(1 - self.lr * self.weight_decay)
            else:
                grad = grad.add(param, alpha=self.weight_decay)
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - self.beta2)
        t = float(step.item())
        step_size = -(self.lr / (1 - self.beta1**t))
        bias_correction2_sqrt = (1 - self.beta2**t) ** 0.5
        if max_exp_avg_sq is not None:  # amsgrad
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            denom = max_exp_avg_sq.sqrt()
        else:
            denom = exp_avg_sq.sqrt()
        denom.div_(bias_correction2_sqrt)
        denom.add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=step_size)
