"""The ddp_comm_hooks package as a drop-in for PyTorch's: names, signatures, DDPCommHookType, noop, mixed precision.

* Every public module and name of PyTorch's package (and the private hook names DDP looks up) exists in ours,
  with the same parameters (names, kinds, defaults) and dataclass fields.
* ``register_ddp_comm_hook`` for every ``DDPCommHookType`` member registers OUR hook and trains DDP (2 ranks,
  3 steps) bitwise like PyTorch's member. Where PyTorch's member cannot run on CPU/Gloo the oracle is
  PyTorch's function under another name (BF16_COMPRESS: DDP refuses the name ``bf16_compress_hook``
  without CUDA) or our hook registered directly (QUANTIZE_*: PyTorch's fail on Gloo; their math is proven
  in test_quantization_hooks.py), and PyTorch's failure is recorded.
* ``_reducer_allreduce_and_upcast_hook`` does to gradients, parameters and the low-precision copies what
  PyTorch's does, driven by DDP's reducer; PyTorch's then fails at the end of backward on CPU, ours does not.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import weakref
from enum import Enum
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks as torch_package
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_default
import torch.distributed.algorithms.ddp_comm_hooks.mixed_precision_hooks as torch_mp
from torch.nn.parallel.distributed import _MixedPrecision

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.algorithms.ddp_comm_hooks as our_package
from tensorplay.distributed.algorithms.ddp_comm_hooks import mixed_precision_hooks as our_mp
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors, error_of

STEPS = 3

# Private names PyTorch's DDP or PyTorch's tests reach for, per module.
PRIVATE_NAMES = {
    "mixed_precision_hooks": ["_AllreduceUpcastHookState", "_reducer_allreduce_and_upcast_hook"],
    "optimizer_overlap_hooks": ["_OptimInBackwardHookState", "_apply_optim_in_backward_hook",
                                "_OptimizerHookState", "_hook_then_optimizer"],
    "default_hooks": ["_allreduce_fut"],
    "": ["_ddp_comm_hook_wrapper", "_powerSGD_comm_hook_wrapper"],
}


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                 and getattr(v, "__module__", None) == module.__name__]
    return list(names)


def _params(obj: Any) -> list[tuple[str, Any, Any]]:
    if dataclasses.is_dataclass(obj):
        return [(f.name, f.default, f.default_factory) for f in dataclasses.fields(obj)]
    target = obj.__init__ if inspect.isclass(obj) else obj
    return [(p.name, p.kind, p.default) for p in inspect.signature(target).parameters.values()]


def _module_pairs() -> list[tuple[str, Any, Any]]:
    pairs = [("", torch_package, our_package)]
    for info in pkgutil.iter_modules(torch_package.__path__):
        theirs = importlib.import_module(f"{torch_package.__name__}.{info.name}")
        ours = importlib.import_module(f"{our_package.__name__}.{info.name}")  # ImportError: a missing module
        pairs.append((info.name, theirs, ours))
    return pairs


@pytest.mark.parametrize("name,theirs,ours", _module_pairs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_name_exists_with_pytorch_signature(name: str, theirs: Any, ours: Any) -> None:
    for attr in _public_names(theirs) + PRIVATE_NAMES.get(name, []):
        assert hasattr(ours, attr), f"{ours.__name__} lacks {attr}"
        want, got = getattr(theirs, attr), getattr(ours, attr)
        assert got.__module__.startswith("tensorplay."), f"{ours.__name__}.{attr} is not ours"
        if inspect.isclass(want) and issubclass(want, Enum):
            assert [m.name for m in got] == [m.name for m in want]
        elif callable(want):
            assert _params(got) == _params(want), f"{ours.__name__}.{attr}"


def test_package_binds_pytorch_short_module_aliases() -> None:
    for alias in ("debugging", "default", "optimizer_overlap", "powerSGD", "quantization"):
        want = getattr(torch_package, alias).__name__.rsplit(".", 1)[1]
        assert getattr(our_package, alias).__name__ == f"{our_package.__name__}.{want}"


# --- DDPCommHookType / register_ddp_comm_hook ----------------------------------------------------------------

def _torch_bf16_hook(state, bucket):  # noqa: ANN001, ANN201  (DDP refuses PyTorch's by name without CUDA)
    return torch_default.bf16_compress_hook(state, bucket)


def _model() -> tp.nn.Module:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(6, 8), tp.nn.Tanh(), tp.nn.Linear(8, 3))


def _train(register: Any) -> list[torch.Tensor]:
    model = _model()
    ddp = tp.nn.parallel.DistributedDataParallel(model)
    register(ddp)
    opt = tp.optim.SGD(model.parameters(), lr=0.1)
    gen = tp.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(tp.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _oracle(member: str) -> Any:
    """How PyTorch's member is registered here (or, where it cannot run on CPU/Gloo, its stand-in)."""
    if member == "BF16_COMPRESS":
        return lambda ddp: ddp.register_comm_hook(None, _torch_bf16_hook)
    if member.startswith("QUANTIZE"):
        hook = our_package.DDPCommHookType[member].value.keywords["comm_hook"]
        return lambda ddp: ddp.register_comm_hook(None, hook)
    return lambda ddp: torch_package.register_ddp_comm_hook(torch_package.DDPCommHookType[member], ddp)


def hook_type_runs() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for member in our_package.DDPCommHookType:
        ours = _train(lambda ddp, m=member: our_package.register_ddp_comm_hook(m, ddp, state=None))
        results[member.name] = (ours, _train(_oracle(member.name)))
    for member in ("BF16_COMPRESS", "QUANTIZE_PER_TENSOR"):
        results[f"pytorch_{member}"] = error_of(
            _train, lambda ddp, m=member: torch_package.register_ddp_comm_hook(torch_package.DDPCommHookType[m], ddp))
    results["plain"] = _train(lambda ddp: None)
    results["bad_type"] = error_of(our_package.register_ddp_comm_hook, "ALLREDUCE", None)
    return results


@pytest.fixture(scope="module")
def hook_type_results() -> list[dict[str, Any]]:
    return run_distributed(hook_type_runs, world_size=2)


@pytest.mark.parametrize("member", [m.name for m in our_package.DDPCommHookType])
def test_register_ddp_comm_hook_matches_pytorch(hook_type_results: list[dict[str, Any]], member: str) -> None:
    assert our_package.DDPCommHookType[member].value.keywords["comm_hook"].__module__.startswith("tensorplay.")
    for rank, results in enumerate(hook_type_results):
        ours, theirs = results[member]
        assert_equal_tensors(ours, theirs, f"{member}, rank {rank}")
    averaged = member != "NOOP"
    same_on_ranks = all(torch.equal(a, b) for a, b in zip(hook_type_results[0][member][0],
                                                           hook_type_results[1][member][0], strict=True))
    assert same_on_ranks == averaged, member  # noop keeps local gradients: the replicas drift apart


def test_pytorch_members_that_fail_on_cpu(hook_type_results: list[dict[str, Any]]) -> None:
    bf16 = hook_type_results[0]["pytorch_BF16_COMPRESS"]
    assert bf16 is not None and "BF16" in bf16[1].upper(), bf16
    quantize = hook_type_results[0]["pytorch_QUANTIZE_PER_TENSOR"]
    assert quantize is not None and "IndexError" in quantize[1], quantize


def test_register_refuses_a_non_member(hook_type_results: list[dict[str, Any]]) -> None:
    assert hook_type_results[0]["bad_type"] == (
        "TypeError", "register_ddp_comm_hook: comm_hook_type must be a DDPCommHookType member (e.g. "
                     "DDPCommHookType.ALLREDUCE), got 'ALLREDUCE'")


def test_allreduce_member_is_plain_ddp(hook_type_results: list[dict[str, Any]]) -> None:
    for results in hook_type_results:
        assert_equal_tensors(results["ALLREDUCE"][0], results["plain"], "ALLREDUCE vs DDP without a hook")


# --- mixed precision -----------------------------------------------------------------------------------------

class _DDPView:
    """What the mixed-precision hook reads from DDP: its reducer, group, config and module."""

    def __init__(self, ddp: Any, config: _MixedPrecision) -> None:
        self.reducer, self.module, self.mixed_precision = ddp.reducer, ddp.module, config
        self.process_group = dist.group.WORLD


def mixed_precision_run(impl: str, reduce_dtype: torch.dtype) -> dict[str, Any]:
    model = _model()
    ddp = tp.nn.parallel.DistributedDataParallel(model)
    view = _DDPView(ddp, _MixedPrecision(param_dtype=torch.float32, reduce_dtype=reduce_dtype))
    buckets: list[torch.Tensor] = []
    if impl != "plain":
        for p in model.parameters():
            p._fp_param = p.data  # type: ignore[attr-defined]
            p._mp_param = p.data.clone()  # type: ignore[attr-defined]  (freed by the hook)
        module = our_mp if impl == "ours" else torch_mp
        state = module._AllreduceUpcastHookState(ddp_weakref=weakref.ref(view), upcast_stream=torch.Stream())
        ddp.register_comm_hook(state, _recording(module._reducer_allreduce_and_upcast_hook, buckets))
    gen = tp.Generator().manual_seed(10 + dist.get_rank())
    error = error_of(lambda: ddp(tp.randn(4, 6, generator=gen)).square().mean().backward())
    grads = [p.grad.clone() for p in model.parameters()]
    if impl == "plain":
        return {"grads": grads}
    return {"grads": grads, "error": error, "buckets": buckets,
            "mp_storage": [p._mp_param.untyped_storage().size() for p in model.parameters()],  # type: ignore
            "enqueued_after": state.wait_for_stream_enqueued}


def _recording(hook: Any, log: list[torch.Tensor]) -> Any:
    """``hook``, noting each bucket it resolves to (both hooks resolve before returning)."""
    def recording_hook(state, bucket):  # noqa: ANN001, ANN202
        fut = hook(state, bucket)
        log.append(fut.value().clone())
        return fut

    return recording_hook


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_mixed_precision_hook_matches_pytorch(reduce_dtype: torch.dtype) -> None:
    ours = run_distributed(mixed_precision_run, "ours", reduce_dtype, world_size=2)
    theirs = run_distributed(mixed_precision_run, "pytorch", reduce_dtype, world_size=2)
    plain = run_distributed(mixed_precision_run, "plain", reduce_dtype, world_size=2)
    for rank, (o, t, p) in enumerate(zip(ours, theirs, plain, strict=True)):
        # Same averaged buckets, same dtype; same low-precision copies freed.
        assert_equal_tensors(o["buckets"], t["buckets"], f"rank {rank}")
        assert all(b.dtype == reduce_dtype for b in o["buckets"])
        assert o["mp_storage"] == t["mp_storage"] == [0] * 4
        # PyTorch's stops at the end of backward on CPU (before DDP copies the averages into .grad); ours not.
        assert t["error"] is not None and "accelerator" in t["error"][1], t["error"]
        assert o["error"] is None and o["enqueued_after"] is False
        if reduce_dtype == torch.float32:  # sum then halve == halve then sum, exactly
            assert_equal_tensors(o["grads"], p["grads"], f"rank {rank}: vs DDP without a hook")
        else:
            for got, want in zip(o["grads"], p["grads"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
                assert got.dtype == torch.float32


def test_mixed_precision_hook_refuses_a_wrong_state() -> None:
    with pytest.raises(TypeError, match="must be an _AllreduceUpcastHookState, got NoneType"):
        our_mp._reducer_allreduce_and_upcast_hook(None, object())  # type: ignore[arg-type]
