"""fully_shard over tensor parallelism (2-D: dp x tp), 4 ranks on a (dp=2, tp=2) mesh.

A tiny pre-norm transformer (attention with Colwise q/k/v and Rowwise o, an MLP
with Colwise fc1 and Rowwise fc2, plain norms, input and head layers) is
parallelised with ``parallelize_module`` on ``mesh["tp"]``, then each block and
the root get ``fully_shard(..., mesh=mesh["dp"])``. Checked against PyTorch's
fully_shard on the same TP model (placements equal; losses and parameters after
Adam steps allclose fp32, rtol 1e-4 / atol 2e-5: TP and dp reduce in other
orders than one process) and against a single-process model fed both dp parts
(the mean over dp). A DCP checkpoint (``torch.distributed.checkpoint``, model and
Adam state) saved by either implementation loads bitwise into the other. HSDP x TP
(a (rep=2, dp=1, tp=2) mesh) equals PyTorch's too.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

from tests.common import fqn_adam_state

IN, DIM, HID, OUT, HEADS, SEQ, BATCH = 5, 8, 10, 3, 2, 4, 2  # HID / tp = 5 rows: uneven over dp
LR, STEPS = 1e-2, 3
FP32 = {"rtol": 1e-4, "atol": 2e-5}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        self.k = nn.Linear(DIM, DIM, bias=False)  # a key bias has a zero gradient: Adam would amplify noise
        self.fc1, self.fc2 = nn.Linear(DIM, HID), nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        # -1 heads: under TP each rank holds HEADS / tp of them
        q, k, v = (proj(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(att)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(seed: int = 0) -> Model:
    tp.manual_seed(seed)
    return Model()


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + dp_rank)
    return tp.randn(BATCH, SEQ, IN, generator=g), tp.randn(BATCH, SEQ, OUT, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# ---------------------------------------------------------------- on the ranks

def _fully_shard(impl: str) -> Any:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from tensorplay.distributed.fsdp import fully_shard
    return fully_shard


def _mesh() -> Any:
    from tensorplay.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tensor_parallel(model: Model, tp_mesh: Any) -> None:
    from tensorplay.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def shard_2d(impl: str, seed: int = 0) -> tuple[Model, Any]:
    """The model, TP on mesh["tp"], then fully_shard per block and on the root over mesh["dp"]."""
    mesh = _mesh()
    model = build(seed)
    _tensor_parallel(model, mesh["tp"])
    fully_shard = _fully_shard(impl)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.detach().full_tensor().clone()


def _layout(model: Model) -> dict[str, tuple]:
    return {name: (tuple(repr(p) for p in param.placements), param.device_mesh.mesh_dim_names,
                   tuple(param.device_mesh.mesh.shape), tuple(param.shape), tuple(param.to_local().shape))
            for name, param in model.named_parameters()}


def placements(impl: str) -> dict[str, Any]:
    try:
        model, _ = shard_2d(impl)
        return {"layout": _layout(model)}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def _train(model: Model, opt: torch.optim.Optimizer, steps: range, dp_rank: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, dp_rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())  # tp ranks of one dp group hold the same loss
    return losses


def train(impl: str) -> dict[str, Any]:
    try:
        model, mesh = shard_2d(impl)
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        losses = _train(model, opt, range(STEPS), mesh["dp"].get_local_rank())
        grads_after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()},
                "grads_left": sorted(grads_after), "layout": _layout(model)}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def train_hsdp_tp(impl: str) -> dict[str, Any]:
    """HSDP x TP on a (rep=2, dp=1, tp=2) mesh: fully_shard over mesh["rep", "dp"], TP on mesh["tp"]."""
    from tensorplay.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "dp", "tp"))
        model = build()
        _tensor_parallel(model, mesh["tp"])
        fully_shard = _fully_shard(impl)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["rep", "dp"])
        fully_shard(model, mesh=mesh["rep", "dp"])
        layout = _layout(model)
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        losses = _train(model, opt, range(2), mesh["rep"].get_local_rank())
        return {"layout": layout, "losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def _full_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _full(v) for k, v in state["model"].items()}
    for fqn, slots in state["optim"].items():
        for slot, value in slots.items():
            out[f"optim.{fqn}.{slot}"] = _full(value) if slot != "step" else value.clone()
    return out


def save(impl: str, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp  # PyTorch's DCP directly, as the oracle

    try:
        model, mesh = shard_2d(impl)
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        _train(model, opt, range(2), mesh["dp"].get_local_rank())
        state = fqn_adam_state(model, opt)
        dcp.save(state, checkpoint_id=path)
        return {"state": _full_state(state)}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def load(impl: str, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    try:
        model, mesh = shard_2d(impl, seed=1)  # other initial values: the load must overwrite them
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        state = fqn_adam_state(model, opt)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        loaded = _full_state(fqn_adam_state(model, opt))
        losses = _train(model, opt, range(2, 3), mesh["dp"].get_local_rank())  # training continues
        return {"state": loaded, "losses": losses, "layout": _layout(model)}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def bad_meshes() -> dict[str, str]:
    """Each way of handing fully_shard a DTensor parameter it cannot shard; the error message of each."""
    from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.tensor import DTensor, Partial, Shard

    mesh = _mesh()
    other_root = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    unnamed = DeviceMesh("cpu", [[0, 1], [2, 3]])
    out = {}
    for case, (param_mesh, placement, fs_mesh) in {
        "overlap": (mesh["tp"], None, mesh),
        "same_dim": (mesh["dp"], None, mesh["dp"]),
        "other_root": (other_root, None, mesh["dp"]),
        "unnamed": (unnamed, None, mesh["dp"]),
        "partial": (mesh["tp"], Partial(), mesh["dp"]),
    }.items():
        model = build()
        weight = DTensor.from_local(model.head.weight.detach(), param_mesh,
                                    [placement or Shard(0)] * param_mesh.ndim, run_check=False)
        model.head.weight = nn.Parameter(weight)
        try:
            fully_shard(model, mesh=fs_mesh)
            out[case] = "no error"
        except ValueError as err:
            out[case] = str(err)
    model = build()
    try:
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=1)
        out["int_reshard_on_sub_mesh"] = "no error"
    except NotImplementedError as err:
        out["int_reshard_on_sub_mesh"] = str(err)
    return out


# ---------------------------------------------------------------- in the test process

def reference() -> dict[str, Any]:
    """One process, no parallelism: each step's batch is both dp parts (mean of the parts' losses)."""
    model = build()
    opt = tp.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        parts = [batch(step, r) for r in range(2)]
        x, y = tp.cat([p[0] for p in parts]), tp.cat([p[1] for p in parts])
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _ok(results: list[dict], what: str) -> list[dict]:
    for rank, got in enumerate(results):
        assert "error" not in got, f"{what} failed on rank {rank}:\n{got['error']}"
    return results


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict]]:
    return {impl: _ok(run_distributed(train, impl, world_size=4), f"{impl} training") for impl in ("ours", "torch")}


def test_placements_equal_pytorch():
    ours = _ok(run_distributed(placements, "ours", world_size=4), "ours")
    torch_ = _ok(run_distributed(placements, "torch", world_size=4), "torch")
    for rank in range(4):
        assert ours[rank]["layout"] == torch_[rank]["layout"], f"rank {rank}"
    layout = ours[0]["layout"]
    assert layout["blocks.0.fc1.weight"][:2] == (("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), ("dp", "tp"))
    assert layout["blocks.0.fc2.weight"][:2] == (("Shard(dim=0)", "Shard(dim=1)"), ("dp", "tp"))
    assert layout["blocks.0.fc2.bias"][:2] == (("Shard(dim=0)", "Replicate()"), ("dp", "tp"))
    assert layout["blocks.0.norm1.weight"][:2] == (("Shard(dim=0)",), ("dp",))  # not TP: dp only
    assert layout["inp.weight"][:2] == (("Shard(dim=0)",), ("dp",))


def test_training_equals_pytorch(trained):
    for rank in range(4):
        ours, theirs = trained["ours"][rank], trained["torch"][rank]
        torch.testing.assert_close(ours["losses"], theirs["losses"], **FP32)
        assert ours["layout"] == theirs["layout"]
        for fqn, value in theirs["params"].items():
            torch.testing.assert_close(ours["params"][fqn], value, **FP32,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r} {f}: {m}")


def test_training_equals_single_process(trained):
    want = reference()
    for rank in range(4):
        got = trained["ours"][rank]
        torch.testing.assert_close(got["losses"], want["losses"], **FP32)
        assert sorted(got["params"]) == sorted(want["params"])
        for fqn, value in want["params"].items():
            torch.testing.assert_close(got["params"][fqn], value, **FP32,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r} {f}: {m}")


def test_no_drift_across_dp(trained):
    """Before TP parameters were sharded over dp, dp groups trained on their own data only and drifted apart."""
    params = [trained["ours"][rank]["params"] for rank in range(4)]
    for fqn in params[0]:
        for rank in range(1, 4):
            assert torch.equal(params[rank][fqn], params[0][fqn]), f"{fqn}: rank {rank} differs from rank 0"
    # and the TP parameters really are sharded over dp (each rank holds a quarter of a Colwise weight's rows)
    layout = trained["ours"][0]["layout"]["blocks.1.q.weight"]
    assert layout[1] == ("dp", "tp") and layout[4][0] == DIM // 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dcp2d")
    out = {}
    for impl in ("ours", "torch"):
        out[f"{impl}_saved"] = _ok(run_distributed(save, impl, str(root / impl), world_size=4), f"{impl} save")
    for loader, saver in (("torch", "ours"), ("ours", "torch"), ("ours", "ours")):
        out[f"{loader}_from_{saver}"] = _ok(run_distributed(load, loader, str(root / saver), world_size=4),
                                            f"{loader} loading {saver}'s checkpoint")
    return out


@pytest.mark.parametrize("loader,saver", [("torch", "ours"), ("ours", "torch"), ("ours", "ours")])
def test_dcp_cross_load(checkpoints, loader, saver):
    for rank in range(4):
        saved = checkpoints[f"{saver}_saved"][rank]["state"]
        loaded = checkpoints[f"{loader}_from_{saver}"][rank]["state"]
        assert sorted(saved) == sorted(loaded)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"rank {rank}: {key} not restored"
    # the reloaded model keeps training identically whichever implementation saved it
    want = checkpoints["ours_from_ours"][0]["losses"]
    torch.testing.assert_close(checkpoints[f"{loader}_from_{saver}"][0]["losses"], want, **FP32)


def test_refuses_unsupported_dtensor_params():
    got = _ok(run_distributed(bad_meshes, world_size=4), "bad meshes")[0]
    assert "part of a larger one" in got.pop("int_reshard_on_sub_mesh")
    for case, message in got.items():
        assert "'head.weight'" in message, f"{case}: {message}"
    assert "overlaps the data-parallel mesh" in got["overlap"]
    assert "overlaps the data-parallel mesh" in got["same_dim"]
    assert "not a sub-mesh of the same mesh" in got["other_root"]
    assert "mesh_dim_names" in got["unnamed"]
    assert "Partial" in got["partial"]


def test_hsdp_over_tensor_parallel_equals_pytorch():
    """A 3-D (replicate, shard, tp) mesh: placements (Replicate(), _StridedShard, Shard) and training as PyTorch's."""
    ours = _ok(run_distributed(train_hsdp_tp, "ours", world_size=4), "ours HSDP x TP")
    theirs = _ok(run_distributed(train_hsdp_tp, "torch", world_size=4), "torch HSDP x TP")
    for rank in range(4):
        assert ours[rank]["layout"] == theirs[rank]["layout"], f"rank {rank}"
        torch.testing.assert_close(ours[rank]["losses"], theirs[rank]["losses"], **FP32)
        for fqn, value in theirs[rank]["params"].items():
            torch.testing.assert_close(ours[rank]["params"][fqn], value, **FP32)
    assert ours[0]["layout"]["blocks.0.fc1.weight"][:2] == (
        ("Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), ("rep", "dp", "tp"))
