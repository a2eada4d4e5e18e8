"""``_comm.agreement``: every rank learns whether any rank failed, and which, and every rank's values (2 ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives
from tensorplay.distributed._comm.agreement import agree, start_agreement
from tensorplay.distributed._comm.watch import CollectiveDivergence
from tensorplay.testing.distributed import run_distributed


def _rank_fn() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    one = agree("one failed", rank == 1, values=[rank, 7])
    out["one"] = (one.failed, one.values, one.differing(), [one.global_rank(r) for r in one.failed])
    none = agree("none failed", False, values=[5, -5])
    out["none"] = (none.failed, none.values, none.differing())
    pending = start_agreement("in flight", rank == 0)  # a collective issued while it is in flight keeps its order
    total = torch.ones(3)
    collectives.all_reduce(total)
    settled = pending.wait()
    out["in_flight"] = (settled.failed, total.tolist())
    return out


def _elsewhere_fn() -> str:
    group = dist.new_group([0, 1])  # its own group: a diverged group raises at once ever after (pooled workers)
    try:
        agree(f"tag of rank {dist.get_rank()}", False, group)
    except CollectiveDivergence as error:
        return str(error)
    return "no error"


def test_every_rank_learns_which_ranks_failed_and_their_values() -> None:
    for rank, got in enumerate(run_distributed(_rank_fn, world_size=2)):
        assert got["one"] == ([1], [[0, 7], [1, 7]], [1], [1]), rank
        assert got["none"] == ([], [[5, -5], [5, -5]], []), rank
        assert got["in_flight"] == ([0], [2.0, 2.0, 2.0]), rank


def test_ranks_in_different_agreements_both_raise_naming_the_other() -> None:
    for rank, message in enumerate(run_distributed(_elsewhere_fn, world_size=2)):
        assert f"rank(s) [{1 - rank}] of the group issued another collective as this one" in message, message


def test_without_a_process_group_it_is_this_ranks_own_verdict() -> None:
    assert not dist.is_initialized()
    verdict = agree("alone", True, values=[3])
    assert (verdict.failed, verdict.values, verdict.differing()) == ([0], [[3, 0]], [])
    assert agree("alone", False).failed == []


def test_more_values_than_fit_are_refused_naming_the_tag() -> None:
    with pytest.raises(ValueError, match=r"start_agreement\('plan'\): at most 2 values, got 3"):
        agree("plan", False, values=[1, 2, 3])
