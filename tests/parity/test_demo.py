"""``make demo`` end to end at toy sizes: tprun with 2 ranks (fully_shard) stops at step 3, 1 rank (ddp) resumes.

The one test that goes through the real launcher and plain script entry points;
examples/train_lm.py's behaviour under every strategy is tested in test_train_lm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_demo_trains_stops_and_resumes_elsewhere(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--tiny", "--steps", "6",
                           "--stop-at", "3", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = json.loads((out / "fully_shard_x2" / "log.json").read_text())
    resumed = json.loads((out / "log.json").read_text())
    assert [r["rank"] for r in first["table"]] == [0, 1]
    assert [step for step, *_ in resumed["train"]] == [1, 2, 3, 4, 5, 6]
    assert resumed["train"][:3] == first["train"]  # the 2-rank segment, carried by the checkpoint
    assert {label for *_, label in resumed["train"][3:]} == {"ddp x1"}
    assert resumed["train"][-1][1] < resumed["train"][0][1]
    assert f"loss curve (both runs): {out / 'loss.png'}" in proc.stdout
    assert (out / "loss.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "step_000006").is_dir()
    assert "per-rank memory and traffic" in proc.stdout and "sample from the trained model" in proc.stdout
