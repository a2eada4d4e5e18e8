"""Muon and Adafactor on sharded parameters train as in one process (ShardedMatrixOptimizer; ZeRO).

Each front end (fully_shard 1-D, HSDP, fully_shard over tensor parallelism on a 2-D mesh, classic FSDP
with ``use_orig_params=True``, ZeRO with ``optimizer_class=``) trains a small MLP with uneven shards for
``STEPS`` steps: ``torch.optim.Muon`` / ``torch.optim.Adafactor`` on the weight matrices (Adafactor also
on 1-D biases in some cases) and Adam on the rest, as Muon users do. Every rank also trains the same
model in one process on the global batch; the full parameters must be allclose (fp32). The Newton-Schulz
calls are counted per rank: each matrix's runs once in the world per step.

PyTorch's usual construction (``torch.optim.Muon(model.parameters())`` on fully_shard's DTensors) is the
negative control: it moves the parameters away from the one-process run, on PyTorch's fully_shard and on ours
alike (no global optimizer hook of ours catches it).
"""

from __future__ import annotations

from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.common import FP32, error_of

STEPS, ROWS, LR = 5, 12, 0.02

MUON_SWEEP: dict[str, dict[str, Any]] = {
    "muon": {},
    "muon_plain_momentum": {"nesterov": False, "momentum": 0.9},
    "muon_rms_adamw": {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.1},
    "muon_original_ns3": {"adjust_lr_fn": "original", "ns_steps": 3, "weight_decay": 0.0},
}
ADAFACTOR_SWEEP: dict[str, dict[str, Any]] = {
    "adafactor": {},
    "adafactor_beta2_eps": {"beta2_decay": -0.5, "eps": (1e-6, 1e-2)},
    "adafactor_maximize_wd_d": {"maximize": True, "weight_decay": 0.01, "d": 2.0},
}


def _model(hidden: int) -> torch.nn.Module:
    tp.manual_seed(0)
    return tp.nn.Sequential(tp.nn.Linear(7, hidden), tp.nn.Tanh(), tp.nn.Linear(hidden, 11), tp.nn.Tanh(),
                            tp.nn.Linear(11, 5, bias=False))


def _batch(step: int, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 5, generator=g)
    return x.chunk(parts)[part], y.chunk(parts)[part]


def _is_matrix(name: str, case: dict) -> bool:
    """Whether the whole-matrix optimizer takes ``name`` (Adafactor's ``vectors`` case takes the biases too)."""
    return name.endswith("weight") or case.get("vectors", False)


def _optimizers(model: torch.nn.Module, case: dict, wrapped: bool, module: Any = None) -> list[Any]:
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    cls = getattr(torch.optim, case["optim"])
    kwargs = {"lr": LR, **case["kwargs"]}
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    matrices = [(n, p) for n, p in named if _is_matrix(n, case)]
    rest = [p for n, p in named if not _is_matrix(n, case)]
    if case["front"] == "zero":
        from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        first = ZeroRedundancyOptimizer([p for _, p in matrices], optimizer_class=cls, **kwargs)
    elif wrapped:
        first = ShardedMatrixOptimizer(cls, matrices, module=module, **kwargs)
    else:  # PyTorch's usual construction (named, so that its errors can name the parameter)
        first = cls(matrices if case["front"] == "usual" else [p for _, p in matrices], **kwargs)
    return [first, torch.optim.Adam(rest, lr=1e-2)] if rest else [first]


def _train(model: torch.nn.Module, optimizers: list[Any], part: int, parts: int) -> None:
    for step in range(STEPS):
        x, y = _batch(step, part, parts)
        (model(x) - y).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _shard(model: torch.nn.Module, front: str) -> tuple[torch.nn.Module, Any, int, int]:
    """``(model, module for the wrapper, data part, data parts)`` under ``front``."""
    from tensorplay.distributed.device_mesh import init_device_mesh
    from tensorplay.distributed.fsdp import FullyShardedDataParallel, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    if front in ("fully_shard", "usual"):
        fully_shard(model[0])
        fully_shard(model)
    elif front == "torch_fully_shard":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        torch_fully_shard(model[0])
        torch_fully_shard(model)
    elif front == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif front == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, None, rank // 2, world // 2
    elif front == "classic":
        model = FullyShardedDataParallel(model, use_orig_params=True)
        return model, model, rank, world
    elif front == "zero":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, None, rank, world


def _full_params(model: torch.nn.Module, front: str) -> dict[str, torch.Tensor]:
    if front == "classic":
        from tensorplay.distributed.fsdp import FullyShardedDataParallel
        with FullyShardedDataParallel.summon_full_params(model):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


class NewtonSchulzCount:
    """Count Muon's Newton-Schulz calls (and the shapes) while active, by patching the module's function."""

    def __enter__(self) -> list[tuple[int, ...]]:
        import torch.optim._muon as muon
        self.original, self.shapes = muon._zeropower_via_newtonschulz, []

        def counted(grad: torch.Tensor, *args: Any) -> torch.Tensor:
            self.shapes.append(tuple(grad.shape))
            return self.original(grad, *args)

        muon._zeropower_via_newtonschulz = counted
        return self.shapes

    def __exit__(self, *exc: object) -> None:
        import torch.optim._muon as muon
        muon._zeropower_via_newtonschulz = self.original


def run_case(case: dict) -> dict[str, Any]:
    """One case on this rank: the max |difference| per parameter from one-process training, the NS calls."""
    hidden = 14 if case["front"] == "tp" else 13   # TP needs even column splits; 13 rows are uneven elsewhere
    reference = _model(hidden)
    _train(reference, _optimizers(reference, case, wrapped=False), 0, 1)
    model, module, part, parts = _shard(_model(hidden), case["front"])
    wrapped = case["front"] not in ("usual", "torch_fully_shard")
    with NewtonSchulzCount() as shapes:
        error = error_of(_train, model, _optimizers(model, case, wrapped, module=module), part, parts)
    if error is not None:
        return {"error": error}
    got, want = _full_params(model, case["front"]), _full_params(reference, "single")
    within = all(torch.allclose(got[n], want[n], **FP32) for n in want)
    return {"diff": {n: (got[n] - want[n]).abs().max().item() for n in want}, "within": within,
            "ns_shapes": shapes}


def run_cases(cases: dict[str, dict]) -> dict[str, dict]:
    return {name: run_case(case) for name, case in cases.items()}


def _cases(front: str, sweep: dict[str, dict], optim: str, **extra: Any) -> dict[str, dict]:
    return {f"{front}/{name}": {"front": front, "optim": optim, "kwargs": kwargs, **extra}
            for name, kwargs in sweep.items()}


def _first(sweep: dict[str, dict]) -> dict[str, dict]:
    return dict(list(sweep.items())[:1])


MATRICES = 3   # the MLP's weight matrices


def _check(results: list[dict[str, dict]], cases: dict[str, dict]) -> None:
    for name, case in cases.items():
        per_rank = [rank_results[name] for rank_results in results]
        assert "error" not in per_rank[0], f"{name}: {per_rank[0]['error']}"
        assert per_rank[0]["within"], f"{name}: differs from one-process training: {per_rank[0]['diff']}"
        if case["optim"] == "Muon":
            calls = sum(len(r["ns_shapes"]) for r in per_rank)
            # Under TP the last layer is not tensor-parallel: each TP rank's data-parallel group updates a replica.
            per_step = MATRICES + 1 if case["front"] == "tp" else MATRICES
            assert calls == per_step * STEPS, f"{name}: {calls} Newton-Schulz calls in the world, " \
                                              f"want {per_step} per step (one per matrix)"


def test_two_ranks_every_front_end_and_argument() -> None:
    cases = {**_cases("fully_shard", MUON_SWEEP, "Muon"), **_cases("fully_shard", ADAFACTOR_SWEEP, "Adafactor"),
             **_cases("fully_shard", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True),
             **_cases("classic", _first(MUON_SWEEP), "Muon"),
             **_cases("classic", ADAFACTOR_SWEEP, "Adafactor", vectors=True),
             **_cases("zero", _first(MUON_SWEEP), "Muon"), **_cases("zero", _first(ADAFACTOR_SWEEP), "Adafactor")}
    _check(run_distributed(run_cases, cases, world_size=2), cases)


def test_one_and_three_ranks() -> None:
    three = {**_cases("fully_shard", _first(MUON_SWEEP), "Muon"), **_cases("classic", _first(MUON_SWEEP), "Muon"),
             **_cases("classic", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True),
             **_cases("fully_shard", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True)}
    _check(run_distributed(run_cases, three, world_size=3), three)
    one = {**_cases("fully_shard", _first(MUON_SWEEP), "Muon"), **_cases("classic", _first(MUON_SWEEP), "Muon"),
           **_cases("plain", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True),
           **_cases("fully_shard", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True)}
    _check(run_distributed(run_cases, one, world_size=1), one)


def test_four_ranks_hsdp_and_tensor_parallel() -> None:
    cases = {**_cases("fully_shard", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True),
             **_cases("hsdp", _first(MUON_SWEEP), "Muon"), **_cases("tp", _first(MUON_SWEEP), "Muon"),
             **_cases("hsdp", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True),
             **_cases("tp", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True),
             **_cases("classic", _first(MUON_SWEEP), "Muon"),
             **_cases("classic", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True)}
    _check(run_distributed(run_cases, cases, world_size=4), cases)


def test_usual_construction_is_as_wrong_as_pytorchs() -> None:
    """``torch.optim.Muon`` / ``Adafactor`` built the usual way on our fully_shard's DTensors do what they do on
    PyTorch's fully_shard (Muon drifts from the one-process run, Adafactor fails): no global optimizer hook of ours
    runs in them, so behaviour cannot depend on what was imported (ShardedMatrixOptimizer is the way)."""
    cases = {**_cases("torch_fully_shard", _first(MUON_SWEEP), "Muon"), **_cases("usual", _first(MUON_SWEEP), "Muon"),
             **_cases("torch_fully_shard", _first(ADAFACTOR_SWEEP), "Adafactor"),
             **_cases("usual", _first(ADAFACTOR_SWEEP), "Adafactor")}
    for rank_results in run_distributed(run_cases, cases, world_size=2):
        control, ours = rank_results["torch_fully_shard/muon"], rank_results["usual/muon"]
        assert not control["within"] and max(control["diff"].values()) > 1e-3, control
        assert ours["diff"] == control["diff"], (ours, control)
        control, ours = rank_results["torch_fully_shard/adafactor"], rank_results["usual/adafactor"]
        assert ours.get("error") == control.get("error") and ours.get("diff") == control.get("diff"), (ours, control)


def test_refuses_what_muon_refuses_naming_the_parameter() -> None:
    for rank_results in run_distributed(refusals, world_size=2):
        muon_own, ours, classic_hint, adafactor_hint = rank_results
        assert ours[0] == "ValueError" and ours[1].startswith(muon_own[1]), (ours, muon_own)
        assert "'0.bias'" in ours[1], ours
        assert "module=" in classic_hint[1] and "'0.weight'" in classic_hint[1], classic_hint
        assert adafactor_hint[0] == "ValueError" and "module=" in adafactor_hint[1], adafactor_hint


def refusals() -> list[tuple[str, str] | None]:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    model = _model(13)
    fully_shard(model)
    classic = FullyShardedDataParallel(_model(13), use_orig_params=True)
    bias = model[0].bias
    return [error_of(torch.optim.Muon, [torch.zeros(bias.shape)]),
            error_of(ShardedMatrixOptimizer, torch.optim.Muon, list(model.named_parameters())[:2]),
            error_of(ShardedMatrixOptimizer, torch.optim.Muon,
                     [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in classic.named_parameters()]),
            error_of(ShardedMatrixOptimizer, torch.optim.Adafactor, list(classic.named_parameters()))]


# ---- state dicts: saved at 2 ranks through our checkpoint package, resumed at 1 and 4 -----------------

SAVED_AT = 2


def _sharded_training(case: dict, seed: int) -> tuple[torch.nn.Module, list[Any]]:
    model, module, _, _ = _shard(_model(13), case["front"])
    if seed:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(float(seed))   # a different start: everything must come from the checkpoint
    return model, _optimizers(model, case, wrapped=True, module=module)


def _train_steps(model: torch.nn.Module, optimizers: list[Any], steps: range) -> None:
    for step in steps:
        x, y = _batch(step, dist.get_rank(), dist.get_world_size())
        (model(x) - y).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def save_case(case: dict, path: str) -> None:
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict

    model, optimizers = _sharded_training(case, 0)
    _train_steps(model, optimizers, range(SAVED_AT))
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def resume_case(case: dict, path: str) -> bool:
    """Load the checkpoint into a differently started model, train the rest; allclose to one process?"""
    import tensorplay.distributed.checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizers = _sharded_training(case, 1)
    model_sd, optim_sd = get_state_dict(model, optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _trains_on_as_one_process(model, optimizers, case)


def _trains_on_as_one_process(model: torch.nn.Module, optimizers: list[Any], case: dict) -> bool:
    """Train the steps after ``SAVED_AT``; allclose to training in one process from the start?"""
    _train_steps(model, optimizers, range(SAVED_AT, STEPS))
    reference = _model(13)
    _train(reference, _optimizers(reference, case, wrapped=False), 0, 1)
    got, want = _full_params(model, case["front"]), _full_params(reference, "single")
    return all(torch.allclose(got[n], want[n], **FP32) for n in want)


def save_then_resume_elsewhere(cases: dict[str, dict], root: str) -> dict[str, bool]:
    """On 2 ranks: save every case (resumed by the other world sizes' calls)."""
    for name, case in cases.items():
        save_case(case, f"{root}/{name}")
    return {}


def resume_all(cases: dict[str, dict], root: str) -> dict[str, bool]:
    return {name: resume_case(case, f"{root}/{name}") for name, case in cases.items()}


def test_state_dicts_resume_at_other_world_sizes(tmp_path: Any) -> None:
    cases = {**_cases("fully_shard", _first(MUON_SWEEP), "Muon"),
             **_cases("fully_shard", _first(ADAFACTOR_SWEEP), "Adafactor", vectors=True)}
    cases = {name.replace("/", "_"): case for name, case in cases.items()}
    run_distributed(save_then_resume_elsewhere, cases, str(tmp_path), world_size=2)
    for world in (1, 4):   # at 4 ranks one rank owns none of Muon's 3 matrices
        for rank_results in run_distributed(resume_all, cases, str(tmp_path), world_size=world):
            assert all(rank_results.values()), f"{world} ranks: {rank_results}"


# ---- full (unsharded) state dicts of Muon: every matrix's momentum on rank 0, sent by its owner -----------

FULL = {"full_state_dict": True}


def save_full_case(case: dict, path: str) -> dict[str, Any]:
    """Train, then take the full state dicts (with and without ``cpu_offload``); rank 0 saves the offloaded ones.

    One optimizer per call (classic FSDP takes one). Returns this rank's owned momentum by FQN, Muon's
    momentum in its full optimizer state dict and in the offloaded one, and rank 1's error loading its ``{}``.
    """
    from tensorplay.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizers = _sharded_training(case, 0)
    _train_steps(model, optimizers, range(SAVED_AT))
    muon, offload = optimizers[0], StateDictOptions(**FULL, cpu_offload=True)
    fqns = get_optimizer_state_dict(model, muon)["param_groups"][0]["params"]
    owned = {fqn: muon.state[p]["momentum_buffer"].clone()
             for fqn, p in zip(fqns, muon.param_groups[0]["params"], strict=True) if muon.state[p]}
    full = get_optimizer_state_dict(model, muon, options=StateDictOptions(**FULL))
    offloaded = [get_optimizer_state_dict(model, optimizer, options=offload) for optimizer in optimizers]
    model_sd = get_model_state_dict(model, options=offload)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optims": offloaded}, path)
    dist.barrier()
    refused = None   # rank 1's {} from cpu_offload is no state dict to load: an error
    if dist.get_rank() == 1:
        refused = error_of(set_optimizer_state_dict, model, muon, offloaded[0], options=StateDictOptions(**FULL))
    return {"owned": owned, "full": _momentum(full), "offloaded": _momentum(offloaded[0]), "refused": refused}


def _momentum(optim_sd: dict[str, Any]) -> dict[str, Any]:
    return {fqn: state.get("momentum_buffer") for fqn, state in optim_sd.get("state", {}).items()}


def resume_full_case(case: dict, path: str) -> bool:
    """Load rank 0's full state dicts (``weights_only``) into a differently started model on every rank, train on."""
    from tensorplay.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizers = _sharded_training(case, 1)
    saved = torch.load(path, weights_only=True)
    set_model_state_dict(model, saved["model"], options=StateDictOptions(**FULL))
    for optimizer, optim_sd in zip(optimizers, saved["optims"], strict=True):
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(**FULL))
    muon, rank = optimizers[0], dist.get_rank()
    on_owners = all(bool(muon.state[p]) == (muon.owner_of(p) in (None, rank)) for p in muon.param_groups[0]["params"])
    return on_owners and _trains_on_as_one_process(model, optimizers, case)


def test_full_state_dicts_of_muon_hold_every_matrix_and_resume(tmp_path: Any) -> None:
    cases = {**_cases("fully_shard", _first(MUON_SWEEP), "Muon"), **_cases("classic", _first(MUON_SWEEP), "Muon")}
    for name, case in cases.items():
        path = str(tmp_path / name.replace("/", "_"))
        saved = run_distributed(save_full_case, case, path, world_size=2)
        owners = {fqn: value for rank_results in saved for fqn, value in rank_results["owned"].items()}
        assert len(owners) == MATRICES and all(rank_results["owned"] for rank_results in saved), saved
        for rank, rank_results in enumerate(saved):
            full = rank_results["full"]   # every rank: every matrix's momentum, equal to its owner's
            assert full.keys() == owners.keys() and all(torch.equal(full[f], owners[f]) for f in owners), (name, rank)
        offloaded = saved[0]["offloaded"]   # cpu_offload: rank 0 keeps it (on CPU), as PyTorch's helper does
        assert offloaded.keys() == owners.keys() and all(torch.equal(offloaded[f], owners[f]) for f in owners), name
        assert saved[1]["offloaded"] == {}, name
        _, message = saved[1]["refused"]   # fully_shard: PyTorch's helper refuses it first
        assert ("rank 1" in message and "cpu_offload" in message if case["front"] == "classic"
                else "state_dict is empty" in message), message
        # At 4 ranks one rank owns none of the 3 matrices (PyTorch's full-state loader would find no device).
        for world in (2, 1, 4) if case["front"] == "fully_shard" else (2, 1):
            assert all(run_distributed(resume_full_case, case, path, world_size=world)), f"{name} at {world} ranks"


# ---- what travels: Adafactor's factors and norms, never a matrix ---------------------------------------

_SENT_ARG = {"all_to_all_single": 1, "all_gather_into_tensor": 1, "all_gather": 1, "reduce_scatter_tensor": 1}
_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather", "broadcast",
                "reduce_scatter_tensor", "reduce", "scatter", "gather", "send", "isend")


class CollectiveLog:
    """``(name, bytes this rank hands in)`` of every torch.distributed collective called while active."""

    def __enter__(self) -> list[tuple[str, int]]:
        self.calls: list[tuple[str, int]] = []
        self.originals = {name: getattr(dist, name) for name in _COLLECTIVES}

        def logged(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                sent = args[_SENT_ARG.get(name, 0)]
                tensors = sent if isinstance(sent, list) else [sent]
                self.calls.append((name, sum(t.numel() * t.element_size() for t in tensors)))
                return self.originals[name](*args, **kwargs)
            return call

        for name in _COLLECTIVES:
            setattr(torch.distributed, name, logged(name))
        return self.calls

    def __exit__(self, *exc: object) -> None:
        for name, original in self.originals.items():
            setattr(torch.distributed, name, original)


SHAPES = [(40, 24), (24, 40), (5, 24)]


def step_collectives(optim: str) -> list[tuple[str, int]]:
    """The collectives one step of ``optim`` on fully_shard'ed matrices of ``SHAPES`` (plus one bias) makes."""
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    tp.manual_seed(0)
    model = tp.nn.Sequential(*[tp.nn.Linear(c, r, bias=i == 2) for i, (r, c) in enumerate(SHAPES)])
    fully_shard(model)
    model(torch.randn(4, 24)).square().mean().backward()
    named = [(n, p) for n, p in model.named_parameters() if optim == "Adafactor" or p.ndim == 2]
    optimizer = ShardedMatrixOptimizer(getattr(torch.optim, optim), named, lr=LR)
    with CollectiveLog() as calls:
        optimizer.step()
    return calls


def test_adafactor_reduces_factors_and_gathers_no_matrix() -> None:
    """Two all-reduces a step: every matrix's row and column sums and parameter norm, then the update norms;
    Muon's owner scheme (the control) moves every parameter and gradient element."""
    params = len(SHAPES) + 1
    factors = sum(r + c for r, c in SHAPES) + params   # the bias's second moment is elementwise, not reduced
    param_bytes = 4 * (sum(r * c for r, c in SHAPES))
    for adafactor, muon in zip(run_distributed(step_collectives, "Adafactor", world_size=2),
                               run_distributed(step_collectives, "Muon", world_size=2), strict=True):
        assert adafactor == [("all_reduce", 4 * factors), ("all_reduce", 4 * params)], adafactor
        assert [name for name, _ in muon] == ["all_to_all_single"] * 2, muon
        # Muon: each rank's pieces of every parameter and gradient (3/2 of the parameters' bytes at 2 ranks).
        assert sum(sent for _, sent in muon) > param_bytes > 10 * sum(sent for _, sent in adafactor), muon


def test_adafactor_batched_matrices_and_vectors_in_one_process() -> None:
    """A 3-D parameter (a batch of matrices: factors per matrix), a 1-D one and a scalar, every option: as torch's."""
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    for kwargs in ADAFACTOR_SWEEP.values():
        tp.manual_seed(0)
        want = [torch.randn(3, 5, 7, requires_grad=True), torch.randn(6, requires_grad=True),
                torch.randn((), requires_grad=True)]
        got = [p.detach().clone().requires_grad_() for p in want]
        reference = torch.optim.Adafactor(want, lr=LR, **kwargs)
        ours = ShardedMatrixOptimizer(torch.optim.Adafactor, got, lr=LR, **kwargs)
        for step in range(STEPS):
            for params, optimizer in ((want, reference), (got, ours)):
                g = torch.Generator().manual_seed(step)
                for param in params:
                    param.grad = torch.randn(param.shape, generator=g)
                optimizer.step()
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **FP32)
        assert ours.state_dict()["state"][0]["row_var"].shape == (3, 5, 1)
        torch.testing.assert_close(ours.state_dict()["state"][0]["col_var"],
                                   reference.state_dict()["state"][0]["col_var"], **FP32)


def zero_muon_flops() -> int:
    """This rank's Newton-Schulz FLOPs in one ZeRO step with Muon over matrices whose sizes mislead by elements."""
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer
    from tensorplay.distributed.optim.matrix._layout import newton_schulz_flops

    tp.manual_seed(0)
    # (2, 2048) has the most elements but costs 1/6 of a (32, 32)'s FLOPs: by elements one rank gets both (32, 32)s.
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(2, 2048), (32, 32), (32, 32)]]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Muon, lr=LR)
    with NewtonSchulzCount() as shapes:
        optimizer.step()
    return sum(newton_schulz_flops(shape, 5) for shape in shapes)


def test_zero_balances_muon_by_newton_schulz_flops() -> None:
    from tensorplay.distributed.optim.matrix._layout import newton_schulz_flops

    per_rank = run_distributed(zero_muon_flops, world_size=2)
    total = sum(newton_schulz_flops(shape, 5) for shape in [(2, 2048), (32, 32), (32, 32)])
    assert sum(per_rank) == total, per_rank
    assert max(per_rank) <= 1.3 * total / 2, per_rank


def test_adafactor_refuses_what_torch_refuses_naming_the_parameter() -> None:
    from tensorplay.distributed.optim import ShardedMatrixOptimizer

    head = torch.zeros(2, 3, dtype=torch.complex64, requires_grad=True)
    kind, message = error_of(ShardedMatrixOptimizer, torch.optim.Adafactor, [("head.weight", head)]) or ("", "")
    assert kind == "ValueError" and "complex" in message and "'head.weight'" in message, message
    weight = torch.zeros(4, 3, requires_grad=True)
    weight.grad = torch.zeros(4, 3).to_sparse()
    kind, message = error_of(ShardedMatrixOptimizer(torch.optim.Adafactor, [("w", weight)]).step) or ("", "")
    assert kind == "RuntimeError" and "sparse" in message and "'w'" in message, message
