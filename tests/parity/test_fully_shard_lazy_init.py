"""fully_shard's lazy init (the root's first forward) against PyTorch's, on 2 thread-ranks.

The root is the state whose forward runs first; it names every parameter and group by its
FQN in the root, refuses a nested state that already ran forward on its own and a root
made of several modules (PyTorch's error types, its message first, then ours), and adopts a
parameter the user re-created after ``fully_shard`` (PyTorch's lazy init does too).
Each check runs the same calls through PyTorch's ``fully_shard`` and compares.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests

from tensorplay import nn
from tensorplay.distributed.fsdp import fully_shard as our_fully_shard

IMPLS = {"ours": our_fully_shard, "torch": torch_fully_shard}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _nested(fully_shard: Any) -> nn.Module:
    model = nn.Sequential(MLP(), MLP())
    with torch.no_grad():  # the same values on every rank and for both implementations, without the shared RNG
        for index, param in enumerate(model.parameters()):
            param.copy_(torch.linspace(-1.0, 1.0, param.numel()).reshape(param.shape) * (index + 1) / 8)
    fully_shard(model[0].in_proj)
    fully_shard(model[0].out_proj)
    fully_shard(model)
    return model


def _state(module: nn.Module) -> Any:
    return module._get_fsdp_state()


def _error(fn: Any) -> tuple[type, str]:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the error is what the test compares
        return type(error), str(error)
    raise AssertionError("no error raised")


class TestFullyShardLazyInit(MultiThreadedTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_root_states_and_fqns_match_pytorch(self) -> None:
        seen = {}
        for impl, fully_shard in IMPLS.items():
            model = _nested(fully_shard)
            root = _state(model)
            root._lazy_init()
            states = [_state(model), _state(model[0].in_proj), _state(model[0].out_proj)]
            seen[impl] = {
                "is_root": [s._is_root for s in states],
                "all_states": root._state_ctx.all_states == states,
                "module_fqns": [s._fsdp_param_group._module_fqn for s in states],
                "param_fqns": [sorted(p._param_fqn for p in s._fsdp_param_group.fsdp_params) for s in states],
            }
        assert seen["ours"] == seen["torch"], seen
        assert seen["ours"]["module_fqns"] == ["", "0.in_proj", "0.out_proj"]

    def test_refusals_match_pytorch(self) -> None:
        for impl, fully_shard in IMPLS.items():
            model = _nested(fully_shard)
            _state(model[0].in_proj)._lazy_init()  # the child first: it became a root
            kind, message = _error(_state(model)._lazy_init)
            assert issubclass(kind, RuntimeError), (impl, kind)
            assert message.startswith("FSDP state has already been lazily initialized for 0.in_proj\n"
                                      "FSDP requires running forward through the root module first"), (impl, message)

            model = nn.Sequential(MLP(), MLP())
            fully_shard([model[0], model[1]])
            kind, message = _error(_state(model[0])._lazy_init)
            assert issubclass(kind, RuntimeError) and message.startswith(
                "FSDP requires a single root module but got "), (impl, message)

    def test_parameter_recreated_after_fully_shard_is_adopted(self) -> None:
        results = {}
        for impl, fully_shard in IMPLS.items():
            model = _nested(fully_shard)
            with torch.no_grad():  # a new DTensor parameter from sharded inputs, as in re-initialisation code
                model[1].in_proj.bias = nn.Parameter(model[1].in_proj.bias * 2)
            x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
            model(x).sum().backward()
            bias = model[1].in_proj.bias
            assert isinstance(bias, DTensor), impl
            results[impl] = (bias.full_tensor(), bias.grad.full_tensor())
        for ours, theirs in zip(results["ours"], results["torch"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


if __name__ == "__main__":
    run_tests()
