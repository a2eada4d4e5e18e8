"""CUDA-only checks, run by ``make gpu-check``: NCCL at world size 1 against PyTorch's, streams and prefetch overlap,
pinned-memory offload, mixed precision, and the memory planner against ``torch.cuda.max_memory_allocated``.

Every test skips without CUDA. Each runs in one fresh NCCL rank (``run_distributed(..., backend="nccl")``).
Results are compared bitwise with PyTorch's where both run the same kernels in the same order: deterministic
algorithms are on and cuBLAS gets a fixed workspace, so a difference is ours, not the GPU's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tensorplay.testing.distributed import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by make gpu-check)")

DIM, ROWS, STEPS = 256, 8, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(4)]).cuda()


def _deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(0)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(ROWS, DIM, device="cuda")).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    """The model's state-dict values; a DTensor's local tensor is the whole of it at world size 1."""
    values = model.state_dict().values()
    return [(v.to_local() if hasattr(v, "to_local") else v).detach().float().cpu() for v in values]


def _fully_shard_run(ours: bool, mesh_shape: tuple[int, ...], options: dict[str, Any]) -> tuple[list, list]:
    from torch.distributed.device_mesh import init_device_mesh
    if ours:
        from tensorplay.distributed import fsdp
    else:
        from torch.distributed import fsdp  # type: ignore[no-redef]
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cuda", mesh_shape, mesh_dim_names=names)
    kwargs = _fully_shard_options(fsdp, options)
    model = _model()
    for block in model:
        fsdp.fully_shard(block, mesh=mesh, **kwargs)
    fsdp.fully_shard(model, mesh=mesh, **kwargs)
    losses = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    return losses, _full_params(model)


def _fully_shard_options(fsdp: Any, options: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if options.get("bf16"):
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options.get("offload"):
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=True)
    return kwargs


def case_fully_shard(mesh_shape: tuple[int, ...], options: dict[str, Any]) -> tuple[tuple, tuple]:
    _deterministic()
    return _fully_shard_run(True, mesh_shape, options), _fully_shard_run(False, mesh_shape, options)


def case_classic(options: dict[str, Any]) -> tuple[tuple, tuple]:
    _deterministic()
    results = []
    for ours in (True, False):
        if ours:
            from tensorplay.distributed import fsdp
        else:
            from torch.distributed import fsdp  # type: ignore[no-redef]
        kwargs: dict[str, Any] = {"device_id": torch.cuda.current_device()}
        if options.get("bf16"):
            kwargs["mixed_precision"] = fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = _model()
        wrapped = fsdp.FullyShardedDataParallel(
            nn.Sequential(*[fsdp.FullyShardedDataParallel(block, **kwargs) for block in model]), **kwargs)
        losses = _train(wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-2))
        results.append((losses, _full_params(wrapped)))  # a full state dict (the default type)
    return results[0], results[1]


def case_zero() -> tuple[tuple, tuple]:
    _deterministic()
    results = []
    for ours in (True, False):
        if ours:
            from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer  # type: ignore[no-redef]
        model = nn.parallel.DistributedDataParallel(_model())
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
        results.append((_train(model, optimizer), _full_params(model)))
    return results[0], results[1]


def _assert_bitwise(ours: tuple, theirs: tuple) -> None:
    assert ours[0] == theirs[0], f"losses differ: ours {ours[0]} PyTorch's {theirs[0]}"
    for i, (a, b) in enumerate(zip(ours[1], theirs[1], strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs from PyTorch's: max |diff| {(a - b).abs().max()}"


def _one_rank(fn: Callable[..., Any], *args: Any) -> Any:
    return run_distributed(fn, *args, world_size=1, backend="nccl", fresh=True)[0]


@pytest.mark.parametrize("options", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_fully_shard_nccl_matches_pytorch(options: dict[str, Any]) -> None:
    _assert_bitwise(*_one_rank(case_fully_shard, (1,), options))


def test_hsdp_1x1_mesh_matches_pytorch() -> None:
    _assert_bitwise(*_one_rank(case_fully_shard, (1, 1), {}))


def test_pinned_cpu_offload_matches_pytorch() -> None:
    _assert_bitwise(*_one_rank(case_fully_shard, (1,), {"offload": True}))


@pytest.mark.parametrize("options", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_classic_fsdp_nccl_matches_pytorch(options: dict[str, Any]) -> None:
    _assert_bitwise(*_one_rank(case_classic, options))


def test_zero_nccl_matches_pytorch() -> None:
    _assert_bitwise(*_one_rank(case_zero))


# ---- streams and the prefetch overlap -------------------------------------------------------------
def case_offload_is_pinned() -> tuple[bool, str]:
    from tensorplay.distributed.fsdp import CPUOffloadPolicy, fully_shard
    torch.cuda.set_device(0)
    model = _model()
    from torch.distributed.tensor import DTensor
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    param = next(model.parameters())
    assert isinstance(param, DTensor) and isinstance(param.grad, DTensor)
    local = param.to_local()
    return local.is_pinned() and param.grad.to_local().device.type == "cpu", str(local.device)


def test_pinned_offload_keeps_shards_in_pinned_host_memory() -> None:
    pinned, device = _one_rank(case_offload_is_pinned)
    assert pinned, f"offloaded shard on {device} is not in pinned host memory (or its gradient not on the CPU)"


def case_prefetch_overlap() -> list[tuple[float, float, float, float]]:
    """Per even unit i: (unit i+1's all-gather start and end, unit i's compute start and end), ms after a reference
    event, from CUDA events: the all-gather's on the all-gather stream, the compute's on the compute stream.

    Odd units carry an unused 256 MiB parameter, so their all-gather (at world size 1 a copy on the all-gather
    stream) is long; even units' compute is made long with a sleep kernel. An all-gather of unit i+1 that
    overlaps unit i's compute then shows as intersecting intervals; one serialized with it does not.
    """
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    width, units, ballast = 1024, 6, 64 * 2**20
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)]).cuda()
    for i, layer in enumerate(model):
        if i % 2 == 1:
            layer.register_parameter("ballast", nn.Parameter(torch.zeros(ballast, device="cuda")))
        fully_shard(layer)
    fully_shard(model)
    index = {id(layer): i for i, layer in enumerate(model)}
    gathers: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
    computes: dict[int, list[torch.cuda.Event]] = {}
    original = group_module.FSDPParamGroup._start_all_gather

    def recorded(self: Any, source: torch.Tensor, group: Any, world: int) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # on the all-gather stream: _start_all_gather runs inside it
        result = original(self, source, group, world)
        end.record()
        i = index.get(id(self.modules[0]))
        if i is not None:
            gathers[i] = (start, end)
        return result

    def begin(i: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        computes[i] = [event]
        if i % 2 == 0:
            torch.cuda._sleep(20_000_000)  # a long compute on the compute stream (~10 ms)

    def end(i: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        computes[i].append(event)

    for i, layer in enumerate(model):  # after fully_shard's pre-forward: compute begins; before its post: it ended
        layer.register_forward_pre_hook(lambda m, a, i=i: begin(i))
        layer.register_forward_hook(lambda m, a, o, i=i: end(i), prepend=True)
    x = torch.randn(64, width, device="cuda")
    with torch.no_grad():
        model(x)  # warm-up: the forward order is known from now on
        torch.cuda.synchronize()
        group_module.FSDPParamGroup._start_all_gather = recorded  # type: ignore[method-assign]
        try:
            reference = torch.cuda.Event(enable_timing=True)
            reference.record()
            model(x)
            torch.cuda.synchronize()
        finally:
            group_module.FSDPParamGroup._start_all_gather = original  # type: ignore[method-assign]
    return [tuple(reference.elapsed_time(e) for e in (*gathers[i + 1], *computes[i]))  # type: ignore[misc]
            for i in range(0, units - 1, 2) if i + 1 in gathers]


def test_next_units_all_gather_runs_while_this_unit_computes() -> None:
    spans = _one_rank(case_prefetch_overlap)
    assert spans, "no prefetched all-gather was recorded"
    for i, (gather_start, gather_end, compute_start, compute_end) in enumerate(spans):
        assert gather_start < compute_end and gather_end > compute_start, (
            f"unit {2 * i + 1}'s all-gather ran {gather_start:.3f}-{gather_end:.3f} ms, unit {2 * i}'s compute "
            f"{compute_start:.3f}-{compute_end:.3f} ms: they do not overlap")


# ---- the memory planner ---------------------------------------------------------------------------
def case_planner_peak() -> tuple[int, int]:
    from tensorplay.distributed import estimate_memory
    from tensorplay.distributed.fsdp import fully_shard
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    width = 1024

    def build() -> nn.Sequential:
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(8)])

    batch = torch.randn(64, width)
    estimate = estimate_memory(build, batch, world_size=1, strategy="fully_shard", compare=False, device="cuda")
    model = build().cuda()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # from here the peak counts the sharded parameters already held
    for _ in range(2):
        model(batch.cuda()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    return estimate.peak, torch.cuda.max_memory_allocated()


def test_memory_planner_within_ten_percent_of_max_memory_allocated() -> None:
    predicted, measured = _one_rank(case_planner_peak)
    assert abs(predicted - measured) <= 0.10 * measured, (
        f"planner predicted {predicted / 2**20:.1f} MiB, "
        f"torch.cuda.max_memory_allocated saw {measured / 2**20:.1f} MiB")
