"""Classic FullyShardedDataParallel keeps in-flight all-gathers within PyTorch's ``limit_all_gathers`` bound.

PyTorch's rate limiter lets at most two all-gathers run ahead of the frees. Our
runtime prefetches one unit ahead and waits for a unit's own gather before it
issues the next prefetch, so whatever the prefetch options, and with
``limit_all_gathers=False`` too, it never has more than one asynchronous gather
pending. Counted here by wrapping the collective every unit gathers with, over
forward and backward of a few steps.
"""

from __future__ import annotations

from typing import Any

import tensorplay.distributed.fsdp._classic.flat_param as flat_param
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import train_fsdp

CONFIGS = [*(dict(strategy=strategy, forward_prefetch=True, backward_prefetch=prefetch, steps=2)
             for strategy in ("FULL_SHARD", "SHARD_GRAD_OP") for prefetch in ("BACKWARD_PRE", "BACKWARD_POST")),
           # PyTorch's limiter off (unbounded on its GPU streams): ours is the same, the flag changes nothing.
           dict(strategy="FULL_SHARD", forward_prefetch=True, backward_prefetch="BACKWARD_PRE", steps=2,
                limit_all_gathers=False)]


def count_in_flight(configs: list[dict[str, Any]]) -> list[dict[str, int]]:
    original = flat_param.all_gather_flat
    counts: list[dict[str, int]] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        count = counts[-1]
        count["issued"] += 1
        count["now"] += 1
        count["most"] = max(count["most"], count["now"])
        pending = original(*args, **kwargs)
        if not kwargs.get("async_op", False):  # synchronous (state dicts, summon): already complete
            count["now"] -= 1
            return pending
        then = pending.finish

        def finish() -> None:
            count["now"] -= 1
            if then is not None:
                then()

        pending.finish = finish
        return pending

    flat_param.all_gather_flat = counting
    try:
        for config in configs:
            counts.append({"issued": 0, "now": 0, "most": 0})
            train_fsdp("ours", config)
    finally:
        flat_param.all_gather_flat = original
    return counts


def test_in_flight_all_gathers_stay_within_pytorchs_limit():
    for rank_counts in run_distributed(count_in_flight, CONFIGS):
        for config, count in zip(CONFIGS, rank_counts, strict=True):
            assert count["issued"] >= 3 * 2, config  # 3 units, 2 steps (FULL_SHARD gathers again in backward)
            assert count["now"] == 0, config  # every gather was waited for
            assert count["most"] == 1, (config, count)  # PyTorch allows 2
