"""PyTorch's DCP state-dict helpers on our front ends: what PyTorch's give on PyTorch's, or a loud error.

A program that swaps only its FSDP (or optimizer) import keeps calling
``torch.distributed.checkpoint.state_dict``'s helpers. On 2 ranks each
(helper x front end x state-dict kind) runs once on PyTorch's implementation
and once on ours; ours must give the same values (checked after gathering every
sharded value whole) or raise a ``RuntimeError`` naming
``tensorplay.distributed.checkpoint`` before anything is loaded or written.
``torch.distributed.checkpoint.save``/``load`` of classic FSDP's own state dicts
(FULL, LOCAL, SHARDED) must write the same checkpoint (keys, global sizes) and
round-trip to the same values. :func:`main` prints the table as markdown.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

FRONTS = ("classic orig=False", "classic orig=True", "fully_shard", "ZeRO", "_NamedOptimizer")
KINDS = ("sharded", "full")  # StateDictOptions(full_state_dict=...)
HELPERS = ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
           "set_optimizer_state_dict", "set_state_dict", "_patch_model_state_dict", "_patch_optimizer_state_dict")
DCP_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
OURS_NAMED = "tensorplay.distributed.checkpoint"
#: Outcomes the requirement accepts: the values PyTorch's give (or its error), or a loud error naming the way out;
#: where PyTorch's raises, ours may work if its values are checked (ZeRO: against a plain optimizer; DCP rows: the
#: state loaded back equals the state saved).
ACCEPTED = ("equal", "loud error", "both raise", "both raise; ours names the way",
            "ours works (equals a plain optimizer), PyTorch's raises",
            "ours works (round trip checked), PyTorch's raises")


# ---- building the front ends -------------------------------------------------------------------------

def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _api(impl: str, subtree: str) -> Any:
    """``torch.distributed.<subtree>`` (the oracle) or ours."""
    return importlib.import_module(f"{'torch' if impl == 'torch' else 'tensorplay'}.distributed.{subtree}")


def _build(front: str, impl: str, seed: int) -> tuple[nn.Module, Any]:
    """``front`` from PyTorch (``impl="torch"``), ours, or plain Adam (``"plain"``), trained one Adam step."""
    model: Any = _model(seed)
    if front.startswith("classic"):
        model = _api(impl, "fsdp").FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                                            use_orig_params=front.endswith("True"))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif front == "fully_shard":
        _api(impl, "fsdp").fully_shard(model[0])
        _api(impl, "fsdp").fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif impl == "plain":  # the non-distributed oracle where PyTorch's own front end fails
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif front == "ZeRO":
        opt = _api(impl, "optim").ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    else:
        opt = _api(impl, "optim")._NamedOptimizer(model.named_parameters(), torch.optim.Adam, lr=1e-2, module=model)
    sharded = front.startswith("classic") or front == "fully_shard"  # else every rank steps the same (ZeRO's oracle)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + 10 * dist.get_rank() * sharded))
    model(x).pow(2).sum().backward()
    opt.step()
    model.zero_grad()
    return model, opt


# ---- whole values, comparable across implementations -------------------------------------------------

def _whole(value: Any) -> Any:
    """``value`` with every DTensor / ShardedTensor gathered whole (collective), dict keys as strings."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {str(k): _whole(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [_whole(v) for v in value]
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, ShardedTensor):
        full = torch.zeros(value.size(), dtype=value.metadata().tensor_properties.dtype)
        for shard in value.local_shards():
            where = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes,
                                                          strict=True))
            full[where].copy_(shard.tensor)
        dist.all_reduce(full)
        return full
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        both = isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
        return both and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
    return bool(a == b)


def _readback(front: str, impl: str, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """The model's and optimizer's state as whole tensors, through each implementation's own sound API."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    from tensorplay.distributed.checkpoint import state_dict as ours_sd

    full = torch_sd.StateDictOptions(full_state_dict=True)
    if front.startswith("classic") or front == "fully_shard":
        helpers = torch_sd if impl == "torch" else ours_sd
        model_sd = _whole(helpers.get_model_state_dict(model, options=full))
        if front == "classic orig=True":  # PyTorch 2.13 on CPU returns exp_avg_sq for exp_avg: compare params only
            return model_sd
        return model_sd, _whole(helpers.get_optimizer_state_dict(model, opt, options=full))
    model_sd = _whole(model.state_dict())
    if front == "ZeRO":
        if impl != "plain":
            opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        return model_sd, _whole(opt.state_dict()) if dist.get_rank() == 0 else None
    return model_sd, _whole(opt.state_dict())


# ---- one helper on one front end ---------------------------------------------------------------------

def _call(front: str, impl: str, helper: str, kind: str, source: Any) -> Any:
    """Apply PyTorch's ``helper`` to ``front`` built by ``impl``; return what it gives, whole."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    options = torch_sd.StateDictOptions(full_state_dict=kind == "full")
    model, opt = _build(front, impl, seed=1)
    if helper.startswith("get_"):
        args = (model,) if helper == "get_model_state_dict" else (model, opt)
        return _whole(getattr(torch_sd, helper)(*args, options=options))
    model_sd, optim_sd = copy.deepcopy(source)
    if helper == "set_model_state_dict":
        torch_sd.set_model_state_dict(model, model_sd, options=options)
    elif helper == "set_optimizer_state_dict":
        torch_sd.set_optimizer_state_dict(model, opt, optim_sd, options=options)
    elif helper == "set_state_dict":
        torch_sd.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    elif helper == "_patch_model_state_dict":
        torch_sd._patch_model_state_dict(model, options=options)
        got = _whole(model.state_dict())
        model.load_state_dict(model_sd)
        return got, _readback(front, impl, model, opt)
    else:
        torch_sd._patch_optimizer_state_dict(model, optimizers=(opt,), options=options)
        got = _whole(opt.state_dict())
        opt.load_state_dict(optim_sd)
        return got, _readback(front, impl, model, opt)
    return _readback(front, impl, model, opt)


def _source(front: str, kind: str) -> Any:
    """What PyTorch's helpers give on PyTorch's ``front`` (seed 0): the state the set helpers load."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    options = torch_sd.StateDictOptions(full_state_dict=kind == "full")
    model, opt = _build(front, "torch", seed=0)
    try:
        return torch_sd.get_state_dict(model, opt, options=options)
    except Exception:  # noqa: BLE001 - PyTorch's ZeRO refuses: load a plain model's state instead
        plain = _model(0)
        return torch_sd.get_state_dict(plain, torch.optim.Adam(plain.parameters()), options=options)


def _attempt(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except BaseException as error:  # noqa: BLE001 - the outcome is recorded (DCP raises BaseExceptions)
        return False, error


def _verdict(theirs: tuple[bool, Any], ours: tuple[bool, Any]) -> tuple[str, str]:
    (their_ok, their_value), (our_ok, our_value) = theirs, ours
    if not our_ok:
        text = f"{type(our_value).__name__}: {our_value}"
        if not their_ok:
            named = "; ours names the way" if OURS_NAMED in str(our_value) else ""
            return "both raise" + named, f"theirs {type(their_value).__name__}: {their_value}; ours {text}"
        if isinstance(our_value, RuntimeError) and OURS_NAMED in str(our_value):
            return "loud error", text
        return "unhelpful error", text + "\n" + "".join(traceback.format_exception(our_value))
    if not their_ok:
        return "ours works, PyTorch's raises", f"{type(their_value).__name__}: {their_value}"
    return ("equal", "") if _same(their_value, our_value) else ("SILENTLY DIFFERENT", "")


def _agreed(outcome: tuple[bool, Any]) -> tuple[bool, Any]:
    """Make every rank report the same success (values are compared where they live)."""
    flag = torch.tensor([0 if outcome[0] else 1])
    dist.all_reduce(flag)
    if flag.item() and outcome[0]:
        return False, RuntimeError("raised on another rank")
    return outcome


def helper_table() -> dict[str, tuple[str, str]]:
    """(helper, front, kind) -> (verdict, detail), on every rank."""
    warnings.simplefilter("ignore")
    table: dict[str, tuple[str, str]] = {}
    for front in FRONTS:
        for kind in KINDS:
            source = _source(front, kind)
            for helper in HELPERS:
                theirs = _agreed(_attempt(functools.partial(_call, front, "torch", helper, kind, source)))
                ours = _agreed(_attempt(functools.partial(_call, front, "ours", helper, kind, source)))
                verdict = _verdict(theirs, ours)
                if verdict[0] == "ours works, PyTorch's raises" and front == "ZeRO":
                    plain = _call(front, "plain", helper, kind, source)
                    verdict = ("ours works (equals a plain optimizer), PyTorch's raises" if _same(plain, ours[1])
                               else "SILENTLY DIFFERENT from a plain optimizer", verdict[1])
                table[f"{helper} | {front} | {kind}"] = verdict
    return table


# ---- torch.distributed.checkpoint.save / load of classic FSDP's own state dicts ----------------------

def _dcp_round_trip(front: str, impl: str, sd_type: str, with_optim: bool, root: str) -> Any:
    import torch.distributed.checkpoint as torch_dcp

    fsdp = _api(impl, "fsdp")
    FSDP, state_dict_type = fsdp.FullyShardedDataParallel, getattr(fsdp.StateDictType, sd_type)
    path = os.path.join(root, f"{impl}-{front}-{sd_type}-{with_optim}".replace(" ", "").replace("=", ""))

    def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        with FSDP.state_dict_type(model, state_dict_type):
            out = {"model": model.state_dict()}
            if with_optim:
                out["optim"] = FSDP.optim_state_dict(model, opt)
        return out

    model, opt = _build(front, impl, seed=0)
    saved = state(model, opt)
    torch_dcp.save(saved, checkpoint_id=path)
    before = _whole(saved)
    meta = torch_dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sizes = {key: tuple(getattr(m, "size", ())) for key, m in meta.items()}
    model, opt = _build(front, impl, seed=1)
    loaded = state(model, opt)
    torch_dcp.load(loaded, checkpoint_id=path)
    with FSDP.state_dict_type(model, state_dict_type):
        model.load_state_dict(loaded["model"])
        if with_optim:
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, loaded["optim"]))
    after = _whole(state(model, opt))
    if not _same(before, after):
        raise AssertionError(f"{impl}: the state loaded back differs from the state saved")
    return sizes, before if front == "classic orig=False" or not with_optim else before["model"]


def dcp_table(root: str) -> dict[str, tuple[str, str]]:
    warnings.simplefilter("ignore")
    table: dict[str, tuple[str, str]] = {}
    for front in FRONTS[:2]:
        for sd_type in DCP_TYPES:
            for with_optim in (False, True):
                if with_optim and sd_type == "LOCAL_STATE_DICT":
                    continue  # neither implementation has a local optimizer state dict
                trip = functools.partial(_dcp_round_trip, front, sd_type=sd_type, with_optim=with_optim, root=root)
                theirs, ours = _agreed(_attempt(functools.partial(trip, "torch"))), _agreed(_attempt(
                    functools.partial(trip, "ours")))
                what = "dcp.save/load model+optim" if with_optim else "dcp.save/load model"
                verdict = _verdict(theirs, ours)
                if verdict[0] == "ours works, PyTorch's raises":  # _dcp_round_trip checked ours
                    verdict = ("ours works (round trip checked), PyTorch's raises", verdict[1])
                table[f"{what} | {front} | {sd_type}"] = verdict
    return table


# ---- the tests ---------------------------------------------------------------------------------------

HELPER_ROWS = [f"{h} | {f} | {k}" for f in FRONTS for k in KINDS for h in HELPERS]
DCP_ROWS = [f"dcp.save/load model{o} | {f} | {t}" for f in FRONTS[:2] for t in DCP_TYPES
            for o in ("", "+optim") if not (o and t == "LOCAL_STATE_DICT")]


@pytest.fixture(scope="module")
def table() -> dict[str, tuple[str, str]]:
    with tempfile.TemporaryDirectory() as root:
        helpers, dcp = run_distributed(helper_table, world_size=2), run_distributed(dcp_table, root, world_size=2)
    for other in (helpers[1], dcp[1]):  # every rank reached the same verdicts
        assert {k: v[0] for k, v in other.items()} == {k: v[0] for k, v in (helpers[0] | dcp[0]).items() if
                                                       k in other}
    return helpers[0] | dcp[0]


@pytest.mark.parametrize("row", HELPER_ROWS + DCP_ROWS)
def test_same_as_pytorch_or_loud(table, row):
    verdict, detail = table[row]
    assert verdict in ACCEPTED, f"{row}: {verdict}\n{detail}"


@pytest.mark.parametrize("front", FRONTS[:2])
def test_every_pytorch_helper_refuses_classic_fsdp_by_name(table, front):
    """On our classic FSDP every PyTorch helper raises ours, naming itself and the helper to use instead."""
    for row in (r for r in HELPER_ROWS if f"| {front} |" in r):
        verdict, detail = table[row]
        helper = row.split(" | ")[0]
        assert verdict == "loud error" and detail.startswith("ForeignStateDictHelperError"), f"{row}: {detail}"
        assert "tensorplay.distributed.checkpoint.state_dict" in detail and "get_state_dict" in detail, detail
        assert helper.removeprefix("_patch") in detail or "patched by" in detail, detail


def refused_before_anything_happens(root: str) -> dict[str, Any]:
    """The report's example, and a DCP save through a patched state_dict: ours raised, nothing written or loaded."""
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint import state_dict as torch_sd

    from tensorplay.distributed.fsdp._classic.foreign_helpers import ForeignStateDictHelperError

    warnings.simplefilter("ignore")
    model, opt = _build("classic orig=False", "ours", seed=0)
    out: dict[str, Any] = {}
    with pytest.raises(ForeignStateDictHelperError, match="get_state_dict does not know") as error:
        torch_sd.get_state_dict(model, opt)
    out["message"] = str(error.value)
    torch_sd._patch_model_state_dict(model)
    with pytest.raises(ForeignStateDictHelperError, match="patched by"):
        torch_dcp.save({"model": model}, checkpoint_id=root)
    out["written"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    before = copy.deepcopy(opt.state_dict())
    other, _ = _build("classic orig=False", "torch", seed=1)
    with pytest.raises(ForeignStateDictHelperError, match="set_state_dict does not know"):
        torch_sd.set_state_dict(model, opt, model_state_dict={"0.weight": torch.zeros(8, 6)},
                                optim_state_dict=torch_sd.get_optimizer_state_dict(other, torch.optim.Adam(
                                    other.parameters())))
    out["optimizer unchanged"] = _same(_whole(before), _whole(opt.state_dict()))
    return out


def test_refused_on_every_rank_before_anything_is_written_or_loaded(tmp_path):
    for rank, got in enumerate(run_distributed(refused_before_anything_happens, str(tmp_path / "ckpt"),
                                               world_size=2)):
        assert got["written"] == [] and got["optimizer unchanged"], rank
        assert "use tensorplay.distributed.checkpoint.state_dict" in got["message"].lower(), got["message"]


def markdown(table: dict[str, tuple[str, str]]) -> str:
    """The verdicts as two markdown tables: PyTorch's helpers, then DCP save/load of classic FSDP's state dicts."""
    lines = ["| helper | state dict | " + " | ".join(FRONTS) + " |", "|---|---|" + "---|" * len(FRONTS)]
    lines += [f"| `{h}` | {k} | " + " | ".join(table[f"{h} | {f} | {k}"][0] for f in FRONTS) + " |"
              for h in HELPERS for k in KINDS]
    lines += ["", "| torch.distributed.checkpoint | StateDictType | " + " | ".join(FRONTS[:2]) + " |",
              "|---|---|---|---|"]
    what = dict.fromkeys(r.split(" | ")[0] for r in DCP_ROWS)
    lines += [f"| {w} | {t} | " + " | ".join(table.get(f"{w} | {f} | {t}", ("n/a",))[0] for f in FRONTS[:2]) + " |"
              for w in what for t in DCP_TYPES if f"{w} | {FRONTS[0]} | {t}" in table]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print the table (``python -c "from tests.parity.test_dcp_helpers_foreign import main; main()"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(helper_table, world_size=2)[0] | run_distributed(dcp_table, tmp, world_size=2)[0]
    print(markdown(results))
    for key, (verdict, detail) in results.items():
        if verdict not in ACCEPTED:
            print(f"--- {key}: {verdict}\n{detail[:600]}")
