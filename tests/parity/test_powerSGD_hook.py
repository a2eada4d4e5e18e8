"""PowerSGD: DDP with our hooks against PyTorch's hook (2 and 4 ranks) and against one-process math.

* ``powerSGD_hook``: bitwise equal to PyTorch's over 6 steps (2 plain, 4 compressed) for ranks 1, 2 and 3 (QR),
  error feedback and warm start on and off, batching of same-shaped gradients, several buckets, 2 and 4 ranks.
  PyTorch's hook issues its second and third all-reduces from future callbacks; with several buckets on Gloo
  their order against the next bucket's collectives differs between ranks and Gloo aborts the process
  ("collective mismatch"), so the oracle hook is waited for inside the hook (same arithmetic, serialised).
  One case runs PyTorch's hook unwrapped, with a single bucket, where it works as is.
* ``batched_powerSGD_hook``: PyTorch's raises AssertionError; ours equals the same math with the batch
  dimension fixed, computed here in one process from every rank's local gradient (2 ranks, bitwise).
* Compression statistics equal PyTorch's; the ratios are printed (``pytest -s``).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as torch_powersgd

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as our_powersgd
from tensorplay.distributed.algorithms.ddp_comm_hooks._low_rank import orthogonalize_
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_equal_tensors, error_of

STEPS = 6
START = 2
LR = 0.1


def _model() -> tp.nn.Module:
    # 12x16 and two 12x12 weights compress; biases and the 2x12 head (too small to gain) go uncompressed.
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(16, 12), tp.nn.Tanh(), tp.nn.Linear(12, 12), tp.nn.Tanh(),
                            tp.nn.Linear(12, 12), tp.nn.Tanh(), tp.nn.Linear(12, 2))


def _batches(features: int = 16) -> list[torch.Tensor]:
    gen = tp.Generator().manual_seed(100 + dist.get_rank())
    return [tp.randn(8, features, generator=gen) for _ in range(STEPS)]


def _torch_hook_waited(state, bucket):  # noqa: ANN001, ANN202  (DDP rejects postponed annotations)
    fut = torch_powersgd.powerSGD_hook(state, bucket)
    fut.wait()  # serialise PyTorch's callback-issued collectives (see the module docstring)
    return fut


def _train(impl: str, options: dict[str, Any], bucket_cap_mb: float) -> dict[str, Any]:
    model = _model()
    ddp = tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if impl == "ours":
        state: Any = our_powersgd.PowerSGDState(None, start_powerSGD_iter=START, **options)
        hook: Any = our_powersgd.powerSGD_hook
    else:
        state = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=START, **options)
        hook = torch_powersgd.powerSGD_hook if impl == "pytorch" else _torch_hook_waited
    if impl != "none":
        ddp.register_comm_hook(state, hook)
    opt = tp.optim.SGD(model.parameters(), lr=LR)
    trajectory = []
    for x in _batches():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    stats = state.compression_stats() if impl != "none" else None
    return {"trajectory": trajectory, "stats": stats}


SEVERAL_BUCKETS = 0.0005
ONE_BUCKET = 25.0
CASES: dict[str, tuple[dict[str, Any], float, str]] = {
    "rank1": ({"matrix_approximation_rank": 1}, SEVERAL_BUCKETS, "waited"),
    "rank2": ({"matrix_approximation_rank": 2}, SEVERAL_BUCKETS, "waited"),
    "rank3_qr": ({"matrix_approximation_rank": 3}, SEVERAL_BUCKETS, "waited"),
    "rank1_batched_shapes": ({"matrix_approximation_rank": 1, "batch_tensors_with_same_shape": True},
                             ONE_BUCKET, "waited"),
    "rank2_no_feedback_no_warm": ({"matrix_approximation_rank": 2, "use_error_feedback": False,
                                   "warm_start": False, "random_seed": 7}, SEVERAL_BUCKETS, "waited"),
    "rank1_one_bucket_unwrapped": ({"matrix_approximation_rank": 1}, ONE_BUCKET, "pytorch"),
}
FOUR_RANK_CASES = ["rank1", "rank2"]


def powersgd_runs(case_names: list[str]) -> dict[str, Any]:
    caps = {CASES[name][1] for name in case_names}
    out: dict[str, Any] = {"none": {cap: _train("none", {}, cap) for cap in caps}}
    for name in case_names:
        options, cap, oracle = CASES[name]
        out[name] = {"ours": _train("ours", options, cap), "pytorch": _train(oracle, options, cap)}
    return out


@pytest.fixture(scope="module")
def results_on() -> Callable[[int], list[dict[str, Any]]]:
    """Per world size, every rank's results, run once on first use."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def results(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            names = list(CASES) if world == 2 else FOUR_RANK_CASES
            cache[world] = run_distributed(powersgd_runs, names, world_size=world)
        return cache[world]

    return results


@pytest.mark.parametrize("world,name", [(2, name) for name in CASES] + [(4, name) for name in FOUR_RANK_CASES])
def test_powerSGD_hook_matches_pytorch_bitwise(results_on: Callable[[int], list[dict[str, Any]]], world: int,
                                               name: str) -> None:
    results = results_on(world)
    for rank, result in enumerate(results):
        ours, theirs = result[name]["ours"], result[name]["pytorch"]
        for step, (got, want) in enumerate(zip(ours["trajectory"], theirs["trajectory"], strict=True)):
            assert_equal_tensors(got, want, f"{name}, rank {rank}/{world}, step {step}")
        assert ours["stats"] == theirs["stats"], (name, rank)
        # Compression really happened: the compressed steps leave plain averaging.
        plain = result["none"][CASES[name][1]]["trajectory"]
        assert_equal_tensors(ours["trajectory"][START - 1], plain[START - 1], f"{name}: plain steps")
        assert any(not torch.equal(a, b) for a, b in zip(ours["trajectory"][-1], plain[-1], strict=True)), name
    # Every rank applies the same averaged update.
    assert_equal_tensors(results[0][name]["ours"]["trajectory"][-1], results[-1][name]["ours"]["trajectory"][-1],
                         f"{name}: ranks diverged")
    rate, before, after = results[0][name]["ours"]["stats"]
    assert rate == before / after and rate > 1
    print(f"\nPowerSGD {name} on {world} ranks: compression rate {rate:.2f} ({before} -> {after} elements)")


# --- batched_powerSGD_hook ---------------------------------------------------------------------------------

BATCHED_SHAPE = (7, 5)  # one parameter: the bucket is its gradient, 35 elements -> a 6x6 padded square


def _single_param_model() -> tp.nn.Module:
    tp.manual_seed(1)
    return tp.nn.Linear(BATCHED_SHAPE[1], BATCHED_SHAPE[0], bias=False)


def _loss(model: tp.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).tanh().square().mean()


def batched_run(rank_r: int, warm_start: bool) -> dict[str, Any]:
    model = _single_param_model()
    ddp = tp.nn.parallel.DistributedDataParallel(model)
    state = our_powersgd.PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=START,
                                       warm_start=warm_start)
    local_grads: list[torch.Tensor] = []

    def recording_hook(state, bucket):  # noqa: ANN001, ANN202
        local_grads.append(bucket.buffer().detach().clone())
        return our_powersgd.batched_powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    opt = tp.optim.SGD(model.parameters(), lr=LR)
    weights = []
    for x in _batches(BATCHED_SHAPE[1]):
        opt.zero_grad()
        _loss(ddp, x).backward()
        opt.step()
        weights.append(model.weight.detach().clone())
    torch_state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=0,
                                               use_error_feedback=False, warm_start=False)
    torch_error = _torch_batched_error(torch_state, model)
    return {"weights": weights, "stats": state.compression_stats(), "local_grads": local_grads,
            "torch_error": torch_error}


def _torch_batched_error(state: Any, model: tp.nn.Module) -> tuple[str, str] | None:
    """What PyTorch's batched hook raises when it compresses (iteration >= start)."""
    ddp = tp.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, torch_powersgd.batched_powerSGD_hook)
    return error_of(lambda: _loss(ddp, tp.randn(2, BATCHED_SHAPE[1])).backward())


def _reference_batched(local_grads: list[list[torch.Tensor]], rank_r: int, warm_start: bool) -> list[torch.Tensor]:
    """PyTorch's batched PowerSGD math on every rank's local gradients (recorded on the ranks, so no BLAS
    thread count can round them differently here), with the batch dimension fixed."""
    world = len(local_grads)
    model = _single_param_model()
    rng = np.random.RandomState(0)
    numel = math.prod(BATCHED_SHAPE)
    side = math.ceil(math.sqrt(numel))
    errors: list[torch.Tensor | None] = [None] * world
    q_memory: torch.Tensor | None = None
    weights = []
    for step in range(STEPS):
        grads = [rank_grads[step] for rank_grads in local_grads]
        if step < START:
            average = sum(g / world for g in grads)
        else:
            padded = [torch.cat([g, g.new_zeros(side * side - numel)]) for g in grads]
            for r in range(world):
                if errors[r] is not None:
                    padded[r] += errors[r]
            local = [p.clone() for p in padded]
            if q_memory is None or not warm_start:
                gen = torch.Generator().manual_seed(int(rng.randint(1_000_000_000)))
                q_memory = torch.randn(side, rank_r, generator=gen)
            torch_powersgd._orthogonalize(q_memory.unsqueeze(0))  # the fix: a batch of one
            p = sum(m.view(side, side) @ q_memory for m in padded)
            torch_powersgd._orthogonalize(p.unsqueeze(0))
            q_memory = sum(m.view(side, side).t() @ p for m in padded) / world
            approximated = (p @ q_memory.t()).flatten()
            errors = [loc - approximated for loc in local]
            average = approximated[:numel]
        with torch.no_grad():
            model.weight.add_(average.view(BATCHED_SHAPE), alpha=-LR)  # SGD's own update
        weights.append(model.weight.detach().clone())
    return weights


@pytest.mark.parametrize("rank_r,warm_start", [(1, True), (2, True), (2, False)])
def test_batched_powerSGD_hook_matches_fixed_math(rank_r: int, warm_start: bool) -> None:
    per_rank = run_distributed(batched_run, rank_r, warm_start, world_size=2)
    expected = _reference_batched([r["local_grads"] for r in per_rank], rank_r, warm_start)
    for rank, result in enumerate(per_rank):
        assert_equal_tensors(result["weights"], expected, f"rank {rank}")
        assert result["torch_error"] is not None and "AssertionError" in " ".join(result["torch_error"])
    rate, before, after = per_rank[0]["stats"]
    assert (before, after) == (35 * (STEPS - START), 6 * rank_r * 2 * (STEPS - START))
    print(f"\nbatched PowerSGD rank {rank_r}: compression rate {rate:.2f} ({before} -> {after} elements)")


# --- the state: pickling, validation; the math in one process ------------------------------------------------

def test_state_signature_and_slots_match_pytorch() -> None:
    import inspect

    ours = inspect.signature(our_powersgd.PowerSGDState.__init__).parameters
    theirs = inspect.signature(torch_powersgd.PowerSGDState.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.values()]
    assert our_powersgd.PowerSGDState.__slots__ == torch_powersgd.PowerSGDState.__slots__
    assert our_powersgd.__all__ == sorted(torch_powersgd.__all__)


def test_pickle_drops_the_process_group() -> None:
    state = our_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, random_seed=3)
    state.iter = 5
    state.error_dict[0] = torch.ones(3)
    assert "process_group" not in state.__getstate__()
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None  # no default group in this process
    assert restored.iter == 5 and torch.equal(restored.error_dict[0], torch.ones(3))
    assert restored.rng.randint(1_000_000_000) == np.random.RandomState(3).randint(1_000_000_000)


@pytest.mark.parametrize("kwargs,error,phrase", [
    ({"start_powerSGD_iter": 1}, ValueError, "Expect `start_powerSGD_iter` > 1"),
    ({"matrix_approximation_rank": 0}, ValueError, "matrix_approximation_rank must be >= 1"),
    ({"matrix_approximation_rank": 1.5}, TypeError, "matrix_approximation_rank must be an int"),
    ({"min_compression_rate": -1}, ValueError, "min_compression_rate must be >= 0"),
    ({"min_compression_rate": "2"}, TypeError, "min_compression_rate must be a real number"),
    ({"orthogonalization_epsilon": float("nan")}, ValueError, "orthogonalization_epsilon must be >= 0"),
    ({"random_seed": -1}, ValueError, "random_seed must be >= 0"),
    ({"process_group": "world"}, TypeError, "process_group must be a ProcessGroup or None"),
])
def test_state_refuses_bad_input(kwargs: dict[str, Any], error: type, phrase: str) -> None:
    arguments = {"process_group": None, **kwargs}
    with pytest.raises(error, match=phrase.replace("`", ".").replace("(", r"\(")):
        our_powersgd.PowerSGDState(**arguments)


def test_hook_refuses_a_wrong_state() -> None:
    with pytest.raises(TypeError, match="hook state must be a PowerSGDState"):
        our_powersgd.powerSGD_hook(None, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batched_powerSGD_hook: the hook state must be a PowerSGDState"):
        our_powersgd.batched_powerSGD_hook(torch_powersgd.PowerSGDState(None), object())  # type: ignore[arg-type]


@pytest.mark.parametrize("rank,dtype", [(1, torch.float32), (2, torch.float32), (4, torch.float32),
                                        (3, torch.float16)])
def test_orthogonalize_matches_pytorch(rank: int, dtype: torch.dtype) -> None:
    matrices = torch.randn(3, 9, rank, generator=torch.Generator().manual_seed(rank)).to(dtype)
    ours, theirs = matrices.clone(), matrices.clone()
    orthogonalize_(ours)
    torch_powersgd._orthogonalize(theirs)
    assert torch.equal(ours, theirs)


def test_zero_column_stays_zero_not_nan() -> None:
    matrices = torch.zeros(1, 4, 2)
    matrices[0, :, 1] = torch.tensor([1.0, 2.0, 2.0, 0.0])
    orthogonalize_(matrices)
    assert torch.equal(matrices[0, :, 0], torch.zeros(4))
    assert torch.allclose(matrices[0, :, 1], torch.tensor([1.0, 2.0, 2.0, 0.0]) / 3)
    theirs = torch.zeros(1, 4, 2)
    torch_powersgd._orthogonalize(theirs)
    assert torch.isnan(theirs).all()  # PyTorch's, for the record


def test_orthogonalize_refuses_a_wide_or_2d_input() -> None:
    with pytest.raises(ValueError, match=r"B x n x r with r <= n\), got shape \(3, 2\)"):
        orthogonalize_(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 3\)"):
        orthogonalize_(torch.zeros(1, 2, 3))
