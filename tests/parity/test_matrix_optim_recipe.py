"""``examples/train_lm.py --optim muon``: under fully_shard on 2 ranks it follows the 1-rank curve, and a run
stopped at step 3 resumes at 1 rank (the Muon state saved by its owner ranks through the checkpoint package).

Muon orthogonalises in bfloat16, so the gradients' different summation order on 2 ranks moves the loss by
a few 1e-5 relative (AdamW's curves agree to 2e-5): the tolerance is 1e-4 relative. AdamW's curve, from the
same start, is the control: it must differ by far more.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tensorplay.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import train_lm  # noqa: E402

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "6",
        "--warmup", "2", "--lr", "1e-2", "--val-every", "6", "--val-batches", "1", "--sample-bytes", "0",
        "--no-progress", "--no-plot"]
MUON_TOL = {"rel": 1e-4, "abs": 1e-4}


def run_all(argvs: dict[str, list[str]]) -> dict[str, list[float]]:
    return {name: [loss for _, loss, _ in train_lm.main(argv)["train"]] for name, argv in argvs.items()}


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("train_lm_muon")
    muon = TINY + ["--optim", "muon"]
    sharded = run_distributed(run_all, {"fully_shard": muon + ["--strategy", "fully_shard", "--ckpt-every", "3",
                                                                "--out", str(root / "fs")]}, world_size=2)[0]
    step3 = str(root / "fs" / "checkpoints" / "step_000003")
    single = run_distributed(run_all, {
        "one_rank": muon + ["--strategy", "ddp", "--out", str(root / "ref")],
        "resumed": muon + ["--strategy", "ddp", "--resume", step3, "--out", str(root / "resumed")],
        "adamw": TINY + ["--strategy", "ddp", "--out", str(root / "adamw")]}, world_size=1)[0]
    return sharded | single


def test_fully_shard_muon_follows_the_one_rank_curve(curves: dict[str, Any]) -> None:
    assert curves["fully_shard"] == pytest.approx(curves["one_rank"], **MUON_TOL)
    assert curves["one_rank"][-1] < curves["one_rank"][0]
    assert abs(curves["adamw"][-1] - curves["one_rank"][-1]) > 100 * MUON_TOL["abs"]   # Muon really ran


def test_resumed_at_one_rank_continues_the_curve(curves: dict[str, Any]) -> None:
    assert len(curves["resumed"]) == len(curves["one_rank"])   # the first 3 come from the checkpoint
    assert curves["resumed"] == pytest.approx(curves["one_rank"], **MUON_TOL)
