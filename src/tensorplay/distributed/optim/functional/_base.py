"""What every functional optimizer shares: its parameters, its state, input checks.

A functional optimizer takes gradients as arguments instead of reading
``param.grad``, so a communication hook, a remote worker or an autograd hook can
step it with gradients it holds itself. Subclasses declare the per-parameter
state they keep (:meth:`_FunctionalOptimizer._init_state`) and run the update
(:meth:`_FunctionalOptimizer._update`) through ``_updates``.

``state[param]`` has the keys the ``tp.optim`` class optimizer uses ("step",
"exp_avg", ...), so state moves between the two forms as is.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from tensorplay.distributed.optim._deprecation_warning import warn_on_construction

__all__: list[str] = []


class _FunctionalOptimizer:
    """Base of the ``_Functional*`` classes: one parameter group, state keyed by parameter."""

    #: Class optimizer name used in messages ("Adam" for ``_FunctionalAdam``).
    _optimizer_name: str = ""
    defaults: dict[str, float]
    state: dict[Tensor, dict[str, Tensor]]
    param_group: dict[str, list[Tensor]]

    def __init__(self, params: Iterable[Tensor], allow_empty: bool) -> None:
        warn_on_construction()  # PyTorch's TorchScript deprecation notice (see _deprecation_warning)
        if isinstance(params, Tensor) or not isinstance(params, Iterable):
            raise TypeError(f"{type(self).__name__}: params must be an iterable of Tensors (e.g. "
                            f"model.parameters()), got {params!r} ({type(params).__name__})")
        params = list(params)
        for index, param in enumerate(params):
            _check_param(param, f"params[{index}]", type(self).__name__)
        if not params and not allow_empty:
            raise ValueError(f"{type(self).__name__} got an empty parameter list; pass at least one tensor, "
                             "or _allow_empty_param_list=True to add parameters through step_param")
        self.state = {}
        # One group only: per-group options are what the class optimizers are for.
        self.param_group = {"params": params}

    def _set_kernel_path(self, foreach: bool | None, fused: bool | None = False) -> None:
        """Record ``foreach`` / ``fused`` (None means False), refusing both at once or fused on bad tensors."""
        if foreach and fused:
            raise ValueError(f"{type(self).__name__}: foreach=True and fused=True cannot be set together; "
                             "choose one")
        if fused:
            check_fused(self.param_group["params"], type(self).__name__)
        self.foreach = bool(foreach)
        self.fused = bool(fused)

    # ------------------------------------------------------------------ public steps

    def step(self, gradients: Sequence[Tensor | None]) -> None:
        """One step of every parameter; ``gradients[i]`` belongs to ``params[i]`` (None: skip it)."""
        params = self.param_group["params"]
        if len(params) != len(gradients):
            raise ValueError(
                f"{type(self).__name__}.step got {len(gradients)} gradients for {len(params)} parameters; "
                "pass one gradient (or None) per parameter, in the order the parameters were given")
        # The parameters were checked at construction.
        self._step_checked(*self._with_grads(params, gradients, "gradients"))

    def step_param(self, param: Tensor, grad: Tensor | None) -> None:
        """One step of a single parameter (state created on first use); a None ``grad`` is a no-op."""
        if grad is None:
            return
        _check_param(param, "param", f"{type(self).__name__}.step_param")
        self._check_grad(param, grad, "grad")
        self._step_checked([param], [grad])

    def step_params(self, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """:meth:`step_param` over several parameters at once (one foreach step for all)."""
        if len(params) != len(grads):
            raise ValueError(f"{type(self).__name__}.step_params got {len(grads)} gradients for "
                             f"{len(params)} parameters; pass one gradient (or None) per parameter")
        self._step_checked(*self._with_grads(params, grads, "grads", f"{type(self).__name__}.step_params"))

    # ------------------------------------------------------------------ subclass contract

    def _init_state(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        """The state of a parameter before its first step."""
        raise NotImplementedError

    def _update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        """Run one step on ``params`` (all with a gradient) under ``torch.no_grad``."""
        raise NotImplementedError

    def _sparse_refusal(self) -> str | None:
        """Why sparse gradients are refused under the current options, or None if accepted."""
        return f"{self._optimizer_name} does not support sparse gradients"

    def _script_update(self) -> torch.nn.Module | None:
        """This optimizer's update as a ``_script_updates`` module sharing its parameters, or None where it
        has none for these options (foreach, fused, tensor hyper-parameters ...): then only the Python
        step runs."""
        return None

    def _float_defaults(self) -> dict[str, float] | None:
        """``defaults`` as Python floats, or None if one is a tensor (TorchScript modules take floats)."""
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.defaults.values()):
            return None
        return {k: float(v) for k, v in self.defaults.items()}

    # ------------------------------------------------------------------ helpers

    def _with_grads(self, params: Sequence[Tensor], grads: Sequence[Tensor | None], grads_name: str,
                    check_params_as: str | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """The parameters that have a gradient and their gradients, each checked (the parameter too when
        ``check_params_as`` names the caller)."""
        stepped, kept = [], []
        for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
            if grad is None:
                continue
            if check_params_as is not None:
                _check_param(param, f"params[{index}]", check_params_as)
            self._check_grad(param, grad, f"{grads_name}[{index}]")
            stepped.append(param)
            kept.append(grad)
        return stepped, kept

    def _step_checked(self, params: list[Tensor], grads: list[Tensor]) -> None:
        if not params:
            return
        states = [self._state_of(p, g) for p, g in zip(params, grads, strict=True)]
        with torch.no_grad():
            self._update(params, grads, states)

    def _state_of(self, param: Tensor, grad: Tensor) -> dict[str, Tensor]:
        state = self.state.get(param)
        if state is None:
            state = self.state[param] = self._init_state(param, grad)
        return state

    def _check_grad(self, param: Tensor, grad: Tensor, where: str) -> None:
        if not isinstance(grad, Tensor):
            raise TypeError(f"{type(self).__name__}: {where} must be a Tensor or None, got {type(grad).__name__}")
        if grad.is_sparse:
            reason = self._sparse_refusal()
            if reason is not None:
                raise RuntimeError(f"{type(self).__name__}: {where} is a sparse gradient, but {reason}; "
                                   "densify it with .to_dense() or use an optimizer that accepts sparse "
                                   "gradients (SGD, Adagrad)")
        if grad.shape != param.shape:
            raise ValueError(f"{type(self).__name__}: {where} has shape {tuple(grad.shape)} but its parameter "
                             f"has shape {tuple(param.shape)}")


def _check_param(param: object, where: str, owner: str) -> None:
    if not isinstance(param, Tensor):
        raise TypeError(f"{owner}: {where} must be a Tensor, got {type(param).__name__}")
    if not param.is_leaf:
        raise ValueError(
            f"{owner}: {where} is not a leaf tensor (it was computed by {type(param.grad_fn).__name__}); an "
            "optimizer can only update leaf tensors. Pass the parameter itself, not a view or result of it")


def scalar_dtype() -> torch.dtype:
    """dtype of the "step" counter: float64 under a float64 default dtype, else float32 (as tp.optim)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def new_step(param: Tensor, on_param_device: bool = False) -> Tensor:
    """A zero "step" counter: on the CPU, or (fused kernels) a float32 one on the parameter's device."""
    if on_param_device:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0, dtype=scalar_dtype())


def zeros_like(param: Tensor) -> Tensor:
    """A zero state tensor shaped, strided and placed like ``param``."""
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def check_range(name: str, value: float, low: float, high: float | None = None, *, owner: str,
                include_high: bool = False) -> None:
    """``low <= value`` (and ``value < high``, or ``<=`` with include_high), else a ValueError naming it."""
    if not isinstance(value, (numbers.Real, Tensor)) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a real number, got {value!r} ({type(value).__name__})")
    above = high is not None and (value > high if include_high else value >= high)
    if not value >= low or above:  # written so that NaN fails too
        bound = f"in [{low}, {high}{']' if include_high else ')'}" if high is not None else f">= {low}"
        raise ValueError(f"{owner}: invalid {name}={value}; it must be {bound}")


def check_nonnegative(owner: str, **options: float) -> None:
    """Each of ``options`` must be a real number >= 0 (the error names ``owner`` and the option)."""
    for name, value in options.items():
        check_range(name, value, 0.0, owner=owner)


def check_betas(owner: str, betas: tuple[float, float]) -> None:
    """``betas`` must be a pair of numbers in [0, 1) (the error names ``owner``)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{owner}: betas must be a pair of floats (beta1, beta2), got {betas!r}")
    check_range("betas[0]", betas[0], 0.0, 1.0, owner=owner)
    check_range("betas[1]", betas[1], 0.0, 1.0, owner=owner)


def check_fused(params: Iterable[Tensor], owner: str) -> None:
    """Fused kernels take floating-point tensors on CPU, CUDA, MPS, XPU or the PrivateUse1 device."""
    supported = {"cpu", "cuda", "mps", "xpu", torch._C._get_privateuse1_backend_name()}
    for index, p in enumerate(params):
        if not (p.is_floating_point() and p.device.type in supported):
            raise RuntimeError(f"{owner}: fused=True needs floating-point tensors on one of {sorted(supported)}, "
                               f"but params[{index}] is {p.dtype} on {p.device}; use foreach=True instead")
