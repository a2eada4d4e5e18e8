"""_NamedOptimizer: FQN-keyed optimizer state, against PyTorch's _NamedOptimizer.

Plain model (one process), fully_shard and classic FSDP (2 ranks). Where the
arithmetic is the same the comparisons are bitwise (``torch.equal``). With a
classic FSDP module PyTorch's class computes ``FSDP.optim_state_dict`` and drops
the result (its ``state_dict`` returns the flat per-rank state, which its own
``load_state_dict`` then refuses); ours returns that FQN-keyed result, so it is
compared with ``torch.distributed.fsdp.FullyShardedDataParallel.optim_state_dict``
over a plain optimizer, the state PyTorch's class means to return.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tensorplay.distributed.optim import _NamedOptimizer
from tensorplay.testing.distributed import run_distributed


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Sequential(nn.Linear(10, 7), nn.Tanh()), nn.Linear(7, 3))


def train(model: nn.Module, optims: list[Any], steps: int = 3, seed: int = 1, rank: int = 0) -> None:
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 1000 + step * 10 + rank))
        model(x).pow(2).sum().backward()
        for optim in optims:
            optim.step()
        model.zero_grad()  # PyTorch's _NamedOptimizer.zero_grad raises


def torch_named(*args: Any, **kwargs: Any) -> Any:
    from torch.distributed.optim import _NamedOptimizer as TorchNamed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchNamed(*args, **kwargs)


def ours_named(*args: Any, **kwargs: Any) -> _NamedOptimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _NamedOptimizer(*args, **kwargs)


def local(value: Any) -> Any:
    """This rank's part: a DTensor's local tensor, a ShardedTensor's one local shard, else the value."""
    if hasattr(value, "local_tensor"):  # ShardedTensor (torch.equal on two of them needs an accelerator)
        return value.local_tensor()
    return value.to_local() if hasattr(value, "to_local") else value


def assert_state_dicts_equal(a: dict, b: dict, ordered: bool = True) -> None:
    """Equal keys and values (bitwise); ``ordered=False``: the keys' order may differ (a dict's order)."""
    assert list(a["state"]) == list(b["state"]) if ordered else sorted(a["state"]) == sorted(b["state"])
    for fqn, state in a["state"].items():
        assert list(state) == list(b["state"][fqn]) if ordered else sorted(state) == sorted(b["state"][fqn]), fqn
        for key, value in state.items():
            other = b["state"][fqn][key]
            if isinstance(value, torch.Tensor):
                assert type(value) is type(other), (fqn, key)
                assert torch.equal(local(value), local(other)), (fqn, key)
            else:
                assert value == other, (fqn, key)
    assert a["param_groups"] == b["param_groups"]


def group_factories(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.003}]


# ---- plain model --------------------------------------------------------------------------------------

@pytest.mark.parametrize("optim_class, kwargs, grouped", [
    (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, False),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}, False),
    (torch.optim.AdamW, {"lr": 0.02}, True),
])
def test_plain_model_equals_pytorch(optim_class: type, kwargs: dict, grouped: bool) -> None:
    theirs_model, ours_model = make_model(), make_model()
    theirs = torch_named(theirs_model.named_parameters(), optim_class,
                         group_factories(theirs_model) if grouped else None, **kwargs)
    ours = ours_named(ours_model.named_parameters(), optim_class,
                      group_factories(ours_model) if grouped else None, **kwargs)
    assert ours.ordered_param_keys == theirs.ordered_param_keys
    train(theirs_model, [theirs])
    train(ours_model, [ours])
    assert_state_dicts_equal(ours.state_dict(), theirs.state_dict())
    for (name, a), (_, b) in zip(ours_model.named_parameters(), theirs_model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    if grouped:
        extra = {"params": ours_model[3].parameters(), "lr": 0.5}
        theirs.add_param_group({"params": theirs_model[3].parameters(), "lr": 0.5})
        ours.add_param_group(extra)
        train(theirs_model, [theirs], seed=2)
        train(ours_model, [ours], seed=2)
        assert_state_dicts_equal(ours.state_dict(), theirs.state_dict())


def test_param_groups_warning_and_isinstance() -> None:
    model = make_model()
    with pytest.warns(UserWarning, match="Since we pass in param_groups"):
        ours = _NamedOptimizer(model.named_parameters(), torch.optim.SGD, group_factories(model), lr=0.1)
    assert isinstance(ours, torch.optim.Optimizer)
    assert ours.defaults["lr"] == 0.1 and ours.param_groups is ours._optimizer.param_groups


def test_zero_grad_works_where_pytorch_raises() -> None:
    model = make_model()
    theirs = torch_named(model.named_parameters(), torch.optim.SGD, lr=0.1)
    ours = ours_named(model.named_parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(AttributeError):
        theirs.zero_grad()
    ours.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    ours.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_init_state_equals_pytorch() -> None:
    theirs_model, ours_model = make_model(), make_model()
    theirs = torch_named(theirs_model.named_parameters(), torch.optim.Adam, lr=0.1)
    ours = ours_named(ours_model.named_parameters(), torch.optim.Adam, lr=0.1)
    assert ours.state_dict()["state"] == {}
    theirs.init_state()
    ours.init_state()
    assert_state_dicts_equal(ours.state_dict(), theirs.state_dict())


def test_load_state_dict_round_trip() -> None:
    model_a, model_b = make_model(), make_model()
    saved_from = ours_named(model_a.named_parameters(), torch.optim.Adam, lr=0.01)
    train(model_a, [saved_from])
    saved = saved_from.state_dict()
    loader = ours_named(model_b.named_parameters(), torch.optim.Adam, lr=0.5, betas=(0.5, 0.6))
    train(model_b, [loader], seed=7)
    assert not torch.equal(loader.state_dict()["state"]["0.weight"]["exp_avg"], saved["state"]["0.weight"]["exp_avg"])
    loader.load_state_dict(saved)
    assert_state_dicts_equal(loader.state_dict(), saved)
    # Continuing from the loaded state equals continuing the original (same parameters too).
    model_b.load_state_dict(model_a.state_dict())
    train(model_a, [saved_from], seed=3)
    train(model_b, [loader], seed=3)
    assert_state_dicts_equal(loader.state_dict(), saved_from.state_dict())
    # And the same load into PyTorch's class gives the same state.
    theirs = torch_named(make_model().named_parameters(), torch.optim.Adam, lr=0.5)
    theirs.init_state()
    theirs.load_state_dict(saved)
    assert_state_dicts_equal(theirs.state_dict(), saved)


def test_load_partial_state_dict_equals_pytorch() -> None:
    """Conditional training: a state dict holding some parameters' state loads those only."""
    model = make_model()
    partial = ours_named(model.named_parameters(), torch.optim.SGD, group_factories(model), lr=0.01, momentum=0.9)
    train(model, [partial])
    saved = partial.state_dict()
    results = []
    for build in (ours_named, torch_named):
        fresh = make_model()
        loader = build(fresh.named_parameters(), torch.optim.SGD, lr=0.01, momentum=0.5)
        train(fresh, [loader], seed=4)
        loader.load_state_dict(saved)
        results.append(loader.state_dict())
    assert_state_dicts_equal(results[0], results[1])
    assert torch.equal(results[0]["state"]["0.weight"]["momentum_buffer"],
                       saved["state"]["0.weight"]["momentum_buffer"])


def _snapshot(optim: _NamedOptimizer) -> dict:
    sd = optim.state_dict()
    return {"state": {f: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for f, s in sd["state"].items()}, "param_groups": sd["param_groups"]}


def test_bad_state_dicts_change_nothing() -> None:
    model = make_model()
    optim = ours_named(model.named_parameters(), torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match="Expects the optim to be initialized before load but found not initialized"):
        optim.load_state_dict({"state": {}, "param_groups": []})
    train(model, [optim])
    good = _snapshot(optim)

    unknown = _snapshot(optim)
    unknown["state"]["9.weight"] = unknown["state"]["0.weight"]
    unknown["state"]["0.weight"]["exp_avg"].fill_(3.0)
    wrong_shape = _snapshot(optim)
    wrong_shape["state"]["3.bias"]["exp_avg_sq"] = torch.zeros(4)
    wrong_shape["state"]["0.bias"]["exp_avg"].fill_(5.0)
    wrong_keys = _snapshot(optim)
    del wrong_keys["state"]["2.0.weight"]["exp_avg"]
    wrong_group = _snapshot(optim)
    wrong_group["param_groups"][0]["surprise"] = 1
    cases = {
        "unknown": (unknown, ['Unexpected key(s) in state_dict: "state.9.weight"', "this optimizer holds"]),
        "wrong_shape": (wrong_shape, ["size mismatch for state.3.bias.exp_avg_sq", "torch.Size([4])",
                                      "torch.Size([3])"]),
        "wrong_keys": (wrong_keys, ['Missing key(s) in state_dict: "state.2.0.weight.exp_avg"']),
        "wrong_group": (wrong_group, ["surprise"]),
        "not_a_state_dict": ({"state": {}}, ["'param_groups'"]),
    }
    for name, (bad, phrases) in cases.items():
        with pytest.raises(ValueError) as error:
            optim.load_state_dict(bad)
        for phrase in phrases:
            assert phrase in str(error.value), (name, str(error.value))
        assert_state_dicts_equal(optim.state_dict(), good)


def test_bad_param_groups() -> None:
    model = make_model()
    stranger = nn.Parameter(torch.ones(8, 1))
    optim = ours_named(model.named_parameters(), torch.optim.SGD, group_factories(model), lr=0.1)
    keys = list(optim.ordered_param_keys)
    with pytest.raises(ValueError, match="some parameters are not in the module.*shape \\(8, 1\\)"):
        optim.add_param_group({"params": [model[3].weight, stranger]})
    assert optim.ordered_param_keys == keys and len(optim.param_groups) == 2
    with pytest.raises(ValueError, match="param_groups.*some parameters are not in the module"):
        _NamedOptimizer(model.named_parameters(), torch.optim.SGD, [{"params": [stranger]}], lr=0.1)
    with pytest.raises(TypeError, match="param_groups\\[0\\] must be a dict"):
        _NamedOptimizer(model.named_parameters(), torch.optim.SGD, [[model[0].weight]], lr=0.1)
    with pytest.raises(ValueError, match="'params'"):
        _NamedOptimizer(model.named_parameters(), torch.optim.SGD, [{"lr": 0.1}], lr=0.1)
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors"):
        _NamedOptimizer(model.named_parameters(), torch.optim.SGD, [{"params": ["x"]}], lr=0.1)
    # A parameter already held: the wrapped optimizer refuses, our keys stay as they were.
    with pytest.raises(ValueError):
        optim.add_param_group({"params": [model[0].weight]})
    assert optim.ordered_param_keys == keys


# ---- fully_shard (2 ranks) ----------------------------------------------------------------------------

def _fully_shard_rank(optim_name: str) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp

    import tensorplay.distributed.fsdp as our_fsdp
    from tensorplay.distributed.tensor import DTensor
    rank = torch.distributed.get_rank()
    optim_class = getattr(torch.optim, optim_name)
    options = {"momentum": 0.9} if optim_name == "SGD" else {"weight_decay": 0.1}
    results: dict[str, Any] = {}
    for impl, fsdp, build in (("ours", our_fsdp, ours_named), ("torch", torch_fsdp, torch_named)):
        model = make_model()
        fsdp.fully_shard(model[2])
        fsdp.fully_shard(model)
        optim = build(model.named_parameters(), optim_class, lr=0.01, **options)
        train(model, [optim], rank=rank)
        results[impl] = optim.state_dict()
        results[impl + "_params"] = {n: p.to_local().clone() for n, p in model.named_parameters()}
        if impl == "ours":
            assert all(isinstance(v, DTensor) for s in results[impl]["state"].values() for k, v in s.items()
                       if k != "step")
            # Round trip: a second optimizer, trained differently, loads the first's state.
            other = build(model.named_parameters(), optim_class, lr=0.5, **options)
            other.init_state()
            other.load_state_dict(results[impl])
            results["reloaded"] = other.state_dict()
    assert_state_dicts_equal(results["ours"], results["torch"])
    assert_state_dicts_equal(results["reloaded"], results["ours"])
    for name, value in results["ours_params"].items():
        assert torch.equal(value, results["torch_params"][name]), name
    return {"keys": list(results["ours"]["state"])}


@pytest.mark.parametrize("optim_name", ["SGD", "Adam"])
def test_fully_shard_equals_pytorch(optim_name: str) -> None:
    keys = run_distributed(_fully_shard_rank, optim_name, world_size=2)
    assert keys[0]["keys"] == keys[1]["keys"] and "2.0.weight" in keys[0]["keys"]


# ---- classic FSDP (2 ranks) ---------------------------------------------------------------------------

def reference_state(steps: int = 3, world_size: int = 2) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state after ``train`` on every rank's data, computed in one process (gradients averaged)."""
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            model.zero_grad()
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 + step * 10 + rank))
            model(x).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for param, *per_rank in zip(model.parameters(), *grads, strict=True):
            param.grad = sum(per_rank) / world_size
        optim.step()
    return {name: optim.state[param] for name, param in model.named_parameters()}


def full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def equals_full(got: Any, reference: torch.Tensor) -> bool:
    """``got`` (plain, DTensor, or a ShardedTensor whose local shards are compared in place) equals ``reference``."""
    if hasattr(got, "local_shards"):  # ShardedTensor: classic FSDP's default sharded layout
        shards = got.local_shards()
        return bool(shards) and all(
            torch.equal(shard.tensor, reference[tuple(slice(o, o + n) for o, n in zip(
                shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True))])
            for shard in shards)
    return torch.equal(full(got), reference)


def _classic_rank(use_orig_params: bool, sharded: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchType

    from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    from tensorplay.distributed.fsdp import StateDictType
    rank = torch.distributed.get_rank()
    cpu = torch.device("cpu")

    ours_model = FSDP(make_model(), use_orig_params=use_orig_params, device_id=cpu)
    ours = ours_named(ours_model.named_parameters(), torch.optim.Adam, module=ours_model, lr=0.01)
    named_model = TorchFSDP(make_model(), use_orig_params=use_orig_params, device_id=cpu)
    theirs_named = torch_named(named_model.named_parameters(), torch.optim.Adam, module=named_model, lr=0.01)
    plain_model = TorchFSDP(make_model(), use_orig_params=use_orig_params, device_id=cpu)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    for model, optim in ((ours_model, ours), (named_model, theirs_named), (plain_model, plain)):
        train(model, [optim], rank=rank)
    if sharded:
        FSDP.set_state_dict_type(ours_model, StateDictType.SHARDED_STATE_DICT)
        TorchFSDP.set_state_dict_type(plain_model, TorchType.SHARDED_STATE_DICT)
    got = ours.state_dict()
    # Against the single-process run: every state value, bitwise.
    reference = reference_state()
    assert list(got["state"]) == list(reference)
    for fqn, state in reference.items():
        assert sorted(got["state"][fqn]) == sorted(state), fqn
        for key, value in state.items():
            assert equals_full(got["state"][fqn][key], value), (fqn, key)
    if not use_orig_params and not sharded:
        # Against PyTorch: with use_orig_params=True its optim_state_dict returns a wrong exp_avg on CPU
        # (off by up to 0.65 from the single-process run); the sharded case is checked against the
        # single-process run above, so the full, flat-parameter case is compared here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = TorchFSDP.optim_state_dict(plain_model, plain)
        assert_state_dicts_equal(got, expected, ordered=False)
    # Training equals PyTorch's _NamedOptimizer over PyTorch's FSDP, parameter by parameter.
    ours_params, theirs_params = ours_model.state_dict(), named_model.state_dict()
    assert list(ours_params) == list(theirs_params)
    for name, value in ours_params.items():
        assert equals_full(value, full(theirs_params[name])), name

    # Round trip through a second optimizer, trained differently.
    other = ours_named(ours_model.named_parameters(), torch.optim.Adam, module=ours_model, lr=0.5)
    train(ours_model, [other], seed=9, rank=rank)
    other.load_state_dict(got)
    assert_state_dicts_equal(other.state_dict(), got)

    # Bad input: an unknown FQN and a wrong shape, refused on every rank, nothing loaded.
    before = other.state_dict()
    bad = {"state": dict(got["state"]), "param_groups": got["param_groups"]}
    bad["state"]["9.weight"] = got["state"]["0.weight"]
    bad["state"]["3.bias"] = {**got["state"]["3.bias"], "exp_avg": torch.zeros(5)}
    try:
        other.load_state_dict(bad)
        message = ""
    except ValueError as error:
        message = str(error)
    assert_state_dicts_equal(other.state_dict(), before)
    return {"message": message, "keys": list(got["state"])}


@pytest.mark.parametrize("use_orig_params, sharded", [(False, False), (True, False), (False, True)])
def test_classic_fsdp_state_dict_equals_pytorch(use_orig_params: bool, sharded: bool) -> None:
    results = run_distributed(_classic_rank, use_orig_params, sharded, world_size=2)
    for result in results:
        assert result["keys"] == ["0.weight", "0.bias", "2.0.weight", "2.0.bias", "3.weight", "3.bias"]
        assert "nothing was loaded" in result["message"] and '"state.9.weight"' in result["message"]
        assert "size mismatch for state.3.bias.exp_avg: copying a param with shape torch.Size([5])" in result["message"]


# ---- ShardedTensor state (2 ranks) --------------------------------------------------------------------

def _sharded_tensor_rank() -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardMetadata,
        init_from_local_shards,
    )

    from tensorplay.distributed._checks.load_check import LoadProblems
    from tensorplay.distributed.optim.named_optimizer import _copied, _state_problems
    rank = torch.distributed.get_rank()

    def sharded(value: float) -> Any:
        metadata = ShardMetadata([rank * 2, 0], [2, 3], f"rank:{rank}/cpu")
        return init_from_local_shards([Shard(torch.full((2, 3), value), metadata)], 4, 3)

    target, saved = sharded(1.0), sharded(5.0)
    good, bad = LoadProblems(), LoadProblems()
    _state_problems(good, "w", {"m": saved}, {"m": target})
    _state_problems(bad, "w", {"m": torch.zeros(4, 3)}, {"m": target})
    _copied(saved, target)
    return {"good": good.lines(), "bad": bad.lines(), "copied": target.local_shards()[0].tensor.tolist()}


def test_sharded_tensor_state_is_checked_and_copied_shard_by_shard() -> None:
    for result in run_distributed(_sharded_tensor_rank, world_size=2):
        assert result["good"] == []
        assert len(result["bad"]) == 1 and "state.w.m: expected a ShardedTensor" in result["bad"][0]
        assert result["copied"] == [[5.0] * 3] * 2
