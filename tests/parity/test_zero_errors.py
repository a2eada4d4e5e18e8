"""ZeroRedundancyOptimizer's bad inputs: each a clear error, on every rank, and nothing hangs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorplay as tp
from tensorplay.distributed.optim import _FunctionalAdam
from tensorplay.distributed.optim.zero_redundancy_optimizer import (
    ZeroRedundancyOptimizer,
)
from tensorplay.testing.distributed import run_distributed

from tests.parity.zero_common import batch, make_model


def error_of(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)
    return None


def zero(params: Any = None, cls: Any = tp.optim.Adam, **kwargs: Any) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(params if params is not None else make_model().parameters(), cls, lr=0.1, **kwargs)


def sparse_param() -> None:
    zero([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.eye(3).to_sparse())])


def twice_in_groups() -> None:
    shared = torch.nn.Parameter(torch.randn(3))
    zero([{"params": [torch.nn.Parameter(torch.randn(2)), shared]}, {"params": [shared]}])


def twice_via_add_param_group() -> None:
    model = make_model()
    optimizer = zero(model.parameters())
    optimizer.add_param_group({"params": [model.head.weight]})


def overlap_without_hook() -> None:
    model = make_model()
    ddp = DDP(model)
    optimizer = zero(ddp.parameters(), overlap_with_ddp=True)
    ddp(batch(0)).sum().backward()
    optimizer.step()


def state_dict_without_consolidate() -> None:
    zero().state_dict()


def state_dict_on_another_rank() -> None:
    optimizer = zero()
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() == 1:
        optimizer.state_dict()


def load_mismatched_state_dict() -> None:
    small = tp.optim.Adam(tp.nn.Linear(2, 2).parameters())  # 2 parameters; the model has 6
    zero().load_state_dict(small.state_dict())


def consolidate_to_missing_rank() -> None:
    zero().consolidate_state_dict(to=5)


def bad_class_on_rank_one() -> None:
    zero(cls=tp.optim.Adam if dist.get_rank() == 0 else tp.optim.Adam(make_model().parameters()))


def local_step_fails_on_rank_one(bucket: bool = False, one_param_per_rank: bool = False) -> None:
    params = list(make_model().parameters())
    optimizer = zero(params[:2] if one_param_per_rank else params, parameters_as_bucket_view=bucket)
    # How the outcome travels (see [Note: step errors ride on the broadcasts]): in a bucket or a pack of small
    # parameters that every rank broadcasts; a rank with a single parameter has neither, so an agreement.
    assert optimizer._status is not None and optimizer._status.rides is not one_param_per_rank

    def closure() -> torch.Tensor:
        if dist.get_rank() == 1:
            raise FloatingPointError("loss is nan on rank 1")
        return torch.tensor(0.0)

    optimizer.step(closure)


def different_params_per_rank() -> None:
    zero(list(make_model().parameters())[: 4 + dist.get_rank()])


CASES = {
    "not_an_optimizer": lambda: zero(cls=lambda params, **kw: None),
    "functional_without_overlap": lambda: zero(cls=_FunctionalAdam),
    "overlap_without_functional_form": lambda: zero(cls=tp.optim.NAdam, overlap_with_ddp=True),
    "sparse_param": sparse_param,
    "twice_in_groups": twice_in_groups,
    "twice_via_add_param_group": twice_via_add_param_group,
    "overlap_without_hook": overlap_without_hook,
    "state_dict_without_consolidate": state_dict_without_consolidate,
    "state_dict_on_another_rank": state_dict_on_another_rank,
    "load_mismatched_state_dict": load_mismatched_state_dict,
    "consolidate_to_missing_rank": consolidate_to_missing_rank,
    "bad_class_on_rank_one": bad_class_on_rank_one,
    "local_step_fails_on_rank_one": local_step_fails_on_rank_one,
    "bucket_step_fails_on_rank_one": lambda: local_step_fails_on_rank_one(bucket=True),
    "vote_step_fails_on_rank_one": lambda: local_step_fails_on_rank_one(one_param_per_rank=True),
    "different_params_per_rank": different_params_per_rank,
}


def all_errors() -> dict[str, tuple[str, str] | None]:
    return {name: error_of(case) for name, case in CASES.items()}


def test_bad_inputs_are_clear_errors_on_every_rank_without_hanging():
    # One pooled call runs every case in turn: a hang in any of them fails on the timeout.
    rank0, rank1 = run_distributed(all_errors, world_size=2, timeout=90)
    expected_both = {
        "not_an_optimizer": ("TypeError", "optimizer_class must be a subclass of torch.optim.Optimizer"),
        "functional_without_overlap": ("ValueError", ("_FunctionalAdam is a functional optimizer, which is "
                                                      "only used with overlap_with_ddp=True")),
        "overlap_without_functional_form": ("ValueError", "NAdam has none; use one of ["),
        "sparse_param": ("ValueError", "param 1 of group 0 has layout torch.sparse_coo"),
        "twice_in_groups": ("ValueError", "param 1 of group 0 is also param 0 of group 1"),
        "twice_via_add_param_group": ("ValueError", "param 4 of group 0 is also param 0 of group 1"),
        "overlap_without_hook": ("RuntimeError", "no ZeRO hook is registered"),
        "state_dict_without_consolidate": ("RuntimeError", "call consolidate_state_dict(to="),
        "load_mismatched_state_dict": ("StateDictLoadError", ("it has 1 param group(s) with [2] parameters, "
                                                      "this optimizer has 1 with [6]")),
        "consolidate_to_missing_rank": ("ValueError", "to must be a rank of the group, 0..1"),
        "different_params_per_rank": ("ValueError", "rank 1 has an extra 'param 4 of group 0'"),
    }
    for name, (kind, text) in expected_both.items():
        for rank, errors in enumerate((rank0, rank1)):
            assert errors[name] is not None, (name, rank)
            assert errors[name][0] == kind and text in errors[name][1], (name, rank, errors[name])
    assert rank0["state_dict_on_another_rank"] is None
    assert rank1["state_dict_on_another_rank"][0] == "RuntimeError"
    assert "consolidate_state_dict(to=1)" in rank1["state_dict_on_another_rank"][1]
    # An error on one rank reaches the other, naming the rank that failed.
    assert rank1["bad_class_on_rank_one"][0] == "TypeError"
    assert rank0["bad_class_on_rank_one"] == (
        "RuntimeError", ("ZeroRedundancyOptimizer construction failed on rank 1 (see that rank's error); "
                         "rank 0 stops too so that no rank waits forever in a collective"))
    # Status element in a pack / in a bucket / an agreement.
    for case in ("local_step_fails_on_rank_one", "bucket_step_fails_on_rank_one", "vote_step_fails_on_rank_one"):
        assert rank1[case] == ("FloatingPointError", "loss is nan on rank 1")
        assert rank0[case][0] == "RuntimeError"
        assert "ZeroRedundancyOptimizer.step (the local optimizer step) failed on rank 1" in rank0[case][1]
