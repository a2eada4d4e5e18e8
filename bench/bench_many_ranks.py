"""Many local ranks for real: ``tprun --nproc-per-node W`` on a tiny model, fully_shard and ZeRO, W = 2 .. 32.

Each W is one launch of our launcher (``python -m tensorplay.distributed.run --standalone``) running
``bench/_many_ranks_job.py``: Gloo, a 4 x Linear(64) model with fully_shard (default group), then with
``DistributedDataParallel`` + our ``ZeroRedundancyOptimizer`` (a group of its own). Shown against W:

- start-up: from the launch to the end of fully_shard's step 1 (slowest rank), split into the interpreter
  start and imports, ``init_process_group``, construction and step 1;
- our set-up pieces that could grow with W (timed by wrapping them, see the job's docstring): the shared-memory
  arena (first collective of a group; includes the pipe barrier), the pipe barrier, the slot mapping, the plan
  agreement. Wall time is the least over ranks (the rank that arrived last waits least: the cost once all
  are there); CPU time is the median over ranks;
- per step: wall and CPU time of a step (median over steps, then over ranks; CPU split into forward +
  backward and the optimizer step) against the same model's local step, and their difference: what our
  code and the communication cost each rank; PyTorch's fully_shard and ZeroRedundancyOptimizer run in the
  same launch (groups of their own) as the baseline.

Each table ends with the growth exponent: the least-squares slope of log(figure) against log(W). This machine
has few cores: W processes share them, so wall times that are CPU-bound grow like W / cores from the start
(slope about 1 once W exceeds the cores) while the CPU each rank spends is what should stay flat.

    .venv/bin/python bench/bench_many_ranks.py [--quick] [--worlds 2 4 8 16 32 64] [--steps 9]

Writes the figures also to ``bench/out/many_ranks.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUT = HERE / "out"
JOB = HERE / "_many_ranks_job.py"
FRONT_ENDS = (("fully_shard", "fully_shard"), ("zero", "ZeRO + DDP"))  # ours; "<key>_torch": PyTorch's
PARTS = ("shm arena set-up", "pipe barrier set-up", "shm slot mapping", "plan agreement")
PRIVATE_MIB_GUESS = 250.0  # per rank, until a run has measured it


def private_mib_per_rank() -> float:
    """Private memory of one rank as the last run measured it (``bench/out/many_ranks.json``), else a guess."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return max(row["private_mib"] for row in json.loads((OUT / "many_ranks.json").read_text())["rows"])
    return PRIVATE_MIB_GUESS


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) / 1024
    return float("inf")


def launch(world: int, steps: int, timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    """One ``tprun`` run of the job with ``world`` local ranks; every rank's result and the launcher's wall time."""
    with tempfile.TemporaryDirectory(prefix="tp_many_ranks_") as out:
        env = {**os.environ, "TP_MANY_RANKS_OUT": out, "OMP_NUM_THREADS": "1",
               "TP_MANY_RANKS_LAUNCH": repr(time.time())}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tensorplay.distributed.run", "--standalone",
                               "--nproc-per-node", str(world), str(JOB), "--steps", str(steps)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        elapsed = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"tprun with {world} ranks exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]
    if len(ranks) != world:
        raise RuntimeError(f"tprun with {world} ranks: {len(ranks)} ranks wrote results")
    return ranks, elapsed


def summarize(world: int, ranks: list[dict[str, Any]], launcher_s: float) -> dict[str, Any]:
    """The figures of one W: start-up (slowest rank), set-up parts (wall: least over ranks; CPU: median), steps."""
    row: dict[str, Any] = {"world": world, "launcher_s": launcher_s,
                           "first_step_from_launch_s": max(r["first_step_from_launch_s"] for r in ranks),
                           "start_import_s": max(r["start_s"] + r["import_s"] for r in ranks),
                           "init_s": max(r["init_s"] for r in ranks),
                           "rss_mib": max(r["rss_mib"] for r in ranks),
                           "private_mib": max(r["private_mib"] for r in ranks)}
    for key in [k + suffix for k, _ in FRONT_ENDS for suffix in ("", "_torch")]:
        fronts = [r[key] for r in ranks]
        parts = {}
        for part in PARTS:
            spent = [f["parts"].get(part, [0.0, 0.0, 0]) for f in fronts]
            parts[part] = {"wall_s": min(s[0] for s in spent), "cpu_s": statistics.median(s[1] for s in spent),
                           "calls": max(s[2] for s in spent)}
        row[key] = {"construct_s": max(f["construct_s"] for f in fronts),
                    "first_step_s": max(f["first_step_s"] for f in fronts),
                    "setup_cpu_s": statistics.median(f["setup_cpu_s"] for f in fronts), "parts": parts,
                    **{name: statistics.median(f[name] for f in fronts)
                       for name in ("step_s", "step_cpu_s", "local_step_s", "local_step_cpu_s",
                                    "backward_cpu_s", "optimizer_cpu_s")}}
    return row


def slope(worlds: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(W), over the positive values; nan with fewer than two."""
    points = [(math.log(w), math.log(v)) for w, v in zip(worlds, values, strict=True) if v > 0]
    if len(points) < 2:
        return float("nan")
    mean_x, mean_y = (statistics.fmean(p[i] for p in points) for i in (0, 1))
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else float("nan")


def print_rows(title: str, worlds: list[int], lines: list[tuple[str, list[float]]], unit: str = "ms") -> None:
    """One markdown table: a line per figure, a column per W, then the growth exponent."""
    print(f"\n### {title}\n")
    print("| figure | " + " | ".join(f"W={w}" for w in worlds) + " | growth exponent |")
    print("|---|" + "---|" * (len(worlds) + 1))
    scale, digits = (1e3, 1) if unit == "ms" else (1.0, 2 if unit == "s" else 0)
    for name, values in lines:
        cells = " | ".join(f"{v * scale:,.{digits}f}" for v in values)
        print(f"| {name} ({unit}) | {cells} | {slope(worlds, values):.2f} |")


def _at(row: dict[str, Any], path: str) -> float:
    """The figure at ``path`` ("fully_shard/parts/plan agreement/cpu_s"); "a - b": the difference of two paths."""
    if " - " in path:
        first, second = path.split(" - ")
        return _at(row, first) - _at(row, second)
    value: Any = row
    for part in path.split("/"):
        value = value[part]
    return float(value)


def _lines(rows: list[dict[str, Any]], spec: list[tuple[str, str]]) -> list[tuple[str, list[float]]]:
    return [(name, [_at(r, path) for r in rows]) for name, path in spec]


def _step_spec(key: str) -> list[tuple[str, str]]:
    torch_key = key + "_torch"
    return [("ours: step wall", f"{key}/step_s"), ("PyTorch's: step wall", f"{torch_key}/step_s"),
            ("ours: step CPU", f"{key}/step_cpu_s"), ("ours: forward + backward CPU", f"{key}/backward_cpu_s"),
            ("ours: optimizer step CPU", f"{key}/optimizer_cpu_s"),
            ("PyTorch's: step CPU", f"{torch_key}/step_cpu_s"),
            ("PyTorch's: forward + backward CPU", f"{torch_key}/backward_cpu_s"),
            ("PyTorch's: optimizer step CPU", f"{torch_key}/optimizer_cpu_s"),
            ("local step CPU (no process group)", f"{key}/local_step_cpu_s"),
            ("ours - local, CPU", f"{key}/step_cpu_s - {key}/local_step_cpu_s"),
            ("PyTorch's - local, CPU", f"{torch_key}/step_cpu_s - {torch_key}/local_step_cpu_s")]


def print_tables(rows: list[dict[str, Any]]) -> None:
    worlds = [r["world"] for r in rows]
    print_rows("Start-up, slowest rank", worlds, _lines(rows, [
        ("launch to end of step 1", "first_step_from_launch_s"), ("interpreter start + imports", "start_import_s"),
        ("init_process_group (c10d)", "init_s"), ("fully_shard construction", "fully_shard/construct_s"),
        ("fully_shard step 1", "fully_shard/first_step_s"),
        ("PyTorch's fully_shard construction", "fully_shard_torch/construct_s"),
        ("PyTorch's fully_shard step 1", "fully_shard_torch/first_step_s"),
        ("ZeRO + DDP construction", "zero/construct_s"), ("ZeRO + DDP step 1", "zero/first_step_s"),
        ("PyTorch's ZeRO + DDP construction", "zero_torch/construct_s"),
        ("PyTorch's ZeRO + DDP step 1", "zero_torch/first_step_s"),
        ("tprun launcher, whole run", "launcher_s")]), unit="s")
    for key, label in FRONT_ENDS:
        print_rows(f"{label}: our set-up pieces (wall: least over ranks; CPU: median rank)", worlds, _lines(rows, [
            *((f"{part} wall", f"{key}/parts/{part}/wall_s") for part in PARTS),
            *((f"{part} CPU", f"{key}/parts/{part}/cpu_s") for part in PARTS),
            ("construction + step 1, CPU", f"{key}/setup_cpu_s")]))
        print_rows(f"{label}: per step, ours and PyTorch's (median rank)", worlds, _lines(rows, _step_spec(key)))
    print_rows("Memory per rank (largest)", worlds, _lines(rows, [("RSS", "rss_mib"), ("private", "private_mib")]),
               unit="MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="W = 2, 4, 8")
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="default 2 4 8 16 32")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    args = parser.parse_args()
    worlds = args.worlds or ([2, 4, 8] if args.quick else [2, 4, 8, 16, 32])
    print(f"tprun --standalone, Gloo, {os.cpu_count()} cores shared by all ranks (and other jobs), "
          f"OMP_NUM_THREADS=1, {args.steps} timed steps\n")
    rows, private = [], private_mib_per_rank()
    for world in worlds:
        if world * private * 1.3 > available_mib():  # room left for the launcher and other jobs
            print(f"(skipping W={world}: {world} ranks x {private:.0f} MiB private would not fit in "
                  f"{available_mib():,.0f} MiB available)")
            continue
        ranks, launcher_s = launch(world, args.steps, args.timeout)
        rows.append(summarize(world, ranks, launcher_s))
        private = rows[-1]["private_mib"]
        print(f"W={world}: launcher {launcher_s:.1f} s", flush=True)
    if not rows:
        return
    print_tables(rows)
    OUT.mkdir(exist_ok=True)
    (OUT / "many_ranks.json").write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
