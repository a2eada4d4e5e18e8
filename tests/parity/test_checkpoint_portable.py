"""Training state saved under one strategy resumes under another, at another world size.

Savers (2 ranks): DDP, ZeRO, classic FullyShardedDataParallel, fully_shard and
HSDP (fully_shard on a 2x1 replicate x shard mesh) each train ``SAVED_AT`` Adam
steps and save model + optimizer through ``tensorplay.distributed.checkpoint``
(``get_state_dict`` + ``save``), with a ShardedGradScaler and a model averager
as ``Stateful`` entries. Loaders (single process at 1 rank; DDP at 2; ZeRO,
classic FSDP, fully_shard and HSDP at 2 and 3 ranks) build a differently seeded
model and a fresh scaler and averager, ``load`` + ``set_state_dict``, and train
``MORE`` steps on the same global batches; the scaler and the averager's step
come back as saved. Every combination must equal one
uninterrupted single-process run (fp32, rtol 1e-4 / atol 1e-5: the ranks' mean
of gradients is summed in another order). ZeRO's checkpoint holds each rank's own
parameters' state (saved without any gather).
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

SAVED_AT, MORE, LR, ROWS = 2, 3, 1e-2, 12
TOL = {"rtol": 1e-4, "atol": 1e-5}
SAVERS = ("ddp", "zero", "classic", "fully_shard", "hsdp")
LOADERS = {1: ("single",), 2: ("ddp", "zero", "classic", "fully_shard", "hsdp"),
           3: ("zero", "classic", "fully_shard", "hsdp")}
#: What the saved scaler and averager hold (a fresh one holds the defaults).
SCALER_STATE = {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3,
                "_growth_tracker": 2}


def _model(seed: int) -> torch.nn.Module:
    tp.manual_seed(seed)
    return tp.nn.Sequential(tp.nn.Linear(6, 10), tp.nn.Tanh(), tp.nn.Linear(10, 5), tp.nn.Tanh(), tp.nn.Linear(5, 3))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = tp.randn(ROWS, 6, generator=g), tp.randn(ROWS, 3, generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    for step in steps:
        x, y = _batch(step, rank, world)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _build(strategy: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    if strategy == "single":
        return model, tp.optim.Adam(model.parameters(), lr=LR)
    if strategy in ("ddp", "zero"):
        ddp = tp.nn.parallel.DistributedDataParallel(model)
        if strategy == "ddp":
            return ddp, tp.optim.Adam(ddp.parameters(), lr=LR)
        from tensorplay.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), tp.optim.Adam, lr=LR)
    if strategy == "classic":
        from tensorplay.distributed.fsdp import FullyShardedDataParallel

        fsdp = FullyShardedDataParallel(model)
        return fsdp, tp.optim.Adam(fsdp.parameters(), lr=LR)
    from tensorplay.distributed.fsdp import fully_shard

    mesh = None
    if strategy == "hsdp":
        from tensorplay.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return model, tp.optim.Adam(model.parameters(), lr=LR)


def _extras(saved: bool) -> dict[str, Any]:
    """A ShardedGradScaler and a PeriodicModelAverager: as saved (non-default state) or fresh."""
    from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler, averager = ShardedGradScaler(device="cpu"), PeriodicModelAverager(period=2, warmup_steps=1)
    scaler.scale(torch.ones(1))  # makes the scale tensor, so load_state_dict fills it
    if saved:
        scaler.load_state_dict(dict(SCALER_STATE))
        averager.step = SAVED_AT
    return {"scaler": scaler, "averager": averager}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from tensorplay.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from tensorplay.distributed.tensor import DTensor

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def save_all(root: str) -> dict[str, Any]:
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    try:
        for strategy in SAVERS:
            model, opt = _build(strategy, seed=0)
            _train(model, opt, range(SAVED_AT), dist.get_rank(), dist.get_world_size())
            model_sd, optim_sd = get_state_dict(model, opt)
            out[f"{strategy}_optim_fqns"] = sorted(optim_sd["state"])
            dcp.save({"model": model_sd, "optim": optim_sd, **_extras(saved=True)},
                     checkpoint_id=f"{root}/{strategy}")
        return out
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def resume_all(root: str) -> dict[str, Any]:
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_state_dict,
    )

    warnings.simplefilter("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for saver in SAVERS:
        for loader in LOADERS[world]:
            try:
                model, opt = _build(loader, seed=7)
                model_sd, optim_sd = get_state_dict(model, opt)  # templates of this rank's shapes
                extras = _extras(saved=False)
                state = {"model": model_sd, "optim": optim_sd, **extras}
                dcp.load(state, checkpoint_id=f"{root}/{saver}")
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                _train(model, opt, range(SAVED_AT, SAVED_AT + MORE), rank, world)
                out[f"{saver}->{loader}@{world}"] = _full_params(model)
                out[f"{saver}->{loader}@{world} extras"] = (extras["scaler"].state_dict(),
                                                            extras["averager"].state_dict())
            except Exception:  # noqa: BLE001 - reported by the test
                out[f"{saver}->{loader}@{world}"] = traceback.format_exc()
    return out


def _reference() -> dict[str, torch.Tensor]:
    model = _model(seed=0)
    opt = tp.optim.Adam(model.parameters(), lr=LR)
    _train(model, opt, range(SAVED_AT + MORE), 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("portable"))
    saved = run_distributed(save_all, root, world_size=2, timeout=600)
    for rank, got in enumerate(saved):
        assert "error" not in got, f"save on rank {rank}:\n{got['error']}"
    out: dict[str, Any] = {"saved": saved}
    for world in LOADERS:
        out.update(run_distributed(resume_all, root, world_size=world, timeout=600)[0])
    return out


@pytest.mark.parametrize("combo", [f"{s}->{lo}@{w}" for s in SAVERS for w, loaders in LOADERS.items()
                                   for lo in loaders])
def test_resume_under_another_strategy_equals_an_uninterrupted_run(resumed, combo):
    got = resumed[combo]
    assert isinstance(got, dict), f"{combo} failed:\n{got}"
    assert resumed[f"{combo} extras"] == (SCALER_STATE, {"step": SAVED_AT}), combo
    want = _reference()
    assert sorted(got) == sorted(want)
    for fqn, value in want.items():
        torch.testing.assert_close(got[fqn], value, **TOL, msg=lambda m, fqn=fqn: f"{combo}: {fqn}\n{m}")


def test_zero_saves_each_ranks_own_state_without_gathering(resumed):
    """Each rank's ZeRO optimizer state dict holds only the FQNs it owns; together, all of them once."""
    per_rank = [set(r["zero_optim_fqns"]) for r in resumed["saved"]]
    assert all(per_rank) and not set.intersection(*per_rank)
    assert set.union(*per_rank) == {n for n, _ in _model(0).named_parameters()}


# ---- Muon and Adafactor (ShardedMatrixOptimizer): saved at 2 ranks, resumed at 1 and 3 ---------------------

MATRIX_OPTIMS = {"muon": ("Muon", False), "adafactor": ("Adafactor", True)}   # (optimizer, biases: 1-D state)
MATRIX_SAVERS = ("classic", "fully_shard")
MATRIX_LOADERS = {1: ("single",), 3: ("classic", "fully_shard")}


def _matrix_build(optim: str, strategy: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model whose every parameter one ShardedMatrixOptimizer updates (Muon: bias-free, all matrices)."""
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    name, bias = MATRIX_OPTIMS[optim]
    tp.manual_seed(seed)
    model: torch.nn.Module = tp.nn.Sequential(tp.nn.Linear(6, 10, bias=bias), tp.nn.Tanh(),
                                              tp.nn.Linear(10, 3, bias=bias))
    module = None
    if strategy == "classic":
        from tensorplay.distributed.fsdp import FullyShardedDataParallel

        model = module = FullyShardedDataParallel(model, use_orig_params=True)
    elif strategy == "fully_shard":
        from tensorplay.distributed.fsdp import fully_shard

        fully_shard(model)
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    return model, ShardedMatrixOptimizer(getattr(torch.optim, name), named, module=module, lr=LR)


def matrix_save_all(root: str) -> dict[str, Any]:
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict

    warnings.simplefilter("ignore")
    try:
        for optim in MATRIX_OPTIMS:
            for strategy in MATRIX_SAVERS:
                model, opt = _matrix_build(optim, strategy, seed=0)
                _train(model, opt, range(SAVED_AT), dist.get_rank(), dist.get_world_size())
                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{optim}_{strategy}")
        return {}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def matrix_resume_all(root: str) -> dict[str, Any]:
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.simplefilter("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for optim in MATRIX_OPTIMS:
        for saver in MATRIX_SAVERS:
            for loader in MATRIX_LOADERS[world]:
                combo = f"{optim}:{saver}->{loader}@{world}"
                try:
                    model, opt = _matrix_build(optim, loader, seed=7)
                    model_sd, optim_sd = get_state_dict(model, opt)
                    state = {"model": model_sd, "optim": optim_sd}
                    dcp.load(state, checkpoint_id=f"{root}/{optim}_{saver}")
                    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                    _train(model, opt, range(SAVED_AT, SAVED_AT + MORE), rank, world)
                    out[combo] = _full_params(model)
                except Exception:  # noqa: BLE001 - reported by the test
                    out[combo] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def matrix_resumed(tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("portable_matrix"))
    for rank, got in enumerate(run_distributed(matrix_save_all, root, world_size=2, timeout=600)):
        assert "error" not in got, f"save on rank {rank}:\n{got['error']}"
    out: dict[str, Any] = {}
    for world in MATRIX_LOADERS:
        out.update(run_distributed(matrix_resume_all, root, world_size=world, timeout=600)[0])
    return out


@pytest.mark.parametrize("combo", [f"{o}:{s}->{lo}@{w}" for o in MATRIX_OPTIMS for s in MATRIX_SAVERS
                                   for w, loaders in MATRIX_LOADERS.items() for lo in loaders])
def test_muon_and_adafactor_resume_under_another_strategy(matrix_resumed, combo):
    got = matrix_resumed[combo]
    assert isinstance(got, dict), f"{combo} failed:\n{got}"
    model, opt = _matrix_build(combo.split(":")[0], "single", seed=0)
    _train(model, opt, range(SAVED_AT + MORE), 0, 1)
    want = {k: v.detach() for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(want)
    for fqn, value in want.items():
        torch.testing.assert_close(got[fqn], value, **TOL, msg=lambda m, fqn=fqn: f"{combo}: {fqn}\n{m}")
