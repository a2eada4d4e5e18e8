"""Repro of the shared-memory barrier's exit race (issue 41): two Gloo ranks, each a process that exits at once.

    .venv/bin/python tests/scripts/exit_race_repro.py [--runs 50] [--program full|sharded|both]

``full``: classic FSDP, one step, a FULL_STATE_DICT on every rank. ``sharded``: a tied-weight
model under classic FSDP, a SHARDED_STATE_DICT taken and loaded back, then
``destroy_process_group``. Rank 1 then leaves at once (``os._exit``), as a rank whose
interpreter exits quickly does, while rank 0 may still be in the last barrier's wait (rank 1,
or ``REPRO_LATE_RANK``, arrives 20 ms late at each barrier, so the other is already waiting there).

The ranks are forked from this process after the imports (each run costs a group's set-up,
not two interpreters' start). A run is clean when both ranks exit 0 and neither raised (the
race showed as ``shared-memory barrier: rank 1 of the group has exited`` -> ``CollectiveDivergence``
on rank 0). Each run prints how many shared-memory barriers rank 0 passed.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
import warnings

import torch

import tensorplay.distributed as dist
from tensorplay.distributed._comm import host_barrier
from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
from tensorplay.distributed.fsdp import StateDictType


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def _full() -> None:
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.state_dict()


def _sharded() -> None:
    model = FSDP(Tied(), use_orig_params=True)
    model(torch.randint(0, 11, (4, 5))).sum().backward()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(model.state_dict())
    dist.destroy_process_group()


def _rank(rank: int, port: int, program: str, report: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    warnings.simplefilter("ignore")
    arrivals = [0]
    arrive = host_barrier.PipeBarrier.arrive

    def counted(self: host_barrier.PipeBarrier) -> host_barrier.BarrierWork:
        arrivals[0] += 1
        if rank == int(os.environ.get("REPRO_LATE_RANK", "1")):
            time.sleep(0.02)  # the other rank is then in the barrier's wait when this one arrives
        return arrive(self)

    host_barrier.PipeBarrier.arrive = counted  # type: ignore[method-assign]
    code = 0
    try:
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        _full() if program == "full" else _sharded()
    except BaseException:  # noqa: BLE001 - reported to the parent
        os.write(report, traceback.format_exc().encode()[-1500:])
        code = 1
    os.write(report, f"\nbarriers {arrivals[0]}\n".encode())
    os._exit(code)  # at once: the race's window


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(program: str) -> tuple[bool, str]:
    port, children = _port(), []
    for rank in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _rank(rank, port, program, write)
        os.close(write)
        children.append((pid, read))
    outs, codes = [], []
    for pid, read in children:
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        outs.append(b"".join(chunks).decode(errors="replace"))
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    bad = [f"rank {rank} exited {code}: {out.strip()}" for rank, (code, out) in enumerate(zip(codes, outs,
                                                                                            strict=True)) if code]
    return not bad, "; ".join(bad) if bad else outs[0].strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--program", choices=("full", "sharded", "both"), default="both")
    args = parser.parse_args()
    for program in ("full", "sharded") if args.program == "both" else (args.program,):
        failures, passed = [], set()
        for _ in range(args.runs):
            ok, why = run_once(program)
            (passed.add(why) if ok else failures.append(why))
        print(f"{program}: {args.runs - len(failures)} of {args.runs} runs clean ({', '.join(sorted(passed))} "
              "shared-memory barriers on rank 0)", flush=True)
        for why in failures[:3]:
            print("   ", why[-700:], flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
