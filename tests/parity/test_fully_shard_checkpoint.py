"""fully_shard + tensorplay.distributed.checkpoint: saved at 4 ranks, loaded at 2, training continues.

The 4-rank run trains ``SAVED_AT`` Adam steps and saves the sharded model and
optimizer state (FQN-keyed DTensors); the 2-rank run builds a fresh sharded
model, loads, and trains ``MORE`` steps on the same global batches (each of its
ranks takes two of the 4-rank parts). Losses and parameters must match one
uninterrupted single-process run (fp32, rtol 1e-4 / atol 2e-5) and PyTorch's
fully_shard doing the same round trip; the reloaded parameters must equal the
saved ones bitwise. Each implementation must load the other's checkpoint, and ours
one saved from a 2x2 HSDP mesh (Replicate, Shard(0)) into a 1-D mesh.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.common import FP32, fqn_adam_state
from tests.parity._fsdp_models import build, loss_fn, parts_batch
from tests.parity.fully_shard_cases import LR, Case, fsdp_api, full_tensor, global_mean, reference, shard_model

SAVED_AT = 2
MORE = 2
#: (loader, saver): each implementation reads its own and the other's checkpoint; "hsdp" is ours saved on 2x2.
PAIRS = (("ours", "ours"), ("torch", "torch"), ("ours", "torch"), ("torch", "ours"), ("ours", "hsdp"))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, parts: list[int]) -> list[float]:
    losses = []
    for step in steps:
        x, y = parts_batch(step, parts)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(global_mean(loss))
        opt.step()
        opt.zero_grad()
    return losses


def save_at_four(impl: str, path: str, hsdp: bool = False) -> dict[str, Any]:
    import tensorplay.distributed.checkpoint as dcp

    try:
        model = shard_model(fsdp_api(impl), Case(world=4, hsdp=hsdp))
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        losses = _train(model, opt, range(SAVED_AT), [dist.get_rank()])
        dcp.save(fqn_adam_state(model, opt), checkpoint_id=path)
        return {"losses": losses, "params": {n: full_tensor(p) for n, p in model.named_parameters()}}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def load_at_two(impl: str, path: str) -> dict[str, Any]:
    import tensorplay.distributed.checkpoint as dcp

    try:
        model = shard_model(fsdp_api(impl), Case(world=2))
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        state = fqn_adam_state(model, opt)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        loaded = {n: full_tensor(p) for n, p in model.named_parameters()}
        rank = dist.get_rank()
        losses = _train(model, opt, range(SAVED_AT, SAVED_AT + MORE), [2 * rank, 2 * rank + 1])
        return {"loaded": loaded, "losses": losses, "params": {n: full_tensor(p) for n, p in model.named_parameters()}}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def _rank0(results: list[dict], what: str) -> dict:
    for rank, got in enumerate(results):
        assert "error" not in got, f"{what} failed on rank {rank}:\n{got['error']}"
    return results[0]


def _assert_close(got: dict, want: dict, what: str) -> None:
    for fqn, value in want.items():
        torch.testing.assert_close(got[fqn], value, **FP32, msg=lambda m, f=fqn: f"{what}: {f} differs\n{m}")


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for impl in ("ours", "torch"):
        out[f"{impl}_saved"] = _rank0(run_distributed(save_at_four, impl, str(root / impl), world_size=4),
                                      f"{impl} save")
    out["hsdp_saved"] = _rank0(run_distributed(save_at_four, "ours", str(root / "hsdp"), hsdp=True, world_size=4),
                               "ours HSDP save")
    for loader, saver in PAIRS:
        out[f"{loader}_from_{saver}"] = _rank0(run_distributed(load_at_two, loader, str(root / saver), world_size=2),
                                               f"{loader} loading {saver}'s checkpoint")
    return out


def test_reload_is_bitwise(round_trips):
    for loader, saver in PAIRS:
        saved, loaded = round_trips[f"{saver}_saved"]["params"], round_trips[f"{loader}_from_{saver}"]["loaded"]
        assert sorted(saved) == sorted(loaded)
        for fqn, value in saved.items():
            assert torch.equal(loaded[fqn], value), f"{loader} loading {saver}'s checkpoint: {fqn} not restored"


@pytest.mark.parametrize("run", [f"{loader}_from_{saver}" for loader, saver in PAIRS])
def test_round_trip_continues_like_an_uninterrupted_run(round_trips, run):
    want = reference(Case(world=4), steps=SAVED_AT + MORE)
    saver = run.split("_from_")[1]
    losses = round_trips[f"{saver}_saved"]["losses"] + round_trips[run]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), **FP32)
    _assert_close(round_trips[run]["params"], want["params"], f"{run} vs uninterrupted single process")


def test_round_trip_matches_pytorch(round_trips):
    assert round_trips["ours_saved"]["losses"] == pytest.approx(round_trips["torch_saved"]["losses"], rel=1e-5)
    _assert_close(round_trips["ours_from_ours"]["params"], round_trips["torch_from_torch"]["params"], "ours vs PyTorch")


def state_dict_helpers(impl: str) -> dict[str, Any]:
    """tensorplay.distributed.checkpoint.state_dict's full-state-dict helpers on a trained sharded model."""
    from tensorplay.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    try:
        model = shard_model(fsdp_api(impl), Case())
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        _train(model, opt, range(2), [dist.get_rank()])
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out = {"params": {n: full_tensor(p) for n, p in model.named_parameters()},
               "model": get_model_state_dict(model, options=full),
               "optim": get_optimizer_state_dict(model, opt, options=full).get("state", {})}  # rank 0 only
        set_model_state_dict(model, build().state_dict(), options=StateDictOptions(full_state_dict=True))
        out["reset"] = {n: full_tensor(p) for n, p in model.named_parameters()}
        return out
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def test_full_state_dict_helpers_match_pytorch():
    ours, theirs = (_rank0(run_distributed(state_dict_helpers, impl, world_size=2), impl) for impl in ("ours", "torch"))
    assert sorted(ours["model"]) == sorted(theirs["model"]) == sorted(build().state_dict())
    _assert_close(ours["model"], ours["params"], "full model state dict vs the trained parameters")
    _assert_close(ours["model"], theirs["model"], "full model state dict vs PyTorch")
    assert sorted(ours["optim"]) == sorted(theirs["optim"])
    for fqn, state in theirs["optim"].items():
        _assert_close(ours["optim"][fqn], state, f"Adam state of {fqn} vs PyTorch")
    for fqn, value in build().state_dict().items():
        if fqn in ours["reset"]:
            assert torch.equal(ours["reset"][fqn], value), f"set_model_state_dict did not load {fqn}"


def torch_save_per_rank(impl: str, path: str, meta: bool) -> dict[str, Any]:
    """Train, ``torch.save`` this rank's sharded model and optimizer state dicts, load them into a fresh model.

    PyTorch's DTensor gives a DTensor its local tensor's storage offset, and ``torch.save`` fails on a DTensor
    with a non-zero one: ours must not hand out such DTensors (see [Note: a parameter's own storage]).
    """
    try:
        case = Case(world=2, meta=meta)
        model = shard_model(fsdp_api(impl), case)
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        _train(model, opt, range(SAVED_AT), [dist.get_rank()])
        file = f"{path}/{impl}_{meta}_rank{dist.get_rank()}.pt"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, file)
        saved = {n: full_tensor(p) for n, p in model.named_parameters()}
        fresh = shard_model(fsdp_api(impl), case)
        fresh_opt = tp.optim.Adam(fresh.parameters(), lr=LR)
        loaded = torch.load(file, weights_only=True)
        fresh.load_state_dict(loaded["model"])
        fresh_opt.load_state_dict(loaded["optim"])
        parts = [dist.get_rank()]
        more = range(SAVED_AT, SAVED_AT + MORE)
        return {"saved": saved, "loaded": {n: full_tensor(p) for n, p in fresh.named_parameters()},
                "losses": _train(model, opt, more, parts), "fresh_losses": _train(fresh, fresh_opt, more, parts)}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


@pytest.mark.parametrize("meta", [False, True])
def test_torch_save_of_a_rank_state_dict_round_trips_like_pytorch(tmp_path, meta):
    results = {impl: _rank0(run_distributed(torch_save_per_rank, impl, str(tmp_path), meta, world_size=2), "save")
               for impl in ("ours", "torch")}
    for impl, got in results.items():
        for name, value in got["saved"].items():
            assert torch.equal(got["loaded"][name], value), (impl, name)
        assert got["fresh_losses"] == got["losses"], impl  # the optimizer state came back too
    torch.testing.assert_close(results["ours"]["losses"], results["torch"]["losses"], **FP32)
