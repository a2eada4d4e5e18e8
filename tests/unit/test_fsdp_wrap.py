"""Auto-wrap policies choose the same submodules as PyTorch's (its ``_recursive_wrap`` is the oracle)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

from tensorplay.distributed.fsdp import wrap as ours


class Marker(nn.Module):
    """Stands in for the FSDP wrapper: just records which modules were wrapped."""

    def __init__(self, module: nn.Module, **kwargs: object) -> None:
        super().__init__()
        self.inner, self.kwargs = module, kwargs


def tree() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 10),
        nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 10)),
        nn.ModuleList([nn.Linear(10, 10), nn.MultiheadAttention(10, 2)]),
        nn.TransformerEncoderLayer(10, 2, 20),
    )


def wrapped_names(module: nn.Module) -> list[str]:
    return sorted(name for name, m in module.named_modules() if isinstance(m, Marker))


def run_ours(policy, root: nn.Module | None = None, ignored: set[nn.Module] = frozenset()) -> list[str]:
    root = tree() if root is None else root
    ignored_params = {p for m in ignored for p in m.parameters()}
    ours.auto_wrap(root, policy, wrap_fn=lambda m, overrides: Marker(m, **overrides),
                   skip=lambda m: isinstance(m, Marker) or m in ignored,
                   counted=lambda m: sum(p.numel() for p in m.parameters() if p not in ignored_params))
    return wrapped_names(root)


def run_torch(policy) -> list[str]:
    root = tree()
    torch_wrap._recursive_wrap(root, policy, Marker, ignored_modules=set(), ignored_params=set(),
                               only_wrap_children=True)
    return wrapped_names(root)


POLICIES = {
    "always": (ours.always_wrap_policy, torch_wrap.always_wrap_policy),
    "size_100": (functools.partial(ours.size_based_auto_wrap_policy, min_num_params=100),
                 functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=100)),
    "size_600": (functools.partial(ours.size_based_auto_wrap_policy, min_num_params=600),
                 functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=600)),
    "transformer": (functools.partial(ours.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}),
                    functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})),
    "lambda": (functools.partial(ours.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Sequential)),
               functools.partial(torch_wrap.lambda_auto_wrap_policy,
                                 lambda_fn=lambda m: isinstance(m, nn.Sequential))),
    "module": (ours.ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.ReLU}),
               torch_wrap.ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.ReLU})),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_wraps_like_pytorch(name):
    ours_policy, torch_policy = POLICIES[name]
    expected = run_torch(torch_policy)
    assert expected, "the policy should wrap something in this tree"
    assert run_ours(ours_policy) == expected


def test_ignored_modules_are_not_wrapped_or_entered():
    root = tree()
    names = run_ours(ours.always_wrap_policy, root, ignored={root[1]})
    assert "1" not in names and not any(name.startswith("1.") for name in names)
    assert "0" in names


def test_custom_policy_passes_overrides():
    policy = ours.CustomPolicy(lambda m: {"sharding_strategy": "NO_SHARD"} if isinstance(m, nn.ReLU) else False)
    root = tree()
    ours.auto_wrap(root, policy, wrap_fn=lambda m, overrides: Marker(m, **overrides),
                   skip=lambda m: isinstance(m, Marker), counted=lambda m: 0)
    assert wrapped_names(root) == ["1.1"]
    assert root[1][1].kwargs == {"sharding_strategy": "NO_SHARD"}


def test_wrap_only_inside_enable_wrap():
    linear = nn.Linear(2, 2)
    assert ours.wrap(linear) is linear
    with ours.enable_wrap(wrapper_cls=Marker, flag=1):
        wrapped = ours.wrap(linear, other=2)
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with ours.enable_wrap(wrapper_cls=Marker):
                pass
    assert isinstance(wrapped, Marker) and wrapped.kwargs == {"flag": 1, "other": 2}
    assert ours.wrap(linear) is linear


def test_module_wrap_policy_repr_names_classes():
    assert repr(ours.ModuleWrapPolicy([nn.Linear])) == "ModuleWrapPolicy(Linear)"
