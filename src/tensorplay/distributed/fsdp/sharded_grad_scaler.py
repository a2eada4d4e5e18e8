"""ShardedGradScaler: AMP loss scaling whose skip-or-step decision is shared by every rank.

A plain :class:`~tensorplay.amp.GradScaler` looks for inf/NaN only in the
gradients this process holds. Under sharding (fully_shard, classic FSDP, ZeRO)
each rank holds a different slice, so one rank could step on a healthy slice
while another skips an overflowed one, and the replicas drift apart. Here
``unscale_`` checks the local slice, then all-reduces the overflow flag over the
process group, so every rank skips, backs off and grows the scale together.
"""

from __future__ import annotations

import warnings
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.amp.grad_scaler import OptState
from tensorplay.distributed._checks.load_check import check_load
from tensorplay.distributed._checks.validation import (
    check_bool,
    check_instance,
    check_int,
    check_process_group,
    check_real,
)
from tensorplay.distributed._comm import collectives
from tensorplay.distributed.tensor import DTensor

__all__ = ["ShardedGradScaler"]

_DeviceFlags = dict[torch.device, torch.Tensor]
_GradBuckets = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]

_warned_cuda_fallback = False

#: The entries of a scaler's state dict (``GradScaler.state_dict``).
_SCALER_STATE = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and value.numel() == 1)


def _resolve_device(device: str, enabled: bool) -> str:
    """``device``, or ``"cpu"`` when ``"cuda"`` is asked for on a machine without CUDA (warned once)."""
    global _warned_cuda_fallback
    if device != "cuda" or not enabled or torch.cuda.is_available():
        return device
    if not _warned_cuda_fallback:
        _warned_cuda_fallback = True
        warnings.warn(
            "ShardedGradScaler: device='cuda' but CUDA is not available; scaling on the device of the "
            "loss and gradients (CPU) instead of disabling. Pass device='cpu' to silence this warning.",
            UserWarning, stacklevel=3,
        )
    return "cpu"


def _local_values(param: torch.Tensor, allow_fp16: bool) -> torch.Tensor:
    """The gradient values this rank holds for ``param``, as a tensor that can be unscaled in place.

    A DTensor gradient gives its local shard; a sparse gradient its values, after
    coalescing fp16 ones (summed in fp32) so duplicate indices cannot hide an
    overflow that the sum would produce.
    """
    grad = param.grad
    if grad is None:
        raise ValueError(f"cannot unscale a parameter without a gradient (shape {tuple(param.shape)})")
    if (not allow_fp16) and grad.dtype == torch.float16:
        raise ValueError("Attempting to unscale FP16 gradients.")
    if isinstance(grad, DTensor):
        return grad.to_local()  # under no_grad: the shard's own storage, not a copy
    if not grad.is_sparse:
        return grad
    if grad.dtype == torch.float16:
        param.grad = grad.float().coalesce().to(torch.float16)
    coalesced = param.grad
    assert coalesced is not None  # set just above or kept from the caller's check
    return coalesced._values()


def _bucket_local_grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> _GradBuckets:
    """This rank's gradient values of ``optimizer``'s parameters, grouped by device, then dtype."""
    buckets: _GradBuckets = defaultdict(lambda: defaultdict(list))
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                values = _local_values(param, allow_fp16)
                buckets[values.device][values.dtype].append(values)
    return buckets


def _check_scaler_args(device: Any, init_scale: Any, backoff_factor: Any, growth_factor: Any,
                       growth_interval: Any, enabled: Any, process_group: Any) -> None:
    """Clear errors where ``GradScaler`` asserts (``growth_factor=0.5``) or fails later (``init_scale="x"``)."""
    where = "ShardedGradScaler"
    check_instance(device, (str, torch.device), "device", where, hint="e.g. 'cuda' or 'cpu'")
    check_real(init_scale, "init_scale", where, above=0.0)
    check_real(backoff_factor, "backoff_factor", where, above=0.0, below=1.0)
    check_real(growth_factor, "growth_factor", where, above=1.0)
    check_int(growth_interval, "growth_interval", where, minimum=1)
    check_bool(enabled, "enabled", where)
    check_process_group(process_group, "process_group", where)


class ShardedGradScaler(torch.amp.GradScaler):
    """Gradient scaler for sharded training: every rank skips, backs off and grows the scale together.

    Same interface as :class:`~tensorplay.amp.GradScaler` (``scale``, ``unscale_``,
    ``step``, ``update``, ``get_scale``, ``state_dict``, ...). ``unscale_(optimizer)``
    unscales only the gradient values this rank holds (plain tensors, flat
    parameter shards, the local shard of DTensor gradients, the values of sparse
    gradients; fp16 and bf16 allowed), then all-reduces one overflow flag over
    ``process_group``. Every rank must therefore call ``unscale_`` / ``step`` for the
    same optimizers in the same order, including a rank whose optimizer holds no
    gradient this step: it joins the all-reduce with a zero flag.

    Args:
        device: device type of the scale, as in ``GradScaler``. Differs from
            PyTorch: ``"cuda"`` (the default) on a machine without CUDA does not
            disable the scaler; it warns once and scales on the CPU, so the same
            script scales for real on a CPU-only Gloo group.
        init_scale, backoff_factor, growth_factor, growth_interval, enabled: as
            in ``GradScaler`` (note the ``backoff_factor`` / ``growth_factor`` order).
        process_group: group the overflow flag is reduced over; ``None`` is the
            default group. Without an initialised process group the scaler acts
            as a single-rank one.

    The flag is reduced on the scale's device, except that a CPU scale with an
    accelerator ``device`` is reduced on that accelerator (NCCL cannot reduce
    host tensors). Optimizers that unscale inside their own step
    (``_step_supports_amp_scaling``, e.g. fused Adam) get the all-reduced flag too
    (PyTorch's checks only the local shard on that path).

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import fully_shard
        >>> from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        >>> model = tp.nn.Linear(8, 4)
        >>> fully_shard(model)
        FSDPLinear(...)
        >>> optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = ShardedGradScaler(device="cpu")
        >>> loss = model(tp.randn(2, 8)).sum()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(optimizer)       # skipped on every rank if any rank's gradients overflowed
        >>> scaler.update()              # the same new scale on every rank
        >>> scaler.get_scale()
        65536.0
    """

    process_group: dist.ProcessGroup | None

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_scaler_args(device, init_scale, backoff_factor, growth_factor, growth_interval, enabled, process_group)
        super().__init__(
            _resolve_device(device, enabled), init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled,
        )
        self.process_group = process_group

    def scale(self, outputs: Any) -> Any:  # GradScaler's overloads: Tensor, list, tuple, iterable
        """Multiply ``outputs`` (a tensor or nested iterable of tensors) by the scale, keeping each dtype.

        The dtype is kept so a low-precision loss (fp16/bf16 under mixed
        precision) backpropagates low-precision gradients, as FSDP expects.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            assert self._scale is not None  # set by the lazy init
            return (outputs * self._scale.to(outputs.device, non_blocking=True)).to(outputs.dtype)
        if isinstance(outputs, abc.Iterable):
            scaled: Iterable[Any] = map(self.scale, outputs)
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise ValueError(f"outputs must be a Tensor or an iterable of Tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's gradient values by the scale; agree with every rank on whether any overflowed.

        Raises ``RuntimeError`` when called twice for ``optimizer`` before
        ``update()``, or after ``step(optimizer)``, as ``GradScaler`` does.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # The reciprocal in fp64: a power-of-two scale then unscales exactly.
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        self._all_reduce_found_inf(state["found_inf_per_device"])
        state["stage"] = OptState.UNSCALED

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> _DeviceFlags:
        """Unscale this rank's gradient values in place; return one local overflow flag per device.

        A rank with no gradient values still gets a (zero) flag on ``found_inf``'s
        device, so it has something to all-reduce and to step/update with.
        """
        flags: _DeviceFlags = {}
        with torch.no_grad():
            for device, by_dtype in _bucket_local_grads(optimizer, allow_fp16).items():
                flags[device] = found_inf.to(device, copy=True)
                device_inv_scale = inv_scale.to(device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], device_inv_scale)
        return flags or {found_inf.device: found_inf.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the scaler state (from :meth:`state_dict`), all or nothing.

        Unlike ``GradScaler`` (which sets the entries it finds before failing on
        a missing one), every missing, unexpected or non-numeric entry is listed
        in one :class:`StateDictLoadError` before anything changes. A disabled
        scaler ignores the call; an empty state dict raises as in PyTorch.
        """
        if self._enabled and state_dict:
            check_instance(state_dict, dict, "state_dict", "ShardedGradScaler.load_state_dict")
            bad = [f"{key}: expected a number, got {type(state_dict[key]).__name__}" for key in _SCALER_STATE
                   if key in state_dict and not _is_number(state_dict[key])]
            check_load(dict.fromkeys(_SCALER_STATE), state_dict, where="ShardedGradScaler", extra=bad)
        super().load_state_dict(state_dict)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:  # type: ignore[override]
        # The path of optimizers that unscale themselves (fused Adam): the flag must be global there too.
        flags = super()._check_inf_per_device(optimizer)
        self._all_reduce_found_inf(flags)  # type: ignore[arg-type]  # keyed by device at run time
        return flags

    def _all_reduce_found_inf(self, flags: _DeviceFlags) -> None:
        """Replace every local flag by the number of overflowed devices over the whole group.

        One all-reduce per call whatever the devices, so ranks whose gradients
        live on different devices (or nowhere) issue matching collectives.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        reduce_device = self._reduce_device()
        total = torch.zeros((), dtype=torch.float32, device=reduce_device)
        for flag in flags.values():
            total += flag.to(reduce_device)
        collectives.all_reduce(total, self.process_group, where="ShardedGradScaler found_inf")
        for flag in flags.values():
            flag.copy_(total)

    def _reduce_device(self) -> torch.device:
        if self._scale is None:
            raise RuntimeError("ShardedGradScaler: no scale yet; call scale(loss) before unscale_/step")
        scale_device = self._scale.device
        if scale_device.type == "cpu" and self._device != "cpu":
            return torch.device(self._device)
        return scale_device
