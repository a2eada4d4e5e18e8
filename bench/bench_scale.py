"""What one rank pays for our machinery at W = 8 ... 16,384, simulated on PyTorch's fake process group.

    .venv/bin/python bench/bench_scale.py [--world-sizes 8,64,512,4096,16384] [--front-ends fully_shard,zero]

One fresh process per world size stands for rank 0 of a world of W (``tensorplay.testing.scale``, see its
[Note: the scale simulation]) and runs every front end in turn: construction, lazy init (the first step), a
training step (mean of ``--steps``) and a DCP save. The baseline is the same rank at W = 8: each table gives the
per-rank figure at every W and its ratio to W = 8. Charts (log-log, one line per front end) go to
``bench/report/scale_*.png``; ``bench/out/scale_counts.json`` keeps every count, with the per-rank, per-step store
operations by kind at each W (read by the store-load benchmark).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "src"))

from tensorplay.testing.scale import FRONT_ENDS, Counts, simulate_in_subprocess  # noqa: E402

OUT = HERE / "out"
CHARTS = HERE / "report"

#: (label, how to read it from Counts); each is per rank.
FIGURES: list[tuple[str, Any]] = [
    ("collectives / step", lambda c: c.phases["step"].total("collectives")),
    ("control collectives / step", lambda c: c.phases["step"].total("collectives", control_only=True)),
    ("set-up collectives (construction + lazy init)",
     lambda c: c.phases["construction"].total("collectives") + c.phases["lazy_init"].total("collectives")),
    ("control bytes, set-up", lambda c: c.phases["construction"].total("collective_bytes", True)
     + c.phases["lazy_init"].total("collective_bytes", True)),
    ("DCP save collectives", lambda c: c.phases["dcp_save"].total("collectives") if "dcp_save" in c.phases else 0),
    ("DCP save control bytes",
     lambda c: c.phases["dcp_save"].total("collective_bytes", True) if "dcp_save" in c.phases else 0),
    ("store calls / step", lambda c: c.phases["step"].total("store_calls")),
    ("store keys / step", lambda c: c.phases["step"].total("store_keys")),
    ("store keys, set-up", lambda c: c.phases["construction"].total("store_keys")
     + c.phases["lazy_init"].total("store_keys")),
    ("background store ops / s", lambda c: c.background_store_ops_per_s),
    ("threads started", lambda c: sum(p.threads for p in c.phases.values())),
    ("watch bytes", lambda c: c.watch_bytes),
    ("our Python bytes", lambda c: c.our_python_bytes),
    ("pooled buffer bytes", lambda c: c.pooled_buffer_bytes),
    ("sharded bytes x W", lambda c: c.sharded_bytes * c.world_size),
    ("our host ms / step", lambda c: c.our_host_ms_per_step),
]


def run(front_ends: list[str], world_sizes: list[int], hidden: int, steps: int,
        reuse: bool, table_only: bool = False) -> dict[int, dict[str, Counts]]:
    """Each world size in one fresh process; its counts kept in bench/out/scale_W<W>.json as soon as done
    (merged with the front ends already there). ``reuse``: take the front ends already kept instead of running
    them again (e.g. after running world sizes in parallel)."""
    results: dict[int, dict[str, Counts]] = {}
    OUT.mkdir(parents=True, exist_ok=True)
    for world in world_sizes:
        cache = OUT / f"scale_W{world}.json"
        kept = {row["front_end"]: Counts.from_json(row) for row in json.loads(cache.read_text())} \
            if cache.exists() else {}
        missing = [name for name in front_ends if not (reuse and name in kept)]
        if missing and not table_only:
            start = time.perf_counter()
            for counts in simulate_in_subprocess(missing, world, hidden=hidden, steps=steps, linger_s=1.0,
                                                 timeout_s=3600):
                kept[counts.front_end] = counts
            cache.write_text(json.dumps([c.to_json() for c in kept.values()]))
            print(f"<!-- W={world}: {time.perf_counter() - start:.0f} s -->", flush=True)
        results[world] = kept
    return results


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.2f}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.3g}"


def table(label: str, read: Any, results: dict[int, dict[str, Counts]], front_ends: list[str]) -> str:
    """One row per front end: the figure at each W, and the largest W's over the smallest's (- where not run)."""
    worlds = sorted(results)
    head = f"| {label} | " + " | ".join(f"W={w}" for w in worlds) + " | largest W / W=8 |"
    lines = [head, "|---" * (len(worlds) + 2) + "|"]
    for front_end in front_ends:
        values = [read(results[w][front_end]) if front_end in results[w] else None for w in worlds]
        ran = [v for v in values if v is not None]
        first, last = (ran[0], ran[-1]) if ran else (0.0, 0.0)
        ratio = last / first if first else (1.0 if last == 0 else float("inf"))
        cells = " | ".join("-" if v is None else _fmt(v) for v in values)
        lines.append(f"| {front_end} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines)


def errors(results: dict[int, dict[str, Counts]]) -> list[str]:
    return [f"- {c.front_end} W={c.world_size} {name}: {phase.error}"
            for counts in results.values() for c in counts.values() for name, phase in c.phases.items()
            if phase.error]


def draw(results: dict[int, dict[str, Counts]], front_ends: list[str]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    CHARTS.mkdir(parents=True, exist_ok=True)
    worlds = sorted(results)
    paths = []
    for label, read in FIGURES:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
        for front_end in front_ends:
            ran = [w for w in worlds if front_end in results[w]]
            ax.plot(ran, [read(results[w][front_end]) for w in ran], marker="o", label=front_end)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)  # log, with 0 drawn (many counts are 0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("world size W")
        ax.set_ylabel(f"{label} (per rank)")
        ax.set_title(f"{label}, per rank, against W")
        ax.legend(fontsize=6, ncol=2)
        name = "scale_" + "".join(ch if ch.isalnum() else "_" for ch in label).strip("_").lower() + ".png"
        fig.tight_layout()
        fig.savefig(CHARTS / name, dpi=90)
        plt.close(fig)
        paths.append(f"report/{name}")
    return paths


def write_json(results: dict[int, dict[str, Counts]], hidden: int, steps: int) -> Path:
    """Every count, plus the per-rank, per-step store operations by kind at each W (for the store-load bench)."""
    OUT.mkdir(parents=True, exist_ok=True)
    per_step = {str(w): {c.front_end: {"calls": c.phases["step"].store_calls, "keys": c.phases["step"].store_keys,
                                       "background_ops_per_s": c.background_store_ops_per_s,
                                       "background_calls": c.background_store_calls,
                                       "setup_calls": _merge(c, "store_calls"), "setup_keys": _merge(c, "store_keys")}
                         for c in counts.values()}
                for w, counts in results.items()}
    path = OUT / "scale_counts.json"
    path.write_text(json.dumps({"hidden": hidden, "steps": steps, "per_rank_per_step_store": per_step,
                                "counts": {str(w): [c.to_json() for c in counts.values()]
                                           for w, counts in results.items()}},
                               indent=1))
    return path


def _merge(counts: Counts, what: str) -> dict[str, float]:
    merged: dict[str, float] = {}
    for name in ("construction", "lazy_init"):
        for key, value in getattr(counts.phases[name], what).items():
            merged[key] = merged.get(key, 0) + value
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="8,64,512,4096,16384")
    parser.add_argument("--front-ends", default=",".join(FRONT_ENDS))
    parser.add_argument("--hidden", type=int, default=16384, help="the model's wide dim (>= W for 1/W shards)")
    parser.add_argument("--steps", type=int, default=6, help="steps averaged for the per-step figures")
    parser.add_argument("--reuse", action="store_true", help="take front ends already in bench/out/scale_W*.json")
    parser.add_argument("--table-only", action="store_true", help="run nothing: tables of what is kept (- if not)")
    args = parser.parse_args()
    front_ends = args.front_ends.split(",")
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    start = time.perf_counter()
    results = run(front_ends, world_sizes, args.hidden, args.steps, args.reuse or args.table_only,
                  args.table_only)
    print(f"## Scale: one rank's cost against W (fake process group, rank 0, hidden {args.hidden}, "
          f"{args.steps} steps averaged; {time.perf_counter() - start:.0f} s in all)\n")
    for label, read in FIGURES:
        print(table(label, read, results, front_ends) + "\n")
    problems = errors(results)
    if problems:
        print("Phases that raised on the fake group (counted up to the error):\n" + "\n".join(problems) + "\n")
    for path in draw(results, front_ends):
        print(f"![{path}]({path})")
    print(f"\ncounts: {write_json(results, args.hidden, args.steps).relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
