"""fully_shard with ranks that are threads of one process (PyTorch's threaded process group).

PyTorch's own fully_shard tests run every rank as a thread (``FSDPTestMultiThread``), so
nothing in our sharding layer may be shared between ranks through the process: a
post-forward subgroup cached per process once made one thread-rank use another's group
(an error on one rank, the others blocked in a collective: a hang). Here 4 thread-ranks
train a two-group model under each ``reshard_after_forward`` (True, False, 2) and every
gradient must equal a single-process run on the concatenated batch (fp32 allclose
rtol 1e-5 / atol 1e-6: the same math, summed in another order).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests

import tensorplay.distributed as dist
from tensorplay import nn
from tensorplay.distributed.fsdp import fully_shard

DIM, ROWS = 6, 2


def _model() -> nn.Module:
    """Deterministic weights without the (process-global) RNG, which thread-ranks would race on."""
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.copy_(torch.linspace(-1.0, 1.0, param.numel()).reshape(param.shape) * (index + 1) / 4)
    return model


def _batch(world: int) -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, world * ROWS * DIM).reshape(world * ROWS, DIM)


class TestFullyShardThreadRanks(MultiThreadedTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_reshard_after_forward_modes_match_single_process(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        full = _batch(world)
        ref = _model()
        ref(full).pow(2).sum().div(world).backward()
        for reshard_after_forward in (True, False, 2, 2):  # the second 2 finds the subgroups made already
            model = _model()
            fully_shard(model[0], reshard_after_forward=reshard_after_forward)
            fully_shard(model[2], reshard_after_forward=reshard_after_forward)
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            model(full[rank * ROWS: (rank + 1) * ROWS]).pow(2).sum().backward()
            for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert isinstance(param, DTensor), (reshard_after_forward, name)
                torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6,
                                           msg=f"reshard_after_forward={reshard_after_forward}: {name}")

    def test_cast_to_float64_after_init(self) -> None:
        """``model.to(torch.float64)`` after fully_shard: parameters and gradients are float64, equal to a
        single-process float64 run (PyTorch's test_to_float64_after_init)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        full = _batch(world).double()
        ref = _model().double()
        ref(full).pow(2).sum().div(world).backward()
        model = _model()
        fully_shard(model[0])
        fully_shard(model)
        model.to(torch.float64)
        model(full[rank * ROWS: (rank + 1) * ROWS]).pow(2).sum().backward()
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert param.dtype == param.to_local().dtype == param.grad.dtype == torch.float64, name
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-12, atol=1e-12, msg=name)


if __name__ == "__main__":
    run_tests()
