"""MixedPrecision's BatchNorm rule on the classic FullyShardedDataParallel, against PyTorch's.

With an ``auto_wrap_policy`` and ``MixedPrecision``, modules of
``_module_classes_to_ignore`` (batch norms by default) become their own units
with mixed precision disabled, compute in float32 and hand back the input's
dtype. Ours wraps the same units as PyTorch's, warns as it does, and trains
bitwise equal; with ``_module_classes_to_ignore=()`` the batch norms stay in
the surrounding units and compute in the low precision.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import fsdp_api


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 10),
                                  nn.BatchNorm1d(10), nn.ReLU())
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train(impl: str, ignore: bool) -> dict[str, Any]:
    api, wrap = fsdp_api(impl)
    rank = dist.get_rank()
    torch.manual_seed(0)
    mixed = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if not ignore:
        # Without the rule the norms compute in fp16 (their running stats too, or batch_norm refuses).
        mixed = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                   buffer_dtype=torch.float16, _module_classes_to_ignore=())
    dtypes: list[str] = []
    net = Net()
    net.body[1].register_forward_hook(lambda m, args, out: dtypes.append(f"{args[0].dtype}->{out.dtype}"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = api.FullyShardedDataParallel(net, auto_wrap_policy=wrap.ModuleWrapPolicy({nn.Linear}),
                                             mixed_precision=mixed, device_id=torch.device("cpu"))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    units = api.FullyShardedDataParallel.fsdp_modules(model)
    with api.FullyShardedDataParallel.summon_full_params(model):
        state = {k: v.clone() for k, v in model.state_dict().items()}
    return {
        "units": [(type(unit.module).__name__, unit.mixed_precision.param_dtype) for unit in units],
        "warned": [str(w.message)[:67] for w in caught if "auto_wrap_policy" in str(w.message)],
        "dtypes": dtypes, "losses": losses, "state": state,
    }


def both(ignore: bool) -> list[dict[str, Any]]:
    return [train("ours", ignore), train("torch", ignore)]


def test_batch_norms_become_full_precision_units_as_in_pytorch():
    for ignore in (True, False):
        for ours, theirs in run_distributed(both, ignore):
            assert ours["units"] == theirs["units"], ignore
            assert ours["dtypes"] == theirs["dtypes"], ignore
            assert ours["losses"] == theirs["losses"], ignore
            assert list(ours["state"]) == list(theirs["state"])
            for key, value in theirs["state"].items():
                assert torch.equal(ours["state"][key], value), (ignore, key)
            assert bool(ours["warned"]) == bool(theirs["warned"]) == ignore
            assert ours["warned"] == ["Both mixed precision and an auto_wrap_policy were specified to FSDP"] * ignore
            if ignore:
                assert ("BatchNorm1d", None) in ours["units"]
                assert set(ours["dtypes"]) == {"torch.float32->torch.float32"}  # computed in full precision
            else:
                assert all(name != "BatchNorm1d" for name, _ in ours["units"])
                assert set(ours["dtypes"]) == {"torch.float16->torch.float16"}
