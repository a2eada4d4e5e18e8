"""examples/train_lm.py --survive under tprun --survive: 4 ranks, a rank SIGKILLed in backward, and the loss
curve of the survivors (3 ranks from the kill on, the same global batch) is an uninterrupted run's.

The uninterrupted run is the recipe without --survive on one rank (its global batch is the same rows, all
on one rank), so the test also checks that --survive trains the recipe's own arithmetic. The strategies
--survive does not regroup are refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import train_lm  # noqa: E402

ROOT = Path(__file__).parents[2]
TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "12", "--steps", "6",
        "--warmup", "2", "--lr", "1e-2", "--no-progress", "--no-plot"]


def _env(**extra: str) -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1",
            "TENSORPLAY_STALL_S": "1", **extra}


def _curve(out: Path) -> list[float]:
    return [loss for _, loss, *_ in json.loads((out / "log.json").read_text())["train"]]


def test_a_rank_killed_in_backward_ends_on_the_uninterrupted_curve(tmp_path):
    survived, plain = tmp_path / "survive", tmp_path / "plain"
    launcher = [sys.executable, "-m", "tensorplay.distributed.run", "--survive", "--nproc-per-node", "4",
                "--max-restarts", "1"]
    run = subprocess.run([*launcher, str(ROOT / "examples/train_lm.py"), "--survive", "--strategy", "fully_shard",
                          "--survive-timeout", "8", "--out", str(survived), *TINY],
                         env=_env(TENSORPLAY_KILL_AT="2:1:backward"), capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "was killed by SIGKILL" in run.stderr
    records = [json.loads(line) for line in (survived / "survive_steps.jsonl").read_text().splitlines()]
    kills = [r for r in records if "kill" in r]
    assert [(k["kill"], k["rank"], k["moment"]) for k in kills] == [(2, 1, "backward")]
    assert {r["world"] for r in records if r.get("step") == 3} <= {3, 4}  # the retried step, over the survivors
    reference = subprocess.run([sys.executable, str(ROOT / "examples/train_lm.py"), "--strategy", "ddp",
                                "--sample-bytes", "0", "--val-every", "100", "--val-batches", "1", "--out", str(plain),
                                *TINY], env=_env(), capture_output=True, text=True, timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    ours, theirs = _curve(survived), _curve(plain)
    assert len(ours) == len(theirs) == 6
    assert ours == pytest.approx(theirs, rel=2e-5, abs=2e-5)


@pytest.mark.parametrize("strategy", ["hsdp", "fsdp", "zero", "localsgd"])
def test_survive_refuses_the_strategies_it_does_not_regroup_by_name(strategy):
    with pytest.raises(ValueError, match=f"--survive needs --strategy fully_shard or ddp .* got --strategy {strategy}"):
        train_lm.check_config(train_lm.parse_args([*TINY, "--survive", "--strategy", strategy]), world=4)


def test_survive_names_the_flags_it_does_not_train():
    with pytest.raises(ValueError, match="drop --grad-accum, --ckpt-every"):
        train_lm.check_config(train_lm.parse_args([*TINY, "--survive", "--grad-accum", "2", "--ckpt-every", "3"]),
                              world=4)
    train_lm.check_config(train_lm.parse_args([*TINY, "--survive", "--batch-size", "10"]), world=3)  # uneven: fine
