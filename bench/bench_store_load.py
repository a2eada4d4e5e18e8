"""The rendezvous TCPStore under load: many sleeping client processes replaying the watch's per-rank operation mix.

Rank 0 of c10d hosts one ``TCPStore`` (libuv server) that every rank talks to; the collective watch is our
largest user of it. This script starts such a server in its own process, then N client processes (forked
from a parent that imported ``torch.distributed``, so they share its pages; each connects its own
``TCPStore`` client), and each client replays one simulated rank's operation mix on its own clock:

    before  the watch in git HEAD before issue 29: per process group a heartbeat thread ``set``s a ~3 KiB
            JSON status every 0.5 s and ``check``s an alarm key every second; every 32nd collective a
            ``set`` of a fingerprint, then ``check`` and ``multi_get`` of every rank's fingerprint (W keys);
    after   the redesigned watch: one watcher per rank (not per group) doing one small ``add``
            every max(0.5, W/10000) s; a fingerprint round every 32 x ceil(W/256) collectives, each 2 ``add``s
            and at most 2 ``add(key, 0)`` reads.

with 3 process groups and 100 collectives per step (HSDP-like), one step per ``--step-s`` seconds. An
operation is one key touched (a ``multi_get`` of W keys is W operations: the unit of the issue's
"W x W reads"); requests are counted too. Measured: the server's achieved operations per second against
the offered load, client latency per request (p50/p99), the server process's CPU share; and, clients
in a closed loop (no sleeping), the most operations per second the server achieved (its capacity here: a
lower bound, as the clients share this machine's cores with it). Then the extrapolation: at W ranks the
store sees W x (operations per rank per second), as a fraction of that capacity. When
``bench/out/scale_counts.json`` (the scale simulation's counts) is present, the extrapolation adds the
per-rank store operations it counted for the redesigned watch.

    .venv/bin/python bench/bench_store_load.py [--quick] [--clients 8 16 32 64 128] [--seconds 4]

Writes the figures also to ``bench/out/store_load.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import random
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

OUT = Path(__file__).parent / "out"
GROUPS, COLLECTIVES_PER_STEP, FINGERPRINT_EVERY = 3, 100, 32
STATUS_BYTES, FINGERPRINT_BYTES = 3 * 1024, 96
FP_SLOTS = 4  # fingerprint slots pre-filled for every rank: a multi_get never waits on a missing key
WORLDS = (8, 64, 512, 4096, 16384)
LATENCY_SAMPLES = 20000  # kept per client


@dataclass(frozen=True)
class Stream:
    """A periodic activity of one rank: every ``period_s`` it issues ``ops`` (kind, number of keys)."""

    name: str
    period_s: float
    ops: tuple[tuple[str, int], ...]

    def keys_per_s(self) -> float:
        return sum(keys for _, keys in self.ops) / self.period_s

    def requests_per_s(self) -> float:
        return len(self.ops) / self.period_s


def streams(mix: str, world: int, step_s: float) -> list[Stream]:
    """One rank's store traffic under ``mix`` ("before" or "after") in a world of ``world`` ranks."""
    round_s = step_s * FINGERPRINT_EVERY / COLLECTIVES_PER_STEP  # time between fingerprint rounds (all groups)
    spaced_s = round_s * -(-world // 256)  # the redesign spaces rounds by one more interval per 256 ranks
    if mix == "before":
        beats = [Stream(f"heartbeat {g}", 0.5, (("set_status", 1),)) for g in range(GROUPS)]
        alarms = [Stream(f"alarm {g}", 1.0, (("check", 1),)) for g in range(GROUPS)]
        rounds = Stream("fingerprint", round_s, (("set_fp", 1), ("check", world), ("multi_get", world)))
        return [*beats, *alarms, rounds]
    if mix == "after":
        watcher = Stream("watcher", max(0.5, world / 10000), (("add", 1),))
        rounds = Stream("fingerprint", spaced_s, (("add", 1), ("add", 1), ("read", 1), ("read", 1)))
        return [watcher, rounds]
    raise ValueError(f"mix must be 'before' or 'after', got {mix!r}")


def keys_per_rank_s(mix: str, world: int, step_s: float) -> float:
    return sum(s.keys_per_s() for s in streams(mix, world, step_s))


# ---- the server -------------------------------------------------------------------------------------
def _serve(port_pipe: Any, stop: Any) -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, use_libuv=True, wait_for_workers=False)
    port_pipe.send(store.port)
    stop.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> tuple[float, float]:
    """Resident and private (not shared with other processes) memory of a process, in MiB."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, amount = line.split(":", 1)
        values[name] = int(amount.split()[0])
    return values["Rss"] / 1024, (values["Private_Clean"] + values["Private_Dirty"]) / 1024


# ---- a client: one simulated rank ---------------------------------------------------------------------
class Replayer:
    """Issues one rank's streams against the store, timing each request."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.status = "x" * STATUS_BYTES
        self.fingerprint = "f" * FINGERPRINT_BYTES
        self.round = 0
        self.latencies_us: list[float] = []
        self.requests = self.keys = 0

    def issue(self, kind: str, keys: int) -> None:
        store, slot = self.store, self.round % FP_SLOTS
        start = time.perf_counter()
        if kind == "set_status":
            store.set(f"live/{self.rank}", self.status)
        elif kind == "set_fp":
            store.set(f"fp/{slot}/{self.rank}", self.fingerprint)
        elif kind in ("check", "multi_get"):
            names = [f"fp/{slot}/{rank}" for rank in range(keys)] if keys > 1 else [f"alarm/{self.rank % GROUPS}"]
            store.check(names) if kind == "check" else store.multi_get(names)
        elif kind == "add":
            store.add(f"count/{slot}/{self.rank % 64}", 1)
        elif kind == "read":
            store.add(f"count/{slot}/{self.rank % 64}", 0)
        else:
            raise ValueError(f"unknown store operation {kind!r}")
        if len(self.latencies_us) < LATENCY_SAMPLES:
            self.latencies_us.append((time.perf_counter() - start) * 1e6)
        self.requests += 1
        self.keys += keys

    def run(self, plan: list[Stream], until: float, paced: bool) -> None:
        """Each stream's ops every ``period_s`` from a random phase; ``paced=False``: back to back, same mix."""
        clock = time.monotonic()
        due = [(clock + random.uniform(0, s.period_s), i) for i, s in enumerate(plan)]
        heapq.heapify(due)
        while True:
            when, index = heapq.heappop(due)
            if paced:
                if when >= until:
                    return
                time.sleep(max(0.0, when - time.monotonic()))
            elif time.monotonic() >= until:
                return
            for kind, keys in plan[index].ops:
                self.issue(kind, keys)
            if plan[index].name == "fingerprint":
                self.round += 1
            heapq.heappush(due, (when + plan[index].period_s, index))


def _client(port: int, rank: int, mix: str, world: int, step_s: float, seconds: float, paced: bool,
            ready: Any, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, use_libuv=True, timeout=timedelta(seconds=120))
    replayer = Replayer(store, rank, world)
    ready.wait()
    start = time.monotonic()
    replayer.run(streams(mix, world, step_s), start + seconds, paced)
    results.put({"rank": rank, "requests": replayer.requests, "keys": replayer.keys,
                 "seconds": time.monotonic() - start, "latencies_us": replayer.latencies_us})


@dataclass
class Row:
    mix: str
    clients: int
    paced: bool
    offered_keys_s: float
    achieved_keys_s: float
    achieved_requests_s: float
    p50_us: float
    p99_us: float
    server_cpu: float
    client_rss_mib: float
    client_private_mib: float


def measure(port: int, server_pid: int, mix: str, clients: int, step_s: float, seconds: float,
            paced: bool) -> Row:
    """Run ``clients`` replaying ``mix`` for ``seconds``; the server's throughput and the clients' latency."""
    ctx = mp.get_context("fork")
    ready, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(port, rank, mix, clients, step_s, seconds, paced, ready, results),
                         daemon=True) for rank in range(clients)]
    for proc in procs:
        proc.start()
    ready.wait(timeout=120)
    cpu_start, wall_start = cpu_seconds(server_pid), time.monotonic()
    time.sleep(seconds / 2)
    rss, private = memory_mib(procs[0].pid or 0)
    outcomes = [results.get(timeout=seconds + 120) for _ in procs]
    busy_s = cpu_seconds(server_pid) - cpu_start  # the load lasted ``span``; the wall since ``wall_start`` is longer
    for proc in procs:
        proc.join(timeout=30)
    latencies = sorted(x for o in outcomes for x in o["latencies_us"])
    span = max(max(o["seconds"] for o in outcomes), 1e-9)
    busy = busy_s / min(span, time.monotonic() - wall_start)
    return Row(mix, clients, paced, clients * keys_per_rank_s(mix, clients, step_s),
               sum(o["keys"] for o in outcomes) / span, sum(o["requests"] for o in outcomes) / span,
               _quantile(latencies, 0.5), _quantile(latencies, 0.99), busy, rss, private)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prefill(port: int, clients: int) -> None:
    """Every rank's fingerprint in every slot, as on the healthy path once all ranks published."""
    store = dist.TCPStore("127.0.0.1", port, None, False, use_libuv=True)
    for slot in range(FP_SLOTS):
        for rank in range(clients):
            store.set(f"fp/{slot}/{rank}", "f" * FINGERPRINT_BYTES)


# ---- the extrapolation ------------------------------------------------------------------------------
def simulated_after_rates(path: Path, step_s: float) -> dict[int, float] | None:
    """Per-rank store operations per second of the redesigned watch at each W, from the scale simulation if it ran.

    Reads ``per_rank_per_step_store`` of ``bench_scale.py``'s JSON (per W, per front end: ``keys`` touched per
    step by kind, ``background_ops_per_s``); per W the largest over the front ends, at one step per ``step_s``.
    """
    if not path.exists():
        return None
    per_world = json.loads(path.read_text()).get("per_rank_per_step_store", {})
    found: dict[int, float] = {}
    for world, front_ends in per_world.items():
        rates = [sum(counts.get("keys", {}).values()) / step_s + float(counts.get("background_ops_per_s", 0.0))
                 for counts in front_ends.values()]
        if rates:
            found[int(world)] = max(rates)
    return found or None


def extrapolate(capacity: dict[str, float], step_s: float, simulated: dict[int, float] | None) -> list[dict[str, Any]]:
    """Store operations per second at each W in ``WORLDS``, per mix, and as a fraction of the measured capacity.

    "after, watcher only": the redesign with the fingerprints carried in collectives instead of the store.
    """
    rows = []
    for world in WORLDS:
        per_rank = {mix: keys_per_rank_s(mix, world, step_s) for mix in ("before", "after")}
        per_rank["after, watcher only"] = streams("after", world, step_s)[0].keys_per_s()
        if simulated and world in simulated:
            per_rank["after, simulated"] = simulated[world]
        rows.append({"world": world, **{f"{mix}/per_rank_s": rate for mix, rate in per_rank.items()},
                     **{f"{mix}/store_s": world * rate for mix, rate in per_rank.items()},
                     **{f"{mix}/of_capacity": world * rate / capacity["before" if mix == "before" else "after"]
                        for mix, rate in per_rank.items()}})
    return rows


# ---- the tables ------------------------------------------------------------------------------------
def print_load(rows: list[Row]) -> None:
    print("| mix | clients | paced | offered ops/s | achieved ops/s | requests/s | p50 us | p99 us | server CPU "
          "| client RSS / private MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.mix} | {r.clients} | {'yes' if r.paced else 'closed loop'} | "
              f"{r.offered_keys_s:,.0f} | {r.achieved_keys_s:,.0f} | {r.achieved_requests_s:,.0f} | "
              f"{r.p50_us:,.0f} | {r.p99_us:,.0f} | {r.server_cpu:.0%} | "
              f"{r.client_rss_mib:.0f} / {r.client_private_mib:.1f} |")


def print_extrapolation(rows: list[dict[str, Any]], capacity: dict[str, float], step_s: float) -> None:
    mixes = list(dict.fromkeys(key.split("/")[0] for r in rows for key in r if key.endswith("/per_rank_s")))
    print(f"\n### Extrapolation: store load at W ranks, one step per {step_s:g} s (capacity measured here: "
          f"before mix {capacity['before']:,.0f} ops/s, after mix {capacity['after']:,.0f} ops/s)\n")
    print("| W | " + " | ".join(f"{mix}: ops/rank/s | store ops/s | of capacity" for mix in mixes) + " |")
    print("|---|" + "---|---|---|" * len(mixes))
    for r in rows:
        cells = " | ".join(f"{r[f'{mix}/per_rank_s']:,.1f} | {r[f'{mix}/store_s']:,.0f} | "
                           f"{r[f'{mix}/of_capacity']:,.2f}x" if f"{mix}/per_rank_s" in r else "- | - | -"
                           for mix in mixes)
        print(f"| {r['world']:,} | {cells} |")
    budget = capacity["after"] / WORLDS[-1]
    print(f"\nAt {WORLDS[-1]:,} ranks the measured capacity leaves {budget:.1f} store ops per rank per second.")


def client_counts(requested: list[int] | None, quick: bool) -> list[int]:
    """The client counts to run: those asked for, else 8 .. 128, less what this machine's free memory can't hold.

    Not 256 by default: on 2 cores, 256 sleeping clients wake late (p99 over 1 s, the server 6% busy), which
    measures the clients' machine rather than the server.
    """
    wanted = requested or ([8, 16, 32] if quick else [8, 16, 32, 64, 128])
    available_mib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable")) / 1024
    fits = [n for n in wanted if n * 10 < available_mib / 4]  # ~3 MiB private per forked client measured; 10 kept
    if len(fits) < len(wanted):
        print(f"(skipping {sorted(set(wanted) - set(fits))} clients: {available_mib:,.0f} MiB available)")
    return fits


def measure_all(counts: list[int], step_s: float, seconds: float) -> list[Row]:
    """Paced rows for every client count and mix, then closed-loop rows (the capacity) at a few counts."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    server = ctx.Process(target=_serve, args=(send, stop), daemon=True)
    server.start()
    port, server_pid = receive.recv(), server.pid or 0
    prefill(port, max(counts))
    rows = [measure(port, server_pid, mix, n, step_s, seconds, True) for n in counts for mix in ("before", "after")]
    rows += [measure(port, server_pid, mix, n, step_s, seconds, False) for mix in ("before", "after")
             for n in sorted({counts[0], min(32, counts[-1]), counts[-1]})]
    stop.set()
    server.join(timeout=10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 to 32 clients, 2 s each")
    parser.add_argument("--clients", type=int, nargs="+", default=None)
    parser.add_argument("--seconds", type=float, default=None, help="replay time per row (default 4; --quick 2)")
    parser.add_argument("--step-s", type=float, default=1.0, help="training step time the mix is replayed at")
    parser.add_argument("--extrapolate-only", action="store_true",
                        help="no measuring: the extrapolation from the capacity in bench/out/store_load.json")
    args = parser.parse_args()
    if args.extrapolate_only:
        saved = json.loads((OUT / "store_load.json").read_text())
        capacity, rows = saved["capacity_ops_s"], [Row(**row) for row in saved["rows"]]
    else:
        seconds = args.seconds or (2.0 if args.quick else 4.0)
        print(f"TCPStore (libuv) server in its own process; clients forked after `import torch.distributed`; "
              f"{os.cpu_count()} cores shared by server and clients (and other jobs); {GROUPS} process groups, "
              f"{COLLECTIVES_PER_STEP} collectives and one step per {args.step_s:g} s; {seconds:g} s per row; "
              f"ops = keys touched\n")
        rows = measure_all(client_counts(args.clients, args.quick), args.step_s, seconds)
        print_load(rows)
        capacity = {mix: max(r.achieved_keys_s for r in rows if r.mix == mix and not r.paced)
                    for mix in ("before", "after")}
    simulated = simulated_after_rates(OUT / "scale_counts.json", args.step_s)
    if simulated:
        print("\n(after, simulated: per-rank store operations from bench/out/scale_counts.json, the largest over "
              "front ends, its step's collectives at one step per --step-s)")
    extrapolated = extrapolate(capacity, args.step_s, simulated)
    print_extrapolation(extrapolated, capacity, args.step_s)
    OUT.mkdir(exist_ok=True)
    (OUT / "store_load.json").write_text(json.dumps(
        {"step_s": args.step_s, "cores": os.cpu_count(), "rows": [asdict(r) for r in rows],
         "capacity_ops_s": capacity, "extrapolation": extrapolated,
         "after_counts_from_simulation": simulated is not None}, indent=1))


if __name__ == "__main__":
    main()
