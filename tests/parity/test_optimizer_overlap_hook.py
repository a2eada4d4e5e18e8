"""The DDP optimizer-overlap hook on 2 Gloo ranks.

Oracles, same seed and per-rank data: DDP with its built-in all-reduce plus a
plain ``optimizer.step()``, and DDP with PyTorch's own ``_hook_then_optimizer``
(Adam, AdamW, SGD: the functional optimizers PyTorch gives ``step_param``).
Bitwise: DDP's all-reduce and the all-reduce hook both divide by the world size
and sum, and the functional steps are the class optimizers' kernels.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

STEPS = 3

# (class name, kwargs): all eight functional optimizers step through the hook.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    ("AdamW", {"lr": 0.01, "foreach": True}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Adagrad", {"lr": 0.05, "lr_decay": 0.01}),
    ("Adadelta", {"lr": 0.5, "weight_decay": 0.1}),
    ("Adamax", {"lr": 0.01, "maximize": True}),
    ("Rprop", {"lr": 0.01, "etas": (0.4, 1.3)}),
]
PYTORCH_HAS_STEP_PARAM = {"SGD", "Adam", "AdamW"}


def _model() -> tp.nn.Module:
    torch.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(6, 16), tp.nn.ReLU(), tp.nn.Linear(16, 8), tp.nn.ReLU(),
                            tp.nn.Linear(8, 2))


def _ddp(model: tp.nn.Module) -> tp.nn.parallel.DistributedDataParallel:
    # A tiny bucket cap gives several buckets, so steps really interleave with communication.
    return tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randn(4, 6, generator=gen) for _ in range(STEPS)]


def _train_plain(name: str, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    ddp = _ddp(_model())
    optim = getattr(tp.optim, name)(ddp.parameters(), **kwargs)
    for x in _batches():
        ddp(x).pow(2).sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in ddp.parameters()]


def _train_hooked(name: str, kwargs: dict[str, Any], impl: str, owned: slice | None = None) -> list[torch.Tensor]:
    """DDP with an optimizer-overlap hook; with ``owned``, the hook steps only those parameters and a
    plain optimizer steps the rest after backward."""
    if impl == "ours":
        from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
            _hook_then_optimizer,
            _OptimizerHookState,
        )
        from tensorplay.distributed.optim.utils import as_functional_optim
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
            _hook_then_optimizer,
            _OptimizerHookState,
        )
        from torch.distributed.optim import as_functional_optim
    ddp = _ddp(_model())
    params = list(ddp.parameters())
    hooked = params[owned] if owned is not None else None
    rest = [p for p in params if hooked is not None and all(p is not h for h in hooked)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        functional = as_functional_optim(getattr(tp.optim, name), **kwargs)
    ddp.register_comm_hook(None, _hook_then_optimizer(allreduce_hook, _OptimizerHookState(functional, hooked)))
    plain = getattr(tp.optim, name)(rest, **kwargs) if rest else None
    for x in _batches():
        ddp(x).pow(2).sum().backward()
        if plain is not None:
            plain.step()
        ddp.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


def overlap_runs() -> dict[str, list[torch.Tensor]]:
    results: dict[str, list[torch.Tensor]] = {}
    for name, kwargs in CONFIGS:
        results[f"{name}/plain"] = _train_plain(name, kwargs)
        results[f"{name}/ours"] = _train_hooked(name, kwargs, "ours")
        if name in PYTORCH_HAS_STEP_PARAM:
            results[f"{name}/pytorch"] = _train_hooked(name, kwargs, "pytorch")
    results["subset/ours"] = _train_hooked("Adam", {"lr": 0.01}, "ours", owned=slice(0, 3))
    results["subset/pytorch"] = _train_hooked("Adam", {"lr": 0.01}, "pytorch", owned=slice(0, 3))
    results["subset/plain"] = _train_plain("Adam", {"lr": 0.01})
    return results


def _assert_equal(expected: list[torch.Tensor], actual: list[torch.Tensor], what: str) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(e, a), f"{what}: parameter {i} differs by {(e - a).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, list[torch.Tensor]]]:
    return run_distributed(overlap_runs, world_size=2)


@pytest.mark.parametrize("name", [name for name, _ in CONFIGS] + ["subset"])
def test_hook_matches_ddp_plus_step_and_pytorch(per_rank, name: str) -> None:
    for rank, results in enumerate(per_rank):
        start = _model()
        plain = results[f"{name}/plain"]
        moved = any(not torch.equal(s.detach(), r) for s, r in zip(start.parameters(), plain, strict=True))
        assert moved, f"rank {rank}: {name} did not train"
        _assert_equal(results[f"{name}/plain"], results[f"{name}/ours"], f"rank {rank} {name}: ours vs DDP+step")
        if f"{name}/pytorch" in results:
            _assert_equal(results[f"{name}/pytorch"], results[f"{name}/ours"], f"rank {rank} {name}: vs PyTorch")
    _assert_equal(per_rank[0][f"{name}/ours"], per_rank[1][f"{name}/ours"], f"{name}: ranks diverged")


def test_state_without_step_param_is_refused() -> None:
    from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import _OptimizerHookState

    with pytest.raises(ValueError, match=r"SGD has no step_param\(param, grad\) method.*as_functional_optim"):
        _OptimizerHookState(tp.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))


class _FakeBucket:
    """The three GradBucket methods the wrapper uses, over one flat buffer."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._buffer = torch.cat([torch.ones_like(p).flatten() for p in params])
        pieces = self._buffer.split([p.numel() for p in params])
        self._grads = [g.view_as(p) for g, p in zip(pieces, params, strict=True)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads


def _wrapped(hook):
    from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
        _hook_then_optimizer,
        _OptimizerHookState,
    )
    from tensorplay.distributed.optim.utils import as_functional_optim

    return _hook_then_optimizer(hook, _OptimizerHookState(as_functional_optim(tp.optim.SGD, lr=0.5)))


def test_failed_communication_fails_the_step() -> None:
    params = [torch.zeros(2), torch.zeros(3)]

    def failing_hook(state, bucket):
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_exception(RuntimeError("all-reduce lost a peer"))
        return fut

    result = _wrapped(failing_hook)(None, _FakeBucket(params))
    with pytest.raises(RuntimeError, match="all-reduce lost a peer"):
        result.wait()
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params), "stepped on un-reduced gradients"


def test_hook_result_is_adopted_before_the_step() -> None:
    params = [torch.zeros(2), torch.zeros(3)]

    def returns_a_copy(state, bucket):  # e.g. a compression hook that decompresses into a new tensor
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(torch.full_like(bucket.buffer(), 4.0))
        return fut

    bucket = _FakeBucket(params)
    out = _wrapped(returns_a_copy)(None, bucket).wait()
    assert out is bucket.buffer() and torch.equal(out, torch.full((5,), 4.0))
    assert all(torch.equal(p, torch.full_like(p, -2.0)) for p in params)  # 0 - 0.5 * 4
