"""ShardedGradScaler: every rank skips, backs off and grows together; parity with PyTorch's and a local run.

Gradients are sharded here without fully_shard: each parameter of a Linear is a
Shard(0) DTensor on a 1-D CPU mesh, gathered by a parametrization whose backward
reduce-scatters (sums) the gradient, so ``param.grad`` is this rank's DTensor
shard, as under fully_shard. The oracle is PyTorch's ShardedGradScaler with
device="cpu" (its default "cuda" disables itself on a CPU-only machine); the
local reference is loss scaling written out by hand on the unsharded model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.nn.utils import parametrize

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.fsdp import sharded_grad_scaler as sgs_module
from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tensorplay.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors, error_of

IN, OUT, BATCH, LR = 4, 5, 3, 0.125
INF, NAN = float("inf"), float("nan")
# step -> (rank, parameter index, value written into that rank's first local gradient element)
Injections = dict[int, tuple[int, int, float]]


# ---------------------------------------------------------------------------------------------
# A Linear whose gradients are sharded by hand


class _AllGather(tp.nn.Module):
    """Parametrization: the full tensor of a Shard(0) DTensor; its backward sums and re-shards the grad."""

    def forward(self, shard: DTensor) -> torch.Tensor:
        return shard.full_tensor(grad_placements=[Partial()])


def sharded_linear(dtype: torch.dtype, in_features: int = IN, out_features: int = OUT) -> tp.nn.Linear:
    """The same seeded Linear on every rank, its parameters replaced by their Shard(0) DTensors."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tp.manual_seed(0)
    model = tp.nn.Linear(in_features, out_features).to(dtype)
    for name, param in list(model.named_parameters()):
        setattr(model, name, tp.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        parametrize.register_parametrization(model, name, _AllGather(), unsafe=True)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def rank_batch(step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    tp.manual_seed(1000 * step + rank)
    return tp.randn(BATCH, IN).to(dtype)


def inject(params: list[torch.Tensor], injection: tuple[int, int, float] | None) -> None:
    if injection is not None and injection[0] == dist.get_rank():
        _, index, value = injection
        grad = params[index].grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = value


def train(scaler: Any, model: tp.nn.Module, optimizers: list[torch.optim.Optimizer], steps: int,
          injections: Injections, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Run ``steps`` scaled steps; record the scale and this rank's parameter shards after each."""
    params = list(model.parameters())
    record = []
    for step in range(steps):
        loss = model(rank_batch(step, dist.get_rank(), dtype)).float().pow(2).sum()
        scaler.scale(loss).backward()
        inject(params, injections.get(step))
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        for optimizer in optimizers:
            optimizer.zero_grad()
        record.append({"scale": scaler.get_scale(), "params": [local(p) for p in params]})
    return record


def reference(dtype: torch.dtype, steps: int, injections: Injections, init_scale: float,
              growth_interval: int) -> list[dict[str, Any]]:
    """Loss scaling by hand on the unsharded model with every rank's batch: the local reference."""
    world = dist.get_world_size()
    tp.manual_seed(0)
    model = tp.nn.Linear(IN, OUT).to(dtype)
    params = list(model.parameters())
    optimizer = tp.optim.SGD(params, lr=LR)
    scale, healthy_streak, record = init_scale, 0, []
    for step in range(steps):
        for rank in range(world):
            loss = model(rank_batch(step, rank, dtype)).float().pow(2).sum()
            (loss * tp.tensor(scale)).backward()
        if step in injections:
            rank, index, value = injections[step]
            rows_before = sum(chunk.shape[0] for chunk in params[index].chunk(world)[:rank])
            params[index].grad[rows_before].view(-1)[0] = value
        if all(bool(p.grad.isfinite().all()) for p in params):
            for p in params:
                p.grad.mul_(tp.tensor(1.0 / scale))
            optimizer.step()
            healthy_streak += 1
            if healthy_streak == growth_interval:
                scale, healthy_streak = scale * 2.0, 0
        else:
            scale, healthy_streak = scale * 0.5, 0
        optimizer.zero_grad()
        rank = dist.get_rank()
        record.append({"scale": scale, "params": [p.detach().chunk(world)[rank].clone() for p in params]})
    return record


def ours_and_torch(ours: Any, theirs: Any) -> list[tuple[str, type, Any]]:
    """(run name, scaler class, the API it is paired with): ours with ours, PyTorch's with PyTorch's."""
    return [("ours", ShardedGradScaler, ours), ("torch", TorchShardedGradScaler, theirs)]


def two_layer_mlp() -> tp.nn.Sequential:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(IN, OUT), tp.nn.ReLU(), tp.nn.Linear(OUT, 2))


def assert_skipped_together(record: list[dict[str, Any]], steps: tuple[int, ...]) -> None:
    """At each of ``steps`` this rank's parameters did not move and the scale backed off."""
    for step in steps:
        previous = record[step - 1]
        assert_equal_tensors(record[step]["params"], previous["params"], f"step {step}")
        assert record[step]["scale"] == previous["scale"] * 0.5, step


def assert_records_equal(ours: list[dict[str, Any]], other: list[dict[str, Any]], what: str) -> None:
    for step, (a, b) in enumerate(zip(ours, other, strict=True)):
        assert a["scale"] == b["scale"], f"{what}: scale differs at step {step}: {a['scale']} vs {b['scale']}"
        for index, (pa, pb) in enumerate(zip(a["params"], b["params"], strict=True)):
            assert torch.equal(pa, pb), f"{what}: parameter {index} differs at step {step}:\n{pa}\n{pb}"


# ---------------------------------------------------------------------------------------------
# Overflow on one rank's shard; parity with PyTorch's ShardedGradScaler and the local reference

STEPS = 8
INJECTIONS: Injections = {2: (1, 0, INF), 5: (0, 1, NAN)}


def run_three_ways(dtype: torch.dtype, init_scale: float, growth_interval: int) -> dict[str, Any]:
    kwargs = dict(init_scale=init_scale, growth_interval=growth_interval)
    runs = {}
    for name, make_scaler in (("ours", lambda: ShardedGradScaler(device="cpu", **kwargs)),
                              ("torch", lambda: TorchShardedGradScaler(device="cpu", **kwargs))):
        model = sharded_linear(dtype)
        runs[name] = train(make_scaler(), model, [tp.optim.SGD(model.parameters(), lr=LR)], STEPS,
                           INJECTIONS, dtype)
    runs["reference"] = reference(dtype, STEPS, INJECTIONS, init_scale, growth_interval)
    model = sharded_linear(dtype)
    runs["initial"] = [local(p) for p in model.parameters()]
    return runs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_matches_pytorch_and_local_reference_step_for_step(dtype):
    # fp16 at 2**16 overflows on its own at first, then grows back into overflow: both paths get exercised.
    init_scale = 2.0**16 if dtype == torch.float16 else 2.0**10
    per_rank = run_distributed(run_three_ways, dtype, init_scale, 2, world_size=2)
    for runs in per_rank:
        assert_records_equal(runs["ours"], runs["torch"], f"{dtype} vs PyTorch's ShardedGradScaler")
        assert_records_equal(runs["ours"], runs["reference"], f"{dtype} vs the unsharded reference")
    scales = [step["scale"] for step in per_rank[0]["ours"]]
    assert scales == [step["scale"] for step in per_rank[1]["ours"]]
    if dtype == torch.float16:
        assert scales[0] < init_scale  # a natural fp16 overflow backed off
    else:
        # Healthy, healthy (grow), injected inf on rank 1 (back off), ...
        assert scales[:3] == [init_scale, init_scale * 2, init_scale]


def test_overflow_on_one_rank_skips_the_step_on_every_rank():
    per_rank = run_distributed(run_three_ways, torch.float32, 2.0**10, 2, world_size=2)
    for runs in per_rank:
        ours = runs["ours"]
        # Step 2: inf in rank 1's weight shard only; step 5: NaN in rank 0's bias shard only.
        assert_skipped_together(ours, (2, 5))
        # Healthy steps apply the update on every rank.
        for step in (0, 1, 3, 4, 6, 7):
            previous = ours[step - 1]["params"] if step else runs["initial"]
            assert not any(torch.equal(a, b) for a, b in zip(ours[step]["params"], previous, strict=True))


# ---------------------------------------------------------------------------------------------
# Several optimizers sharing one scaler; sparse gradients; fused optimizers


def two_optimizers() -> dict[str, Any]:
    runs = {}
    injections: Injections = {1: (1, 1, INF)}  # the bias (second optimizer) overflows on rank 1 only
    for name, cls in (("ours", ShardedGradScaler), ("torch", TorchShardedGradScaler)):
        model = sharded_linear(torch.float32)
        optimizers = [tp.optim.SGD([model.parametrizations.weight.original], lr=LR),
                      tp.optim.Adam([model.parametrizations.bias.original], lr=LR)]
        runs[name] = train(cls(device="cpu", init_scale=2.0**8, growth_interval=3), model, optimizers, 4,
                           injections, torch.float32)
    return runs


def test_several_optimizers_share_one_scaler():
    for runs in run_distributed(two_optimizers, world_size=2):
        assert_records_equal(runs["ours"], runs["torch"], "two optimizers vs PyTorch's")
        ours = runs["ours"]
        weight_moved = not torch.equal(ours[1]["params"][0], ours[0]["params"][0])
        bias_moved = not torch.equal(ours[1]["params"][1], ours[0]["params"][1])
        assert weight_moved and not bias_moved  # only the overflowed optimizer skips, on every rank
        assert [step["scale"] for step in ours] == [2.0**8, 2.0**7, 2.0**7, 2.0**7]


def sparse_embedding(dtype: torch.dtype) -> dict[str, Any]:
    rank, runs = dist.get_rank(), {}
    for name, cls in (("ours", ShardedGradScaler), ("torch", TorchShardedGradScaler)):
        tp.manual_seed(0)
        embedding = tp.nn.Embedding(6, 3, sparse=True).to(dtype)
        optimizer = tp.optim.SGD(embedding.parameters(), lr=LR)
        scaler, record = cls(device="cpu", init_scale=2.0**6, growth_interval=2), []
        for step in range(4):
            ids = tp.tensor([rank, 3, rank, 5 - step])  # duplicates: an uncoalesced sparse gradient
            scaler.scale(embedding(ids).float().sum()).backward()
            if step == 1 and rank == 1:
                embedding.weight.grad._values().view(-1)[0] = INF
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            record.append({"scale": scaler.get_scale(), "params": [local(embedding.weight)]})
        runs[name] = record
    return runs


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_sparse_gradients(dtype):
    for runs in run_distributed(sparse_embedding, dtype, world_size=2):
        assert_records_equal(runs["ours"], runs["torch"], f"sparse {dtype} vs PyTorch's")
        ours = runs["ours"]
        assert torch.equal(ours[1]["params"][0], ours[0]["params"][0])  # inf on rank 1 only: skipped here too
        assert [step["scale"] for step in ours] == [2.0**6, 2.0**5, 2.0**5, 2.0**6]


def fused_adam() -> list[torch.Tensor]:
    param = tp.nn.Parameter(tp.ones(3))
    optimizer = tp.optim.Adam([param], lr=LR, fused=True)  # unscales inside its own step
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
    factor = INF if dist.get_rank() == 1 else 1.0
    scaler.scale((param * factor).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    return [param.detach().clone(), tp.tensor(scaler.get_scale())]


def test_fused_optimizer_skips_on_every_rank():
    # PyTorch's ShardedGradScaler leaves this path unsynchronised: its rank 0 would step.
    for param, scale in run_distributed(fused_adam, world_size=2):
        assert torch.equal(param, tp.ones(3)) and scale.item() == 2.0


# ---------------------------------------------------------------------------------------------
# Ranks with nothing to unscale; bad input


def rank_without_gradients() -> dict[str, Any]:
    """Rank 1 has an empty optimizer, an empty DTensor shard, and a parameter without a gradient."""
    rank = dist.get_rank()
    model = sharded_linear(torch.float32, out_features=1)  # one row over two ranks: rank 1's shard is empty
    unused = tp.nn.Parameter(tp.ones(2))
    # Rank 0's second optimizer holds a parameter that never gets a gradient; rank 1's holds none at all.
    idle = [{"params": [] if rank else [unused]}]
    optimizers = [tp.optim.SGD(model.parameters(), lr=LR), tp.optim.SGD(idle, lr=LR)]
    scaler, scales, params = ShardedGradScaler(device="cpu", init_scale=2.0**4, growth_interval=1), [], []
    for step in range(3):
        scaler.scale(model(rank_batch(step, rank, torch.float32)).sum()).backward()
        inject(list(model.parameters()), (0, 0, INF) if step == 1 else None)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        model.zero_grad()
        scales.append(scaler.get_scale())
        params.append([local(p) for p in model.parameters()])
    return {"scales": scales, "params": params, "local_numel": [p.to_local().numel() for p in model.parameters()]}


def test_rank_without_gradients_joins_the_all_reduce():
    r0, r1 = run_distributed(rank_without_gradients, world_size=2, timeout=60)
    assert r1["local_numel"] == [0, 0] and r0["local_numel"] == [IN, 1]
    # Growth every healthy step, back-off for rank 0's inf: identical on the rank with nothing to unscale.
    assert r0["scales"] == r1["scales"] == [2.0**5, 2.0**4, 2.0**5]
    assert_equal_tensors(r0["params"][1], r0["params"][0], "rank 0, step 1 vs step 0")


def _error(call: Callable[[], Any]) -> tuple[str, str] | None:
    return error_of(call, catch=(RuntimeError, AssertionError, ValueError))


def bad_input(cls: type) -> dict[str, Any]:
    """Each misuse as GradScaler defines it; the group must still work afterwards."""
    param = tp.nn.Parameter(tp.ones(2))
    optimizer = tp.optim.SGD([param], lr=LR)
    scaler = cls(device="cpu", init_scale=2.0)
    errors = {"step_before_scale": _error(lambda: scaler.step(optimizer)),
              "unscale_before_scale": _error(lambda: scaler.unscale_(optimizer))}
    scaler.scale(param.sum()).backward()
    errors["update_before_step"] = _error(scaler.update)
    scaler.unscale_(optimizer)
    errors["unscale_twice"] = _error(lambda: scaler.unscale_(optimizer))
    scaler.step(optimizer)
    errors["unscale_after_step"] = _error(lambda: scaler.unscale_(optimizer))
    errors["step_twice"] = _error(lambda: scaler.step(optimizer))
    errors["closure"] = _error(lambda: scaler.step(optimizer, closure=lambda: None))
    scaler.update()
    errors["scale_non_tensor"] = _error(lambda: scaler.scale(3.0))
    return {"errors": errors, "param": param.detach().clone(), "scale": scaler.get_scale()}


def bad_input_both() -> dict[str, Any]:
    return {"ours": bad_input(ShardedGradScaler), "torch": bad_input(TorchShardedGradScaler)}


def test_bad_input_raises_as_gradscaler_defines():
    for result in run_distributed(bad_input_both, world_size=2):
        ours, theirs = result["ours"], result["torch"]
        for case, error in ours["errors"].items():
            if case != "scale_non_tensor":  # ours names the type it got
                assert error == theirs["errors"][case], case
        errors = ours["errors"]
        assert errors["step_before_scale"][0] == "AssertionError"
        assert "Attempted step but _scale is None" in errors["step_before_scale"][1]
        assert "did not use scaler.scale(loss or outputs)" in errors["step_before_scale"][1]
        assert errors["update_before_step"] == ("AssertionError", "No inf checks were recorded prior to update.")
        assert errors["unscale_twice"] == (
            "RuntimeError", "unscale_() has already been called on this optimizer since the last update().")
        assert errors["unscale_after_step"] == ("RuntimeError", "unscale_() is being called after step().")
        assert errors["step_twice"] == ("RuntimeError", "step() has already been called since the last update().")
        assert errors["closure"][0] == "RuntimeError" and "Closure" in errors["closure"][1]
        assert errors["scale_non_tensor"] == ("ValueError",
                                              "outputs must be a Tensor or an iterable of Tensors, got float")
        assert torch.equal(ours["param"], theirs["param"]) and ours["scale"] == theirs["scale"] == 2.0


# ---------------------------------------------------------------------------------------------
# The seed's loop on gradients sharded by hand (the seed itself runs under fully_shard elsewhere)


def seed_loop_sharded_by_hand(scaler_factory: Callable[[], Any]) -> dict[str, Any]:
    tp.manual_seed(0)
    model = sharded_linear(torch.float32, 64, 64)
    scaler = scaler_factory()
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    for x in (tp.randn(8, 64) for _ in range(2)):
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad()
    return {"params": [local(p) for p in model.parameters()], "enabled": scaler.is_enabled(),
            "scale": scaler.get_scale(), "scale_initialised": scaler._scale is not None}


def seed_loop_unsharded() -> list[torch.Tensor]:
    """The same two steps without sharding or scaling; the gradient sums both ranks' (identical) batches."""
    tp.manual_seed(0)
    model = tp.nn.Linear(64, 64)
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    for x in (tp.randn(8, 64) for _ in range(2)):
        (model(x).sum() + model(x).sum()).backward()
        optimizer.step()
        model.zero_grad()
    return [p.detach().chunk(dist.get_world_size())[dist.get_rank()].clone() for p in model.parameters()]


def seed_loop_three_ways() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback warning of the default device="cuda"
        ours = seed_loop_sharded_by_hand(ShardedGradScaler)
    theirs = seed_loop_sharded_by_hand(lambda: TorchShardedGradScaler(device="cpu"))
    return {"ours": ours, "torch": theirs, "reference": seed_loop_unsharded()}


def test_seed_loop_with_default_scaler_on_hand_sharded_gradients():
    for runs in run_distributed(seed_loop_three_ways, world_size=2):
        ours = runs["ours"]
        assert ours["enabled"] and ours["scale_initialised"] and ours["scale"] == 2.0**16
        for a, b, c in zip(ours["params"], runs["torch"]["params"], runs["reference"], strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)  # power-of-two scaling is exact


# ---------------------------------------------------------------------------------------------
# Device defaults and single-process use (no process group)


@pytest.mark.skipif(tp.cuda.is_available(), reason="the CPU fallback applies only without CUDA")
def test_default_device_falls_back_to_cpu_with_one_warning(monkeypatch):
    monkeypatch.setattr(sgs_module, "_warned_cuda_fallback", False)
    with pytest.warns(UserWarning, match="CUDA is not available; scaling on the device of the loss"):
        scaler = ShardedGradScaler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedGradScaler()  # once per process
    assert scaler.is_enabled()
    assert scaler.scale(tp.tensor(3.0)).item() == 3.0 * 2.0**16
    assert scaler.state_dict()["scale"] == 2.0**16


def test_without_process_group_matches_gradscaler():
    assert not dist.is_initialized()
    runs = []
    for scaler in (ShardedGradScaler(device="cpu", init_scale=2.0**12, growth_interval=1),
                   tp.amp.GradScaler(device="cpu", init_scale=2.0**12, growth_interval=1)):
        tp.manual_seed(0)
        model = tp.nn.Linear(IN, OUT)
        optimizer = tp.optim.SGD(model.parameters(), lr=LR)
        record = []
        for step in range(4):
            loss = model(rank_batch(step, 0, torch.float32)).pow(2).sum() * (INF if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            record.append({"scale": scaler.get_scale(), "params": [local(p) for p in model.parameters()]})
        runs.append(record)
    assert_records_equal(runs[0], runs[1], "single process vs GradScaler")
    assert [step["scale"] for step in runs[0]] == [2.0**13, 2.0**14, 2.0**13, 2.0**14]
    state = ShardedGradScaler(device="cpu")
    state.load_state_dict({"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 7,
                           "_growth_tracker": 2})
    assert state.state_dict() == {"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25,
                                  "growth_interval": 7, "_growth_tracker": 2}


@pytest.mark.skipif(not tp.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_offloaded_gradients_share_one_decision():
    scaler = ShardedGradScaler(init_scale=2.0**4)  # the default device="cuda", no process group
    on_gpu = tp.nn.Parameter(tp.ones(3, device="cuda"))
    offloaded = tp.nn.Parameter(tp.ones(3))  # a CPU-offloaded shard
    optimizer = tp.optim.SGD([on_gpu, offloaded], lr=LR)
    record = []
    for step in range(2):
        loss = on_gpu.sum() + offloaded.sum().cuda() * (INF if step == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        record.append((scaler.get_scale(), on_gpu.detach().cpu(), offloaded.detach().clone()))
    # Step 0: inf only in the CPU gradient, yet the CUDA parameter skips too; step 1 applies to both.
    assert record[0][0] == 2.0**3
    assert torch.equal(record[0][1], tp.ones(3)) and torch.equal(record[0][2], tp.ones(3))
    assert record[1][0] == 2.0**3 and torch.equal(record[1][1], tp.full((3,), 1 - LR))
    assert torch.equal(record[1][2], tp.full((3,), 1 - LR))


# ---------------------------------------------------------------------------------------------
# With classic FullyShardedDataParallel (MixedPrecision fp16): flat-parameter shards


def with_classic_fsdp(keep_low_precision_grads: bool) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp

    import tensorplay.distributed.fsdp as our_fsdp

    injections: Injections = {2: (1, 0, INF), 4: (0, 0, NAN)}
    runs = {}
    for name, scaler_cls, api in ours_and_torch(our_fsdp, torch_fsdp):
        precision = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16,
                                       keep_low_precision_grads=keep_low_precision_grads)
        model = api.FullyShardedDataParallel(two_layer_mlp(), mixed_precision=precision,
                                             device_id=torch.device("cpu"))
        scaler = scaler_cls(device="cpu", init_scale=2.0**16, growth_interval=2)
        runs[name] = train(scaler, model, [tp.optim.SGD(model.parameters(), lr=LR)], 6, injections, torch.float32)
        model(rank_batch(0, dist.get_rank(), torch.float32)).sum().backward()
        runs[f"{name}_grad_dtype"] = next(model.parameters()).grad.dtype
    return runs


@pytest.mark.parametrize("keep_low_precision_grads", [False, True], ids=["fp32-grads", "fp16-grads"])
def test_with_classic_fsdp_mixed_precision(keep_low_precision_grads):
    for runs in run_distributed(with_classic_fsdp, keep_low_precision_grads, world_size=2):
        assert_records_equal(runs["ours"], runs["torch"], "classic FSDP vs PyTorch's FSDP + ShardedGradScaler")
        assert_skipped_together(runs["ours"], (2, 4))  # inf in rank 1's flat shard, NaN in rank 0's
        expected_dtype = torch.float16 if keep_low_precision_grads else torch.float32
        assert runs["ours_grad_dtype"] == runs["torch_grad_dtype"] == expected_dtype


# ---------------------------------------------------------------------------------------------
# With fully_shard (mp_policy fp16): DTensor shards of fp32 parameters, fp16 compute and reduction


def with_fully_shard() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp

    import tensorplay.distributed.fsdp as our_fsdp

    injections: Injections = {2: (1, 0, INF), 4: (0, 3, NAN)}
    runs = {}
    for name, scaler_cls, api in ours_and_torch(our_fsdp, torch_fsdp):
        model = two_layer_mlp()
        policy = api.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
        api.fully_shard(model[0], mp_policy=policy)
        api.fully_shard(model, mp_policy=policy)
        scaler = scaler_cls(device="cpu", init_scale=2.0**16, growth_interval=2)
        runs[name] = train(scaler, model, [tp.optim.SGD(model.parameters(), lr=LR)], 7, injections, torch.float32)
    return runs


def test_with_fully_shard_mixed_precision():
    for runs in run_distributed(with_fully_shard, world_size=2):
        assert_records_equal(runs["ours"], runs["torch"], "fully_shard vs PyTorch's")
        ours = runs["ours"]
        assert_skipped_together(ours, (2, 4))  # inf in rank 1's first shard, NaN in rank 0's last
        assert ours[-1]["scale"] == ours[-2]["scale"] * 2  # two healthy steps since the NaN: growth


# ---------------------------------------------------------------------------------------------
# With ZeroRedundancyOptimizer: each rank updates its partition; the skip must still be global


def with_zero_redundancy_optimizer() -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer

    from tensorplay.distributed.optim import ZeroRedundancyOptimizer

    injections: Injections = {1: (1, 2, INF), 3: (0, 0, NAN)}
    runs = {}
    for name, scaler_cls, zero_cls in ours_and_torch(ZeroRedundancyOptimizer, TorchZeroRedundancyOptimizer):
        model = two_layer_mlp()
        optimizer = zero_cls(model.parameters(), optimizer_class=tp.optim.SGD, lr=LR)
        scaler = scaler_cls(device="cpu", init_scale=2.0**6, growth_interval=2)
        runs[name] = train(scaler, model, [optimizer], 5, injections, torch.float32)
    return runs


def test_with_zero_redundancy_optimizer():
    for runs in run_distributed(with_zero_redundancy_optimizer, world_size=2):
        assert_records_equal(runs["ours"], runs["torch"], "ZeRO vs PyTorch's ZeRO + ShardedGradScaler")
        ours = runs["ours"]
        assert_skipped_together(ours, (1, 3))  # inf in rank 1's grad, NaN in rank 0's: every partition skips
        assert [step["scale"] for step in ours] == [2.0**6, 2.0**5, 2.0**5, 2.0**4, 2.0**4]
