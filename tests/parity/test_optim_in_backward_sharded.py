"""Optimizers applied in backward under fully_shard, classic FSDP and DDP == the same front end + a plain step.

The table: front end x mode x optimizer (SGD with momentum, Adam, AdamW, ``_FunctionalAdam``), each run
on 2 ranks against the same front end whose optimizer steps after backward (accumulation and
``clip_grad_norm_`` written as a user writes them):

* ``step``: no options; ``no_sync``: 2 micro-batches, the first under the front end's
  ``no_sync()`` / ``set_requires_gradient_sync(False)``; ``accum2``: ``accumulation_steps=2``,
  every micro-batch reduced. All three bitwise.
* ``exact``: ``max_norm`` with ``clip_mode="exact"`` == ``clip_grad_norm_`` + step, to 1e-6 (the
  global norm is summed in another order across ranks; a single process is bitwise, see
  ``test_optim_in_backward_options.py``).
* ``previous``: == a plain step whose gradients are scaled by the previous step's clip
  coefficient (the first step exact), to 1e-6; its distance from exact clipping is the stated
  bound (``test_previous_norm_bound``).

Classic FSDP (``use_orig_params=True``) runs the whole grid; fully_shard sweeps the optimizers in the
step mode and the modes with Adam; DDP (its comm hook hands each averaged bucket to ``grad_ready``) every
mode with the class optimizers, and ``_FunctionalAdam`` in the step mode, all bitwise: its gradients are
replicated, so the norm is summed as ``clip_grad_norm_`` sums it. Compositions (exact clipping, Adam):
mixed precision (bf16 compute, fp32 reduce), CPU offload, activation checkpointing on both FSDPs, and HSDP
(a 2 x 1 mesh; on 4 ranks a 2 x 2 one, step and exact with Adam). Also: ShardedGradScaler on the three
front ends (inf on one rank: the step is skipped on both, no parameter touched, == the plain scaler path),
checkpoint save/resume through our checkpoint package on both FSDPs (bitwise, previous-norm clipping
resumed with the saved norm), and the errors that need ranks.
PyTorch has no oracle here (its optimizer-in-backward needs an accelerator with DDP and is unsupported
with FSDP).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed.optim import _FunctionalAdam
from tensorplay.distributed.optim.apply_optimizer_in_backward import InBackwardOptions, _apply_optimizer_in_backward
from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity._fsdp_models import MLPBlock, TinyLM, batch, loss_fn

STEPS = 2  # the second step is the first that "previous" clips with an earlier norm
MAX_NORM = 0.5  # below the gradients' norm, so every step clips
OPTIMIZERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {  # name: (in-backward class, plain class, kwargs)
    "sgd": (tp.optim.SGD, tp.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (tp.optim.Adam, tp.optim.Adam, {"lr": 0.01}),
    "adamw": (tp.optim.AdamW, tp.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "functional_adam": (_FunctionalAdam, tp.optim.Adam, {"lr": 0.01}),
}
MODES: dict[str, InBackwardOptions] = {
    "step": InBackwardOptions(),
    "no_sync": InBackwardOptions(),
    "accum2": InBackwardOptions(accumulation_steps=2),
    "exact": InBackwardOptions(max_norm=MAX_NORM, clip_mode="exact"),
    "previous": InBackwardOptions(max_norm=MAX_NORM, clip_mode="previous"),
}
#: A front end, or one composed with mixed precision (bf16 compute, fp32 reduce), CPU offload or activation
#: checkpointing; the compositions run the step and exact modes with Adam.
FRONT_ENDS = ("fully_shard", "classic", "ddp", *(f"{f}+{c}" for f in ("fully_shard", "classic")
                                                  for c in ("mp", "offload", "ac")), "fully_shard+hsdp")
BITWISE_MODES = ("step", "no_sync", "accum2")
SCALER_FRONT_ENDS = ("fully_shard", "classic", "ddp")
RESUME_FRONT_ENDS = ("fully_shard", "classic")


def _modes(front_end: str) -> list[str]:
    if "+" in front_end:
        return ["exact"]  # the kept-gradient path; "step" takes the same hand-out
    return list(MODES)


def _optims(front_end: str, mode: str) -> list[str]:
    """The whole grid on classic FSDP (cheap); fully_shard (about 10x the cost per run here) sweeps the
    optimizers in the step mode and the modes with Adam."""
    if "+" in front_end or (front_end == "fully_shard" and mode != "step"):
        return ["adam"]
    # DDP: the functional optimizer takes the same hand-out as the class ones; once is enough.
    return [o for o in OPTIMIZERS if front_end != "ddp" or mode == "step" or o != "functional_adam"]


def _apply(model: torch.nn.Module, front_end: str, optim: Any, kwargs: dict[str, Any],
           options: InBackwardOptions) -> None:
    """``apply_optimizer_in_backward`` on the wrapped model (DDP: then its hook, before the first forward)."""
    _apply_optimizer_in_backward(optim, model.parameters(), kwargs, options=options)
    if front_end == "ddp":
        from tensorplay.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
            _register_optim_in_backward_hook,
        )

        _register_optim_in_backward_hook(model)


# ---- the front ends ---------------------------------------------------------------------------------

def _wrap(front_end: str) -> torch.nn.Module:
    tp.manual_seed(0)
    model = TinyLM(blocks=2)
    front_end, _, composed = front_end.partition("+")
    if composed == "ac":
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]
    if front_end == "fully_shard":
        from tensorplay.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {}
        if composed == "mp":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if composed == "offload":
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        if composed == "hsdp":  # 2 replicas: of a 1-rank shard group on 2 ranks, of a 2-rank one on 4
            from tensorplay.distributed.device_mesh import init_device_mesh

            kwargs["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                              mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, **kwargs)
        return fully_shard(model, **kwargs)
    if front_end == "classic":
        from tensorplay.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {}
        if composed == "mp":
            extra["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if composed == "offload":
            extra["cpu_offload"] = CPUOffload(offload_params=True)
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({MLPBlock}), use_orig_params=True,
                                        device_id=torch.device("cpu"), **extra)
    return tp.nn.parallel.DistributedDataParallel(model)


def _no_sync(model: torch.nn.Module, front_end: str) -> Any:
    """The front end's switch for a micro-batch whose gradients are not reduced."""
    import contextlib

    if front_end.startswith("fully_shard"):
        @contextlib.contextmanager
        def off() -> Any:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]
        return off()
    return model.no_sync()  # type: ignore[operator]


def _total_norm(model: torch.nn.Module, front_end: str) -> torch.Tensor:
    """The global gradient norm as a user computes it (nothing clipped: max_norm is inf)."""
    if front_end.startswith("classic"):
        return model.clip_grad_norm_(math.inf)  # type: ignore[operator]
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _clip(model: torch.nn.Module, front_end: str, max_norm: float) -> None:
    if front_end.startswith("classic"):
        model.clip_grad_norm_(max_norm)  # type: ignore[operator]
    else:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)


def _scale_grads(model: torch.nn.Module, coefficient: torch.Tensor) -> None:
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).mul_(coefficient)


# ---- one training run ---------------------------------------------------------------------------------

def _micro_batches(mode: str) -> int:
    return 2 if mode in ("no_sync", "accum2") else 1


def _backward(model: torch.nn.Module, step: int, micro: int) -> float:
    tokens, targets = batch(step, dist.get_rank(), micro)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    return float(loss.detach())


def _run_micro_batches(model: torch.nn.Module, front_end: str, mode: str, step: int) -> None:
    for micro in range(_micro_batches(mode)):
        last = micro == _micro_batches(mode) - 1
        if mode == "no_sync" and not last:
            with _no_sync(model, front_end):
                _backward(model, step, micro)
        else:
            _backward(model, step, micro)


def train_in_backward(front_end: str, mode: str, optim: str) -> dict[str, Any]:
    in_backward_class, _, kwargs = OPTIMIZERS[optim]
    model = _wrap(front_end)
    _apply(model, front_end, in_backward_class, kwargs, MODES[mode])
    norms, coefficients = [], []
    grads_left = []
    for step in range(STEPS):
        _run_micro_batches(model, front_end, mode, step)
        group = next(iter(model.parameters()))._in_backward_groups[0]  # type: ignore[attr-defined]
        norms.append(None if group.last_norm is None else float(group.last_norm))
        coefficients.append(None if group.last_coefficient is None else float(group.last_coefficient))
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
    return {"params": _local_params(model), "norms": norms, "coefficients": coefficients, "grads_left": grads_left}


def train_after_backward(front_end: str, mode: str, optim: str) -> dict[str, Any]:
    _, plain_class, kwargs = OPTIMIZERS[optim]
    model = _wrap(front_end)
    optimizer = plain_class(model.parameters(), **kwargs)
    start = _local_params(model)
    previous: torch.Tensor | None = None
    for step in range(STEPS):
        _run_micro_batches(model, front_end, mode, step)
        if mode == "exact" or (mode == "previous" and previous is None):
            previous = _total_norm(model, front_end)
            _clip(model, front_end, MAX_NORM)
        elif mode == "previous":
            assert previous is not None
            coefficient = torch.clamp(MAX_NORM / (previous + 1e-6), max=1.0)
            previous = _total_norm(model, front_end)
            _scale_grads(model, coefficient)
        optimizer.step()
        optimizer.zero_grad()
    return {"params": _local_params(model), "start": start}


def _local_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def table_runs(checkpoint_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for front_end in FRONT_ENDS:
        for mode in _modes(front_end):
            for optim in _optims(front_end, mode):
                key = f"{front_end}/{mode}/{optim}"
                results[key] = {"ours": train_in_backward(front_end, mode, optim),
                                "plain": train_after_backward(front_end, mode, optim)}
    for front_end in SCALER_FRONT_ENDS:
        results[f"scaler/{front_end}"] = {"ours": _scaler_run(front_end, True), "plain": _scaler_run(front_end, False)}
    for front_end in RESUME_FRONT_ENDS:
        results[f"resume/{front_end}"] = _save_and_resume(front_end, f"{checkpoint_dir}/{front_end}")
    results["bound"] = _previous_vs_exact()
    results["errors"] = _distributed_errors()
    return results


# ---- checkpoint save / resume through our checkpoint package -------------------------------------------

def _save_and_resume(front_end: str, checkpoint_dir: str) -> dict[str, Any]:
    """AdamW in backward with previous-norm clipping: 2 steps, save, 1 step == load into a fresh model, 1 step.

    The third step clips with the second one's norm, saved with the optimizers: a resumed run that lost it
    would clip its first step exactly, and differ.
    """
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from tensorplay.distributed.optim import _get_in_backward_optimizers

    def fresh() -> torch.nn.Module:
        model = _wrap(front_end)
        _apply(model, front_end, tp.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, MODES["previous"])
        return model

    model = fresh()
    start = _local_params(model)
    for step in range(2):
        _backward(model, step, 0)
    model_sd, optim_sd = get_state_dict(model, _get_in_backward_optimizers(model))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    _backward(model, 2, 0)
    resumed = fresh()
    model_sd, optim_sd = get_state_dict(resumed, _get_in_backward_optimizers(resumed))
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(resumed, _get_in_backward_optimizers(resumed), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    _backward(resumed, 2, 0)
    return {"continued": _local_params(model), "resumed": _local_params(resumed), "start": start}


# ---- ShardedGradScaler: a step with inf on one rank is skipped on every rank ----------------------------

def _scaler_run(front_end: str, in_backward: bool) -> dict[str, Any]:
    """Adam, exact clipping, fp32 with a loss scale of 2**10; rank 0's loss is inf at step 1."""
    from tensorplay.distributed.fsdp import ShardedGradScaler

    model = _wrap(front_end)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    optimizer = None
    if in_backward:
        options = InBackwardOptions(max_norm=MAX_NORM, clip_mode="exact", grad_scaler=scaler)
        _apply(model, front_end, tp.optim.Adam, {"lr": 0.01}, options)
    else:
        optimizer = tp.optim.Adam(model.parameters(), lr=0.01)
    snapshots = []
    for step in range(3):  # skipped at step 1
        tokens, targets = batch(step, dist.get_rank(), 0)
        loss = loss_fn(model(tokens), targets)
        if step == 1 and dist.get_rank() == 0:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if optimizer is not None:
            scaler.unscale_(optimizer)
            _clip(model, front_end, MAX_NORM)
            scaler.step(optimizer)
            optimizer.zero_grad()
        scaler.update()
        snapshots.append(_local_params(model))
    skipped = None
    if in_backward:
        skipped = next(iter(model.parameters()))._in_backward_groups[0].skipped_steps  # type: ignore[attr-defined]
    return {"params": snapshots[-1], "snapshots": snapshots, "scale": float(scaler.get_scale()), "skipped": skipped,
            "grads_left": sum(p.grad is not None for p in model.parameters())}


# ---- previous-norm against exact clipping -------------------------------------------------------------

def _previous_vs_exact() -> dict[str, Any]:
    """Plain SGD (the update is -lr * c * g): the second step's parameters differ by lr * |c_prev - c| * ||g||."""
    runs = {}
    for mode in ("exact", "previous"):
        model = _wrap("fully_shard")
        _apply_optimizer_in_backward(tp.optim.SGD, model.parameters(), {"lr": 0.1}, options=MODES[mode])
        group = next(iter(model.parameters()))._in_backward_groups[0]  # type: ignore[attr-defined]
        _backward(model, 0, 0)
        first_coefficient = float(group.last_coefficient)
        _backward(model, 1, 0)
        local_sq = sum(float(p.to_local().detach().double().square().sum()) for p in model.parameters())
        runs[mode] = {"params": _local_params(model), "norm": float(group.last_norm),
                      "coefficient": float(group.last_coefficient), "first_coefficient": first_coefficient,
                      "local_sq": local_sq}
    diff_sq = torch.tensor(sum(float((a.double() - b.double()).square().sum())
                               for a, b in zip(runs["exact"]["params"], runs["previous"]["params"], strict=True)))
    dist.all_reduce(diff_sq)
    runs["distance"] = float(diff_sq.sqrt())
    return runs


# ---- bad input across ranks ---------------------------------------------------------------------------

def _distributed_errors() -> dict[str, Any]:
    errors = {}
    for front_end in ("fully_shard", "ddp"):
        model = _wrap(front_end)
        steps = 2 + dist.get_rank()  # rank 0 accumulates 2 micro-batches, rank 1 3
        _apply(model, front_end, tp.optim.SGD, {"lr": 0.1}, InBackwardOptions(accumulation_steps=steps))
        errors[f"accumulation_differs/{front_end}"] = error_of(_backward, model, 0, 0)
    return errors


HSDP_2X2_MODES = ("step", "exact")


def hsdp_2x2_runs() -> dict[str, Any]:
    """fully_shard on a 2 x 2 (replicate x shard) mesh: Adam in the step and exact modes (4 ranks)."""
    return {mode: {"ours": train_in_backward("fully_shard+hsdp", mode, "adam"),
                   "plain": train_after_backward("fully_shard+hsdp", mode, "adam")} for mode in HSDP_2X2_MODES}


@pytest.fixture(scope="module")
def per_rank_hsdp_2x2() -> list[dict[str, Any]]:
    return run_distributed(hsdp_2x2_runs, world_size=4)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(table_runs, str(tmp_path_factory.mktemp("in_backward_ckpt")), world_size=2)


def _cases() -> list[tuple[str, str, str]]:
    return [(f, m, o) for f in FRONT_ENDS for m in _modes(f) for o in _optims(f, m)]


@pytest.mark.parametrize(("front_end", "mode", "optim"), _cases(), ids=["/".join(c) for c in _cases()])
def test_in_backward_equals_step_after_backward(per_rank: list[dict[str, Any]], front_end: str, mode: str,
                                                optim: str) -> None:
    _assert_equal_runs([results[f"{front_end}/{mode}/{optim}"] for results in per_rank], mode,
                       bitwise=front_end == "ddp")  # DDP's norm: replicated gradients, summed locally


def _assert_equal_runs(runs: list[dict[str, Any]], mode: str, bitwise: bool = False) -> None:
    """Each rank's in-backward run == its after-backward run: bitwise, or to 1e-6 for a norm summed across
    ranks."""
    for rank, run in enumerate(runs):
        ours, plain = run["ours"]["params"], run["plain"]["params"]
        assert any(not torch.equal(a, b) for a, b in zip(plain, run["plain"]["start"], strict=True)), "no training"
        compare: Callable[[torch.Tensor, torch.Tensor], bool]
        if mode in BITWISE_MODES or bitwise:
            compare = torch.equal
        else:
            def compare(a: torch.Tensor, b: torch.Tensor) -> bool:
                return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
        for index, (a, b) in enumerate(zip(ours, plain, strict=True)):
            assert compare(a, b), (f"rank {rank}, parameter {index}: differs by "
                                   f"{(a - b).abs().max().item() if a.numel() else 0:.3g}")
        assert run["ours"]["grads_left"] == [0] * STEPS, "in-backward parameters keep .grad after backward"
        if mode in ("exact", "previous"):
            assert all(c is not None and c < 1.0 for c in run["ours"]["coefficients"]), "nothing was clipped"


@pytest.mark.parametrize("mode", HSDP_2X2_MODES)
def test_hsdp_2x2_in_backward_equals_step_after_backward(per_rank_hsdp_2x2: list[dict[str, Any]],
                                                         mode: str) -> None:
    _assert_equal_runs([results[mode] for results in per_rank_hsdp_2x2], mode)


@pytest.mark.parametrize("front_end", SCALER_FRONT_ENDS)
def test_sharded_grad_scaler_skips_inf_step_on_every_rank(per_rank: list[dict[str, Any]], front_end: str) -> None:
    for rank, results in enumerate(per_rank):
        ours, plain = results[f"scaler/{front_end}"]["ours"], results[f"scaler/{front_end}"]["plain"]
        assert ours["skipped"] == 1 and ours["grads_left"] == 0, f"rank {rank}"
        assert ours["scale"] == plain["scale"] == 2.0**9, "the scaler backed off once"
        for a, b in zip(ours["snapshots"][1], ours["snapshots"][0], strict=True):
            assert torch.equal(a, b), f"rank {rank}: the skipped step touched a parameter"
        assert any(not torch.equal(a, b) for a, b in zip(ours["snapshots"][2], ours["snapshots"][1], strict=True))
        for index, (a, b) in enumerate(zip(ours["params"], plain["params"], strict=True)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), f"rank {rank}, parameter {index}"


@pytest.mark.parametrize("front_end", RESUME_FRONT_ENDS)
def test_checkpoint_save_resume_continues_bitwise(per_rank: list[dict[str, Any]], front_end: str) -> None:
    for rank, results in enumerate(per_rank):
        run = results[f"resume/{front_end}"]
        assert any(not torch.equal(a, b) for a, b in zip(run["continued"], run["start"], strict=True)), "no training"
        for index, (a, b) in enumerate(zip(run["resumed"], run["continued"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}, parameter {index}: the resumed run differs"


def test_previous_norm_bound(per_rank: list[dict[str, Any]]) -> None:
    """Same first step (previous-norm's first step is exact); the second differs by exactly the stated bound."""
    for results in per_rank:
        bound = results["bound"]
        exact, previous = bound["exact"], bound["previous"]
        assert exact["first_coefficient"] == previous["first_coefficient"] < 1.0
        assert previous["norm"] == pytest.approx(exact["norm"], rel=1e-6)
        stated = 0.1 * abs(previous["first_coefficient"] - exact["coefficient"]) * exact["norm"]
        assert stated > 0, "the test needs the norm to change between steps"
        assert bound["distance"] <= stated * (1 + 1e-4) + 1e-7
        assert bound["distance"] >= stated * (1 - 1e-3), "SGD's update difference is exactly the bound"


@pytest.mark.parametrize("front_end", ["fully_shard", "ddp"])
def test_accumulation_steps_differ_across_ranks(per_rank: list[dict[str, Any]], front_end: str) -> None:
    for rank, results in enumerate(per_rank):
        kind, message = results["errors"][f"accumulation_differs/{front_end}"]
        assert kind == "ValueError", message
        assert "accumulation_steps differs across ranks" in message and f"rank {rank} has {2 + rank}" in message
        assert f"rank(s) [{1 - rank}] have [{3 - rank}]" in message
