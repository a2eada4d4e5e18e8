"""``make bench``: run every bench/bench_*.py, then write bench/REPORT.md with their tables and charts.

    .venv/bin/python bench/run_all.py [NAME ...]      # only scripts whose name contains a NAME

Each script prints its own ratio tables (markdown); their standard output is
shown as it comes and kept in bench/out/<script>.txt. REPORT.md is then
assembled from every kept output (so a partial run refreshes its own sections
and keeps the others' last results), with charts drawn from bench_recipe's JSON:
step time and model-state memory per rank, per strategy, at world sizes 1, 2, 4.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUT = HERE / "out"
CHARTS = HERE / "report"
REPORT = HERE / "REPORT.md"


def run_script(script: Path) -> tuple[int, str]:
    """Run one bench script, echoing its standard output; return its exit code and that output."""
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def summary(script: Path) -> str:
    """The first paragraph of a script's docstring."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def draw_recipe_charts(rows: list[dict[str, Any]]) -> list[str]:
    """Step time and per-rank memory, one group of bars per world size; returns the PNG paths (relative)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    CHARTS.mkdir(exist_ok=True)
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    worlds = sorted({r["world"] for r in rows})
    cell = {(r["strategy"], r["world"]): r for r in rows}
    width = 0.8 / len(worlds)
    charts = []
    for name, ylabel, keys in (("step_time", "median step time (ms)", ("step_ms",)),
                               ("memory", "MiB per rank (params + grads + optimizer state)",
                                ("param_mib", "grad_mib", "optim_mib"))):
        fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
        for j, world in enumerate(worlds):
            xs = [i + (j - (len(worlds) - 1) / 2) * width for i in range(len(strategies))]
            bottom = [0.0] * len(strategies)
            for k, key in enumerate(keys):
                heights = [cell[(s, world)][key] if (s, world) in cell else 0.0 for s in strategies]
                ax.bar(xs, heights, width, bottom=bottom, color=f"C{j}", alpha=1.0 - 0.3 * k, edgecolor="white",
                       label=f"{world} rank{'s' if world > 1 else ''}" if k == 0 else None)
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(strategies)), strategies)
        ax.set_ylabel(ylabel)
        title = "examples/train_lm.py per strategy and world size (Gloo, CPU, 1 thread per rank)"
        title += ("\nstacked: parameters, gradients, optimizer state (lighter)" if len(keys) > 1
                  else "\nsame global batch at every world size; more ranks than cores oversubscribes")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = CHARTS / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        charts.append(str(path.relative_to(HERE)))
    return charts


def _markdown(text: str) -> list[str]:
    """A script's output, with a blank line before each table so that it renders."""
    lines: list[str] = []
    for line in text.strip().splitlines():
        if line.startswith("|") and lines and lines[-1] and not lines[-1].startswith("|"):
            lines.append("")
        lines.append(line)
    return lines


def write_report(load: str = "") -> None:
    import torch

    cpus = os.cpu_count()
    lines = ["# Benchmark report", "",
             f"Written by `make bench` (bench/run_all.py) on {datetime.date.today()}: {platform.machine()}, "
             f"{cpus} CPU core(s), Python {platform.python_version()}, torch {torch.__version__}{load}. "
             "Every table comes from one run of its script, ours and the baseline side by side in that run. "
             "CPU timings on a shared machine are noisy: read the ratios, not the absolute times.", ""]
    recipe = OUT / "recipe.json"
    if recipe.exists():
        lines += ["## Charts: the training recipe per strategy at 1, 2 and 4 ranks", ""]
        lines += [f"![{Path(c).stem}]({c})" for c in draw_recipe_charts(json.loads(recipe.read_text()))] + [""]
    for script in sorted(HERE.glob("bench_*.py")):
        kept = OUT / f"{script.stem}.txt"
        lines += [f"## {script.name}", "", summary(script), ""]
        lines += [*(_markdown(kept.read_text()) if kept.exists() else ["_not run yet_"]), ""]
    REPORT.write_text("\n".join(lines))


def main() -> int:
    selected = sys.argv[1:]
    OUT.mkdir(exist_ok=True)
    failed = []
    load_before = os.getloadavg()[1]
    for script in sorted(HERE.glob("bench_*.py")):
        if selected and not any(s in script.stem for s in selected):
            continue
        print(f"==> {script.name}", flush=True)
        code, output = run_script(script)
        if code != 0:
            failed.append(script.name)
            output += f"\n\n_{script.name} failed (exit code {code})_\n"
        (OUT / f"{script.stem}.txt").write_text(output)
    write_report(f"; 5-minute load average {load_before:.1f} before the run, {os.getloadavg()[1]:.1f} after")
    print(f"report: {REPORT}")
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
