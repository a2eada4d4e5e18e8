"""The fully_shard option grid: cases, the rank-side training run, the single-process reference, comparisons.

Every case trains the tiny transformer of ``_fsdp_models`` for a few Adam steps
and is checked twice: against a single-process model fed the concatenated
batch, and against PyTorch's ``torch.distributed.fsdp.fully_shard`` run the same
way. All cases of one (implementation, world size) run in one multi-rank call;
a case that raises returns its traceback instead of discarding the pool.

Tolerances: fp32 cases allclose(rtol=1e-4, atol=2e-5) on losses, first-step
gradients and parameters after the steps, against the reference and against
PyTorch (reductions are summed in another order than in one process). bf16
cases (bf16 parameters, fp32 reduction) are compared with a single-process
emulation that runs each rank's part on a bf16 copy of the parameters, averages
the fp32 gradients and steps fp32 masters: the first loss to 1e-5 (an fp32
forward is ~1e-3 off), first-step gradients to 4e-3 + 1.6e-2 relative (two bf16
ulps), later losses to 1e-2 and parameters to 2e-2 (Adam turns
ulp-sized differences of near-zero gradients into lr-sized ones).
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.common import FP32
from tests.parity._fsdp_models import TinyTransformer, build, loss_fn, parts_batch

LR = 1e-2
STEPS = 3
FP32_TOL = {"loss0": FP32, "losses": FP32, "grads": FP32, "params": FP32}
BF16_TOL = {"loss0": {"rtol": 0.0, "atol": 1e-5}, "losses": {"rtol": 0.0, "atol": 1e-2},
            "grads": {"rtol": 1.6e-2, "atol": 4e-3}, "params": {"rtol": 0.0, "atol": 2e-2}}


@dataclass(frozen=True)
class Case:
    world: int = 2
    nested: bool = True          # fully_shard each block, then the root
    raf: Any = None              # reshard_after_forward for the blocks (None: the default)
    prefetch: bool = False       # explicit forward/backward prefetch between blocks
    mp: bool = False             # bf16 params, fp32 reduce
    offload: str | None = None   # "pin": CPUOffloadPolicy(); "nopin": CPUOffloadPolicy(pin_memory=False)
    accum: bool = False          # two micro-batches, sync only on the last
    sync_each: bool = False      # with accum: reduce every micro-batch (sharded grads accumulate)
    hsdp: bool = False           # 2x2 mesh (replicate, shard)
    tie: bool = False            # tied embedding / head
    meta: bool = False           # built on meta, then to_empty + loaded
    clip: float | None = None    # clip_grad_norm_ max norm


CASES: dict[str, Case] = {
    "root_only": Case(nested=False),
    "nested": Case(),
    "raf_true": Case(raf=True),
    "raf_false": Case(raf=False),
    "prefetch": Case(prefetch=True),
    "mp_bf16": Case(mp=True),
    "offload": Case(offload="nopin"),
    "offload_mp": Case(offload="nopin", mp=True),
    "offload_accum": Case(offload="nopin", accum=True),
    "tied_mp": Case(tie=True, mp=True),
    "accum": Case(accum=True),
    "accum_synced": Case(accum=True, sync_each=True),
    "accum_mp": Case(accum=True, mp=True),
    "tied": Case(tie=True),
    "meta": Case(meta=True),
    "clip": Case(clip=0.05),
    "nested_w4": Case(world=4),
    "raf_int_w4": Case(world=4, raf=2),
    "raf_int_prefetch_w4": Case(world=4, raf=2, prefetch=True),
    "hsdp_w4": Case(world=4, hsdp=True),
    "hsdp_accum_mp_w4": Case(world=4, hsdp=True, accum=True, mp=True),
    "hsdp_clip_w4": Case(world=4, hsdp=True, clip=0.05),
    "meta_tied_w4": Case(world=4, meta=True, tie=True, raf=False),
    # One rank: every collective is local (see [Note: a group of one rank] in _comm/collectives.py).
    "one_rank": Case(world=1),
    "one_rank_mp_accum": Case(world=1, mp=True, accum=True),
}
# PyTorch's CPUOffloadPolicy() (pin_memory=True) fails on a CPU-only machine; ours must not:
# that case is compared with the single-process run only.
OURS_ONLY = {"offload_pinned": Case(offload="pin")}


def fsdp_api(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import tensorplay.distributed.fsdp as api
    return api


# ---------------------------------------------------------------- on the ranks

def _mesh(case: Case) -> Any:
    from tensorplay.distributed.device_mesh import init_device_mesh

    if case.hsdp:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _policies(api: Any, case: Case) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if case.mp:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case.offload == "pin":
        kwargs["offload_policy"] = api.CPUOffloadPolicy()
    elif case.offload == "nopin":
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    return kwargs


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict into a sharded model's local shards, in place."""
    from tensorplay.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                local = distribute_tensor(full[name], param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full[name])
        for name, buf in model.named_buffers():
            buf.copy_(full[name])


def describe(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Type, placements and local shape of each tensor (what the state-dict checks compare)."""
    from tensorplay.distributed.tensor import DTensor

    out = {}
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            out[name] = ("DTensor", tuple(str(p) for p in t.placements), tuple(t.to_local().shape), str(t.dtype))
        else:
            out[name] = (type(t).__name__, None, tuple(t.shape), str(t.dtype))
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    from tensorplay.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def global_mean(loss: torch.Tensor) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def shard_model(api: Any, case: Case) -> torch.nn.Module:
    """Build (on meta if asked) and fully_shard the tiny transformer as the case says."""
    if case.meta:
        with torch.device("meta"):
            model = build(tie=case.tie)
    else:
        model = build(tie=case.tie)
    mesh = _mesh(case)
    policies = _policies(api, case)
    if case.nested:
        for layer in model.layers:
            api.fully_shard(layer, mesh=mesh, reshard_after_forward=case.raf, **policies)
    api.fully_shard(model, mesh=mesh, **policies)
    if case.meta:
        model.to_empty(device="cpu")
        load_full(model, build(tie=case.tie).state_dict())
    if case.prefetch:
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return model


def train_case(api: Any, case: Case) -> dict[str, Any]:
    rank = dist.get_rank()
    model = shard_model(api, case)
    info = {
        "is_fsdp": [isinstance(m, api.FSDPModule) for m in (model, *model.layers)],
        "is_orig": isinstance(model, TinyTransformer),
        "state_dict": describe(model.state_dict()),
    }
    opt = tp.optim.Adam(model.parameters(), lr=LR)
    micros = 2 if case.accum else 1
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(micros):
            if case.accum and not case.sync_each:
                model.set_requires_gradient_sync(micro == micros - 1)
            x, y = parts_batch(step, [rank], micro)
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(global_mean(loss))
        if case.clip is not None:
            norms.append(full_tensor(tp.nn.utils.clip_grad_norm_(model.parameters(), case.clip)).item())
        info["grads"] = describe({n: p.grad for n, p in model.named_parameters()})
        if step == 0:
            info["grads0"] = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    info.update(losses=losses, norms=norms, params={n: full_tensor(p) for n, p in model.named_parameters()})
    return info


def run_cases(impl: str, cases: dict[str, dict]) -> dict[str, Any]:
    api = fsdp_api(impl)
    out: dict[str, Any] = {}
    for name, fields in cases.items():
        try:
            out[name] = train_case(api, Case(**fields))
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out if dist.get_rank() == 0 else {}


# ---------------------------------------------------------------- in the test process

def reference(case: Case, steps: int = STEPS) -> dict[str, Any]:
    """One process, the concatenated batch of all ranks (bf16 cases: per-part bf16 copies, fp32 masters)."""
    model = build(tie=case.tie)
    opt = tp.optim.Adam(model.parameters(), lr=LR)
    parts = list(range(case.world))
    losses, norms = [], []
    for step in range(steps):
        for micro in range(2 if case.accum else 1):
            if case.mp:
                losses.append(_bf16_backward(model, step, parts, micro))
            else:
                x, y = parts_batch(step, parts, micro)
                loss = loss_fn(model(x), y)
                loss.backward()
                losses.append(loss.item())
        if case.clip is not None:
            norms.append(tp.nn.utils.clip_grad_norm_(model.parameters(), case.clip).item())
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "grads0": grads0,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "keys": sorted(model.state_dict())}


def _bf16_backward(model: torch.nn.Module, step: int, parts: list[int], micro: int) -> float:
    total = 0.0
    for part in parts:
        low = copy.deepcopy(model)
        for q in low.parameters():  # parameters only: fully_shard leaves buffers in fp32
            q.data = q.data.to(torch.bfloat16)
        x, y = parts_batch(step, [part], micro)
        loss = loss_fn(low(x), y)
        loss.backward()
        total += loss.item()
        for p, q in zip(model.parameters(), low.parameters(), strict=True):
            g = q.grad.float() / len(parts)
            p.grad = g if p.grad is None else p.grad + g
    return total / len(parts)


_RESULTS: dict[tuple[str, int], dict[str, Any]] = {}
_REFS: dict[str, dict[str, Any]] = {}


def results(impl: str, world: int) -> dict[str, Any]:
    if (impl, world) not in _RESULTS:
        cases = {**CASES, **(OURS_ONLY if impl == "ours" else {})}
        chosen = {name: asdict(c) for name, c in cases.items() if c.world == world}
        _RESULTS[impl, world] = run_distributed(run_cases, impl, chosen, world_size=world, timeout=300)[0]
    return _RESULTS[impl, world]


def ref(name: str) -> dict[str, Any]:
    if name not in _REFS:
        _REFS[name] = reference({**CASES, **OURS_ONLY}[name])
    return _REFS[name]


def case_result(impl: str, name: str) -> dict[str, Any]:
    case = {**CASES, **OURS_ONLY}[name]
    got = results(impl, case.world)[name]
    assert "error" not in got, f"{impl} failed on case {name}:\n{got['error']}"
    return got


def assert_same_training(got: dict, want: dict, tol: dict, what: str) -> None:
    def close(a: Any, b: Any, kind: str, label: str) -> None:
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), **tol[kind],
                                   msg=lambda m: f"{what}: {label} differ\n{m}")

    close(got["losses"][0], want["losses"][0], "loss0", "first losses")
    close(got["losses"], want["losses"], "losses", "losses")
    close(got["norms"], want["norms"], "losses", "clip_grad_norm_ totals")
    assert sorted(got["params"]) == sorted(want["params"]), f"{what}: parameter names differ"
    for fqn in want["params"]:
        close(got["grads0"][fqn], want["grads0"][fqn], "grads", f"first-step gradients of {fqn}")
        close(got["params"][fqn], want["params"][fqn], "params", f"parameters {fqn}")


def tol(name: str) -> dict:
    return BF16_TOL if {**CASES, **OURS_ONLY}[name].mp else FP32_TOL
