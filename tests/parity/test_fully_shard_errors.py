"""fully_shard bad inputs: each gives a clear error naming the module or parameter and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tensorplay as tp
from tensorplay import nn
from tensorplay.testing.distributed import run_distributed

from tests.common import error_of
from tests.parity._fsdp_models import TinyLM


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    return error_of(fn) or ("no error", "")


def child_after_parent() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    model = TinyLM()
    fully_shard(model)
    fully_shard(model.blocks[1])


def twice() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    model = nn.Linear(4, 4)
    fully_shard(model)
    fully_shard(model)


def uneven_dim1() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    from tensorplay.distributed.tensor import Shard
    fully_shard(nn.Sequential(nn.Linear(3, 4)), shard_placement_fn=lambda p: Shard(1))


def cuda_mesh_on_cpu() -> None:
    from tensorplay.distributed.device_mesh import DeviceMesh
    from tensorplay.distributed.fsdp import fully_shard
    fully_shard(nn.Linear(4, 4), mesh=DeviceMesh("cuda", tp.arange(2), _init_backend=False))


def forward_on_meta() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    with torch.device("meta"):
        model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model(tp.zeros(2, 3, dtype=tp.long))


def bad_reshard_int() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    fully_shard(nn.Linear(4, 4), reshard_after_forward=3)


def prefetch_plain_module() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    model = TinyLM()
    fully_shard(model.blocks[0])
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])


def three_d_mesh() -> None:
    from tensorplay.distributed.device_mesh import DeviceMesh
    from tensorplay.distributed.fsdp import fully_shard
    fully_shard(nn.Linear(4, 4), mesh=DeviceMesh("cpu", tp.arange(2).view(1, 1, 2)))


def deepcopy_sharded() -> None:
    import copy

    from tensorplay.distributed.fsdp import fully_shard
    copy.deepcopy(fully_shard(nn.Linear(4, 4)))


def tied_across_groups() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    model = TinyLM(tied=True)
    fully_shard(model.head)
    fully_shard(model)


def tied_across_sibling_groups() -> None:
    # emb's own call cannot name the model's FQNs (a module does not know its parents): the parent's call does.
    from tensorplay.distributed.fsdp import fully_shard
    model = TinyLM(tied=True)
    fully_shard(model.head)
    fully_shard(model.emb)
    fully_shard(model)


def tied_across_sibling_groups_no_parent() -> None:
    # No fully_shard parent: refused at the first forward (emb's lazy init), each named under its own module.
    from tensorplay.distributed.fsdp import fully_shard
    model = TinyLM(tied=True)
    fully_shard(model.head)
    fully_shard(model.emb)
    model(tp.zeros(2, 3, dtype=tp.long))


def mixed_dtypes() -> None:
    from tensorplay.distributed.fsdp import fully_shard
    fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(tp.bfloat16)))


def meta_forward_after_rerooting() -> None:
    # Each fully_shard on a parent makes a new root: the leaf's FQNs are re-prefixed, not prefixed twice.
    from tensorplay.distributed.fsdp import fully_shard
    with torch.device("meta"):
        leaf = nn.Linear(4, 4)
    mid = nn.Sequential(leaf)
    top = nn.Sequential(mid)
    for module in (leaf, mid):
        fully_shard(module)
        _error(lambda module=module: module(tp.zeros(1, 4)))
    fully_shard(top)
    top(tp.zeros(1, 4))


CASES = {
    "child_after_parent": (child_after_parent, "ValueError", ["'blocks.1'", "bottom-up"]),
    "twice": (twice, "ValueError", ["already applied", "Linear"]),
    "uneven_dim1": (uneven_dim1, "ValueError", ["'0.weight'", "size 3 on dim 1", "Shard(0)"]),
    "cuda_mesh_on_cpu": (cuda_mesh_on_cpu, "ValueError", ["Linear", "'cuda'", "cpu"]),
    "forward_on_meta": (forward_on_meta, "RuntimeError", ["FSDPTinyLM", "emb.weight", "meta device", "to_empty"]),
    "bad_reshard_int": (bad_reshard_int, "ValueError", ["reshard_after_forward=3", "2"]),
    "prefetch_plain_module": (prefetch_plain_module, "ValueError", ["Block", "fully_shard"]),
    "three_d_mesh": (three_d_mesh, "ValueError", ["3D"]),
    "tied_across_groups": (tied_across_groups, "ValueError", [
        "parameter 'emb.weight' is shared with 'head.weight', which an earlier fully_shard call (on 'head')",
        "one group"]),
    "tied_across_sibling_groups": (tied_across_sibling_groups, "ValueError", [
        "parameter 'emb.weight' is shared with 'head.weight', which an earlier fully_shard call (on 'head')",
        "one group"]),
    "tied_across_sibling_groups_no_parent": (tied_across_sibling_groups_no_parent, "ValueError", [
        "parameter 'weight' of this root's FSDPEmbedding is shared with 'weight' of the FSDPLinear an earlier "
        "fully_shard call already sharded, which is not inside this root", "one group"]),
    "mixed_dtypes": (mixed_dtypes, "ValueError", ["Sequential", "'0.weight' is torch.float32",
                                                  "'1.weight' is torch.bfloat16", "MixedPrecisionPolicy"]),
    "meta_forward_after_rerooting": (meta_forward_after_rerooting, "RuntimeError",
                                     ["(0.0.weight, 0.0.bias,", "meta device"]),
    "deepcopy_sharded": (deepcopy_sharded, "RuntimeError", ["FSDPLinear", "deep-copy the module before"]),
}


def all_errors() -> dict[str, tuple[str, str]]:
    return {name: _error(fn) for name, (fn, _, _) in CASES.items()}


def test_bad_inputs_name_the_culprit():
    for errors in run_distributed(all_errors, world_size=2):
        for name, (_, kind, fragments) in CASES.items():
            got_kind, message = errors[name]
            assert got_kind == kind, (name, got_kind, message)
            for fragment in fragments:
                assert fragment in message, (name, fragment, message)
