"""Classic FSDP ``load_state_dict`` is all or nothing, on every rank, for each state-dict type.

A state dict saved from a model whose parameters are all 0.5 is damaged (a
missing key, an unexpected key, a wrong shape; or a wrong value on rank 1 only)
and loaded into a freshly wrapped model on 2 ranks. Ours raises one error on
every rank listing every bad key (with both shapes) and leaves every rank's
parameters and buffers bitwise unchanged. PyTorch's FSDP (the reference that
fails, run where it cannot hang: FULL_STATE_DICT) copies the good keys before
raising, and with rank 1's value damaged rank 0 loads while rank 1 raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity.classic_fsdp_cases import fsdp_api, make_model, wrap_model

NESTED = "layers.1.linear1.weight"          # in the last nested unit: PyTorch has loaded the others by then
SHAPE = tuple(make_model().get_parameter(NESTED).shape)
TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")


def _damage_key(type_name: str) -> str:
    """The key a fault is planted in: a parameter, or the nested unit's flat shard for local state dicts."""
    return "layers.1._flat_param" if type_name == "LOCAL_STATE_DICT" else NESTED


def _other_key(key: str) -> str:
    """A second key, in another unit: the root's norm weight, or the first nested unit's flat shard."""
    return "layers.0._flat_param" if key.endswith("_flat_param") else "norm.weight"


def _missing(sd: dict[str, Any], key: str, rank: int) -> None:
    del sd[key]


def _unexpected(sd: dict[str, Any], key: str, rank: int) -> None:
    sd["layers.1.bogus.weight"] = torch.zeros(2)


def _wrong_shape(sd: dict[str, Any], key: str, rank: int) -> None:
    sd[key] = torch.zeros(3, 5)


def _all_three(sd: dict[str, Any], key: str, rank: int) -> None:
    _wrong_shape(sd, key, rank)
    _unexpected(sd, key, rank)
    del sd[_other_key(key)]


def _rank1_wrong_shape(sd: dict[str, Any], key: str, rank: int) -> None:
    if rank == 1:
        _wrong_shape(sd, key, rank)


def _rank1_not_tensor(sd: dict[str, Any], key: str, rank: int) -> None:
    if rank == 1:
        sd[key] = "damaged"


FAULTS: dict[str, Callable[[dict[str, Any], str, int], None]] = {
    "missing": _missing, "unexpected": _unexpected, "wrong_shape": _wrong_shape, "all_three": _all_three,
    "rank1_wrong_shape": _rank1_wrong_shape, "rank1_not_tensor": _rank1_not_tensor,
}


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameters (flat shards) and buffers, copied."""
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _unchanged(model: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    after = _snapshot(model)
    return len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _source_state(impl: str, type_name: str, config: dict[str, Any]) -> dict[str, Any]:
    """A state dict of ``type_name`` from a wrapped model whose parameters are all 0.5."""
    api, _ = fsdp_api(impl)
    source = wrap_model(impl, config)
    with api.FullyShardedDataParallel.summon_full_params(source), torch.no_grad():
        for name, _ in make_model().named_parameters():  # through the wrappers' attribute forwarding
            functools.reduce(getattr, name.split("."), source.module).fill_(0.5)
    with api.FullyShardedDataParallel.state_dict_type(source, getattr(api.StateDictType, type_name)):
        return source.state_dict()


def load_cases(impl: str, type_names: tuple[str, ...], faults: list[str], strict: bool = True,
               config: dict[str, Any] | None = None) -> dict[str, tuple[tuple[str, str] | None, bool]]:
    """Per ``type/fault``: (error type and message or None, whether this rank's model is unchanged)."""
    config = config or {}
    import tensorplay.distributed as dist
    api, _ = fsdp_api(impl)
    rank = dist.get_rank()
    results = {}
    for type_name in type_names:
        state_dict_type = getattr(api.StateDictType, type_name)
        saved = _source_state(impl, type_name, config)
        for fault in faults:
            target = wrap_model(impl, config)
            damaged = dict(saved)
            if fault != "none":
                FAULTS[fault](damaged, _damage_key(type_name), rank)
            before = _snapshot(target)
            with api.FullyShardedDataParallel.state_dict_type(target, state_dict_type):
                error = error_of(target.load_state_dict, damaged, strict=strict)
            results[f"{type_name}/{fault}"] = (error, _unchanged(target, before))
    return results


def _shape_line(type_name: str, key: str, given: str) -> str:
    """The line naming ``key``, the shape given and the one expected (a local state dict's: the flat shard)."""
    if type_name == "LOCAL_STATE_DICT":
        return f"size mismatch for {key}: copying {given} from checkpoint, rank 1's flat shard is torch.Size(["
    return (f"size mismatch for {key}: copying {given} from checkpoint, the shape in current model is "
            f"{torch.Size(SHAPE)}.")


def test_every_problem_listed_and_nothing_loaded_on_any_rank():
    faults = ["none", "missing", "unexpected", "wrong_shape", "all_three", "rank1_wrong_shape", "rank1_not_tensor"]
    per_rank = run_distributed(load_cases, "ours", TYPES, faults)
    for rank, results in enumerate(per_rank):
        for type_name in TYPES:
            key = _damage_key(type_name)
            clean_error, clean_unchanged = results[f"{type_name}/none"]
            assert clean_error is None and not clean_unchanged, (type_name, clean_error)  # a load does load
            for fault in faults[1:]:
                error, unchanged = results[f"{type_name}/{fault}"]
                assert unchanged, (rank, type_name, fault)
                assert error is not None and error[0] == "StateDictLoadError", (rank, type_name, fault, error)
                message = error[1]
                assert "nothing was loaded" in message and f"on rank {rank}" in message, message
                if fault in ("missing", "all_three"):
                    missing = key if fault == "missing" else _other_key(key)
                    assert f'Missing key(s) in state_dict: "{missing}".' in message, message
                if fault in ("unexpected", "all_three"):
                    assert 'Unexpected key(s) in state_dict: "layers.1.bogus.weight".' in message, message
                if fault in ("wrong_shape", "all_three") or (fault == "rank1_wrong_shape" and rank == 1):
                    line = _shape_line(type_name, key, "a param with shape torch.Size([3, 5])")
                    assert line.replace("rank 1's", f"rank {rank}'s") in message, message
                if fault == "rank1_not_tensor" and rank == 1:
                    assert _shape_line(type_name, key, "a non-tensor value") in message, message
                if fault.startswith("rank1_") and rank == 0:
                    assert "failed on rank(s) [1]" in message and "size mismatch" not in message, message


def test_strict_false_allows_missing_and_unexpected_but_not_wrong_shapes():
    per_rank = run_distributed(load_cases, "ours", TYPES, ["missing", "unexpected", "all_three"], False)
    for results in per_rank:
        for type_name in TYPES:
            for fault in ("missing", "unexpected"):
                error, unchanged = results[f"{type_name}/{fault}"]
                assert error is None and not unchanged, (type_name, fault, error)
            error, unchanged = results[f"{type_name}/all_three"]
            assert unchanged and error is not None, (type_name, error)
            assert "size mismatch" in error[1] and "Missing" not in error[1] and "Unexpected" not in error[1]


def test_hybrid_shard_agrees_over_both_groups():
    """Rank 1's damage reaches ranks 2 and 3 too (another shard group): shard group, then replicate group."""
    config = dict(strategy="HYBRID_SHARD", hybrid_per_node=True)
    per_rank = run_distributed(load_cases, "ours", ("FULL_STATE_DICT",), ["rank1_wrong_shape"], True, config,
                               world_size=4)
    for rank, results in enumerate(per_rank):
        error, unchanged = results["FULL_STATE_DICT/rank1_wrong_shape"]
        assert unchanged and error is not None and error[0] == "StateDictLoadError", (rank, error)
        assert ("size mismatch for" in error[1]) == (rank == 1), (rank, error)


def test_pytorch_fsdp_half_loads_where_ours_refuses():
    """The reference that fails: PyTorch's FSDP copies every good key before raising."""
    per_rank = run_distributed(load_cases, "torch", ("FULL_STATE_DICT",), ["all_three", "rank1_wrong_shape"])
    for rank, results in enumerate(per_rank):
        error, unchanged = results["FULL_STATE_DICT/all_three"]
        assert error is not None and error[0] == "RuntimeError" and not unchanged  # raised, yet loaded
        error, unchanged = results["FULL_STATE_DICT/rank1_wrong_shape"]
        assert not unchanged  # rank 0 loaded everything, rank 1 all but the damaged key
        assert (error is None) == (rank == 0)
