"""Classic FullyShardedDataParallel.register_comm_hook, with PyTorch's FSDP default hooks and a user hook.

Each configuration trains a few Adam steps with the hook registered on ours and
on PyTorch's FSDP: losses and parameters are bitwise equal. PyTorch's
``allreduce_hook`` / ``reduce_scatter_hook`` with a ``DefaultState`` reproduce the
default reduction, so they also equal the hookless run; a hook that sums instead
of averaging does not (the hook really runs).
"""

from __future__ import annotations

from typing import Any

import torch

from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
from tensorplay.distributed.fsdp import ShardingStrategy
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import (
    FP32,
    assert_close_states,
    assert_equal_states,
    comm_hook,
    ours_and_pytorch,
    train_reference,
)

HOOK_CONFIGS = [dict(strategy="FULL_SHARD", comm_hook="reduce_scatter_hook"),
                dict(strategy="SHARD_GRAD_OP", comm_hook="reduce_scatter_hook", orig=True),
                dict(strategy="NO_SHARD", comm_hook="allreduce_hook"),
                dict(strategy="FULL_SHARD", comm_hook="sum"),
                dict(strategy="NO_SHARD", comm_hook="sum", orig=True)]


def test_comm_hooks_match_pytorch_and_default_hooks_match_no_hook():
    ref_losses, ref_state = train_reference(world=2)
    for config, (ours_losses, ours_state), (torch_losses, torch_state) in ours_and_pytorch(HOOK_CONFIGS):
        assert ours_losses == torch_losses, config
        assert_equal_states(ours_state, torch_state)
        if config["comm_hook"] == "sum":  # twice the mean gradient: Adam's steps differ from the reference's
            assert ours_losses[-1] != ref_losses[-1]
            continue
        torch.testing.assert_close(ours_losses, ref_losses, **FP32)
        assert_close_states(ours_state, ref_state, **FP32)


def _error(fn: Any) -> str:
    try:
        fn()
    except (AssertionError, TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_hooks() -> dict[str, str]:
    cpu = torch.device("cpu")
    state, reduce_scatter = comm_hook("reduce_scatter_hook")
    _, allreduce = comm_hook("allreduce_hook")

    def registered_twice() -> None:
        model = FSDP(torch.nn.Linear(2, 2), device_id=cpu)
        model.register_comm_hook(state, reduce_scatter)
        model.register_comm_hook(state, reduce_scatter)

    def on_nested() -> None:
        model = FSDP(torch.nn.Sequential(FSDP(torch.nn.Linear(2, 2), device_id=cpu), torch.nn.Linear(2, 2)),
                     device_id=cpu)
        model.check_is_root()
        model[0].register_comm_hook(state, reduce_scatter)

    return {
        "not_callable": _error(lambda: FSDP(torch.nn.Linear(2, 2), device_id=cpu).register_comm_hook(state, 3)),
        "two_args_on_sharded": _error(lambda: FSDP(torch.nn.Linear(2, 2), device_id=cpu)
                                      .register_comm_hook(state, allreduce)),
        "three_args_on_no_shard": _error(lambda: FSDP(torch.nn.Linear(2, 2), device_id=cpu,
                                                      sharding_strategy=ShardingStrategy.NO_SHARD)
                                         .register_comm_hook(state, reduce_scatter)),
        "twice": _error(registered_twice),
        "nested": _error(on_nested),
    }


def test_bad_hooks_raise_pytorch_types_with_how_to_fix():
    messages = run_distributed(bad_hooks)[0]
    expected = {
        "not_callable": "ValueError: The communication hook must be callable but got 3",
        "two_args_on_sharded": "TypeError: register_comm_hook: hook 'allreduce_hook' cannot be called as "
                               "hook(state, grad, output), which FULL_SHARD units call",
        "three_args_on_no_shard": "TypeError: register_comm_hook: hook 'reduce_scatter_hook' cannot be called as "
                                  "hook(state, grad), which NO_SHARD units call",
        "twice": "AssertionError: A communication hook is already registered",
        "nested": "AssertionError: register_comm_hook can only be called on a root instance",
    }
    for name, start in expected.items():
        assert messages[name].startswith(start), (name, messages[name])
