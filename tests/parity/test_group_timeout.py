"""Every rank that waits on a failing peer raises within the group's own ``timeout=``, naming the peer and the site.

A sample of :mod:`timeout_cases`' grid (front end x what the peer does x transport), each rank a fresh
process in a group made with a 4 s timeout and the watch's defaults (5 s stall slices, 300 s straggler
patience). Before, a peer that raised and lived on kept its waiting peer for the straggler patience
(300 s; 100 s and more measured), the shared-memory barrier defaulted to c10d's 30 minutes, and a
rank that loaded a state dict while its peer started training waited in an unwatched all-gather until
Gloo's default 30 minutes. ``bench/timeout_table.py`` prints the whole grid.
"""

from __future__ import annotations

import pytest

from tests.parity import timeout_cases as cases

T = cases.GROUP_TIMEOUT_S
SHM, GLOO = {}, {"TENSORPLAY_SHM": "0"}


def _waiting_rank_raised(outcome: dict, rank: int, within_s: float, *names: str) -> str:
    status, message, seconds = outcome["results"].get(rank, ("no report", "", None))
    assert status == "raised", (rank, status, message, outcome["exits"])
    assert seconds <= within_s, f"rank {rank} raised after {seconds:.1f} s (group timeout {T} s): {message}"
    assert "CollectiveDivergence" in message, message
    for name in names:
        assert name in message, (name, message)
    code, ended = outcome["exits"][rank]
    assert code == 0 and ended is not None and ended <= seconds + 5.0, (rank, outcome["exits"][rank])
    return message


@pytest.mark.parametrize("front_end, behaviour, env", [
    ("fully_shard", "raise", SHM), ("classic", "sleep", GLOO), ("hook", "raise", SHM),
])
def test_a_peer_that_lives_elsewhere_is_named_within_the_group_timeout(front_end, behaviour, env):
    outcome = cases.spawn(front_end, behaviour, env=env)
    _waiting_rank_raised(outcome, 0, T, "rank 1 is not in a collective of this group", "the group's timeout")


@pytest.mark.parametrize("front_end, behaviour, env", [("zero", "exit", SHM), ("averager", "kill", GLOO)])
def test_a_peer_that_exited_or_died_is_named_within_seconds(front_end, behaviour, env):
    outcome = cases.spawn(front_end, behaviour, env=env)
    message = _waiting_rank_raised(outcome, 0, 3.0, "rank(s) [1] exited" if behaviour == "exit" else "rank(s) [1] died")
    assert ("rank 1 exited" if behaviour == "exit" else "rank 1 is dead (pid") in message, message


def test_a_peer_in_another_collective_is_named_by_both_within_the_group_timeout():
    outcome = cases.spawn("fully_shard", "other", env=SHM)
    for rank in (0, 1):
        _waiting_rank_raised(outcome, rank, T, "'something else'", "all-gather of 'layers.")


@pytest.mark.parametrize("front_end", ["fully_shard", "classic"])
def test_one_rank_loading_while_its_peer_trains_fails_at_once_on_both(front_end):
    # Through Gloo, classic FSDP's state_dict() all-gather meets the peer's plan agreement with another size,
    # and Gloo aborts that process ("Received data size doesn't match"); the other rank still raises at once.
    outcome = cases.spawn(front_end, "skip_load", env=SHM)
    for rank in (0, 1):
        _waiting_rank_raised(outcome, rank, 3.0, "plan agreement")
    loading = "load check" if front_end == "fully_shard" else "all-gather of 'weight'"
    assert loading in outcome["results"][1][1], outcome["results"][1][1]


def test_under_a_launcher_no_rank_answers_and_the_wait_still_ends_within_the_group_timeout():
    """Under torchrun / tprun (TORCHELASTIC_RUN_ID set) ranks run no watcher thread: the store sees nothing from a
    healthy rank; a stalled rank still raises within the timeout, saying its peer did not answer."""
    outcome = cases.spawn("fully_shard", "raise", env={**SHM, "TORCHELASTIC_RUN_ID": "test"})
    _waiting_rank_raised(outcome, 0, T, "rank 1 did not answer (no watcher thread under a launcher",
                         "the group's timeout")
