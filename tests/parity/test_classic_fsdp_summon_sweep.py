"""``summon_full_params`` swept against PyTorch's FSDP, value by value.

Every combination of ``writeback``, ``rank0_only``, ``offload_to_cpu``,
``with_grads``, ``recurse``, ``use_orig_params``, grad mode and sharding strategy
runs on ours and on PyTorch's FSDP over the same nested model with a tied weight:
what the context shows (names, shapes, types, values, gradients, ``state_dict()``),
a write inside it, and the parameters and gradients after exit. Where PyTorch
refuses a combination (``NotImplementedError``), ours either refuses with the same
type or works, and then what it shows equals the single-process model.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import fsdp_api, hybrid_groups

OPTIONS = ("writeback", "rank0_only", "offload_to_cpu", "with_grads", "recurse")
COMBINATIONS = [dict(zip(OPTIONS, values, strict=True)) for values in itertools.product((False, True), repeat=5)]


class Tied(nn.Module):
    """A root unit with a tied weight (``a.weight is b.weight``) around a nested unit with uneven shards."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.block(self.a(x)))


def make_tied() -> Tied:
    torch.manual_seed(0)
    return Tied()


def batch() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + dist.get_rank()))


def wrap(impl: str, strategy: str, orig: bool, groups: Any = None) -> nn.Module:
    api, wrap_module = fsdp_api(impl)
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=wrap_module.ModuleWrapPolicy({nn.Sequential}), use_orig_params=orig,
        sharding_strategy=getattr(api.ShardingStrategy, strategy), device_id=torch.device("cpu"))
    if strategy == "HYBRID_SHARD":
        kwargs["process_group"] = groups
    model = api.FullyShardedDataParallel(make_tied(), **kwargs)
    model(batch()).sum().backward()  # gradients for with_grads
    return model


def _shown(model: nn.Module) -> dict[str, Any]:
    return {name: (tuple(p.shape), type(p).__name__, p.requires_grad, p.detach().clone(),
                   None if p.grad is None else p.grad.clone())
            for name, p in model.named_parameters()}


def probe(impl: str, strategy: str, orig: bool, options: dict[str, bool], grad_enabled: bool,
          groups: Any) -> dict[str, Any]:
    """What one summon shows on this rank, and the parameters and gradients after a write inside it."""
    api, _ = fsdp_api(impl)
    model = wrap(impl, strategy, orig, groups)
    out: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(), torch.set_grad_enabled(grad_enabled):
            warnings.simplefilter("ignore")
            with api.FullyShardedDataParallel.summon_full_params(model, **options):
                out["inside"] = _shown(model)
                out["parameters"] = [tuple(p.shape) for p in model.parameters()]
                if not options["rank0_only"]:  # keys sorted: PyTorch's order puts a tied weight last
                    out["state_dict"] = {k: v.clone() for k, v in sorted(model.state_dict().items())}
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                        if p.grad is not None:
                            p.grad.mul_(2.0)
    except (RuntimeError, ValueError) as error:
        return {"error": type(error).__name__, "is_not_implemented": isinstance(error, NotImplementedError),
                "message": str(error)[:200]}
    out["after"] = _shown(model)
    with api.FullyShardedDataParallel.summon_full_params(model, writeback=False):
        out["after_full"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


def oracle_options(orig: bool, options: dict[str, bool]) -> tuple[bool, dict[str, bool]]:
    """PyTorch's run that shows what ours must show.

    PyTorch's ``offload_to_cpu`` fails without an accelerator (and refuses NO_SHARD and
    ``with_grads``); ours offloads. Offloading to the CPU changes no value on the CPU, so
    the oracle is PyTorch's run without offloading.
    """
    return orig, {**options, "offload_to_cpu": False}


def sweep(strategies: list[str]) -> list[tuple[tuple, dict, dict]]:
    """Ours and PyTorch's for every combination, on this rank."""
    rows, groups = [], hybrid_groups() if "HYBRID_SHARD" in strategies else None
    for strategy, orig, grad_enabled, options in itertools.product(strategies, (False, True), (False, True),
                                                                   COMBINATIONS):
        case = (strategy, orig, grad_enabled, tuple(sorted(options.items())))
        oracle_orig, oracle = oracle_options(orig, options)
        rows.append((case, probe("ours", strategy, orig, options, grad_enabled, groups),
                     probe("torch", strategy, oracle_orig, oracle, grad_enabled, groups)))
    return rows


def reference(world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every parameter and its gradient, unwrapped, after the same backward on the whole batch."""
    model = make_tied()
    for rank in range(world):
        generator = torch.Generator().manual_seed(10 + rank)
        (model(torch.randn(3, 4, generator=generator)).sum() / world).backward()
    return {name: (p.detach().clone(), p.grad.clone()) for name, p in model.named_parameters()}


def _equal(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), (where, list(ours), list(theirs))
        for key in theirs:
            _equal(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, tuple | list):
        assert len(ours) == len(theirs), (where, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _equal(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), (where, ours)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=where)
    else:
        assert ours == theirs, (where, ours, theirs)


def _matches_single_process(ours: dict[str, Any], expected: dict[str, tuple[torch.Tensor, torch.Tensor]],
                            with_grads: bool, where: str) -> None:
    assert list(ours["inside"]) == list(expected), (where, list(ours["inside"]))
    for name, (shape, kind, _, value, grad) in ours["inside"].items():
        assert (shape, kind) == (tuple(expected[name][0].shape), "Parameter"), (where, name, shape, kind)
        torch.testing.assert_close(value, expected[name][0], msg=f"{where} {name}")
        if with_grads:
            torch.testing.assert_close(grad, expected[name][1], msg=f"{where} {name}.grad")


def check(rows: list[tuple[tuple, dict, dict]], rank: int, world: int) -> dict[str, Any]:
    """Each row equal to PyTorch's (or both refuse); each full view equal to the single-process model."""
    expected = reference(world)
    counts: dict[str, Any] = {"equal": 0, "both refuse": 0, "failures": []}
    for (strategy, orig, grad_enabled, items), ours, theirs in rows:
        options, where = dict(items), f"rank {rank} {strategy} orig={orig} grad={grad_enabled} {dict(items)}"
        try:
            if "error" in theirs:
                assert ours.get("is_not_implemented"), (where, ours, theirs)
                counts["both refuse"] += 1
                continue
            assert "error" not in ours, (where, ours)
            _equal(ours, theirs, where)
            if options["recurse"] and (rank == 0 or not options["rank0_only"]):
                _matches_single_process(ours, expected, options["with_grads"], where)
            counts["equal"] += 1
        except AssertionError as failure:
            counts["failures"].append(str(failure)[:400])
    return counts


def sweep_and_check(strategies: list[str]) -> dict[str, Any]:
    return check(sweep(strategies), dist.get_rank(), dist.get_world_size())


@pytest.mark.parametrize("world, strategies", [(2, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
                                               (4, ["HYBRID_SHARD"])])
def test_summon_full_params_equals_pytorch_in_every_combination(world: int, strategies: list[str]) -> None:
    for counts in run_distributed(sweep_and_check, strategies, world_size=world, timeout=600):
        assert not counts["failures"], "\n".join(counts["failures"][:5])
        assert counts["equal"] > counts["both refuse"] > 0, counts


def issue_example() -> dict[str, Any]:
    """The report's program: a flat-parameter unit shows its original parameters inside the context."""
    out = {}
    for impl in ("ours", "torch"):
        api, _ = fsdp_api(impl)
        torch.manual_seed(0)
        model = api.FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
        with api.FullyShardedDataParallel.summon_full_params(model):
            out[impl] = ([tuple(p.shape) for p in model.parameters()], [n for n, _ in model.named_parameters()],
                         sorted(model.state_dict()))
        out[f"{impl} after"] = [n for n, _ in model.named_parameters()]
        # A plain parent with recurse=False summons nothing (its own unit: none).
        parent = nn.Sequential(api.FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu")))
        with api.FullyShardedDataParallel.summon_full_params(parent, recurse=False):
            out[f"{impl} plain parent"] = [tuple(p.shape) for p in parent.parameters()]
    return out


def test_flat_parameters_show_the_originals_inside_summon_full_params() -> None:
    for shown in run_distributed(issue_example, world_size=2):
        assert shown["ours"] == shown["torch"] == ([(4, 4), (4,)], ["weight", "bias"], ["bias", "weight"])
        assert shown["ours after"] == shown["torch after"] == ["_fsdp_wrapped_module._flat_param"]
        assert shown["ours plain parent"] == shown["torch plain parent"] == [(10,)]
