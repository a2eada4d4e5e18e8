"""The collective watch: diverged or dead ranks raise one named error instead of hanging (issue 14).

Scenario tests run each rank in a fresh process (``watch_cases.spawn_ranks``) with a 2 s stall time; a rank
that hangs is killed at the spawn timeout and the test fails on its missing result. The healthy-path tests use
the pooled workers: the watch must never raise there and must not change a single bit of the results.
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import pytest
import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives, watch
from tensorplay.testing.distributed import run_distributed

from tests.comm import watch_cases as cases

TIMEOUT_S = 150.0


def _raised_by(results: dict[int, tuple[str, object, float]], ranks: list[int]) -> dict[int, str]:
    assert sorted(results) == sorted(ranks), f"ranks {sorted(set(ranks) - set(results))} hung or died: {results}"
    for rank in ranks:
        status, message, _ = results[rank]
        assert status == "raised", f"rank {rank}: {status}: {message}"
    return {rank: str(results[rank][1]) for rank in ranks}


@pytest.mark.parametrize("world", [2, 4])
def test_extra_forward_under_fully_shard_raises_on_every_rank(world):
    messages = _raised_by(cases.spawn_ranks(cases.extra_forward, world, TIMEOUT_S), list(range(world)))
    for message in messages.values():
        assert "diverged" in message and "'layers.0'" in message, message
        assert "rank 0" in message and "rank 1" in message, message
        assert "shards unchanged" in message and "shards changed" in message, message


def test_skipped_fully_shard_group_raises_on_every_rank():
    messages = _raised_by(cases.spawn_ranks(cases.skip_group, 2, TIMEOUT_S), [0, 1])
    for message in messages.values():
        assert "rank 0" in message and "rank 1" in message and "'layers." in message, message


def test_skipped_zero_step_names_the_short_rank():
    results = cases.spawn_ranks(cases.zero_skip_step, 2, TIMEOUT_S)
    # Rank 1 finished one step short (nothing left to wait on); rank 0 must not hang in its last step.
    assert results[1][0] == "ok", results
    message = _raised_by({0: results[0]}, [0])[0]
    assert "rank 1 exited" in message and "ZeRO step" in message and "rank 0 is in broadcast" in message, message


def test_averager_at_a_different_step_raises_on_every_rank():
    messages = _raised_by(cases.spawn_ranks(cases.averager_step, 2, TIMEOUT_S), [0, 1])
    for message in messages.values():
        assert "averager step 0" in message and "averager step 1" in message, message


def test_sigkill_of_one_of_four_ranks_is_named_by_the_others():
    results = cases.spawn_ranks(cases.killed_mid_step, 4, TIMEOUT_S)
    assert 2 not in results  # killed
    messages = _raised_by({r: results[r] for r in (0, 1, 3) if r in results}, [0, 1, 3])
    for message in messages.values():
        assert "rank 2 is dead" in message and "'layers." in message, message


def test_a_stopped_rank_is_named_alive_and_where_it_was_last_seen():
    """SIGSTOP, not death: the message says the process lives, is stopped, and the collective it was last in."""
    results = cases.spawn_ranks(cases.stopped_mid_step, 2, TIMEOUT_S)
    message = _raised_by({0: results[0]}, [0])[0]
    assert "rank(s) [1] do not answer the watch" in message and "died" not in message, message
    assert re.search(r"rank 1 is alive but not answering: pid \d+ is stopped \(SIGSTOP or job control\); it did "
                     r"not answer the watch's probe within 2\.0 s; last seen in [\w-]+ of '[^']+' \(collective \d+, "
                     r"[^)]*\), the last one this rank completed with it", message), message
    assert "before its first collective" not in message, message


def test_a_rank_blocked_in_ddps_all_reduce_is_named_within_the_watchs_slices():
    """Under DDP, rank 1 skips a ZeRO step and waits in DDP's own all-reduce (not ours): its thread is idle, so
    rank 0 names it from its slices (0.5 s), not at the group's timeout (90 s) as before."""
    results = cases.spawn_ranks(cases.zero_under_ddp_skip_step, 2, TIMEOUT_S, stall_s=cases.QUICK_STALL_S)
    message = _raised_by({0: results[0]}, [0])[0]
    assert "rank(s) [1] are elsewhere" in message and "the group's timeout" not in message, message
    assert re.search(r"rank 1 is alive but blocked outside tensorplay's collectives \(its thread idle for "
                     r"[\d.]+ s; its last collective of ours in this group was [\w -]+ of "
                     r"'(ZeroRedundancyOptimizer|ZeRO step)"
                     r".*?\)\): probably a collective we do not issue, e\.g\. DDP's all-reduce or your own",
                     message), message
    assert "rank 0 is in broadcast from rank 0 of 'ZeRO step" in message, message


def test_a_rank_that_computes_outside_our_collectives_is_not_named():
    """The same job, but rank 1 computes for six slices before its ZeRO step: its thread's CPU time moves, so
    rank 0 waits (straggler patience) and both finish with the same parameters."""
    results = cases.spawn_ranks(cases.zero_under_ddp_peer_computes, 2, TIMEOUT_S, stall_s=cases.QUICK_STALL_S)
    assert [results.get(rank, ("missing",))[0] for rank in (0, 1)] == ["ok", "ok"], results
    assert results[0][1] == results[1][1], results  # every ZeRO step completed on both: the same parameters


def _train_fully_shard(enabled: bool) -> tuple[list[torch.Tensor], int]:
    watch.configure(enabled=enabled)
    try:
        model, optim = cases._fully_shard_model()
        cases._train(model, optim, 3, lambda step: None)
        group_watch = watch.watch_for(None, lambda: "gloo")
        return [p.full_tensor().detach() for p in model.parameters()], group_watch.seq if group_watch else -1
    finally:
        watch.configure(enabled=True)


def healthy_on_and_off() -> dict[str, object]:
    on, seq_on = _train_fully_shard(True)
    off, seq_off = _train_fully_shard(False)
    return {"on": on, "off": off, "recorded": seq_on, "seq_off": seq_off}


def test_healthy_training_is_bitwise_unchanged_and_recorded():
    for result in run_distributed(healthy_on_and_off):
        assert result["recorded"] > 0 and result["seq_off"] == -1
        for a, b in zip(result["on"], result["off"], strict=True):
            assert torch.equal(a, b)


def different_sites(group: dist.ProcessGroup | None = None) -> str:
    tensor = torch.ones(4)
    # A fresh group: the pooled default group's records may be offset by earlier tests.
    group = dist.new_group([0, 1]) if group is None else group
    try:
        collectives.all_reduce(tensor, group, where=f"site of rank {dist.get_rank()}", fingerprint=True)
    except watch.CollectiveDivergence as error:
        return str(error)
    return "no error"


def test_fingerprint_mismatch_is_an_error_at_that_collective():
    for rank, message in enumerate(run_distributed(different_sites)):
        assert "site of rank 0" in message and "site of rank 1" in message, f"rank {rank}: {message}"


def _raise_without_publishing(self, record, short):
    self._exchange_fingerprints(record, short)  # what it issued goes out with its hash; its records never do
    raise watch.CollectiveDivergence("rank 1 raised without publishing its records")


def sites_with_records_late() -> str:
    """Rank 1 never publishes its records: rank 0 names both sites from the fingerprints alone."""
    group = dist.new_group([0, 1])
    watch.configure(group, stall_s=0.2)  # rank 0 waits 2 * stall + 3 s for the records
    with mock.patch.object(watch.GroupWatch, "_raise_mismatch", _raise_without_publishing) if \
            dist.get_rank() == 1 else contextlib.nullcontext():
        return different_sites(group)


def test_fingerprint_mismatch_names_both_sites_when_records_are_late():
    message = run_distributed(sites_with_records_late)[0]
    assert "rank 1 did not publish its records in time" in message, message
    assert "as collective 0, rank 0 issued all-reduce of 'site of rank 0'" in message, message
    assert "rank 1 issued all-reduce of 'site of rank 1'" in message, message


def bad_options() -> list[str]:
    messages = []
    for kwargs in ({"stall_s": 0}, {"heartbeat_s": 10}, {"fingerprint_every": -1}, {"idle_s": 0}):
        try:
            watch.configure(**kwargs)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_options_are_named():
    messages = run_distributed(bad_options)[0]
    assert [m.split(" must")[0] for m in messages] == ["configure: stall_s", "configure: heartbeat_s",
                                                       "configure: fingerprint_every", "configure: idle_s"]
    assert messages[-1] == "configure: idle_s must be > 0 seconds (math.inf: never), got 0", messages


class _CountingStore:
    """A store proxy counting each operation by kind (and the keys read), forwarding to the real one."""

    def __init__(self, store: object) -> None:
        self.inner, self.calls, self.keys_read = store, {}, 0

    def __getattr__(self, name: str) -> object:
        method = getattr(self.inner, name)

        def counted(*args: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in ("check", "multi_get"):
                self.keys_read += len(args[0])  # type: ignore[arg-type]
            return method(*args)

        return counted


def healthy_store_traffic() -> dict[str, object]:
    """64 all-reduces in a watched group, its store counted: what the healthy path costs a rank."""
    group = dist.new_group(list(range(dist.get_world_size())))
    watch.configure(group, fingerprint_every=8)
    collectives.all_reduce(torch.ones(4), group)  # the watch and its store exist from here
    group_watch = watch.watch_for(group, lambda: "gloo")
    assert group_watch is not None
    counting = _CountingStore(group_watch._store)
    group_watch._store = counting
    for _ in range(63):
        collectives.all_reduce(torch.ones(4), group)
    return {"calls": counting.calls, "keys_read": counting.keys_read, "threads": sorted(
        t.name.rsplit("-", 2)[0] for t in __import__("threading").enumerate() if t.name.startswith("tensorplay-watch"))}


@pytest.mark.parametrize("world", [2, 4])
def test_healthy_path_touches_the_store_a_constant_number_of_times(world):
    """Per fingerprint round (every 8th collective here) a rank adds twice and reads two counters: 8 rounds, at
    most 32 operations, the same at any world size; no status written, no other rank's key read; one watcher
    thread per rank whatever the number of groups."""
    for traffic in run_distributed(healthy_store_traffic, world_size=world):
        assert set(traffic["calls"]) <= {"add"}, traffic
        assert 16 <= traffic["calls"].get("add", 0) <= 32, traffic
        assert traffic["keys_read"] == 0, traffic
        assert len(traffic["threads"]) == 1, traffic


def issuing_thread_recorded() -> dict[str, object]:
    """The watch records the thread that issues a group's collectives (a rank's own thread when ranks are threads);
    collectives from a second thread make it unknown (None: the watch judges without the idle signal)."""
    import threading

    group = dist.new_group(list(range(dist.get_world_size())))
    worker = threading.Thread(target=collectives.all_reduce, args=(torch.ones(4), group))
    worker.start()
    worker.join()
    group_watch = watch.watch_for(group, lambda: "gloo")
    assert group_watch is not None
    alone = watch._issuing_thread([group_watch])
    collectives.all_reduce(torch.ones(4), group)
    return {"worker": alone == worker.native_id, "mixed": watch._issuing_thread([group_watch]) is None}


def test_the_issuing_thread_is_recorded_and_two_make_it_unknown():
    assert run_distributed(issuing_thread_recorded) == [{"worker": True, "mixed": True}] * 2


def object_collective_is_waited_in() -> str | None:
    """While a rank blocks in an object collective of ours (c10d's own call), its status says it waits in it: it is
    in a collective of ours, not idle outside them."""
    import threading
    import time

    from tensorplay.distributed._comm import objects

    group = dist.new_group(list(range(dist.get_world_size())))
    collectives.all_reduce(torch.ones(4), group)  # the group's watch exists
    group_watch = watch.watch_for(group, lambda: "gloo")
    assert group_watch is not None
    seen: list[str] = []
    done = threading.Event()

    def look() -> None:
        while not done.is_set():
            if group_watch.waiting is not None:
                seen.append(group_watch.waiting.op)
            time.sleep(0.01)

    looker = threading.Thread(target=look)
    looker.start()
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 blocks in the gather meanwhile
    objects.all_gather_object([None] * dist.get_world_size(), dist.get_rank(), group)
    done.set()
    looker.join()
    return seen[0] if seen else None


def test_a_rank_blocked_in_an_object_collective_says_it_waits_in_it():
    assert run_distributed(object_collective_is_waited_in)[0] == "all-gather of objects"


def store_lost_messages() -> list[str]:
    group_watch = watch.watch_for(None, lambda: "gloo")
    assert group_watch is not None
    messages = [str(group_watch._store_lost("between collectives", RuntimeError("Broken pipe")))]
    with mock.patch.dict("os.environ", {"TENSORPLAY_SURVIVE": "1"}):
        messages.append(str(group_watch._store_lost("between collectives", RuntimeError("Broken pipe"))))
    return messages


def test_a_lost_store_names_its_host_rank_0_or_the_survive_launcher():
    plain, survive = run_distributed(store_lost_messages)[1]
    assert plain.endswith("rank 1 is between collectives and cannot reach the store (Broken pipe); the rank that "
                          "hosts it (global rank 0) has exited or died"), plain
    assert survive.endswith("the launcher that hosts it (tprun --survive) has exited or died"), survive
