"""Parameters that some ranks use and others do not in one step (data-dependent branches, 2 ranks).

A group's gradient must be the mean over ranks with a zero contribution from
ranks that did not use the parameter (what DDP with find_unused_parameters and
the single-process run on the concatenated batch give). PyTorch's fully_shard
gets this wrong silently (each rank reduces a different set of parameters), so
the comparison is with the single process only (fp32, rtol 1e-4 / atol 2e-5).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.common import FP32
from tests.parity.fully_shard_cases import fsdp_api


class Branchy(tp.nn.Module):
    """Rank 0's data takes branch ``a``, rank 1's takes ``b``; ``c`` is used by both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = tp.nn.Linear(4, 4)
        self.b = tp.nn.Linear(4, 4)
        self.c = tp.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.c(self.a(x) if use_a else self.b(x))


def _data(rank: int) -> tuple[torch.Tensor, bool]:
    return tp.arange(12.0).reshape(3, 4) / 10 * (rank + 1), rank == 0


def branchy_grads(impl: str) -> dict[str, Any]:
    from tensorplay.distributed.tensor import DTensor

    try:
        tp.manual_seed(0)
        model = Branchy()
        fsdp_api(impl).fully_shard(model)
        x, use_a = _data(dist.get_rank())
        model(x, use_a).pow(2).mean().backward()
        # Every rank gathers every parameter (zeros where .grad is None) so no collective is skipped.
        out = {}
        for name, param in model.named_parameters():
            grad = param.grad if param.grad is not None else DTensor.from_local(
                torch.zeros_like(param.to_local()), param.device_mesh, param.placements)
            out[name] = (param.grad is not None, grad.full_tensor())
        return out
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": traceback.format_exc()}


def test_rank_dependent_unused_parameters_average_with_zero():
    tp.manual_seed(0)
    reference = Branchy()
    for rank in range(2):
        x, use_a = _data(rank)
        (reference(x, use_a).pow(2).mean() / 2).backward()
    for rank, got in enumerate(run_distributed(branchy_grads, "ours", world_size=2)):
        assert "error" not in got, got.get("error")
        for name, param in reference.named_parameters():
            has_grad, grad = got[name]
            assert has_grad, f"rank {rank}: {name}.grad is None but another rank used it"
            torch.testing.assert_close(grad, param.grad, **FP32, msg=lambda m, r=rank, n=name: f"rank {r}: {n}\n{m}")
