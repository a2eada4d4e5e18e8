"""``use_as_torch()``: PyTorch's public FSDP / ZeRO / hook modules resolve to ours until undone."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import tensorplay.distributed as dist
import tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks as our_hooks
import tensorplay.distributed.fsdp as our_fsdp
import tensorplay.distributed.optim as our_optim


@pytest.fixture
def switched():
    dist.use_as_torch()
    try:
        yield
    finally:
        dist.use_as_torch(False)


def test_public_modules_resolve_to_ours_private_stay_torchs(switched: None) -> None:
    import torch.distributed.fsdp
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    assert torch.distributed.fsdp is our_fsdp and fully_shard is our_fsdp.fully_shard
    assert FullyShardedDataParallel is our_fsdp.FullyShardedDataParallel
    assert ModuleWrapPolicy is our_fsdp.wrap.ModuleWrapPolicy
    assert ZeroRedundancyOptimizer is our_optim.ZeroRedundancyOptimizer
    assert default_hooks is our_hooks
    private = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    assert private.__file__.startswith(str(importlib.import_module("torch").__path__[0]))  # DCP's, untouched


def test_undo_restores_pytorchs_modules() -> None:
    before = sys.modules["torch.distributed.fsdp"] if "torch.distributed.fsdp" in sys.modules else None
    dist.use_as_torch()
    dist.use_as_torch()  # twice is once
    dist.use_as_torch(False)
    import torch.distributed.fsdp

    assert torch.distributed.fsdp is not our_fsdp
    assert torch.distributed.fsdp.fully_shard.__module__.startswith("torch.")
    assert before is None or sys.modules["torch.distributed.fsdp"] is before


def test_bad_argument() -> None:
    with pytest.raises(TypeError, match=r"use_as_torch: enable must be a bool, got 'yes' \(str\)"):
        dist.use_as_torch("yes")  # type: ignore[arg-type]


def test_tprun_switches_each_worker_with_the_env_var(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport torch.distributed.fsdp as fsdp\n"
                      "print('FROM', fsdp.fully_shard.__module__, sys.argv[1:])\n")
    env = {**os.environ, "TENSORPLAY_AS_TORCH": "1"}
    done = subprocess.run([sys.executable, "-m", "tensorplay.distributed.run", "--nproc-per-node", "1",
                           "--master-port", "0", str(script), "x"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FROM tensorplay.distributed.fsdp._fully_shard._fully_shard ['x']" in done.stdout
