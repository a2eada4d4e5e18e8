"""fully_shard training parity over a grid of options (1, 2 and 4 ranks).

Each case of ``fully_shard_cases`` is checked against a single-process model fed the concatenated batch and
against PyTorch's ``torch.distributed.fsdp.fully_shard`` run the same way (tolerances: see that module).
"""

from __future__ import annotations

import pytest
import torch

from tests.common import FP32
from tests.parity.fully_shard_cases import (
    CASES,
    OURS_ONLY,
    assert_same_training,
    case_result,
    ref,
    tol,
)

IMPLS = ["ours", "torch"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(impl, name):
    assert_same_training(case_result(impl, name), ref(name), tol(name), f"{impl}/{name} vs single process")


@pytest.mark.parametrize("name", list(OURS_ONLY))
def test_ours_only_matches_single_process(name):
    assert_same_training(case_result("ours", name), ref(name), tol(name), f"ours/{name} vs single process")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_pytorch(name):
    ours, theirs = case_result("ours", name), case_result("torch", name)
    assert_same_training(ours, theirs, tol(name), f"{name}: ours vs PyTorch")


@pytest.mark.parametrize("name", list(CASES))
def test_module_types_state_dict_and_grads_match_pytorch(name):
    ours, theirs = case_result("ours", name), case_result("torch", name)
    assert ours["is_fsdp"] == theirs["is_fsdp"] and ours["is_orig"] and theirs["is_orig"]
    assert sorted(ours["state_dict"]) == ref(name)["keys"]
    assert ours["state_dict"] == theirs["state_dict"]
    assert ours["grads"] == theirs["grads"]


def test_low_precision_gradients_accumulate_in_reduce_dtype():
    """bf16 micro-batch gradients kept unsharded across no-sync steps are summed in fp32 (reduce_dtype), as in
    PyTorch: the first step's reduced gradients then equal PyTorch's to fp32 rounding, not just to bf16 ulps."""
    ours, theirs = case_result("ours", "accum_mp"), case_result("torch", "accum_mp")
    for fqn, grad in theirs["grads0"].items():
        torch.testing.assert_close(ours["grads0"][fqn], grad, **FP32, msg=lambda m, f=fqn: f"{f}\n{m}")
