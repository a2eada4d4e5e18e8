"""One rank's cost at W = 4,096 against W = 8, on PyTorch's fake process group (tensorplay.testing.scale).

Each world size runs in one fresh process (every front end of the fast subset in turn). A per-rank count may
grow by at most 10% plus a stated small constant from W = 8 to W = 4,096; sharded state shrinks as 1/W.
The full table, W = 16,384 and the 2-D meshes are bench/bench_scale.py's.
"""

from __future__ import annotations

import math

import pytest

from tensorplay.testing.scale import CountingStore, Counts, simulate, simulate_in_subprocess

FAST = ["fully_shard", "fsdp_full_shard", "zero", "averager"]
SMALL, LARGE = 8, 4096
HIDDEN = 4096  # >= W: every rank holds a non-empty 1/W shard of each wide weight


DCP = ["zero"]  # a DCP save at W = 4,096 costs rank 0 (the coordinator) seconds of PyTorch's planning: one


@pytest.fixture(scope="module")
def counts() -> dict[int, dict[str, Counts]]:
    options = {"hidden": HIDDEN, "steps": 4, "linger_s": 0.0}
    return {world: {c.front_end: c for c in simulate_in_subprocess(FAST, world, dcp=DCP, **options)}
            for world in (SMALL, LARGE)}


def _within(small: float, large: float, constant: float = 0.0) -> bool:
    """``large`` is within 1.1x of ``small`` plus ``constant`` (a stated allowance, O(1) in W)."""
    return large <= 1.1 * small + constant


@pytest.mark.parametrize("front_end", FAST)
def test_collectives_per_rank_do_not_grow_with_world_size(counts, front_end):
    small, large = counts[SMALL][front_end], counts[LARGE][front_end]
    for phase in ("construction", "lazy_init", "step", "dcp_save")[:4 if front_end in DCP else 3]:
        a, b = small.phases[phase], large.phases[phase]
        assert not a.error and not b.error, (phase, a.error, b.error)
        assert _within(a.total("collectives"), b.total("collectives")), (phase, a.collectives, b.collectives)
        # our bookkeeping's bytes (integer collectives: agreements, DCP's object collectives), less DCP's
        # coordinator scatter (see the next test); a plan's offsets grow in digits with W: 1 KiB of slack
        assert _within(_control_bytes(a), _control_bytes(b), 1024), (phase, a.collective_bytes, b.collective_bytes)


def _control_bytes(phase) -> float:
    return phase.total("collective_bytes", True) - phase.collective_bytes.get("scatter (control)", 0)


@pytest.mark.parametrize("front_end", DCP)
def test_dcp_coordinator_scatters_one_plan_per_rank(counts, front_end):
    """Rank 0 coordinates a DCP save: it scatters every rank its plan (PyTorch's DCP), bytes growing as W.

    Every other rank receives its one plan: O(1). Stated, so a change in either direction shows here.
    """
    small = counts[SMALL][front_end].phases["dcp_save"].collective_bytes.get("scatter (control)", 0)
    large = counts[LARGE][front_end].phases["dcp_save"].collective_bytes.get("scatter (control)", 0)
    per_rank_small, per_rank_large = small / SMALL, large / LARGE
    assert per_rank_small > 0 and per_rank_large <= 1.1 * per_rank_small + 64, (per_rank_small, per_rank_large)


@pytest.mark.parametrize("front_end", FAST)
def test_store_operations_and_threads_per_rank_do_not_grow_with_world_size(counts, front_end):
    small, large = counts[SMALL][front_end], counts[LARGE][front_end]
    for phase in ("construction", "lazy_init", "step"):
        a, b = small.phases[phase], large.phases[phase]
        assert _within(a.total("store_calls"), b.total("store_calls")), (phase, a.store_calls, b.store_calls)
        assert _within(a.total("store_keys"), b.total("store_keys")), (phase, a.store_keys, b.store_keys)
        assert _within(a.threads, b.threads), (phase, a.threads, b.threads)


@pytest.mark.parametrize("front_end", FAST)
def test_watch_state_per_rank_does_not_grow_with_world_size(counts, front_end):
    small, large = counts[SMALL][front_end], counts[LARGE][front_end]
    assert large.watched and small.watch_bytes > 0  # the watch ran: a check that cannot pass vacuously
    assert _within(small.watch_bytes, large.watch_bytes, 1024), (small.watch_bytes, large.watch_bytes)


@pytest.mark.parametrize("front_end", FAST)
def test_our_python_objects_per_rank_do_not_grow_with_world_size(counts, front_end):
    """What our code allocates and keeps (tracemalloc, lines under src/tensorplay). ZeRO kept one list per rank
    and group (``owned[r][g]``: 659 kB at W = 4,096) before its partition became one owner per tensor."""
    small, large = counts[SMALL][front_end], counts[LARGE][front_end]
    assert small.our_python_bytes > 0
    assert _within(small.our_python_bytes, large.our_python_bytes, 16 * 1024), (
        small.our_python_bytes, large.our_python_bytes)


@pytest.mark.parametrize("front_end", ["fully_shard", "fsdp_full_shard"])
def test_sharded_state_per_rank_shrinks_as_one_over_world_size(counts, front_end):
    small, large = counts[SMALL][front_end], counts[LARGE][front_end]
    assert small.sharded_bytes > 0
    per_world_small, per_world_large = small.sharded_bytes * SMALL, large.sharded_bytes * LARGE
    # padding: the 16-element biases are padded to W elements (one per rank) at W = 4,096
    assert math.isclose(per_world_small, per_world_large, rel_tol=0.1), (per_world_small, per_world_large)


def test_zero_shards_optimizer_state_until_a_rank_has_under_one_tensor(counts):
    """ZeRO partitions whole tensors: 8 tensors over 8 ranks is one each; at 4,096 most ranks own none."""
    small, large = counts[SMALL]["zero"], counts[LARGE]["zero"]
    assert 0 < small.sharded_bytes and large.sharded_bytes <= small.sharded_bytes


def test_the_watch_counts_its_store_operations(counts):
    """The fake groups are watched: lazy init publishes this rank's status to the store."""
    assert counts[SMALL]["fully_shard"].phases["lazy_init"].total("store_calls") > 0


def test_counting_store_answers_as_if_every_rank_did_the_same():
    store = CountingStore(rank=3, world_size=64)
    assert store.add("n", 2) == 128 and store.add("n", 0) == 128
    store.set("fp/5/3", b"x")
    assert store.check(["fp/5/0", "fp/5/63"]) and store.multi_get(["fp/5/9"]) == [b"x"]
    assert not store.check(["fp/6/0"]) and not store.check(["fp/5/64"])
    with pytest.raises(RuntimeError, match="never set"):
        store.get("missing")
    assert store.calls == {"add": 2, "set": 1, "check": 3, "multi_get": 1, "get": 1}
    assert store.keys["check"] == 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"front_end": "fsdp3", "world_size": 8}, "front_end must be one of"),
    ({"front_end": "zero", "world_size": 12}, "world_size must be a multiple of 8"),
    ({"front_end": "zero", "world_size": 8, "rank": 8}, "rank must be in"),
    ({"front_end": "zero", "world_size": 8, "steps": 0}, "steps must be >= 1"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(**kwargs)
