"""``tprun --help`` names the command users type (argparse would print the module's file name, ``run.py``)."""

from __future__ import annotations

import pytest

from tensorplay.distributed.run import parse_args


def test_help_says_tprun(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tprun "), out[:80]
    assert "--nproc-per-node" in out and "--max-restarts" in out


def test_flags_parse_as_torchrun() -> None:
    args = parse_args(["--nproc-per-node", "2", "--max-restarts", "1", "train.py", "--lr", "0.1"])
    assert (args.nproc_per_node, args.max_restarts, args.training_script) == ("2", 1, "train.py")
    assert args.training_script_args == ["--lr", "0.1"]
