"""``make bench``: run every bench/bench_*.py in turn (each prints its own ratio table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    selected = sys.argv[1:]
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        if selected and not any(s in script.stem for s in selected):
            continue
        print(f"==> {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)]).returncode != 0:
            failed.append(script.name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
