"""The hook behind DDP's native mixed precision: reduce in ``reduce_dtype``, then restore full precision.

DDP constructed with ``mixed_precision=`` computes forward and backward in
``param_dtype`` copies of the parameters. Its hook, per bucket: cast the bucket
to ``reduce_dtype`` when that differs, run the reducer's own all-reduce, divide
by the group size, then point every parameter back at its full-precision
storage (freeing the low-precision copy, rebuilt next forward) and cast its
gradient to the parameter's dtype, so the optimizer steps in full precision.
At the end of backward a callback removes the per-iteration hooks DDP
installed and restores parameters that take no gradient.

Unlike PyTorch's hook, this one also runs without an accelerator: the upcast
runs on ``upcast_stream`` only when that is an accelerator stream, and the
end-of-backward wait for it is skipped on CPU (PyTorch's asks for the current
accelerator stream there and fails). PyTorch's DDP registers PyTorch's own hook
when constructed with ``mixed_precision=`` (and on CPU its forward already fails,
recording a stream event); this one is for code that builds the state itself.

DDP compares hook annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]``, so this module keeps real annotations.
"""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Variable

import tensorplay.distributed as dist

__all__: list[str] = []


@dataclass
class _AllreduceUpcastHookState:
    """A weak reference to the DDP module (for its reducer, group and config) and the stream to upcast on."""

    ddp_weakref: Any
    upcast_stream: torch.Stream
    wait_for_stream_enqueued: bool = False


def _on_accelerator(stream: torch.Stream) -> bool:
    return stream.device.type != "cpu"


def _free_storage(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s storage (it is re-allocated by the next forward's cast)."""
    with torch.no_grad():
        storage = tensor.untyped_storage()
        if storage.size() > 0:
            storage.resize_(0)


def _reducer_allreduce_and_upcast_hook(hook_state: _AllreduceUpcastHookState,
                                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in ``reduce_dtype`` with the reducer's own collective; upcast parameters and grads."""
    ddp = _live_ddp(hook_state)
    config = ddp.mixed_precision
    if config.param_dtype != config.reduce_dtype:
        bucket.set_buffer(bucket.buffer().to(config.reduce_dtype))
    reduced = ddp.reducer._run_allreduce_hook(bucket)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    stream = hook_state.upcast_stream
    with stream if _on_accelerator(stream) else contextlib.nullcontext():
        reduced.wait()
        bucket.buffer().div_(ddp.process_group.size())
        result.set_result(bucket.buffer())
        for param in bucket.parameters():
            _upcast(param)
    if not hook_state.wait_for_stream_enqueued:
        Variable._execution_engine.queue_callback(lambda: _end_of_backward(hook_state))
        hook_state.wait_for_stream_enqueued = True
    return result


def _upcast(param: Any) -> None:
    """Point ``param`` back at its full-precision storage, free the low-precision copy, upcast its grad."""
    param.data = param._fp_param
    _free_storage(param._mp_param)
    param.grad.data = param.grad.to(param.data.dtype)


def _live_ddp(hook_state: Any) -> Any:
    if not isinstance(hook_state, _AllreduceUpcastHookState):
        raise TypeError(f"_reducer_allreduce_and_upcast_hook: the hook state must be an _AllreduceUpcastHookState, "
                        f"got {type(hook_state).__name__}")
    ddp = hook_state.ddp_weakref()
    if ddp is None:
        raise RuntimeError("_reducer_allreduce_and_upcast_hook: the DDP module of this hook state no longer exists")
    return ddp


def _end_of_backward(hook_state: _AllreduceUpcastHookState) -> None:
    stream = hook_state.upcast_stream
    if _on_accelerator(stream):
        torch.accelerator.current_stream().wait_stream(stream)
    ddp = hook_state.ddp_weakref()
    for _, param in ddp.module.named_parameters():
        # DDP re-installs these per-iteration gradient hooks at the next forward.
        if hasattr(param, "_ddp_mp_hook_state"):
            param._ddp_mp_hook_state[1].remove()
            delattr(param, "_ddp_mp_hook_state")
        # Parameters without gradients were cast for forward but never reach the hook.
        if not param.requires_grad and not hasattr(param, "_ddp_ignored"):
            param.data = param._fp_param
    hook_state.wait_for_stream_enqueued = False
