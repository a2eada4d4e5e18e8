"""Classic FSDP's sharded units stage their views' gradients straight into the reduce-scatter.

See [Note: gradients from the views] in ``fsdp/_classic/flat_param.py``: a sharded unit whose gradient is
reduced now hands the reduce-scatter its views' gradients (``collectives.FlatParts``, divided on the way in),
never a flat gradient buffer, also when it reduces in a wider ``reduce_dtype`` (cast on the way in, where
PyTorch holds the flat gradient and its cast together); inside ``no_sync`` the gradient is kept flat and
accumulates as before. Either way training is bitwise PyTorch's FullyShardedDataParallel.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed._comm import collectives
from tensorplay.distributed.fsdp._classic import flat_param
from tensorplay.testing.distributed import run_distributed


def _train(impl: str, strategy: str) -> tuple[list[torch.Tensor], list[list[str]]]:
    """Three steps (the second under no_sync, accumulated into the third); the parameters, and per step the
    kinds of input each reduce-scatter got (ours only)."""
    if impl == "ours":
        from tensorplay.distributed import fsdp
        from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed import fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    torch.manual_seed(0)
    # 300 x 301 + 300 elements: a unit's flat parameter is padded, and its weight crosses chunk boundaries
    model = nn.Sequential(nn.Linear(301, 300), nn.GELU(), nn.Linear(300, 301), nn.Linear(301, 300, bias=False))
    strategy, _, reduced_wider = strategy.partition("+")  # "+fp32_reduce": bf16 compute, fp32 reduction
    precision = fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if reduced_wider else None
    model = fsdp.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                          sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
                                          device_id=torch.device("cpu"), mixed_precision=precision)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    kinds: list[list[str]] = []
    real = collectives.reduce_scatter_flat

    def spy(shard, full, *args, **kwargs):  # noqa: ANN001, ANN202
        kinds[-1].append(type(full).__name__)
        return real(shard, full, *args, **kwargs)

    with mock.patch.object(flat_param, "reduce_scatter_flat", spy):
        for step in range(3):
            kinds.append([])
            x = torch.randn(8, 301, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            if step == 1:
                with model.no_sync():
                    model(x).pow(2).mean().backward()
                continue
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    return [p.detach().clone() for p in model.parameters()], kinds


def staged_and_pytorch(strategy: str) -> tuple[bool, list[list[str]]]:
    ours, kinds = _train("ours", strategy)
    theirs, _ = _train("torch", strategy)
    return all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), kinds


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "FULL_SHARD+fp32_reduce"])
def test_sharded_units_stage_view_grads_bitwise_pytorch(strategy):
    for same, kinds in run_distributed(staged_and_pytorch, strategy, world_size=2):
        assert same
        assert kinds[0] == ["FlatParts"] * 3  # one per Linear (the root holds no parameters of its own)
        assert kinds[1] == []  # no_sync: nothing reduced
        assert kinds[2] == ["Tensor"] * 3  # the kept, accumulated flat gradient
