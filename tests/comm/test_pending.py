"""``_comm.collectives.Pending``: the one type for in-flight work (then / discard)."""

from __future__ import annotations

from tensorplay.distributed._comm.collectives import Pending, wait_all


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(self.name)
        return True


def test_then_runs_after_the_work_and_its_own_finish_once():
    log: list[str] = []
    pending = Pending([_Work(log, "work")], lambda: log.append("own"))  # type: ignore[list-item]
    assert pending.then(lambda: log.append("then")) is pending
    pending.wait()
    pending.wait()
    assert log == ["work", "own", "then"]


def test_discard_waits_for_the_work_but_skips_the_finishing_steps():
    log: list[str] = []
    pending = Pending([_Work(log, "work")]).then(lambda: log.append("then"))  # type: ignore[list-item]
    pending.discard()
    assert log == ["work"] and pending.works == []


def test_wait_all_finishes_each_in_order_and_empties_the_list():
    log: list[str] = []
    pendings = [Pending([_Work(log, f"work{i}")], lambda i=i: log.append(f"own{i}")) for i in range(2)]  # type: ignore[list-item]
    wait_all(pendings)
    assert log == ["work0", "own0", "work1", "own1"] and pendings == []
