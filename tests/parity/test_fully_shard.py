"""fully_shard parity: ours vs a single-process model on the concatenated batch vs PyTorch's fully_shard.

Each multi-rank call runs a whole grid of cases (worker start-up dominates the cost).
A case is a dict of options; ``train`` runs it with ``impl`` in {"ref", "ours", "torch"}.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

from tests.common import assert_close_dicts
from tests.parity._fsdp_models import MLPBlock, TinyLM

VOCAB, DIM, SEQ, ROWS_PER_RANK, STEPS = 13, 10, 5, 2, 3


def batch(step: int, micro: int = 0) -> torch.Tensor:
    """The global batch of ``step`` (all ranks' rows); rank r trains on its slice of rows."""
    gen = torch.Generator().manual_seed(1000 + 10 * step + micro)
    return torch.randint(0, VOCAB, (dist.get_world_size() * ROWS_PER_RANK, SEQ), generator=gen)


def local_rows(tokens: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return tokens[rank * ROWS_PER_RANK: (rank + 1) * ROWS_PER_RANK]


def tokens_for(impl: str, step: int, micro: int = 0) -> torch.Tensor:
    """The reference trains on the global batch, the sharded runs on their rank's rows."""
    tokens = batch(step, micro)
    return tokens if impl == "ref" else local_rows(tokens)


def global_mean(loss: torch.Tensor, impl: str) -> float:
    loss = loss.detach().clone()
    if impl != "ref":
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return float(loss)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def api(impl: str) -> Any:
    if impl == "ours":
        import tensorplay.distributed.fsdp as fsdp
        return fsdp
    import torch.distributed.fsdp as fsdp
    return fsdp


def mesh_for(case: dict) -> Any:
    if case.get("hsdp"):
        from tensorplay.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    return None


def shard(model: TinyLM, impl: str, case: dict) -> None:
    fsdp = api(impl)
    kwargs: dict[str, Any] = {"mesh": mesh_for(case)}
    if case.get("mp"):
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=tp.bfloat16, reduce_dtype=tp.float32)
    if case.get("offload"):
        # PyTorch's pins memory and fails without an accelerator; ours ignores pin_memory there.
        pin = impl == "ours"
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=pin)
    if case.get("nested", True):
        for block in model.blocks:
            fsdp.fully_shard(block, reshard_after_forward=case.get("reshard"), **kwargs)
    fsdp.fully_shard(model, **kwargs)
    if case.get("prefetch"):
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1: i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0): i] if i else [])


def build(impl: str, case: dict) -> TinyLM:
    tp.manual_seed(0)
    reference = TinyLM(tied=case.get("tied", False))
    if impl == "ref":
        return reference
    if not case.get("meta"):
        shard(reference, impl, case)
        return reference
    with torch.device("meta"):
        model = TinyLM(tied=case.get("tied", False))
    shard(model, impl, case)
    model.to_empty(device="cpu")
    from tensorplay.distributed.tensor import distribute_tensor
    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(full[name].detach(), param.device_mesh, param.placements))
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for name, p in model.named_parameters()}


def train(impl: str, case: dict) -> dict[str, Any]:
    """``STEPS`` Adam steps; returns the global mean losses, final full parameters and clip norms."""
    model = build(impl, case)
    optim = tp.optim.Adam(model.parameters(), lr=1e-2)
    micro_batches = 2 if case.get("accum") else 1
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(micro_batches):
            tokens = tokens_for(impl, step, micro)
            if impl != "ref":
                last = micro == micro_batches - 1
                if micro_batches > 1 and case.get("accum") == "no_all_reduce":
                    model.set_requires_all_reduce(last)  # HSDP: reduce-scatter each, all-reduce once
                elif micro_batches > 1 and case.get("accum") == "not_last":
                    model.set_is_last_backward(last)  # sync each, leave the last reduce-scatter in flight
                elif micro_batches > 1:
                    model.set_requires_gradient_sync(last)
            loss = loss_of(model, tokens)
            loss.backward()
            step_loss += global_mean(loss, impl)
        if case.get("clip"):
            norms.append(tp.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).full_tensor().item()
                         if impl != "ref" else tp.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optim.step()
        optim.zero_grad()
        losses.append(step_loss)
    return {"losses": losses, "params": full_params(model), "norms": norms}


def grid(cases: dict[str, dict], impls: tuple[str, ...] = ("ref", "ours", "torch")) -> dict[str, dict]:
    """Run every case with every impl (``torch`` skipped where a case says ``no_torch``)."""
    out: dict[str, dict] = {}
    for name, case in cases.items():
        out[name] = {impl: train(impl, case) for impl in impls if not (impl == "torch" and case.get("no_torch"))}
    return out


def assert_close(a: dict, b: dict, atol: float, rtol: float, what: str) -> None:
    assert a["losses"] == pytest.approx(b["losses"], abs=atol, rel=rtol), what
    assert_close_dicts(a["params"], b["params"], what, atol=atol, rtol=rtol)
    assert a["norms"] == pytest.approx(b["norms"], abs=atol, rel=rtol), what


FP32 = {"atol": 2e-5, "rtol": 1e-4}     # vs the single-process model: summation order differs
ORACLE = {"atol": 1e-6, "rtol": 1e-5}   # vs PyTorch's fully_shard: same arithmetic, reduction order may differ
# bf16 parameters vs the fp32 reference: Adam moves each weight by at most lr per step, so a bf16
# rounding that flips a tiny gradient costs up to 2 * lr per step.
BF16 = {"atol": 2 * STEPS * 1e-2, "rtol": 2e-2}

TWO_RANK_CASES = {
    "root_only": {"nested": False},
    "nested_default": {},
    "reshard_true": {"reshard": True},
    "reshard_false": {"reshard": False},
    "prefetch": {"prefetch": True},
    "accumulate": {"accum": True},
    "accumulate_not_last": {"accum": "not_last"},
    "tied": {"tied": True},
    "clip": {"clip": True},
    "meta_init": {"meta": True},
    "offload": {"offload": True},
    "bf16": {"mp": True},
}

FOUR_RANK_CASES = {
    "nested_4": {},
    "reshard_int_2": {"reshard": 2},
    "hsdp_2x2": {"hsdp": True},
    "hsdp_accumulate_without_all_reduce": {"hsdp": True, "accum": "no_all_reduce"},
}


def check_grid(results: dict[str, dict], cases: dict[str, dict]) -> None:
    for name, by_impl in results.items():
        ref, ours = by_impl["ref"], by_impl["ours"]
        tol = BF16 if cases[name].get("mp") else FP32
        assert_close(ours, ref, **tol, what=f"{name}: ours vs single process")
        if "torch" in by_impl:
            oracle = {"atol": 1e-3, "rtol": 1e-3} if cases[name].get("mp") else ORACLE
            assert_close(ours, by_impl["torch"], **oracle, what=f"{name}: ours vs PyTorch fully_shard")


def test_parity_two_ranks():
    results = run_distributed(grid, TWO_RANK_CASES, world_size=2)
    for rank_results in results:
        check_grid(rank_results, TWO_RANK_CASES)


def test_parity_four_ranks():
    results = run_distributed(grid, FOUR_RANK_CASES, world_size=4)
    for rank_results in results:
        check_grid(rank_results, FOUR_RANK_CASES)


# ---- structure: types, FQNs, DTensor shards ------------------------------------------------------------
def no_sync_then_sync_grads(impl: str) -> dict[str, torch.Tensor]:
    """bf16 compute, fp32 reduction; one backward without gradient sync, then one with: the full gradients."""
    model = build(impl, {"mp": True})
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        loss_of(model, tokens_for(impl, 0, micro)).backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def _no_sync_then_sync() -> dict[str, dict[str, torch.Tensor]]:
    return {impl: no_sync_then_sync_grads(impl) for impl in ("ours", "torch")}


def test_no_sync_gradients_accumulate_in_reduce_dtype():
    # As in PyTorch, the kept bf16 gradients are summed in fp32 (not bf16): equal to fp32 rounding.
    for result in run_distributed(_no_sync_then_sync, world_size=2):
        assert result["ours"].keys() == result["torch"].keys()
        for name, grad in result["torch"].items():
            assert result["ours"][name].dtype == grad.dtype == torch.float32, name
            torch.testing.assert_close(result["ours"][name], grad, **ORACLE, msg=lambda m, name=name: f"{name}: {m}")


def structure() -> dict[str, Any]:
    from tensorplay.distributed._sharding.layout import rank_slice
    from tensorplay.distributed.fsdp import FSDPModule, fully_shard
    from tensorplay.distributed.tensor import DTensor, Shard

    tp.manual_seed(0)
    model = TinyLM()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) or param.placements != (Shard(0),):
            problems.append(f"{name}: {type(param).__name__} {getattr(param, 'placements', None)}")
            continue
        expected = rank_slice(original[name].shape[0], world, rank)
        local = param.to_local()
        if local.shape[0] != expected.size or not torch.equal(local, original[name][expected.start:][:expected.size]):
            problems.append(f"{name}: local rows {local.shape[0]}, expected {expected.size}")
        if not torch.equal(param.full_tensor(), original[name]):
            problems.append(f"{name}: full_tensor differs from the original")
    problems += state_dict_round_trip(model, original)
    return {
        "problems": problems,
        "fqns": [name for name, _ in model.named_parameters()],
        "expected_fqns": list(original),
        "classes": [type(model).__name__, type(model.blocks[0]).__name__, type(model.emb).__name__],
        "mro_ok": isinstance(model, TinyLM) and isinstance(model, FSDPModule)
        and isinstance(model.blocks[0], MLPBlock) and isinstance(model.blocks[0], FSDPModule),
        "state_dict_keys": list(model.state_dict()),
    }


def state_dict_round_trip(model: nn.Module, original: dict[str, torch.Tensor]) -> list[str]:
    """load_state_dict of DTensors (copy and assign=True) lands in the shards the next all-gather reads."""
    from tensorplay.distributed.tensor import DTensor

    problems = []
    for assign in (False, True):
        state = {k: v * 2 if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=assign)
        model.unshard()
        compared = 0
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                continue  # owned by a nested group that unshard() above did not gather
            compared += 1
            if not torch.equal(param, original[name] * (2 if not assign else 4)):
                problems.append(f"{name}: unsharded after load_state_dict(assign={assign}) is stale")
        if not compared:
            problems.append(f"load_state_dict(assign={assign}): unshard() left no root parameter unsharded")
        model.reshard()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param / 4)
    return problems


def seed_example() -> list[float]:
    """The seed's example (distributed-fsdp.txt): fully_shard(model) on nn.Linear with no mesh."""
    from tensorplay.distributed.fsdp import fully_shard

    tp.manual_seed(0)
    model = nn.Linear(64, 64)
    fully_shard(model)
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for x in (tp.randn(8, 64, generator=gen) for _ in range(2)):
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        model.zero_grad()
    return [model.weight.full_tensor().detach(), model.bias.full_tensor().detach()]


def seed_reference(world: int) -> list[torch.Tensor]:
    tp.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = tp.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for _ in range(2):
        xs = [tp.randn(8, 64, generator=g) for g in gens]
        loss = sum(model(x).sum() for x in xs) / world  # fully_shard averages gradients over ranks
        loss.backward()
        optimizer.step()
        model.zero_grad()
    return [model.weight.detach(), model.bias.detach()]


def test_structure_and_seed_example():
    results = run_distributed(_structure_and_seed, world_size=2)
    for info, trained in results:
        assert info["problems"] == []
        assert info["fqns"] == info["expected_fqns"] == info["state_dict_keys"]
        assert info["classes"] == ["FSDPTinyLM", "FSDPMLPBlock", "Embedding"] and info["mro_ok"]
        for ours, ref in zip(trained, seed_reference(2), strict=True):
            torch.testing.assert_close(ours, ref, **FP32)


def _structure_and_seed() -> tuple[dict, list]:
    return structure(), seed_example()


# ---- collective counts ----------------------------------------------------------------------------------
def count_collectives(cases: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Collectives issued by the second training step of each case (prefetch order is known by then)."""
    from tensorplay.distributed._comm import collectives

    counts: dict[str, int] = {}
    originals = {name: getattr(collectives, name) for name in ("all_gather_flat", "reduce_scatter_flat", "all_reduce")}

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            position = 1 if name == "all_reduce" else 2  # all_reduce(tensor, group), the others (out, in, group)
            group = args[position] if len(args) > position else kwargs.get("group")
            key = f"{name}/{dist.get_world_size(group)}"
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)
        return wrapped

    out = {}
    try:
        for name, fn in originals.items():
            setattr(collectives, name, counting(name, fn))
        for case_name, case in cases.items():
            model = build("ours", case)
            for step in range(2):
                counts.clear()
                loss_of(model, local_rows(batch(step))).backward()
            out[case_name] = dict(counts)
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)
    return out


# Three groups (two blocks and the root). The root keeps its parameters after forward (the default for the
# root), the blocks reshard unless told otherwise: so 3 forward + 2 backward all-gathers, 3 reduce-scatters.
COUNT_CASES_2 = {
    "default": ({}, {"all_gather_flat/2": 5, "reduce_scatter_flat/2": 3}),
    "no_reshard": ({"reshard": False}, {"all_gather_flat/2": 3, "reduce_scatter_flat/2": 3}),
    "prefetch": ({"prefetch": True}, {"all_gather_flat/2": 5, "reduce_scatter_flat/2": 3}),
    "root_only": ({"nested": False}, {"all_gather_flat/2": 1, "reduce_scatter_flat/2": 1}),
}
COUNT_CASES_4 = {
    # backward re-gathers the blocks within groups of 2 ranks
    "reshard_int_2": ({"reshard": 2}, {"all_gather_flat/4": 3, "all_gather_flat/2": 2, "reduce_scatter_flat/4": 3}),
    # HSDP: reduce-scatter over the shard dim, then all-reduce over the replicate dim
    "hsdp": ({"hsdp": True}, {"all_gather_flat/2": 5, "reduce_scatter_flat/2": 3, "all_reduce/2": 3}),
}


@pytest.mark.parametrize("world, cases", [(2, COUNT_CASES_2), (4, COUNT_CASES_4)])
def test_one_collective_per_group(world, cases):
    results = run_distributed(count_collectives, {k: c for k, (c, _) in cases.items()}, world_size=world)
    for rank_counts in results:
        assert rank_counts == {k: expected for k, (_, expected) in cases.items()}


# ---- an evaluation forward between backward and the optimizer step -----------------------------------------
def eval_between_backward_and_step(impl: str) -> list[float]:
    """Losses of train steps whose optimizer step follows a no_grad forward (logging a metric, say)."""
    model = build(impl, {})
    optim = tp.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        tokens = tokens_for(impl, step)
        loss = loss_of(model, tokens)
        loss.backward()
        with torch.no_grad():
            loss_of(model, tokens)
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss, impl))
    return losses


def _eval_between() -> dict[str, list[float]]:
    return {impl: eval_between_backward_and_step(impl) for impl in ("ref", "ours")}


def test_no_grad_forward_before_step_sees_the_update():
    # The root keeps its parameters unsharded after forward; a no_grad forward must not leave them so.
    for result in run_distributed(_eval_between, world_size=2):
        assert result["ours"] == pytest.approx(result["ref"], abs=FP32["atol"], rel=FP32["rtol"])


# ---- implicit prefetch ---------------------------------------------------------------------------------------
def prefetch_order() -> list[list[str]]:
    """Per step: all-gathers issued (by the group's first parameter) and block forwards, in order."""
    from tensorplay.distributed._comm import collectives

    model = build("ours", {})
    events: list[str] = []
    original = collectives.all_gather_flat
    groups = {"ag:block0": model.blocks[0]._fsdp_state.group, "ag:block1": model.blocks[1]._fsdp_state.group,
              "ag:root": model._fsdp_state.group}

    def logging_all_gather(output: torch.Tensor, shard: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # parameter all-gathers only (the first forward's plan agreement is an all-gather too)
        events.extend(name for name, group in groups.items() if group.flat_shard is shard)
        return original(output, shard, *args, **kwargs)

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda *_, i=i: events.append(f"fwd:block{i}"))
    steps = []
    collectives.all_gather_flat = logging_all_gather
    try:
        for step in range(2):
            events.clear()
            model.reshard()  # the root keeps its parameters after a forward; start every step sharded
            with torch.no_grad():  # forward only: the order of issue is what is checked
                loss_of(model, local_rows(batch(step)))
            steps.append(list(events))
    finally:
        collectives.all_gather_flat = original
    return steps


def test_implicit_forward_prefetch_issues_the_next_all_gather_early():
    for first, second in run_distributed(prefetch_order, world_size=2):
        # first step: no order known yet, each group gathers when its forward starts
        assert first == ["ag:root", "ag:block0", "fwd:block0", "ag:block1", "fwd:block1"]
        # then each group's pre-forward issues the next group's all-gather before computing
        assert second == ["ag:root", "ag:block0", "ag:block1", "fwd:block0", "fwd:block1"]


# ---- recovering from a backward that raised ------------------------------------------------------------------
def train_after_failed_backward(impl: str, explicit_reset: bool) -> list[float]:
    """A backward that raises right after it started, then two normal steps."""
    model = build(impl, {})
    optim = tp.optim.Adam(model.parameters(), lr=1e-2)
    tokens = tokens_for(impl, 0)
    logits = model(tokens)

    def fail(_grad: torch.Tensor) -> None:
        raise RuntimeError("injected failure")

    logits.register_hook(fail)
    try:
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    except RuntimeError:
        pass
    if explicit_reset and impl == "ours":
        model.reset_iter_state()
    return train_two_steps(model, optim, impl)


def train_two_steps(model: nn.Module, optim: Any, impl: str) -> list[float]:
    losses = []
    for step in range(2):
        loss = loss_of(model, tokens_for(impl, step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss, impl))
    return losses + [float(p.sum()) for p in full_params(model).values()]


def _failed_backward() -> dict[str, list[float]]:
    return {"ref": train_after_failed_backward("ref", False),
            "auto": train_after_failed_backward("ours", False),
            "explicit": train_after_failed_backward("ours", True)}


def test_training_recovers_after_a_backward_that_raised():
    for result in run_distributed(_failed_backward, world_size=2):
        for mode in ("auto", "explicit"):
            assert result[mode] == pytest.approx(result["ref"], abs=FP32["atol"], rel=FP32["rtol"]), mode
