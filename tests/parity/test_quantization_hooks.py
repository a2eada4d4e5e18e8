"""Quantization hooks: DDP with ours == quantize -> all-gather -> dequantize computed in one process (bitwise).

The one-process reference is built from PyTorch's own pieces (its min/max observers and the quantize /
dequantize helpers of its hook module), applied to every rank's local gradient. PyTorch's hooks
themselves fail on Gloo (they index the all-gather future's value in NCCL's layout); that is checked too.
The model has one parameter, so the DDP bucket is exactly its gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks as torch_quant
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.ddp_comm_hooks import quantization_hooks as our_quant
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors, error_of

STEPS = 3
LR = 0.1
SHAPE = (30, 40)  # 1200 gradient elements: 3 channels of 512 (padded), 10 of 128 (padded), 12 of 100 (exact)

def _perchannel_128(state, bucket):  # noqa: ANN001, ANN202  (DDP logs a hook's __qualname__: no partial)
    return our_quant.quantization_perchannel_hook(state, bucket, bucket_size=128)


def _perchannel_100(state, bucket):  # noqa: ANN001, ANN202
    return our_quant.quantization_perchannel_hook(state, bucket, bucket_size=100)


# name -> (our hook, channel size or None for per-tensor)
HOOKS: dict[str, tuple[Any, int | None]] = {
    "per_tensor": (our_quant.quantization_pertensor_hook, None),
    "per_channel_default": (our_quant.quantization_perchannel_hook, 512),
    "per_channel_128": (_perchannel_128, 128),
    "per_channel_100": (_perchannel_100, 100),
}


def _model() -> tp.nn.Module:
    tp.manual_seed(2)
    return tp.nn.Linear(SHAPE[1], SHAPE[0], bias=False)


def _inputs(rank: int) -> list[torch.Tensor]:
    gen = tp.Generator().manual_seed(200 + rank)
    return [tp.randn(6, SHAPE[1], generator=gen) * (rank + 1) for _ in range(STEPS)]


def _loss(model: tp.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sin().sum()


def _recording(hook: Any, log: list[torch.Tensor]) -> Any:
    """``hook``, after noting the bucket it is given (this rank's local gradient)."""
    def recording_hook(state, bucket):  # noqa: ANN001, ANN202
        log.append(bucket.buffer().detach().clone())
        return hook(state, bucket)

    return recording_hook


def _train(hook: Any) -> dict[str, list[torch.Tensor]]:
    model = _model()
    ddp = tp.nn.parallel.DistributedDataParallel(model)
    local_grads: list[torch.Tensor] = []
    ddp.register_comm_hook(None, _recording(hook, local_grads))
    weights = []
    for x in _inputs(dist.get_rank()):
        model.zero_grad()
        _loss(ddp, x).backward()
        with torch.no_grad():
            model.weight.add_(model.weight.grad, alpha=-LR)
        weights.append(model.weight.detach().clone())
    return {"weights": weights, "local_grads": local_grads}


def quantization_runs() -> dict[str, Any]:
    results: dict[str, Any] = {name: _train(hook) for name, (hook, _) in HOOKS.items()}
    for name in ("quantization_pertensor_hook", "quantization_perchannel_hook"):
        results[f"pytorch_{name}"] = error_of(_train, getattr(torch_quant, name))
    return results


def _reference_mean(grads: list[torch.Tensor], channel: int | None) -> torch.Tensor:
    """Each rank's gradient quantized with its own parameters, dequantized, summed in rank order, averaged."""
    total = None
    for grad in grads:
        if channel is None:
            observer = MinMaxObserver()
            observer(grad)
            scale, zero_point = observer.calculate_qparams()
            qparams = torch.FloatTensor([scale, zero_point])
            quantized = torch_quant._quantize_per_tensor_backend(grad, qparams[0], qparams[1])
            dequantized = torch_quant._dequantize_per_tensor_backend(quantized, qparams[0], qparams[1])
        else:
            channels = torch.nn.functional.pad(grad, (0, -grad.numel() % channel)).view(-1, channel)
            observer = PerChannelMinMaxObserver()
            observer(channels)
            scale, zero_point = observer.calculate_qparams()
            qparams = torch.stack((scale, zero_point))
            quantized = torch_quant._quantize_per_channel_backend(channels, qparams[0], qparams[1])
            dequantized = torch_quant._dequantize_per_channel_backend(quantized, qparams[0], qparams[1])
        total = dequantized if total is None else total + dequantized
    assert total is not None
    return total.flatten()[:grads[0].numel()] / len(grads)


def _reference(local_grads: list[list[torch.Tensor]], channel: int | None) -> list[torch.Tensor]:
    """The weights the per-rank local gradients give, averaged by the reference (gradients recorded on the
    ranks: a local gradient recomputed here could round differently with another BLAS thread count)."""
    model = _model()
    weights = []
    for step in range(STEPS):
        grads = [rank_grads[step] for rank_grads in local_grads]
        with torch.no_grad():
            model.weight.add_(_reference_mean(grads, channel).view(SHAPE), alpha=-LR)
        weights.append(model.weight.detach().clone())
    return weights


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def per_rank(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(quantization_runs, world_size=request.param)


@pytest.mark.parametrize("name", list(HOOKS))
def test_quantization_hook_matches_one_process_math(per_rank: tuple[int, list[dict[str, Any]]], name: str) -> None:
    world, results = per_rank
    local_grads = [result[name]["local_grads"] for result in results]
    expected = _reference(local_grads, HOOKS[name][1])
    for rank, result in enumerate(results):
        assert_equal_tensors(result[name]["weights"], expected, f"{name}, rank {rank}/{world}")
    # Quantization changes the result: the exact mean differs.
    exact = sum(grads[0] for grads in local_grads) / world
    assert not torch.equal(_reference_mean([grads[0] for grads in local_grads], HOOKS[name][1]), exact)


def test_pytorch_hooks_fail_on_gloo(per_rank: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = per_rank
    for name in ("quantization_pertensor_hook", "quantization_perchannel_hook"):
        error = results[0][f"pytorch_{name}"]
        assert error is not None and "IndexError" in error[1], (name, error)


def test_signatures_match_pytorch() -> None:
    import inspect

    for name in ("quantization_pertensor_hook", "quantization_perchannel_hook"):
        ours = inspect.signature(getattr(our_quant, name)).parameters
        theirs = inspect.signature(getattr(torch_quant, name)).parameters
        assert [(p.name, p.kind, p.default) for p in ours.values()] == \
            [(p.name, p.kind, p.default) for p in theirs.values()], name


@pytest.mark.parametrize("bucket_size,error,phrase", [
    (0, ValueError, "bucket_size must be >= 1"),
    ("128", TypeError, "bucket_size must be an int"),
])
def test_perchannel_refuses_a_bad_bucket_size(bucket_size: Any, error: type, phrase: str) -> None:
    with pytest.raises(error, match=phrase):
        our_quant.quantization_perchannel_hook(None, object(), bucket_size=bucket_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("hook", ["quantization_pertensor_hook", "quantization_perchannel_hook"])
def test_hooks_refuse_a_state_that_is_not_a_group(hook: str) -> None:
    with pytest.raises(TypeError, match=f"{hook}: the hook state must be a ProcessGroup or None"):
        getattr(our_quant, hook)("world", object())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_rounds_like_pytorch_in_every_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    channels = (torch.randn(8, 512, generator=gen) * 3 * torch.rand(8, 1, generator=gen)).to(dtype)
    low, high = torch.aminmax(channels.to(torch.float32), dim=1)
    scale, zero_point = our_quant._affine_qparams(low, high)
    qparams = torch.stack([scale, zero_point.to(torch.float32)])
    want = torch_quant._quantize_per_channel_backend(channels, qparams[0], qparams[1])
    assert torch.equal(our_quant._quantize(channels, *our_quant._broadcastable(qparams, per_channel=True)), want)
    low, high = torch.aminmax(channels.to(torch.float32))
    scale, zero_point = our_quant._affine_qparams(low, high)
    qparams = torch.stack([scale, zero_point.to(torch.float32)])
    want = torch_quant._quantize_per_tensor_backend(channels, qparams[0], qparams[1])
    assert torch.equal(our_quant._quantize(channels, qparams[0], qparams[1]), want)
