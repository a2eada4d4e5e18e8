"""Uneven inputs under ``Join`` with fully_shard and the classic wrapper (2 and 3 Gloo ranks).

Each rank trains on its own number of batches (5 and 3; 5, 3 and 4; on 4 ranks
with hybrid sharding, 5, 3, 4 and 2). A rank
that runs out reruns its last batch with zero gradients while the others still
have data ([Note: join by shadow step]), so every rank finishes and steps its
shard on the same averaged gradients. Oracles, over the same batches:
PyTorch's DDP under ``Join`` (divides by the full world size, the last joiner's
model broadcast at the end) and one process that sums, at each step, the
gradients of the ranks that still had a batch and divides by the world size.
Tolerance: ``ORACLE`` (rtol 1e-5, atol 1e-6, fp32): the reduction order differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorplay.distributed as dist
from tensorplay.distributed.algorithms.join import Join
from tensorplay.distributed.device_mesh import init_device_mesh
from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
from tensorplay.distributed.fsdp import ShardingStrategy, StateDictType, fully_shard
from tensorplay.distributed.fsdp._join_shadow_step import ShadowStepHook
from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
from tensorplay.testing.distributed import run_distributed

from tests.common import ORACLE, error_of

BATCHES = {2: [5, 3], 3: [5, 3, 4], 4: [5, 3, 4, 2]}  # batches per rank, by world size


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: nn.Module, optim: torch.optim.Optimizer, batches: int, **join_kwargs: object) -> None:
    """The user's loop; ``optimizer`` is passed to Join for the sharded models (their joined ranks step too)."""
    with Join([model], **join_kwargs):
        for step in range(batches):
            optim.zero_grad()
            inputs, target = batch(dist.get_rank(), step)
            F.mse_loss(model(inputs), target).backward()
            optim.step()


def reference(counts: list[int]) -> list[torch.Tensor]:
    """One process: at step t, sum the gradients of the ranks with a t-th batch, divide by the world size."""
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(max(counts)):
        optimizer.zero_grad()
        for rank, count in enumerate(counts):
            if step < count:
                (F.mse_loss(model(batch(rank, step)[0]), batch(rank, step)[1]) / len(counts)).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def ddp_join(counts: list[int]) -> list[torch.Tensor]:
    model = make_model()
    ddp = DDP(model)
    train(ddp, make_optimizer(model), counts[dist.get_rank()])
    return [p.detach().clone() for p in model.parameters()]


def fully_shard_join(counts: list[int], hybrid: bool = False) -> list[torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2)) if hybrid else None  # HSDP: (replicate, shard)
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model)
    train(model, optimizer, counts[dist.get_rank()], optimizer=optimizer)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def classic_join(counts: list[int], use_orig_params: bool = False, hybrid: bool = False) -> list[torch.Tensor]:
    hybrid_args = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                       device_mesh=init_device_mesh("cpu", (2, dist.get_world_size() // 2))) if hybrid else {}
    model = FSDP(make_model(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params,
                 **hybrid_args)
    optimizer = make_optimizer(model)
    train(model, optimizer, counts[dist.get_rank()], optimizer=optimizer)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    return [state[name].detach().clone() for name in make_model().state_dict()]


def rank_fn(front_end: str, counts: list[int]) -> dict[str, list[torch.Tensor]]:
    if front_end == "hybrid":
        return {"sharded HSDP": fully_shard_join(counts, hybrid=True),
                "sharded HYBRID_SHARD": classic_join(counts, hybrid=True), "ddp": ddp_join(counts)}
    if front_end == "fully_shard":
        return {"sharded": fully_shard_join(counts), "ddp": ddp_join(counts)}
    return {"sharded": classic_join(counts), "sharded use_orig_params": classic_join(counts, use_orig_params=True),
            "ddp": ddp_join(counts)}


@pytest.mark.parametrize("front_end, world_size", [("fully_shard", 2), ("fully_shard", 3), ("classic", 2),
                                                   ("classic", 3), ("hybrid", 4)])
def test_join_uneven_inputs_match_ddp(front_end: str, world_size: int) -> None:
    """``hybrid``: fully_shard on a (2, 2) mesh and classic HYBRID_SHARD; Join counts ranks on the world."""
    counts = BATCHES[world_size]
    results = run_distributed(rank_fn, front_end, counts, world_size=world_size, timeout=300)
    want = reference(counts)
    # The extra batches of the ranks with more data move the result: a test that ignored them would fail.
    assert any(not torch.allclose(p, q, **ORACLE) for p, q in zip(want, reference([min(counts)] * world_size),
                                                                      strict=True))
    for rank, got in enumerate(results):
        for what, params in got.items():
            assert len(params) == len(want), f"rank {rank} {what}"
            for index, (p, q) in enumerate(zip(params, want, strict=True)):
                torch.testing.assert_close(p, q, **ORACLE, msg=lambda m, r=rank, w=what, i=index:
                                           f"rank {r} {w} parameter {i}: {m}")
            if what.startswith("sharded"):  # and equal to PyTorch's DDP + Join on the same rank
                for p, q in zip(params, got["ddp"], strict=True):
                    torch.testing.assert_close(p, q, **ORACLE)


def test_join_hook_arguments() -> None:
    module = nn.Linear(2, 2)
    missing = error_of(ShadowStepHook, module)
    assert missing is not None and missing[0] == "ValueError" and "optimizer=optim" in missing[1]
    divisor = error_of(ShadowStepHook, module, optimizer=make_optimizer(module), divide_by_initial_world_size=False)
    assert divisor is not None and divisor[0] == "ValueError" and "divide_by_initial_world_size" in divisor[1]
    wrong = error_of(ShadowStepHook, module, optimizer=3)
    assert wrong is not None and wrong[0] == "TypeError" and "int" in wrong[1]
    assert not module._forward_pre_hooks  # a rejected hook leaves nothing behind


def test_shadow_step_one_process() -> None:
    """The shadow step alone: zero gradients, buffers as before, the step run, nothing counted for Join."""
    from torch.distributed.algorithms.join import _JoinConfig

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    steps: list[int] = []
    hook = ShadowStepHook(module, optimizer=lambda: steps.append(1))
    module._join_config = _JoinConfig(enable=True, throw_on_early_termination=False, is_first_joinable=False)
    module(torch.randn(8, 4)).sum().backward()  # the last real step: its inputs are kept
    stats = [b.clone() for b in module.buffers()]
    hook.main_hook()
    assert steps == [1]
    assert all(p.grad is not None and not p.grad.any() for p in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(stats, module.buffers(), strict=True))
    hook.post_hook(is_last_joiner=True)
    assert not module._forward_pre_hooks and hook.last_inputs is None
