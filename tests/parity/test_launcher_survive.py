"""``tprun --survive``: the store lives in the launcher, a dead worker is replaced, the others carry on.

Each test launches ``python -m tensorplay.distributed.run --survive --standalone --nproc-per-node 2`` on
tests/scripts/survive_worker.py, which writes what each worker saw to ``OUT/<pid>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorplay.distributed.run import parse_args

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "survive_worker.py"


def _command(out: Path, mode: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tensorplay.distributed.run", "--survive", "--standalone", "--nproc-per-node",
            "2", *flags, str(SCRIPT), str(out), mode]


def _env() -> dict[str, str]:
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))


def _launch(out: Path, mode: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, mode, *flags), env=_env(), capture_output=True, text=True, timeout=180)


def _seen(out: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_killed_rank_0_is_replaced_the_others_finish_and_the_store_outlives_it(tmp_path):
    done = _launch(tmp_path, "kill0", "--max-restarts", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    seen = _seen(tmp_path)
    killed = [s for s in seen if s.get("killed")]
    survivor = [s for s in seen if "rank0_gone" in s]
    joined = [s for s in seen if s["env"]["TENSORPLAY_SURVIVE_JOIN"] == "1"]
    assert len(killed) == len(survivor) == len(joined) == 1 and len(seen) == 3, seen
    pid = killed[0]["pid"]
    assert (f"tprun: rank 0 (local_rank 0, pid {pid}) was killed by SIGKILL; the other workers carry on; starting a "
            f"replacement (pid {joined[0]['pid']}, TENSORPLAY_SURVIVE_JOIN=1; 0 of 1 restarts left)") in done.stderr
    assert survivor[0]["rank0_gone"] and survivor[0]["read"] == "rank 1", survivor  # the store, after rank 0 died
    assert joined[0]["read"] == "rank 1", joined  # the replacement reaches the same store
    first = killed[0]["env"]
    assert first == {**first, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True", "TENSORPLAY_SURVIVE": "1",
                     "TENSORPLAY_SURVIVE_JOIN": None}, first
    assert joined[0]["env"] == {**first, "TENSORPLAY_SURVIVE_JOIN": "1"}  # the same environment otherwise
    assert survivor[0]["env"]["RANK"] == "1" and survivor[0]["env"]["MASTER_PORT"] == first["MASTER_PORT"]


def test_without_restarts_a_failed_worker_is_named_the_other_finishes_and_the_job_fails(tmp_path):
    done = _launch(tmp_path, "exit3")
    assert done.returncode == 1, done.stdout + done.stderr
    seen = _seen(tmp_path)
    failed = [s for s in seen if s["env"]["RANK"] == "1"]
    outlived = [s for s in seen if s.get("outlived")]
    assert len(seen) == 2 and len(failed) == len(outlived) == 1, seen  # no replacement; rank 0 ran on after it
    assert (f"tprun: rank 1 (local_rank 1, pid {failed[0]['pid']}) exited with code 3; the other workers carry on; "
            "no restarts left (--max-restarts 0): the job goes on without it") in done.stderr, done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_stops_every_worker(tmp_path, signum):
    launcher = subprocess.Popen(_command(tmp_path, "sleep"), env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_seen(tmp_path)) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        pids = [s["pid"] for s in _seen(tmp_path)]
        assert len(pids) == 2, pids
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signum, err
    assert f"tprun: {signal.Signals(signum).name} received: stopping 2 worker(s)" in err, err
    assert all(_gone(pid) for pid in pids), pids


@pytest.mark.parametrize("flags, refusal", [
    (["--nnodes", "2"], "--survive runs on one host for now: --nnodes must be 1, got '2'"),
    (["--nnodes", "1:4"], "--survive runs on one host for now: --nnodes must be 1, got '1:4'"),
    (["--rdzv-backend", "c10d", "--tee", "3"], "--survive does not take --rdzv-backend, --tee: the launcher hosts "
                                               "the store itself"),
])
def test_survive_refuses_what_it_cannot_do(flags: list[str], refusal: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--survive", "--nproc-per-node", "2", *flags, "train.py"])
    assert exited.value.code == 2
    assert f"tprun: error: {refusal}" in capsys.readouterr().err
