"""DistributedOptimizer over RPC: parity with a local model and with PyTorch's, concurrency, bad input.

Three TensorPipe workers. In the parity run worker0 is the driver (it owns the
first layer), worker1 owns a RemoteModule and worker2 a plain remote weight.
Several checks share one RPC run (each run spawns fresh processes).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.optim as torch_dist_optim

import tensorplay as tp
import tensorplay.distributed.autograd as dist_autograd
import tensorplay.distributed.rpc as rpc
from tensorplay.distributed.nn import RemoteModule
from tensorplay.distributed.optim.functional_sgd import _FunctionalSGD
from tensorplay.distributed.optim.optimizer import _REGISTRY, DistributedOptimizer, _step_registered
from tensorplay.distributed.optim.utils import register_functional_optim
from tensorplay.testing.distributed import RankFailure, run_rpc

from tests.common import error_of

STEPS = 3
#: (optimizer class, kwargs, runs in its functional form); NAdam has no functional form.
OPTIMIZERS: dict[str, tuple[type, dict[str, Any], bool]] = {
    "sgd": (tp.optim.SGD, {"lr": 0.05, "momentum": 0.9}, True),
    "adam": (tp.optim.Adam, {"lr": 0.01}, True),
    "nadam": (tp.optim.NAdam, {"lr": 0.01}, False),
}


# --- pieces that run on the owners -------------------------------------------

def _new_param(value: torch.Tensor) -> torch.Tensor:
    return value.clone().requires_grad_()


def _tanh_matmul(weight_rref: rpc.RRef, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) @ weight_rref.local_value()


def _load_module(module_rref: rpc.RRef, state: dict[str, torch.Tensor]) -> None:
    module_rref.local_value().load_state_dict(state)


def _fetch(rref: rpc.RRef) -> torch.Tensor:
    return rref.local_value().detach().clone()


def _make_list() -> list[int]:
    return [1, 2, 3]


def _owner_step_is_scripted(key: int) -> bool:
    """Whether this owner's step now runs in TorchScript: compiled, and holding the state of every parameter."""
    script = _REGISTRY[key]._script
    return script is not None and all(script.update.has_state)


# --- the model: local, and split over three workers --------------------------

class _LocalModel(tp.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = tp.nn.Linear(4, 6)
        self.middle = tp.nn.Linear(6, 5)
        self.last = tp.nn.Parameter(tp.randn(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.middle(self.first(x))) @ self.last

    def values(self) -> list[torch.Tensor]:
        """In the split model's order: first, middle, last."""
        return [p.detach().clone() for p in [*self.first.parameters(), *self.middle.parameters(), self.last]]


class _SplitModel:
    """``first`` on the driver, ``middle`` a RemoteModule on worker1, ``last`` on worker2."""

    def __init__(self, reference: _LocalModel) -> None:
        self.first = tp.nn.Linear(4, 6)
        self.first.load_state_dict(reference.first.state_dict())
        self.middle = RemoteModule("worker1/cpu", tp.nn.Linear, args=(6, 5))
        rpc.rpc_sync("worker1", _load_module, args=(self.middle.get_module_rref(), reference.middle.state_dict()))
        self.last = rpc.remote("worker2", _new_param, args=(reference.last.detach(),))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.middle.forward(self.first(x))
        return rpc.rpc_sync("worker2", _tanh_matmul, args=(self.last, h))

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.first.parameters()] + self.middle.remote_parameters() + [self.last]

    def values(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.first.parameters()] + [
            rpc.rpc_sync(r.owner(), _fetch, args=(r,)) for r in self.middle.remote_parameters() + [self.last]]


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(8, 4, generator=gen) for _ in range(STEPS)]


def _train_local(optimizer_class: type, kwargs: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _LocalModel()
    optimizer = optimizer_class(model.parameters(), **kwargs)
    for x in _batches():
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.values()


def _train_split(dist_optimizer_class: type, optimizer_class: type, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = _SplitModel(_LocalModel())
    optimizer = dist_optimizer_class(optimizer_class, model.parameter_rrefs(), **kwargs)
    for x in _batches():
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [model(x).pow(2).sum()])
            optimizer.step(context_id)
    return model.values(), optimizer


def _summary(values: list[torch.Tensor], optimizer: DistributedOptimizer) -> dict[str, Any]:
    return {"values": values, "functional": optimizer.is_functional_optim,
            "script_step": isinstance(optimizer._step_function, torch.jit.ScriptFunction),
            "script_owners": [rpc.rpc_sync(owner.worker, _owner_step_is_scripted, args=(owner.key,))
                              for owner in optimizer._owners]}


# --- concurrency: two trainers, one parameter server (worker0) ----------------

_SHARED: dict[str, torch.Tensor] = {}
_SHARED_LOCK = threading.Lock()
TRAINER_STEPS = 20


def _shared_param(name: str) -> torch.Tensor:
    with _SHARED_LOCK:
        return _SHARED.setdefault(name, torch.zeros(20_000, requires_grad=True))


def _known_grad(trainer: int, step: int) -> torch.Tensor:
    return torch.full((20_000,), float(trainer * 100 + step))


def _weighted_sum(param_rref: rpc.RRef, weight: torch.Tensor) -> torch.Tensor:
    return (param_rref.local_value() * weight).sum()


class _SlowSGD(tp.optim.SGD):
    """SGD that yields the GIL inside its step, so unserialized steps would interleave and lose updates."""

    def step(self, closure=None):  # type: ignore[override]
        time.sleep(0.005)
        return super().step(closure)


@torch.jit.ignore
def _yield_gil() -> None:
    time.sleep(0.005)


_yield_gil.__annotations__ = {"return": None}  # TorchScript reads it: a type, not the string "None"


class _SlowScriptUpdate(torch.nn.Module):
    """An owner's TorchScript SGD update that reads, yields the GIL, then writes: unserialized steps lose updates."""

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__()
        self.params = params
        self.lr = lr
        self.has_state = [True for _ in params]

    @torch.jit.export
    def set_state(self, states: list[dict[str, torch.Tensor]]) -> None:
        pass

    @torch.jit.export
    def step(self, grads: list[torch.Tensor | None]) -> bool:
        with torch.no_grad():
            for i in range(len(self.params)):
                grad = grads[i]
                if grad is not None:
                    updated = self.params[i] - self.lr * grad
                    _yield_gil()
                    self.params[i].copy_(updated)
        return True


class _FunctionalSlowScriptSGD(_FunctionalSGD):
    def _script_update(self) -> torch.nn.Module:
        return _SlowScriptUpdate(self.param_group["params"], self.defaults["lr"])


class _SlowScriptSGD(tp.optim.SGD):
    """Stepped on its owner by _SlowScriptUpdate in TorchScript (registered by _driver_checks in each worker,
    not at import: the test process's map stays PyTorch's eight)."""


def _trainer(trainer: int, optimizer_class: type) -> bool:
    """Steps the shared parameter; returns whether its owner stepped it in TorchScript."""
    param_rref = rpc.remote("worker0", _shared_param, args=(optimizer_class.__name__,))
    optimizer = DistributedOptimizer(optimizer_class, [param_rref], lr=0.5)
    if trainer == 2:  # the Python step RPC, used where TorchScript is unavailable
        optimizer._step_function = _step_registered
    for step in range(TRAINER_STEPS):
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker0", _weighted_sum, args=(param_rref, _known_grad(trainer, step)))
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    return rpc.rpc_sync("worker0", _owner_step_is_scripted, args=(optimizer._owners[0].key,))


def _concurrent_trainers(optimizer_class: type) -> tuple[torch.Tensor, list[bool]]:
    futures = [rpc.rpc_async(f"worker{t}", _trainer, args=(t, optimizer_class)) for t in (1, 2)]
    scripted = [future.wait() for future in futures]
    return _shared_param(optimizer_class.__name__).detach().clone(), scripted


# --- parallel step: each owner's step waits until the other's has started ----

_ENTERED = threading.Event()


def _has_entered() -> bool:
    return _ENTERED.is_set()


class _RendezvousSGD(tp.optim.SGD):
    """Steps only once the other parameter server is inside its step too (fails if steps run in sequence)."""

    def step(self, closure=None):  # type: ignore[override]
        _ENTERED.set()
        me = rpc.get_worker_info().name
        other = "worker2" if me == "worker1" else "worker1"
        deadline = time.monotonic() + 20
        while not rpc.rpc_sync(other, _has_entered):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{me}: {other} never entered its step; owners were stepped one after another")
            time.sleep(0.01)
        return super().step(closure)


def _parallel_step() -> bool:
    weights = [rpc.remote(f"worker{w}", _new_param, args=(torch.ones(3),)) for w in (1, 2)]
    optimizer = DistributedOptimizer(_RendezvousSGD, weights, lr=0.1)
    with dist_autograd.context() as context_id:
        loss = sum(rpc.rpc_sync(w.owner(), _weighted_sum, args=(w, torch.ones(3))) for w in weights)
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    return all(torch.equal(rpc.rpc_sync(w.owner(), _fetch, args=(w,)), torch.full((3,), 0.9)) for w in weights)


# --- bad input ---------------------------------------------------------------

def _error(fn: Callable[..., Any], *args: Any) -> tuple[str, str]:
    return error_of(fn, *args) or ("no error", "")


class _RaisingSGD(tp.optim.SGD):
    def step(self, closure=None):  # type: ignore[override]
        raise ValueError("boom from the owner's optimizer")


def _failing_owner_step() -> tuple[str, str]:
    weights = [rpc.remote(f"worker{w}", _new_param, args=(torch.ones(2),)) for w in (1, 2)]
    optimizer = DistributedOptimizer(_RaisingSGD, weights, lr=0.1)
    with dist_autograd.context() as context_id:
        loss = sum(rpc.rpc_sync(w.owner(), _weighted_sum, args=(w, torch.ones(2))) for w in weights)
        dist_autograd.backward(context_id, [loss])
        return _error(optimizer.step, context_id)


def _bad_input() -> dict[str, tuple[str, str]]:
    good = rpc.remote("worker2", _new_param, args=(torch.ones(2),))
    not_a_tensor = rpc.remote("worker1", _make_list)
    optimizer = DistributedOptimizer(tp.optim.SGD, [good], lr=0.1)
    with dist_autograd.context() as finished_context:
        pass
    return {
        "failing_owners": _failing_owner_step(),
        "bad_option": _error(DistributedOptimizer, tp.optim.Adam, [good], -1.0),
        "non_tensor": _error(DistributedOptimizer, tp.optim.SGD, [good, not_a_tensor], 0.1),
        "not_an_rref": _error(DistributedOptimizer, tp.optim.SGD, [good, torch.ones(2)], 0.1),
        "unknown_context": _error(optimizer.step, 123456789),
        "finished_context": _error(optimizer.step, finished_context),
    }


# --- an owner that dies mid-step (last: worker2 is gone afterwards) ----------

class _DieOnStep(tp.optim.SGD):
    def step(self, closure=None):  # type: ignore[override]
        os._exit(3)


def _dying_owner_step() -> tuple[str, str]:
    weights = [rpc.remote(f"worker{w}", _new_param, args=(torch.ones(3),)) for w in (1, 2)]
    survivor = DistributedOptimizer(tp.optim.SGD, weights[:1], lr=0.1)
    dying = DistributedOptimizer(_DieOnStep, weights[1:], lr=0.1)
    with dist_autograd.context() as context_id:
        loss = sum(rpc.rpc_sync(w.owner(), _weighted_sum, args=(w, torch.ones(3))) for w in weights)
        dist_autograd.backward(context_id, [loss])
        survivor.step(context_id)
        return _error(dying.step, context_id)


class _StopWorkers(Exception):
    """Raised on purpose: a graceful rpc.shutdown would wait on the dead worker, so the harness kills the rest."""


# --- the RPC run ----------------------------------------------------------------

def _driver_checks(results_path: str) -> None:
    register_functional_optim(_SlowScriptSGD, _FunctionalSlowScriptSGD)
    if rpc.get_worker_info().name != "worker0":
        return None
    results: dict[str, Any] = {}
    for name, (optimizer_class, kwargs, _) in OPTIMIZERS.items():
        results[name] = {
            "local": _train_local(optimizer_class, kwargs),
            "ours": _summary(*_train_split(DistributedOptimizer, optimizer_class, kwargs)),
            "torch": _train_split(torch_dist_optim.DistributedOptimizer, optimizer_class, kwargs)[0],
        }
    results["concurrent"] = {cls.__name__: _concurrent_trainers(cls) for cls in (_SlowSGD, _SlowScriptSGD)}
    results["parallel"] = _parallel_step()
    results["bad_input"] = _bad_input()
    results["dying_owner"] = _dying_owner_step()
    torch.save(results, results_path)
    raise _StopWorkers("worker2 is dead; stopping the workers without rpc.shutdown")


@pytest.fixture(scope="module")
def driver_results(tmp_path_factory) -> dict[str, Any]:
    results_path = tmp_path_factory.mktemp("rpc_optimizer") / "results.pt"
    # One run for every check: each run spawns three fresh processes.
    with pytest.raises(RankFailure, match="worker2 is dead; stopping the workers"):
        run_rpc(_driver_checks, str(results_path), world_size=3, timeout=120)
    return torch.load(results_path)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_remote_params_match_local_and_pytorch(driver_results, name):
    result = driver_results[name]
    ours = result["ours"]["values"]
    assert result["ours"]["functional"] == OPTIMIZERS[name][2]
    assert result["ours"]["script_step"]  # the fast step RPC (Note: the step RPC) compiled
    # SGD and Adam owners step in TorchScript after the first step (Note: the owner step in TorchScript).
    assert result["ours"]["script_owners"] == [OPTIMIZERS[name][2]] * 3
    assert len(ours) == len(result["local"]) == len(result["torch"]) == 5
    for mine, local, theirs in zip(ours, result["local"], result["torch"], strict=True):
        assert torch.equal(mine, local)
        assert torch.equal(mine, theirs)
    assert not torch.equal(ours[0], _initial_first_weight())  # the steps did update


def _initial_first_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return _LocalModel().first.weight.detach()


@pytest.mark.parametrize("optimizer", ["_SlowSGD", "_SlowScriptSGD"])  # class step, TorchScript owner step
def test_concurrent_trainers_lose_no_update(driver_results, optimizer):
    total = sum(_known_grad(t, s) for t in (1, 2) for s in range(TRAINER_STEPS))
    value, scripted = driver_results["concurrent"][optimizer]
    assert torch.equal(value, -0.5 * total)
    assert scripted == [optimizer == "_SlowScriptSGD"] * 2


def test_step_runs_owners_in_parallel(driver_results):
    assert driver_results["parallel"] is True


def test_bad_input_errors(driver_results):
    bad = driver_results["bad_input"]
    kind, message = bad["non_tensor"]
    assert kind == "TypeError" and "params_rref[1]" in message and "worker1" in message and "list" in message
    kind, message = bad["failing_owners"]
    assert "DistributedOptimizer step failed on worker(s) 'worker1', 'worker2'" in message
    assert "boom from the owner's optimizer" in message
    kind, message = bad["bad_option"]
    assert kind == "ValueError" and "construction failed on worker(s) 'worker2'" in message and "lr" in message
    kind, message = bad["not_an_rref"]
    assert kind == "TypeError" and "params_rref[1]" in message and "not an RRef" in message
    for key, context_id in (("unknown_context", "123456789"), ("finished_context", "")):
        kind, message = bad[key]
        assert kind == "RuntimeError" and "no distributed autograd context" in message and context_id in message
        assert "dist_autograd.context()" in message


def test_owner_dying_mid_step_raises_naming_it(driver_results):
    kind, message = driver_results["dying_owner"]
    assert kind == "RuntimeError"
    assert "DistributedOptimizer step failed on worker(s) 'worker2'" in message


def test_construct_without_init_rpc_says_to_call_it():
    with pytest.raises(RuntimeError, match=r"call tensorplay\.distributed\.rpc\.init_rpc"):
        DistributedOptimizer(tp.optim.SGD, [], lr=0.1)
