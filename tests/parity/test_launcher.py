"""``python -m tensorplay.distributed.run``: torchrun's flags, c10d rendezvous across 'nodes'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tensorplay.testing.distributed import free_port

SCRIPT = Path(__file__).parents[1] / "scripts" / "report_group.py"


def _launch(out: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tensorplay.distributed.run", *flags, str(SCRIPT), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _reports(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


def test_two_nodes_of_two_form_one_group(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", endpoint, "--rdzv-id", "tp-launcher-test"]
    nodes = [_launch(tmp_path, *common, "--node-rank", str(n)) for n in (0, 1)]
    for node in nodes:
        output, _ = node.communicate(timeout=180)
        assert node.returncode == 0, output
    reports = _reports(tmp_path)
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == 6.0 for r in reports)
    assert sorted(r["local_rank"] for r in reports) == [0, 0, 1, 1]


def test_tprun_console_script_single_node(tmp_path):
    tprun = Path(sys.executable).with_name("tprun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    done = subprocess.run([str(tprun), "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["world"] for r in _reports(tmp_path)] == [2, 2]
