"""The training recipe (examples/train_lm.py) under every strategy at world sizes 1, 2 and 4 (Gloo, CPU).

Same model, global batch and data at every world size, so step times compare
directly. Per strategy and world size: the median step time over the timed steps
(rank 0's, first ``--warmup`` steps dropped), the bytes each rank holds in
parameters, gradients and optimizer state (exact, from the local shards), and
the collective payload per step. Peak RSS is not reported here: pooled workers
run one configuration after another, so their high-water mark is shared (the
recipe's own table shows it for a single run).

    .venv/bin/python bench/bench_recipe.py [--worlds 1 2 4] [--steps 10] [--json bench/out/recipe.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "examples"))

import train_lm  # noqa: E402
from tensorplay.testing.distributed import run_distributed  # noqa: E402

MiB = 2**20


def run_configs(argvs: list[list[str]]) -> list[dict[str, Any]]:
    results = []
    for argv in argvs:
        with contextlib.redirect_stdout(io.StringIO()):  # the recipe's own report; the table below sums it up
            r = train_lm.main(argv)
        results.append({"label": r["label"], "step_times": r["step_times"], "table": r["table"],
                        "params": r["params"], "full_param_bytes": r["full_param_bytes"]})
    return results


def measure(worlds: list[int], strategies: list[str], args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    common = ["--dim", str(args.dim), "--n-layers", str(args.layers), "--n-heads", "4", "--seq-len", "64",
              "--batch-size", "8", "--steps", str(args.steps), "--val-every", "1000000", "--val-batches", "1",
              "--sample-bytes", "0", "--no-progress", "--no-plot", "--localsgd-warmup", "2"]
    rows = []
    for world in worlds:
        argvs = [common + ["--strategy", s, "--out", str(out / f"recipe_{s}_x{world}")] for s in strategies]
        results = run_distributed(run_configs, argvs, world_size=world, timeout=900)[0]
        for strategy, r in zip(strategies, results, strict=True):
            step_ms = statistics.median(r["step_times"][args.warmup:]) * 1e3
            table = r["table"]
            rows.append({"strategy": strategy, "world": world, "step_ms": step_ms, "params": r["params"],
                         "full_param_bytes": r["full_param_bytes"],
                         "param_mib": max(t["param_bytes"] for t in table) / MiB,
                         "grad_mib": max(t["grad_bytes"] for t in table) / MiB,
                         "optim_mib": max(t["optim_bytes"] for t in table) / MiB,
                         "comm_mib": max(t["comm_bytes_per_step"] for t in table) / MiB})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    print(f"\nrecipe: byte-level LM, {first['params'] / 1e6:.2f}M params ({first['full_param_bytes'] / MiB:.1f} MiB "
          f"fp32), global batch 8 x 64 bytes, AdamW, Gloo/CPU, 1 thread per rank")
    print("| strategy | world | step ms | vs ddp | params MiB/rank | grads MiB/rank | optim MiB/rank | "
          "model state MiB/rank | comm MiB/step/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    ddp = {r["world"]: r["step_ms"] for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        state = r["param_mib"] + r["grad_mib"] + r["optim_mib"]
        ratio = f"{r['step_ms'] / ddp[r['world']]:.2f}x" if r["world"] in ddp else "-"
        print(f"| {r['strategy']} | {r['world']} | {r['step_ms']:.0f} | {ratio} | {r['param_mib']:.2f} | "
              f"{r['grad_mib']:.2f} | {r['optim_mib']:.2f} | {state:.2f} | {r['comm_mib']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero", "localsgd", "fully_shard", "hsdp", "fsdp"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=str(ROOT / "bench" / "out" / "recipe.json"))
    args = parser.parse_args()
    out = Path(args.json).parent
    out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.worlds, args.strategies, args, out)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print_table(rows)
    print(f"\n(rows as JSON: {args.json}; bench/run_all.py draws them into bench/REPORT.md)")


if __name__ == "__main__":
    main()
