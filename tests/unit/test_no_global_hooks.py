"""No behaviour depends on import order: importing tensorplay installs no global hook (issue 38).

Each case runs in a fresh interpreter, so nothing imported by other tests counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_COUNT_HOOKS = """
import importlib, json, pkgutil
import torch.nn.modules.module as module
import torch.optim.optimizer as optimizer
import tensorplay, tensorplay.distributed
names = [info.name for info in pkgutil.walk_packages(tensorplay.distributed.__path__, "tensorplay.distributed.")]
for name in names:
    importlib.import_module(name)
module_hooks = [n for n in dir(module) if n.startswith("_global_") and n.endswith("hooks")]
counts = {n: len(getattr(module, n)) for n in module_hooks}
counts.update({n: len(getattr(optimizer, n)) for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")})
print(json.dumps({"imported": len(names), "counts": counts}))
"""

_LOADS = """
import json, sys, tempfile
import torch

def build():
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    return torch.nn.Sequential(torch.nn.Linear(4, 4), inner, torch.nn.Linear(4, 2))

if sys.argv[1] == "after":
    model = build()
import tensorplay
import tensorplay.distributed as dist
from tensorplay.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from tensorplay.distributed.checkpoint.state_dict import StateDictOptions
from tensorplay.distributed.fsdp import fully_shard
if sys.argv[1] == "before":
    model = build()
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
fully_shard(model[1][0])
fully_shard(model[1])
full = StateDictOptions(full_state_dict=True)
good = {key: value + 1 for key, value in get_model_state_dict(model, options=full).items()}

def outcome(load):
    before = [p.detach().clone().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in model.parameters()]
    try:
        load()
        error = None
    except Exception as raised:
        error = [type(raised).__name__, str(raised).splitlines()[:2]]
    after = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"error": error, "changed": [not torch.equal(a, b) for a, b in zip(before, after)]}

inner_bad = {**good, "1.0.weight": torch.zeros(2, 2)}
plain_bad = {key: value for key, value in good.items() if key != "2.bias"}
print(json.dumps({"parent": outcome(lambda: model.load_state_dict(inner_bad)),
                  "checkpoint": outcome(lambda: set_model_state_dict(model, plain_bad, options=full))}))
dist.destroy_process_group()
"""


def _run(script: str, *args: str) -> dict:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=root, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_every_distributed_package_installs_no_global_hook() -> None:
    got = _run(_COUNT_HOOKS)
    assert got["imported"] > 50, got  # the walk reached the packages
    assert "_global_module_registration_hooks" in got["counts"] and "_global_forward_pre_hooks" in got["counts"]
    assert got["counts"] == dict.fromkeys(got["counts"], 0), got["counts"]


def test_importing_tensorplay_after_building_the_model_loads_the_same() -> None:
    """A model built before ``import tensorplay`` refuses bad loads as one built after: the sharded part
    through the plain parent, the whole model through the checkpoint package, nothing copied."""
    before, after = _run(_LOADS, "before"), _run(_LOADS, "after")
    assert after == before, (before, after)
    parent, checkpoint = before["parent"], before["checkpoint"]
    assert parent["error"][0] == "StateDictLoadError" and "size mismatch for 0.weight" in parent["error"][1][1]
    assert parent["changed"] == [True, True] + [False] * 4 + [False, False]  # the plain head is nn.Module's
    assert checkpoint["error"] == ["StateDictLoadError", ["Error(s) in loading state_dict for Sequential "
                                   "(nothing was loaded):", '\tMissing key(s) in state_dict: "2.bias".']]
    assert checkpoint["changed"] == [False] * 8
