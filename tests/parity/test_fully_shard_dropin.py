"""fully_shard drop-in knobs (issue 17) against PyTorch's fully_shard, 2 and 4 ranks.

A tiny embedding / blocks / head model (one Linear never used) is sharded per
module and trained two Adam steps under each knob; ours must equal PyTorch's
under the same knob (fp32 allclose rtol 1e-5 / atol 1e-6: the same arithmetic,
other collectives) and, for the knobs that only matter on GPUs, ours without the
knob (bitwise). ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` take a
user collective that counts its calls: the counts equal PyTorch's. On a 2x2
(dp, tp) mesh, ``dp_mesh_dims`` gives PyTorch's placements and training.
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

VOCAB, DIM, OUT, SEQ, BATCH, LR, STEPS = 11, 8, 5, 3, 2, 1e-2, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, OUT)
        self.unused = nn.Linear(DIM, 3)  # never called: its gradient is None, or zeros if reduced anyway

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(97 * step + rank)
    return tp.randint(0, VOCAB, (BATCH, SEQ), generator=g), tp.randint(0, OUT, (BATCH, SEQ), generator=g)


def _modules(impl: str) -> tuple[Any, Any]:
    if impl == "torch":
        import torch.distributed.fsdp as api
        from torch.distributed.fsdp._fully_shard import _fsdp_api as comm_api
    else:
        import tensorplay.distributed.fsdp as api
        from tensorplay.distributed.fsdp._fully_shard import _fsdp_api as comm_api
    return api, comm_api


def _counting_comms(comm_api: Any) -> tuple[Any, Any]:
    """A user all-gather and reduce-scatter (subclasses of the implementation's own classes) that count calls."""

    class AllGather(comm_api.AllGather):
        calls = 0

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            type(self).calls += 1
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class ReduceScatter(comm_api.ReduceScatter):
        calls = 0

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            type(self).calls += 1
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return AllGather(), ReduceScatter()


class _ReduceScatterGroups:
    """Count our reduce-scatters by group: on the shard group the all-gathers use, or on another group over the
    same ranks with the same timeout (``separate``); wraps the comm layer's call until ``close()``."""

    def __init__(self, model: Net) -> None:
        from tensorplay.distributed._comm import collectives
        from tensorplay.distributed._comm.watch import group_timeout_s

        self.calls, self.collectives = {"separate": 0, "shared": 0}, collectives
        self.original = collectives.reduce_scatter_flat
        shard_group = model._fsdp_state.group.mesh_info.shard_group
        ranks, timeout = dist.get_process_group_ranks(shard_group), group_timeout_s(shard_group)

        def counting(output: Any, parts: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
            if group is shard_group:
                self.calls["shared"] += 1
            elif dist.get_process_group_ranks(group) == ranks and group_timeout_s(group) == timeout:
                self.calls["separate"] += 1
            return self.original(output, parts, group, *args, **kwargs)

        collectives.reduce_scatter_flat = counting

    def close(self) -> None:
        self.collectives.reduce_scatter_flat = self.original


def _apply_knob(model: Net, knob: str, comm_api: Any) -> dict[str, Any]:
    fsdp_modules = [model.emb, *model.blocks, model]
    counters: dict[str, Any] = {}
    if knob == "custom_comms":
        all_gather, reduce_scatter = _counting_comms(comm_api)
        for module in fsdp_modules:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        counters = {"all_gather": all_gather, "reduce_scatter": reduce_scatter}
    elif knob == "custom_all_gather_no_unshard_in_backward":
        all_gather, _ = _counting_comms(comm_api)
        for module in fsdp_modules:
            module.set_custom_all_gather(all_gather)
        model.emb.set_unshard_in_backward(False)  # an embedding's weight gradient needs only the indices
        counters = {"all_gather": all_gather}
    elif knob == "hook":
        for module in fsdp_modules:
            module.set_all_reduce_hook(lambda reduced: reduced.mul_(2.0))  # linear, so order-independent
    elif knob == "unused_params":
        model.set_reduce_scatter_unused_params(True)
    elif knob == "max_buffers":
        model.set_reduce_scatter_max_input_buffers(3)
    elif knob == "separate_group":
        model.set_separate_reduce_scatter_group(True)
        counters = {"groups": _ReduceScatterGroups(model)}
    elif knob == "gpu_knobs":
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
            module.set_allocate_memory_from_process_group_for_comm(True)
            module.set_symm_mem_for_comm()
        model.set_separate_reduce_scatter_group(True)
    return counters


def train(impl: str, knob: str) -> dict[str, Any]:
    try:
        api, comm_api = _modules(impl)
        tp.manual_seed(0)
        model = Net()
        for module in (model.emb, *model.blocks):
            api.fully_shard(module)
        api.fully_shard(model)
        counters = _apply_knob(model, knob, comm_api)
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        losses, grads = [], {}
        for step in range(STEPS):
            x, y = _batch(step, dist.get_rank())
            loss = F.cross_entropy(model(x).reshape(-1, OUT), y.reshape(-1))
            loss.backward()
            if step == 0:  # before Adam's first step: the gradients of the same parameters
                grads = {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        for counter in counters.values():
            getattr(counter, "close", lambda: None)()
        return {"losses": losses, "grads": grads, "counts": {k: c.calls for k, c in counters.items()},
                "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def bad_inputs() -> dict[str, str]:
    """The message of each refused knob value (``type: message``)."""
    import tensorplay.distributed.fsdp as api

    model = Net()
    api.fully_shard(model)
    calls = {
        "custom_all_gather": lambda: model.set_custom_all_gather(lambda *a: None),
        "custom_reduce_scatter": lambda: model.set_custom_reduce_scatter(object()),
        "hook": lambda: model.set_all_reduce_hook("not callable"),
        "unshard_in_backward": lambda: model.set_unshard_in_backward("no"),
        "unused_params": lambda: model.set_reduce_scatter_unused_params(1),
        "max_buffers_bool": lambda: model.set_reduce_scatter_max_input_buffers(True),
        "max_buffers_zero": lambda: model.set_reduce_scatter_max_input_buffers(0),
        "force_sum": lambda: model.set_force_sum_reduction_for_comms(None),
        "separate_group": lambda: model.set_separate_reduce_scatter_group("yes"),
        "allocate": lambda: model.set_allocate_memory_from_process_group_for_comm(2),
        "symm_mem": lambda: model.set_symm_mem_for_comm("GLOO"),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def state_accessor() -> dict[str, bool]:
    import tensorplay.distributed.fsdp as api

    model = Net()
    api.fully_shard([model.blocks[0], model.blocks[1]])
    api.fully_shard(model)
    state = api.fully_shard.state(model)
    return {"root_is_state": state is model._fsdp_state,
            "list_group_shares": api.fully_shard.state(model.blocks[0]) is api.fully_shard.state(model.blocks[1]),
            "list_group_not_root": api.fully_shard.state(model.blocks[0]) is not state,
            "unsharded_is_none": api.fully_shard.state(model.head) is None,
            "compat_knobs_store_nothing": _compat_knobs_store_nothing(model)}


def _compat_knobs_store_nothing(model: Any) -> bool:
    """The knobs accepted for compatibility leave every group's attributes as they were."""
    groups = [m._fsdp_state.group for m in model.modules() if getattr(m, "_fsdp_state", None) is not None]
    before = [{key: id(value) for key, value in vars(group).items()} for group in groups]
    for module in {id(m): m for m in model.modules() if hasattr(m, "set_symm_mem_for_comm")}.values():
        module.set_force_sum_reduction_for_comms(True)
        module.set_allocate_memory_from_process_group_for_comm(True)
        module.set_symm_mem_for_comm()
    return before == [{key: id(value) for key, value in vars(group).items()} for group in groups]


# ---------------------------------------------------------------- the tests

KNOBS_WITH_ORACLE = ["default", "custom_comms", "custom_all_gather_no_unshard_in_backward", "hook", "unused_params",
                     "max_buffers"]


def _run(impl: str, knob: str) -> list[dict]:
    results = run_distributed(train, impl, knob, world_size=2)
    for rank, got in enumerate(results):
        assert "error" not in got, f"{impl} {knob} failed on rank {rank}:\n{got['error']}"
    return results


def _assert_same(got: dict, want: dict, **tol: float) -> None:
    torch.testing.assert_close(got["losses"], want["losses"], **tol)
    assert sorted(got["params"]) == sorted(want["params"])
    for fqn in want["params"]:
        torch.testing.assert_close(got["params"][fqn], want["params"][fqn], **tol)
        if fqn not in want["grads"]:
            continue
        assert (got["grads"][fqn] is None) == (want["grads"][fqn] is None), fqn
        if want["grads"][fqn] is not None:
            torch.testing.assert_close(got["grads"][fqn], want["grads"][fqn], **tol)


@pytest.mark.parametrize("knob", KNOBS_WITH_ORACLE)
def test_knob_equals_pytorch(knob):
    ours, theirs = _run("ours", knob), _run("torch", knob)
    for rank in range(2):
        _assert_same(ours[rank], theirs[rank], **TOL)
        assert ours[rank]["counts"] == theirs[rank]["counts"]


def test_custom_comms_are_called_and_change_nothing():
    default, custom = _run("ours", "default")[0], _run("ours", "custom_comms")[0]
    # per step: 4 groups gather in forward, the 3 non-root ones again in backward; 4 reduce-scatters
    assert custom["counts"] == {"all_gather": 7 * STEPS, "reduce_scatter": 4 * STEPS}
    _assert_same(custom, default, **TOL)


def test_unshard_in_backward_skips_one_all_gather():
    got = _run("ours", "custom_all_gather_no_unshard_in_backward")[0]
    assert got["counts"] == {"all_gather": 6 * STEPS}
    _assert_same(got, _run("ours", "default")[0], **TOL)


def test_hook_sees_the_summed_gradient():
    default, hooked = _run("ours", "default")[0], _run("ours", "hook")[0]
    for fqn, grad in default["grads"].items():
        if grad is not None:
            torch.testing.assert_close(hooked["grads"][fqn], 2 * grad, rtol=0, atol=0)


def test_unused_params_get_zero_gradients():
    got = _run("ours", "unused_params")[0]
    assert torch.count_nonzero(got["grads"]["unused.weight"]) == 0
    assert _run("ours", "default")[0]["grads"]["unused.weight"] is None


def test_separate_reduce_scatter_group_carries_every_reduce_scatter_bitwise():
    """set_separate_reduce_scatter_group changes what runs: each group's reduce-scatter goes to a group of its
    own over the shard ranks (none to the shard group the all-gathers use), and the results are bitwise."""
    default, got = _run("ours", "default"), _run("ours", "separate_group")
    for rank in range(2):
        assert got[rank]["counts"] == {"groups": {"separate": 4 * STEPS, "shared": 0}}, got[rank]["counts"]
        _assert_same(got[rank], default[rank], rtol=0, atol=0)


@pytest.mark.parametrize("knob", ["max_buffers", "gpu_knobs"])
def test_knob_leaves_results_bitwise(knob):
    default, got = _run("ours", "default"), _run("ours", knob)
    for rank in range(2):
        _assert_same(got[rank], default[rank], rtol=0, atol=0)


def test_bad_knob_values_are_refused():
    got = run_distributed(bad_inputs, world_size=2)[0]
    expected = {
        "custom_all_gather": ("TypeError",
                              "set_custom_all_gather: comm must be an instance of a subclass of AllGather"),
        "custom_reduce_scatter": ("TypeError", "subclass of ReduceScatter"),
        "hook": ("TypeError", "set_all_reduce_hook: hook must be callable"),
        "unshard_in_backward": ("TypeError", "unshard_in_backward must be a bool"),
        "unused_params": ("TypeError", "reduce_scatter_unused_params must be a bool"),
        "max_buffers_bool": ("TypeError", "max_input_buffers must be an int"),
        "max_buffers_zero": ("ValueError", "max_input_buffers must be a positive int"),
        "force_sum": ("TypeError", "set_force_sum_reduction_for_comms: enable must be a bool"),
        "separate_group": ("TypeError", "set_separate_reduce_scatter_group: enable must be a bool"),
        "allocate": ("TypeError", "set_allocate_memory_from_process_group_for_comm: enable must be a bool"),
        "symm_mem": ("ValueError", "backend must be 'NCCL'"),
    }
    for name, (kind, phrase) in expected.items():
        assert got[name].startswith(kind) and phrase in got[name], f"{name}: {got[name]}"


def test_state_accessor():
    got = run_distributed(state_accessor, world_size=2)[0]
    assert all(got.values()), got


# ---------------------------------------------------------------- dp_mesh_dims on a 2x2 mesh

def _spmd_model(mesh: Any, tensor_parallel: bool = True) -> nn.Module:
    """A two-layer MLP whose parameters are DTensors on the full (dp, tp) mesh, Replicate on dp (and on tp
    unless ``tensor_parallel``)."""
    from tensorplay.distributed.tensor import Replicate, Shard, distribute_tensor

    tp.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 6), nn.Tanh(), nn.Linear(6, OUT))
    layout = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for fqn, placement in layout.items():
        module, name = model.get_submodule(fqn.split(".")[0]), fqn.split(".")[1]
        full = getattr(module, name).detach()
        placement = placement if tensor_parallel else Replicate()
        setattr(module, name, nn.Parameter(distribute_tensor(full, mesh, [Replicate(), placement])))
    return model


def spmd_train(impl: str, dims: dict[str, Any]) -> dict[str, Any]:
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.tensor import DTensor, Replicate, Shard

    try:
        api, _ = _modules(impl)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _spmd_model(mesh, tensor_parallel="replicate" not in dims)  # HSDP: both dims data parallel
        api.fully_shard(model, mesh=mesh, dp_mesh_dims=api.DataParallelMeshDims(**dims))
        layout = {n: (tuple(repr(p) for p in q.placements), q.device_mesh.mesh_dim_names, tuple(q.to_local().shape))
                  for n, q in model.named_parameters()}
        opt = tp.optim.Adam(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            x, _ = _batch(step, mesh["dp"].get_local_rank())
            inputs = torch.nn.functional.one_hot(x % DIM, DIM).float()
            out = model(DTensor.from_local(inputs, mesh, [Shard(0), Replicate()]))
            loss = (out.tanh() ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor().item())
        return {"layout": layout, "losses": losses,
                "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def spmd_bad_inputs() -> dict[str, str]:
    import tensorplay.distributed.fsdp as api
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = api.DataParallelMeshDims(shard="dp")

    def sharded_on_dp() -> nn.Module:
        model = _spmd_model(mesh)
        model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach().full_tensor(), mesh,
                                                         [Shard(0), Shard(1)]))
        return model

    cases = {
        "unknown_dim": lambda: api.fully_shard(_spmd_model(mesh), mesh=mesh,
                                               dp_mesh_dims=api.DataParallelMeshDims(shard="data")),
        "plain_param": lambda: api.fully_shard(nn.Sequential(nn.Linear(DIM, 6)), mesh=mesh, dp_mesh_dims=dims),
        "not_replicate": lambda: api.fully_shard(sharded_on_dp(), mesh=mesh, dp_mesh_dims=dims),
        "wrong_type": lambda: api.fully_shard(_spmd_model(mesh), mesh=mesh, dp_mesh_dims={"shard": "dp"}),
        "int_reshard": lambda: api.fully_shard(_spmd_model(mesh), mesh=mesh, dp_mesh_dims=dims,
                                               reshard_after_forward=2),
        "flattened": lambda: api.fully_shard(_spmd_model(mesh), mesh=mesh,
                                             dp_mesh_dims=api.DataParallelMeshDims(shard=("dp", "tp"))),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError, NotImplementedError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def spmd_reference() -> dict[str, Any]:
    """One process: the same MLP on both dp parts' inputs (Adam is scale-invariant up to its eps: the
    data-parallel gradients here are the global one over the dp size, as in PyTorch, see the test)."""
    tp.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 6), nn.Tanh(), nn.Linear(6, OUT))
    opt = tp.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x = tp.cat([_batch(step, r)[0] for r in range(2)])
        loss = (model(F.one_hot(x % DIM, DIM).float()).tanh() ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": {}}


def _spmd_ok(results: list[dict]) -> list[dict]:
    for got in results:
        assert "error" not in got, got["error"]
    return results


def test_dp_mesh_dims_equals_pytorch():
    """FSDP over "dp" of a (dp, tp) mesh whose parameters are TP-sharded DTensors: PyTorch's placements
    and training. (The loss is a DTensor mean over the dp-sharded batch, so each dp rank's gradient is a
    Partial sum; the reduce-scatter sums and divides by the dp size, as PyTorch does.)"""
    theirs = _spmd_ok(run_distributed(spmd_train, "torch", {"shard": "dp"}, world_size=4))
    ours = _spmd_ok(run_distributed(spmd_train, "ours", {"shard": "dp"}, world_size=4))
    for rank in range(4):
        assert ours[rank]["layout"] == theirs[rank]["layout"]
        _assert_same({**ours[rank], "grads": {}}, {**theirs[rank], "grads": {}}, **TOL)
    assert ours[0]["layout"]["0.weight"][:2] == (("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), ("dp", "tp"))
    assert ours[0]["layout"]["2.weight"][:2] == (("Shard(dim=0)", "Shard(dim=1)"), ("dp", "tp"))
    want = spmd_reference()
    for rank in range(4):
        _assert_same({**ours[rank], "grads": {}}, want, **TOL)


def test_dp_mesh_dims_hsdp_equals_single_process():
    """HSDP named on the full mesh (replicate "dp", shard "tp"). PyTorch 2.13 refuses this set-up on CPU
    ("Expected param's DTensor mesh to be the same mesh passed to fully_shard"), so the oracle is the
    single-process run."""
    ours = _spmd_ok(run_distributed(spmd_train, "ours", {"shard": "tp", "replicate": "dp"}, world_size=4))
    assert ours[0]["layout"]["0.weight"][:2] == (("Replicate()", "Shard(dim=0)"), ("dp", "tp"))
    want = spmd_reference()
    for rank in range(4):
        _assert_same({**ours[rank], "grads": {}}, want, **TOL)


def test_dp_mesh_dims_bad_inputs():
    got = run_distributed(spmd_bad_inputs, world_size=4)[0]
    assert got["unknown_dim"].startswith("ValueError") and "'data'" in got["unknown_dim"]
    assert got["plain_param"].startswith("ValueError") and "'0.weight'" in got["plain_param"]
    assert "must be DTensors on the full SPMD mesh" in got["plain_param"]
    assert got["not_replicate"].startswith("ValueError") and "'0.weight'" in got["not_replicate"]
    assert "expected Replicate()" in got["not_replicate"]
    assert got["wrong_type"].startswith("TypeError") and "dp_mesh_dims" in got["wrong_type"]
    assert got["int_reshard"].startswith("NotImplementedError") and "reshard_after_forward" in got["int_reshard"]
    assert got["flattened"].startswith("NotImplementedError") and "dp_mesh_dims" in got["flattened"]


# ---------------------------------------------------------------- ShardPlacementResult

def placement_results() -> dict[str, Any]:
    """shard_placement_fn returning a ShardPlacementResult on the group's mesh, and on another mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,  # PyTorch's mesh description
    )

    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.fsdp._fully_shard._fsdp_common import (
        ShardPlacementResult,
    )
    from tensorplay.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    for name, make in {"shard": lambda p: Shard(1) if p.dim() == 2 else None,
                       "result": lambda p: ShardPlacementResult(Shard(1) if p.dim() == 2 else None,
                                                                FSDPMeshInfo(mesh, shard_mesh_dim=0))}.items():
        tp.manual_seed(0)
        model = Net()
        fully_shard(model, mesh=mesh, shard_placement_fn=make)
        out[name] = {n: (tuple(repr(q) for q in p.placements), p.to_local().detach().clone())
                     for n, p in model.named_parameters()}
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
    try:
        fully_shard(Net(), mesh=mesh,
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), FSDPMeshInfo(other, shard_mesh_dim=0)))
        out["other_mesh"] = "no error"
    except NotImplementedError as err:
        out["other_mesh"] = str(err)
    return out


def test_shard_placement_result_on_the_same_mesh():
    for got in run_distributed(placement_results, world_size=2):
        assert sorted(got["shard"]) == sorted(got["result"])
        for fqn, (placements, local) in got["shard"].items():
            assert got["result"][fqn][0] == placements and torch.equal(got["result"][fqn][1], local), fqn
        assert got["shard"]["head.weight"][0] == ("Shard(dim=1)",)
        assert "ShardPlacementResult for parameter 'emb.weight'" in got["other_mesh"]
        assert "call fully_shard separately" in got["other_mesh"]
