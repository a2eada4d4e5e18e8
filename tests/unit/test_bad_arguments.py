"""Property: every public constructor and setter of the owned subtrees (fsdp, optim, model averaging, comm
hooks) refuses a wrong type or value with a ValueError or TypeError that names the argument and the value;
never an AttributeError, KeyError, AssertionError or IndexError from deep inside.

PyTorch's versions fail several of these differently (``GradScaler(growth_factor=0.5)`` asserts,
``FSDP.state_dict_type(m, "full")`` raises KeyError, ``CPUOffload(offload_params="no")`` is accepted and
read as True). Process groups: one 1-rank Gloo group in this process, for the module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay import nn

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if dist.is_initialized():  # another test module left one: use it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    _SHARDED.clear()
    dist.destroy_process_group()


# ---- wrong values -------------------------------------------------------------------------------------

_junk = st.one_of(st.text(max_size=4), st.lists(st.integers(-2, 2), max_size=2), st.builds(object))
NOT_BOOL = st.one_of(_junk, st.integers(-2, 3), st.floats(width=32), st.none())
NOT_NUMBER = st.one_of(_junk, st.none())
NOT_OPTIONAL = _junk  # for arguments where None means "the default"
NOT_INT = st.one_of(_junk, st.none(), st.floats(width=32))
NOT_DTYPE = st.one_of(st.sampled_from(["bf16", "float16", "torch.float32", "fp32"]), st.integers(), _junk)
ENUM_NAMES = st.sampled_from(["FULL_SHARD", "full", "NO_SHARD", "BACKWARD_PRE", "FULL_STATE_DICT", "sharded"])
NOT_ENUM = st.one_of(ENUM_NAMES, st.integers(-1, 5), st.floats(width=32), _junk)
NOT_CALLABLE = st.one_of(st.text(max_size=4), st.integers(), st.lists(st.integers(), max_size=2))
NOT_ITERABLE = st.one_of(st.integers(), st.floats(width=32), st.builds(object))
NOT_GROUP = st.one_of(st.text(max_size=4), st.integers(), st.builds(object))
NOT_CLASS = st.one_of(st.sampled_from([int, str, dict, "Adam", 3, None]), st.builds(object))
NEGATIVE = st.floats(max_value=-1e-6, allow_infinity=True)
NEGATIVE_OR_NAN = st.one_of(NEGATIVE, st.just(float("nan")))  # tp.optim accepts a NaN lr; ours refuse it


def ints_below(minimum: int) -> st.SearchStrategy[int]:
    return st.integers(max_value=minimum - 1, min_value=minimum - 1000)


def param() -> nn.Parameter:
    return nn.Parameter(torch.ones(2, 2))


# ---- the calls ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    call: Callable[[Any], Any]   # makes the call with the bad value in place of ``arg``
    arg: str
    values: st.SearchStrategy[Any]


def _fsdp(**kwargs: Any) -> Any:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    return FSDP(nn.Linear(3, 3), **kwargs)


def _fully_shard(**kwargs: Any) -> Any:
    from tensorplay.distributed.fsdp import fully_shard
    return fully_shard(nn.Linear(3, 3), **kwargs)


def _state_dict_type(value: Any, **kwargs: Any) -> Any:
    from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    from tensorplay.distributed.fsdp import StateDictType
    model = _fsdp()
    if kwargs.pop("context", False):
        with FSDP.state_dict_type(model, value):
            return None
    return FSDP.set_state_dict_type(model, **{"state_dict_type": StateDictType.FULL_STATE_DICT, **kwargs}) \
        if kwargs else FSDP.set_state_dict_type(model, value)


def _scaler(**kwargs: Any) -> Any:
    from tensorplay.distributed.fsdp import ShardedGradScaler
    return ShardedGradScaler(device="cpu", **{k: v for k, v in kwargs.items() if k != "device"}) \
        if "device" not in kwargs else ShardedGradScaler(**kwargs)


def _zero(cls: Any = tp.optim.SGD, **kwargs: Any) -> Any:
    from tensorplay.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer([param()], cls, **{"lr": 0.1, **kwargs})


def _functional(name: str, **kwargs: Any) -> Any:
    from tensorplay.distributed import optim
    return getattr(optim, name)([param()], **kwargs)


_SHARDED: list[Any] = []  # one fully_shard module for every setter case (a refused call changes nothing)


def _setter(method: str) -> Callable[[Any], Any]:
    def call(value: Any) -> Any:
        from tensorplay.distributed.fsdp import fully_shard
        if not _SHARDED:
            _SHARDED.append(fully_shard(nn.Linear(3, 3)))
        return getattr(_SHARDED[0], method)(value)
    return call


def _averager(**kwargs: Any) -> Any:
    from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    return PeriodicModelAverager(**{"period": 2, **kwargs})


def _hierarchical(value: Any) -> Any:
    from tensorplay.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )
    return HierarchicalModelAverager(value)


def _post_local(**kwargs: Any) -> Any:
    from tensorplay.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
    return PostLocalSGDState(**{"process_group": None, "subgroup": dist.group.WORLD, "start_localSGD_iter": 2,
                                **kwargs})


def _power_sgd(**kwargs: Any) -> Any:
    from tensorplay.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    return PowerSGDState(**{"process_group": None, **kwargs})


def _post_local_optimizer(**kwargs: Any) -> Any:
    from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from tensorplay.distributed.optim import PostLocalSGDOptimizer
    options = {"optim": tp.optim.SGD([param()], lr=0.1), "averager": PeriodicModelAverager(2), **kwargs}
    return PostLocalSGDOptimizer(**options)


def _in_backward(**kwargs: Any) -> Any:
    from tensorplay.distributed.optim import apply_optimizer_in_backward
    options = {"optimizer_class": tp.optim.SGD, "params": [param()], "optimizer_kwargs": {"lr": 0.1}, **kwargs}
    return apply_optimizer_in_backward(**options)


def _policy(name: str, value: Any) -> Any:
    from tensorplay.distributed.fsdp import wrap
    return getattr(wrap, name)(value)


def _config(name: str, **kwargs: Any) -> Any:
    from tensorplay.distributed import fsdp
    return getattr(fsdp, name)(**kwargs)


FUNCTIONAL = ["_FunctionalSGD", "_FunctionalAdam", "_FunctionalAdamW", "_FunctionalAdamax", "_FunctionalAdagrad",
              "_FunctionalAdadelta", "_FunctionalRMSprop", "_FunctionalRprop"]

CASES: dict[str, Case] = {
    # fully_shard and its policies
    "fully_shard.reshard_after_forward": Case(lambda v: _fully_shard(reshard_after_forward=v),
                                              "reshard_after_forward",
                                              st.one_of(st.text(max_size=4), st.floats(width=32), ints_below(1))),
    "fully_shard.mp_policy": Case(lambda v: _fully_shard(mp_policy=v), "mp_policy", NOT_OPTIONAL),
    "fully_shard.offload_policy": Case(lambda v: _fully_shard(offload_policy=v), "offload_policy", NOT_OPTIONAL),
    "fully_shard.mesh": Case(lambda v: _fully_shard(mesh=v), "mesh", NOT_GROUP),
    "fully_shard.ignored_params": Case(lambda v: _fully_shard(ignored_params=v), "ignored_params", NOT_ITERABLE),
    "fully_shard.shard_placement_fn": Case(lambda v: _fully_shard(shard_placement_fn=v), "shard_placement_fn",
                                           NOT_CALLABLE),
    "MixedPrecisionPolicy.param_dtype": Case(lambda v: _config("MixedPrecisionPolicy", param_dtype=v),
                                             "param_dtype", NOT_DTYPE),
    "MixedPrecisionPolicy.reduce_dtype": Case(lambda v: _config("MixedPrecisionPolicy", reduce_dtype=v),
                                              "reduce_dtype", NOT_DTYPE),
    "MixedPrecisionPolicy.cast_forward_inputs": Case(lambda v: _config("MixedPrecisionPolicy",
                                                                       cast_forward_inputs=v),
                                                     "cast_forward_inputs", NOT_BOOL),
    "CPUOffloadPolicy.pin_memory": Case(lambda v: _config("CPUOffloadPolicy", pin_memory=v), "pin_memory",
                                        NOT_BOOL),
    # FSDPModule setters
    "set_reshard_after_forward": Case(_setter("set_reshard_after_forward"), "reshard_after_forward", NOT_BOOL),
    "set_reshard_after_backward": Case(_setter("set_reshard_after_backward"), "reshard_after_backward", NOT_BOOL),
    "set_requires_gradient_sync": Case(_setter("set_requires_gradient_sync"), "requires_gradient_sync", NOT_BOOL),
    "set_requires_all_reduce": Case(_setter("set_requires_all_reduce"), "requires_all_reduce", NOT_BOOL),
    "set_is_last_backward": Case(_setter("set_is_last_backward"), "is_last_backward", NOT_BOOL),
    "set_gradient_divide_factor": Case(_setter("set_gradient_divide_factor"), "factor",
                                       st.one_of(NOT_NUMBER, st.floats(max_value=0.0))),
    "set_modules_to_forward_prefetch": Case(_setter("set_modules_to_forward_prefetch"), "modules", NOT_ITERABLE),
    "set_modules_to_backward_prefetch": Case(_setter("set_modules_to_backward_prefetch"), "modules",
                                             NOT_ITERABLE),
    # classic FSDP, its options and state-dict settings
    "FSDP.sharding_strategy": Case(lambda v: _fsdp(sharding_strategy=v), "sharding_strategy", NOT_ENUM),
    "FSDP.backward_prefetch": Case(lambda v: _fsdp(backward_prefetch=v), "backward_prefetch", NOT_ENUM),
    "FSDP.cpu_offload": Case(lambda v: _fsdp(cpu_offload=v), "cpu_offload", NOT_OPTIONAL),
    "FSDP.mixed_precision": Case(lambda v: _fsdp(mixed_precision=v), "mixed_precision", NOT_OPTIONAL),
    "FSDP.auto_wrap_policy": Case(lambda v: _fsdp(auto_wrap_policy=v), "auto_wrap_policy", NOT_CALLABLE),
    "FSDP.param_init_fn": Case(lambda v: _fsdp(param_init_fn=v), "param_init_fn", NOT_CALLABLE),
    "FSDP.process_group": Case(lambda v: _fsdp(process_group=v), "process_group", NOT_GROUP),
    "FSDP.device_id": Case(lambda v: _fsdp(device_id=v), "device_id",
                           st.one_of(st.floats(width=32), ints_below(0), st.sampled_from(["gpu0", "x"]))),
    "FSDP.sync_module_states": Case(lambda v: _fsdp(sync_module_states=v), "sync_module_states", NOT_BOOL),
    "FSDP.use_orig_params": Case(lambda v: _fsdp(use_orig_params=v), "use_orig_params", NOT_BOOL),
    "FSDP.forward_prefetch": Case(lambda v: _fsdp(forward_prefetch=v), "forward_prefetch", NOT_BOOL),
    "FSDP.ignored_modules": Case(lambda v: _fsdp(ignored_modules=v), "ignored_modules", NOT_ITERABLE),
    "FSDP.set_state_dict_type": Case(_state_dict_type, "state_dict_type", NOT_ENUM),
    "FSDP.state_dict_type": Case(lambda v: _state_dict_type(v, context=True), "state_dict_type", NOT_ENUM),
    "FSDP.set_state_dict_type.config": Case(lambda v: _state_dict_type(None, state_dict_config=v),
                                            "state_dict_config", st.one_of(st.text(max_size=4), st.integers())),
    "FSDP.set_state_dict_type.optim_config": Case(lambda v: _state_dict_type(None, optim_state_dict_config=v),
                                                  "optim_state_dict_config",
                                                  st.one_of(st.text(max_size=4), st.integers())),
    "MixedPrecision.param_dtype": Case(lambda v: _config("MixedPrecision", param_dtype=v), "param_dtype",
                                       NOT_DTYPE),
    "MixedPrecision.buffer_dtype": Case(lambda v: _config("MixedPrecision", buffer_dtype=v), "buffer_dtype",
                                        NOT_DTYPE),
    "CPUOffload.offload_params": Case(lambda v: _config("CPUOffload", offload_params=v), "offload_params",
                                      NOT_BOOL),
    "FullStateDictConfig.rank0_only": Case(lambda v: _config("FullStateDictConfig", rank0_only=v), "rank0_only",
                                           NOT_BOOL),
    "ShardedStateDictConfig.offload_to_cpu": Case(lambda v: _config("ShardedStateDictConfig", offload_to_cpu=v),
                                                  "offload_to_cpu", NOT_BOOL),
    "FullOptimStateDictConfig.rank0_only": Case(lambda v: _config("FullOptimStateDictConfig", rank0_only=v),
                                                "rank0_only", NOT_BOOL),
    "ModuleWrapPolicy": Case(lambda v: _policy("ModuleWrapPolicy", v), "module_classes", NOT_ITERABLE),
    "CustomPolicy": Case(lambda v: _policy("CustomPolicy", v), "lambda_fn", NOT_CALLABLE),
    # ShardedGradScaler: where PyTorch's GradScaler asserts or accepts nonsense
    "ShardedGradScaler.growth_factor": Case(lambda v: _scaler(growth_factor=v), "growth_factor",
                                            st.one_of(NOT_NUMBER, st.floats(max_value=1.0))),
    "ShardedGradScaler.backoff_factor": Case(lambda v: _scaler(backoff_factor=v), "backoff_factor",
                                             st.one_of(NOT_NUMBER, st.floats(min_value=1.0), st.floats(max_value=0.0))),
    "ShardedGradScaler.init_scale": Case(lambda v: _scaler(init_scale=v), "init_scale",
                                         st.one_of(NOT_NUMBER, st.floats(max_value=0.0))),
    "ShardedGradScaler.growth_interval": Case(lambda v: _scaler(growth_interval=v), "growth_interval",
                                              st.one_of(NOT_INT, ints_below(1))),
    "ShardedGradScaler.enabled": Case(lambda v: _scaler(enabled=v), "enabled", NOT_BOOL),
    "ShardedGradScaler.device": Case(lambda v: _scaler(device=v), "device", st.one_of(st.integers(), st.none())),
    # ZeRO
    "ZeRO.optimizer_class": Case(lambda v: _zero(cls=v), "optimizer_class", NOT_CLASS),
    "ZeRO.process_group": Case(lambda v: _zero(process_group=v), "process_group", NOT_GROUP),
    "ZeRO.parameters_as_bucket_view": Case(lambda v: _zero(parameters_as_bucket_view=v),
                                           "parameters_as_bucket_view", NOT_BOOL),
    "ZeRO.overlap_with_ddp": Case(lambda v: _zero(overlap_with_ddp=v), "overlap_with_ddp", NOT_BOOL),
    "ZeRO.lr": Case(lambda v: _zero(lr=v), "lr", st.one_of(st.text(max_size=4), NEGATIVE)),
    # other optimizers
    **{f"{name}.lr": Case(lambda v, name=name: _functional(name, lr=v), "lr", st.one_of(NOT_NUMBER, NEGATIVE_OR_NAN))
       for name in FUNCTIONAL},
    "_FunctionalAdam.betas": Case(lambda v: _functional("_FunctionalAdam", betas=v), "betas",
                                  st.one_of(st.text(max_size=4), st.tuples(st.floats(0, 0.9)), st.integers())),
    "_FunctionalSGD.params": Case(lambda v: _FunctionalSGD_params(v), "params", NOT_ITERABLE),
    "apply_optimizer_in_backward.optimizer_class": Case(lambda v: _in_backward(optimizer_class=v),
                                                        "optimizer_class", NOT_CLASS),
    "apply_optimizer_in_backward.optimizer_kwargs": Case(lambda v: _in_backward(optimizer_kwargs=v),
                                                         "optimizer_kwargs", st.one_of(st.text(max_size=4),
                                                                                       st.integers())),
    "apply_optimizer_in_backward.lr": Case(lambda v: _in_backward(optimizer_kwargs={"lr": v}), "lr",
                                           st.one_of(st.text(max_size=4), NEGATIVE)),
    "apply_optimizer_in_backward.params": Case(lambda v: _in_backward(params=v), "params", NOT_ITERABLE),
    "apply_optimizer_in_backward.register_hook": Case(lambda v: _in_backward(register_hook=v), "register_hook",
                                                      NOT_BOOL),
    "PostLocalSGDOptimizer.optim": Case(lambda v: _post_local_optimizer(optim=v), "optim", NOT_NUMBER),
    "PostLocalSGDOptimizer.averager": Case(lambda v: _post_local_optimizer(averager=v), "averager", NOT_NUMBER),
    # model averaging
    "PeriodicModelAverager.period": Case(lambda v: _averager(period=v), "period", st.one_of(NOT_INT, ints_below(1))),
    "PeriodicModelAverager.warmup_steps": Case(lambda v: _averager(warmup_steps=v), "warmup_steps",
                                               st.one_of(NOT_INT, ints_below(0))),
    "PeriodicModelAverager.process_group": Case(lambda v: _averager(process_group=v), "process_group", NOT_GROUP),
    "HierarchicalModelAverager": Case(_hierarchical, "period_group_size_dict", NOT_ITERABLE),
    # comm hook states
    "PostLocalSGDState.start_localSGD_iter": Case(lambda v: _post_local(start_localSGD_iter=v),
                                                  "start_localSGD_iter", st.one_of(NOT_INT, ints_below(0))),
    "PostLocalSGDState.post_local_gradient_allreduce": Case(lambda v: _post_local(post_local_gradient_allreduce=v),
                                                            "post_local_gradient_allreduce", NOT_BOOL),
    "PostLocalSGDState.subgroup": Case(lambda v: _post_local(subgroup=v), "subgroup", NOT_GROUP),
    "PowerSGDState.matrix_approximation_rank": Case(lambda v: _power_sgd(matrix_approximation_rank=v),
                                                    "matrix_approximation_rank", st.one_of(NOT_INT, ints_below(1))),
    "PowerSGDState.start_powerSGD_iter": Case(lambda v: _power_sgd(start_powerSGD_iter=v), "start_powerSGD_iter",
                                              st.one_of(NOT_INT, ints_below(0))),
    "PowerSGDState.use_error_feedback": Case(lambda v: _power_sgd(use_error_feedback=v), "use_error_feedback",
                                             NOT_BOOL),
    "PowerSGDState.orthogonalization_epsilon": Case(lambda v: _power_sgd(orthogonalization_epsilon=v),
                                                    "orthogonalization_epsilon",
                                                    st.one_of(NOT_NUMBER, NEGATIVE_OR_NAN)),
    "PowerSGDState.process_group": Case(lambda v: _power_sgd(process_group=v), "process_group", NOT_GROUP),
}


def _FunctionalSGD_params(value: Any) -> Any:  # noqa: N802 - named after the class it builds
    from tensorplay.distributed.optim import _FunctionalSGD
    return _FunctionalSGD(value, lr=0.1)


def _names_value(message: str, value: Any) -> bool:
    if isinstance(value, float) and value != value:
        return "nan" in message
    texts = {repr(value), str(value)}
    if isinstance(value, float) and value.is_integer():
        texts.add(str(int(value)))
    return any(text in message for text in texts)


@pytest.mark.parametrize("name", list(CASES))
@SETTINGS
@given(data=st.data())
def test_bad_argument_is_a_clear_error(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    value = data.draw(case.values, label=case.arg)
    with pytest.raises((TypeError, ValueError)) as caught:
        case.call(value)
    message = str(caught.value)
    assert type(caught.value) in (TypeError, ValueError), f"{name}: {type(caught.value).__name__}: {message}"
    assert re.search(rf"\b{re.escape(case.arg)}\b", message), f"{name}: argument not named: {message}"
    assert _names_value(message, value), f"{name}: value {value!r} not named: {message}"
