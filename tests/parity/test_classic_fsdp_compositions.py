"""Classic FullyShardedDataParallel composed with activation checkpointing.

``apply_activation_checkpointing`` (PyTorch's ``checkpoint_wrapper``) on every
transformer block, either inside the FSDP units (FSDP first, then the blocks the
units hold are checkpointed) or around them (blocks checkpointed first, then FSDP
wraps the block inside each wrapper), for every sharding strategy and
``use_orig_params`` both ways. Each run trains a few Adam steps and is compared
bitwise with PyTorch's FSDP under the same composition, and allclose (fp32) with
the unwrapped model trained in one process.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint

from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import FP32, assert_close_states, assert_equal_states, train_fsdp, train_reference

STEPS = 2
AC_CONFIGS = [dict(ac=where, strategy=strategy, orig=orig, steps=STEPS)
              for where in ("inside", "outside")
              for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
              for orig in (False, True)]
# Reentrant checkpointing recomputes from a backward hook, where grad mode is off; without early stop
# the recomputation runs the units' post-forward too, which must not free the parameters mid-backward.
AC_EXTRA_CONFIGS = [dict(ac="inside", reentrant=True, steps=STEPS),
                    dict(ac="outside", reentrant=True, orig=True, steps=STEPS),
                    dict(ac="inside", strategy="SHARD_GRAD_OP", reentrant=True, orig=True, steps=STEPS),
                    dict(ac="outside", strategy="NO_SHARD", reentrant=True, steps=STEPS),
                    dict(ac="outside", early_stop=False, steps=STEPS),
                    dict(ac="outside", early_stop=False, orig=True, steps=STEPS)]


def train_checkpointed(impls: list[str], configs: list[dict[str, Any]]) -> list[tuple[list[float], dict]]:
    results = []
    for config in configs:
        for impl in impls:
            with torch.utils.checkpoint.set_checkpoint_early_stop(config.get("early_stop", True)):
                results.append(train_fsdp(impl, config))
    return results


def check_against_pytorch_and_reference(configs: list[dict[str, Any]], world_size: int = 2,
                                        bitwise: bool = True) -> None:
    ref_losses, ref_state = train_reference(world=world_size, steps=STEPS)
    for rank_results in run_distributed(train_checkpointed, ["ours", "torch"], configs, world_size=world_size):
        for index, config in enumerate(configs):
            (ours_losses, ours_state), (torch_losses, torch_state) = rank_results[2 * index:2 * index + 2]
            if bitwise:
                assert ours_losses == torch_losses, config
                assert_equal_states(ours_state, torch_state)
            else:  # sums over four ranks may associate differently
                torch.testing.assert_close(ours_losses, torch_losses, **FP32, msg=str(config))
                assert_close_states(ours_state, torch_state, **FP32)
            torch.testing.assert_close(ours_losses, ref_losses, **FP32, msg=str(config))
            assert_close_states(ours_state, ref_state, **FP32)


def test_activation_checkpointing_every_strategy_matches_pytorch_and_single_process():
    check_against_pytorch_and_reference(AC_CONFIGS)


def test_reentrant_and_full_recomputation_match_pytorch_and_single_process():
    check_against_pytorch_and_reference(AC_EXTRA_CONFIGS)


def test_activation_checkpointing_with_hybrid_shard_on_four_ranks():
    configs = [dict(ac="inside", strategy="HYBRID_SHARD", mesh=(2, 2), steps=STEPS),
               dict(ac="outside", strategy="HYBRID_SHARD", mesh=(2, 2), orig=True, steps=STEPS)]
    check_against_pytorch_and_reference(configs, world_size=4, bitwise=False)
