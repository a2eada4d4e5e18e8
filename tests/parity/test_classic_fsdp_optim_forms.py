"""Classic FullyShardedDataParallel's optimizer-state-dict family: every call form PyTorch 2.13 accepts.

Each form (positional and keyword; with and without ``optim``, ``optim_input``
and ``group``) runs on ours and on PyTorch's FSDP after the same training; the
results are equal tensor by tensor (sharded values compared by their local
shards: PyTorch's ShardedTensors, our DTensors), and so are the deprecation
warnings: the same categories, each PyTorch phrase also in ours.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import fsdp_api, make_model, trained

PHRASES = (
    "is being deprecated and is replaced by",
    "The `optim_input` argument is deprecated",
    "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated",
    "The `NO_SHARD` sharding strategy is deprecated",
    "full_state_dict will",
    "FSDP will not all-gather parameters for containers that do not implement forward",
)


def plain(value: Any) -> Any:
    """``value`` with sharded tensors replaced by their local shard (empty when the rank holds none)."""
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return shards[0].tensor.detach().clone() if shards else torch.empty(0)
    if hasattr(value, "to_local"):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    return value


def warning_key(caught: list[warnings.WarningMessage]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """Per FSDP warning: its category, the PHRASES it contains, the FSDP methods it names."""
    keys = []
    for warning in caught:
        message = str(warning.message)
        phrases = tuple(p for p in PHRASES if p in message)
        if not phrases and "FSDP" not in message and "FullyShardedDataParallel" not in message:
            continue  # not FSDP's (e.g. the core's own deprecations)
        names = tuple(dict.fromkeys(re.findall(r"FullyShardedDataParallel\.(\w+)", message)))
        keys.append((warning.category.__name__, phrases or (message,), names))
    return sorted(keys)


def calling(forms: dict[str, Callable[[], Any]]) -> dict[str, tuple[Any, list]]:
    results = {}
    for name, form in forms.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = form()
        results[name] = (plain(value), warning_key(caught))
    return results


def call_forms(impl: str) -> dict[str, tuple[Any, list]]:
    api, _ = fsdp_api(impl)
    FSDP, KeyType = api.FullyShardedDataParallel, api.OptimStateKeyType
    rank, world = dist.get_rank(), dist.group.WORLD
    model, optim = trained(impl, {})
    params = list(model.parameters())
    full_all = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    full_rank0 = FSDP.full_optim_state_dict(model, optim)
    sharded = FSDP.sharded_optim_state_dict(model, optim)
    osd = FSDP.optim_state_dict(model, optim)
    unwrapped = make_model()
    unwrapped_optim = torch.optim.Adam(unwrapped.parameters(), lr=1e-2)
    unwrapped(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    unwrapped_optim.step()
    forms = {
        "full_positional": lambda: FSDP.full_optim_state_dict(model, optim),
        "full_keywords": lambda: FSDP.full_optim_state_dict(model=model, optim=optim, rank0_only=False),
        "full_optim_input": lambda: FSDP.full_optim_state_dict(model, optim, params, False),
        "full_group": lambda: FSDP.full_optim_state_dict(model, optim, rank0_only=True, group=world),
        "sharded_positional": lambda: FSDP.sharded_optim_state_dict(model, optim),
        "sharded_group": lambda: FSDP.sharded_optim_state_dict(model=model, optim=optim, group=world),
        "shard_without_optim": lambda: FSDP.shard_full_optim_state_dict(full_all, model),
        "shard_optim": lambda: FSDP.shard_full_optim_state_dict(full_all, model, optim=optim),
        "shard_optim_input": lambda: FSDP.shard_full_optim_state_dict(full_all, model, params),
        "shard_optim_input_groups": lambda: FSDP.shard_full_optim_state_dict(full_all, model,
                                                                             optim_input=[{"params": params}]),
        "shard_keywords": lambda: FSDP.shard_full_optim_state_dict(full_optim_state_dict=full_all, model=model,
                                                                   optim_input=None, optim=optim),
        "scatter_without_optim": lambda: FSDP.scatter_full_optim_state_dict(full_rank0 if rank == 0 else None,
                                                                            model),
        "scatter_optim": lambda: FSDP.scatter_full_optim_state_dict(full_rank0 if rank == 0 else None, model,
                                                                    optim=optim),
        "scatter_optim_input": lambda: FSDP.scatter_full_optim_state_dict(full_rank0 if rank == 0 else None,
                                                                          model, params),
        "scatter_keywords_group": lambda: FSDP.scatter_full_optim_state_dict(
            full_optim_state_dict=full_rank0 if rank == 0 else None, model=model, optim=optim, group=world),
        "flatten_positional": lambda: FSDP.flatten_sharded_optim_state_dict(sharded, model, optim),
        "flatten_keywords": lambda: FSDP.flatten_sharded_optim_state_dict(sharded_optim_state_dict=sharded,
                                                                          model=model, optim=optim),
        "osd_positional": lambda: FSDP.optim_state_dict(model, optim),
        "osd_given_state": lambda: FSDP.optim_state_dict(model, optim, optim.state_dict()),
        "osd_keywords_group": lambda: FSDP.optim_state_dict(model=model, optim=optim, group=world),
        "to_load_positional": lambda: FSDP.optim_state_dict_to_load(model, optim, osd),
        "to_load_keywords": lambda: FSDP.optim_state_dict_to_load(model=model, optim=optim, optim_state_dict=osd,
                                                                  is_named_optimizer=False, load_directly=False,
                                                                  group=world),
        "to_load_directly": lambda: FSDP.optim_state_dict_to_load(model, optim, osd, load_directly=True),
        "rekey_to_ids": lambda: FSDP.rekey_optim_state_dict(full_all, KeyType.PARAM_ID, unwrapped),
        "rekey_to_ids_optim_input": lambda: FSDP.rekey_optim_state_dict(full_all, KeyType.PARAM_ID, unwrapped,
                                                                        unwrapped.parameters()),
        "rekey_to_ids_optim": lambda: FSDP.rekey_optim_state_dict(full_all, KeyType.PARAM_ID, unwrapped,
                                                                  optim=unwrapped_optim),
        "rekey_to_names": lambda: FSDP.rekey_optim_state_dict(unwrapped_optim.state_dict(), KeyType.PARAM_NAME,
                                                              unwrapped),
    }
    return calling(forms)


def assert_same(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual, key=str) == sorted(expected, key=str), where
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, (where, actual, expected)


def test_every_call_form_matches_pytorch_with_its_warnings():
    ours = run_distributed(call_forms, "ours")
    theirs = run_distributed(call_forms, "torch")
    for rank, (our_forms, their_forms) in enumerate(zip(ours, theirs, strict=True)):
        assert list(our_forms) == list(their_forms)
        for name, (expected, expected_warnings) in their_forms.items():
            actual, actual_warnings = our_forms[name]
            assert_same(actual, expected, f"rank {rank} {name}")
            assert actual_warnings == expected_warnings, (rank, name)
    # Not a comparison of empty results: the forms without optim give every rank its Adam state.
    for form in ("shard_without_optim", "scatter_without_optim", "rekey_to_ids"):
        state = ours[1][form][0]["state"]
        assert state and all("exp_avg" in value for value in state.values()), form
    # The forms did warn (not a comparison of two empty lists).
    assert ours[0]["shard_optim_input"][1] == [
        ("FutureWarning", ("The `optim_input` argument is deprecated",), ()),
        ("FutureWarning", ("is being deprecated and is replaced by",),
         ("shard_full_optim_state_dict", "optim_state_dict_to_load"))]


def construction_and_state_dict_type(impl: str) -> dict[str, list]:
    api, _ = fsdp_api(impl)
    FSDP = api.FullyShardedDataParallel
    cpu = torch.device("cpu")

    def state_dict_type() -> Any:
        model = FSDP(torch.nn.Linear(2, 2), device_id=cpu)
        with FSDP.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
            return model.state_dict()

    forms = {
        "no_shard": lambda: FSDP(torch.nn.Linear(2, 2), device_id=cpu, sharding_strategy=api.ShardingStrategy.NO_SHARD),
        "no_shard_local_state_dict": lambda: no_shard_local(api),
        "container": lambda: FSDP(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), device_id=cpu),
        "state_dict_type": state_dict_type,
        "set_state_dict_type": lambda: FSDP.set_state_dict_type(FSDP(torch.nn.Linear(2, 2), device_id=cpu),
                                                                api.StateDictType.FULL_STATE_DICT),
        "get_state_dict_type": lambda: FSDP.get_state_dict_type(FSDP(torch.nn.Linear(2, 2), device_id=cpu)),
    }
    return {name: key for name, (_, key) in calling(forms).items()}


def no_shard_local(api: Any) -> Any:
    FSDP = api.FullyShardedDataParallel
    model = FSDP(torch.nn.Linear(2, 2), device_id=torch.device("cpu"), sharding_strategy=api.ShardingStrategy.NO_SHARD)
    FSDP.set_state_dict_type(model, api.StateDictType.LOCAL_STATE_DICT)
    return model.state_dict()


def test_construction_and_state_dict_type_warn_as_pytorch():
    ours = run_distributed(construction_and_state_dict_type, "ours")[0]
    theirs = run_distributed(construction_and_state_dict_type, "torch")[0]
    assert ours == theirs
    assert theirs["no_shard"] == [("FutureWarning", ("The `NO_SHARD` sharding strategy is deprecated",), ())]
    assert theirs["get_state_dict_type"] == []
    assert len(theirs["state_dict_type"]) == 2  # entering and leaving the context
