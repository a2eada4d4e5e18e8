"""Functional optimizers: parity with the tp.optim classes and PyTorch's functional optimizers.

Every comparison is bitwise (``torch.equal``) on parameters and on every state
tensor: our update functions run the same operation order as ``torch.optim``
for the same path (per-tensor, foreach, fused).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed.optim as torch_dist_optim

import tensorplay as tp
from tensorplay.distributed.optim.functional._updates import adagrad_step
from tensorplay.distributed.optim.functional_adadelta import _FunctionalAdadelta
from tensorplay.distributed.optim.functional_adagrad import _FunctionalAdagrad
from tensorplay.distributed.optim.functional_adam import _FunctionalAdam
from tensorplay.distributed.optim.functional_adamax import _FunctionalAdamax
from tensorplay.distributed.optim.functional_adamw import _FunctionalAdamW
from tensorplay.distributed.optim.functional_rmsprop import _FunctionalRMSprop
from tensorplay.distributed.optim.functional_rprop import _FunctionalRprop
from tensorplay.distributed.optim.functional_sgd import _FunctionalSGD
from tensorplay.distributed.optim.utils import (
    as_functional_optim,
    functional_optim_from,
    functional_optim_map,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS = 3


@dataclass(frozen=True)
class Spec:
    name: str
    class_optim: type
    ours: type
    theirs: type
    grid: list[dict[str, Any]] = field(hash=False)
    fused: bool = False


SPECS = [
    Spec("Adam", tp.optim.Adam, _FunctionalAdam, torch_dist_optim._FunctionalAdam, [
        {}, {"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True, "weight_decay": 0.05},
        {"betas": (0.8, 0.9), "eps": 1e-6, "amsgrad": True, "maximize": True}], fused=True),
    Spec("AdamW", tp.optim.AdamW, _FunctionalAdamW, torch_dist_optim._FunctionalAdamW, [
        {}, {"weight_decay": 0.0}, {"amsgrad": True, "weight_decay": 0.3}, {"maximize": True}], fused=True),
    Spec("SGD", tp.optim.SGD, _FunctionalSGD, torch_dist_optim._FunctionalSGD, [
        {}, {"weight_decay": 0.1}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.5},
        {"momentum": 0.9, "nesterov": True}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
        {"momentum": 0.5, "maximize": True, "weight_decay": 0.1}], fused=True),
    Spec("RMSprop", tp.optim.RMSprop, _FunctionalRMSprop, torch_dist_optim._FunctionalRMSprop, [
        {}, {"centered": True}, {"momentum": 0.9}, {"momentum": 0.9, "centered": True, "weight_decay": 0.1},
        {"alpha": 0.9, "maximize": True}]),
    Spec("Adagrad", tp.optim.Adagrad, _FunctionalAdagrad, torch_dist_optim._FunctionalAdagrad, [
        {}, {"lr_decay": 0.1}, {"weight_decay": 0.1}, {"initial_accumulator_value": 0.5, "eps": 1e-6},
        {"maximize": True, "weight_decay": 0.1}], fused=True),
    Spec("Adadelta", tp.optim.Adadelta, _FunctionalAdadelta, torch_dist_optim._FunctionalAdadelta, [
        {}, {"rho": 0.5}, {"weight_decay": 0.1}, {"maximize": True, "eps": 1e-4}]),
    Spec("Adamax", tp.optim.Adamax, _FunctionalAdamax, torch_dist_optim._FunctionalAdamax, [
        {}, {"weight_decay": 0.1}, {"betas": (0.5, 0.7)}, {"maximize": True, "weight_decay": 0.1}]),
    Spec("Rprop", tp.optim.Rprop, _FunctionalRprop, torch_dist_optim._FunctionalRprop, [
        {}, {"etas": (0.3, 1.5)}, {"step_sizes": (1e-3, 0.02)}, {"maximize": True}]),
]


def _cases() -> list:
    cases = []
    for spec in SPECS:
        for i, options in enumerate(spec.grid):
            for path in ("single", "foreach") + (("fused",) if spec.fused and i < 2 else ()):
                cases.append(pytest.param(spec, options, path, id=f"{spec.name}-{i}-{path}"))
    return cases


def _path_kwargs(path: str) -> dict[str, bool]:
    """Options selecting the kernel path: per-tensor ("single"), "foreach" or "fused"."""
    return {"foreach": False, "fused": True} if path == "fused" else {"foreach": path == "foreach"}


def _initial_params(dtypes=(torch.float32, torch.float32, torch.float64)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            for shape, dtype in zip(shapes, dtypes, strict=True)]


def _grad_schedule(params: list[torch.Tensor], with_none: bool = False) -> list[list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(1)
    schedule = []
    for step in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]
        # A sign flip on the last step exercises Rprop's shrink branch.
        if step == STEPS - 1:
            grads = [-g for g in grads]
        if with_none and step == 1:
            grads[1] = None
        schedule.append(grads)
    return schedule


def _run_class(spec: Spec, options: dict, path_kwargs: dict, schedule) -> tuple[list, list]:
    params = [p.clone().requires_grad_() for p in _initial_params_for(schedule)]
    optim = spec.class_optim(params, lr=0.01, **options, **path_kwargs)
    for grads in schedule:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        optim.step()
    return [p.detach() for p in params], [optim.state[p] for p in params]


def _initial_params_for(schedule) -> list[torch.Tensor]:
    like = [next(grads[i] for grads in schedule if grads[i] is not None) for i in range(len(schedule[0]))]
    return [p.to(g.device) for p, g in zip(_initial_params(tuple(g.dtype for g in like)), like, strict=True)]


def _run_functional(cls: type, options: dict, path_kwargs: dict, schedule, how: str) -> tuple[list, list]:
    params = [p.clone() for p in _initial_params_for(schedule)]
    if how == "as_functional":
        optim = cls([], lr=0.01, **options, **path_kwargs, _allow_empty_param_list=True)
    else:
        optim = cls(params, lr=0.01, **options, **path_kwargs)
    for grads in schedule:
        grads = [None if g is None else g.clone() for g in grads]
        if how == "step":
            optim.step(grads)
        elif how == "step_params":
            optim.step_params(params, grads)
        else:
            for p, g in zip(params, grads, strict=True):
                optim.step_param(p, g)
    return params, [optim.state.get(p, {}) for p in params]


def _assert_same(expected: tuple[list, list], actual: tuple[list, list], what: str) -> None:
    exp_params, exp_states = expected
    act_params, act_states = actual
    for i, (e, a) in enumerate(zip(exp_params, act_params, strict=True)):
        assert torch.equal(e, a), f"{what}: params[{i}] differ (max {(e - a).abs().max().item():.3g})"
    for i, (e, a) in enumerate(zip(exp_states, act_states, strict=True)):
        assert set(e) == set(a), f"{what}: state[{i}] keys {sorted(a)} != {sorted(e)}"
        for key in e:
            assert torch.equal(e[key], a[key]), f"{what}: state[{i}][{key!r}] differs"
            assert e[key].dtype == a[key].dtype and e[key].device == a[key].device, f"{what}: {key} dtype/device"


@pytest.mark.parametrize(("spec", "options", "path"), _cases())
def test_matches_class_optimizer_and_pytorch_functional(spec: Spec, options: dict, path: str) -> None:
    path_kwargs = _path_kwargs(path)
    schedule = _grad_schedule(_initial_params())
    reference = _run_class(spec, options, path_kwargs, schedule)
    for how in ("step", "step_param", "step_params"):
        _assert_same(reference, _run_functional(spec.ours, options, path_kwargs, schedule, how), f"ours.{how}")
    _assert_same(_run_functional(spec.theirs, options, path_kwargs, schedule, "step"), reference,
                 "PyTorch's functional optimizer")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_cuda_paths_match_class(spec: Spec) -> None:
    """On the GPU foreach and fused run different kernels from per-tensor ones: each must match the
    class optimizer's own path."""
    schedule = [[g.cuda() for g in grads] for grads in _grad_schedule(_initial_params())]
    for path in ("single", "foreach") + (("fused",) if spec.fused else ()):
        for options in spec.grid:
            reference = _run_class(spec, options, _path_kwargs(path), schedule)
            _assert_same(reference, _run_functional(spec.ours, options, _path_kwargs(path), schedule, "step"),
                         f"cuda {path} {options}")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("path", ["single", "foreach"])
def test_none_gradients_skip_the_parameter(spec: Spec, path: str) -> None:
    schedule = _grad_schedule(_initial_params(), with_none=True)
    options = spec.grid[-1]
    reference = _run_class(spec, options, _path_kwargs(path), schedule)
    _assert_same(reference, _run_functional(spec.ours, options, _path_kwargs(path), schedule, "step"), "step")
    _assert_same(reference, _run_functional(spec.ours, options, _path_kwargs(path), schedule, "as_functional"),
                 "as_functional + step_param")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("path", ["single", "foreach"])
def test_complex_parameters_match_class(spec: Spec, path: str) -> None:
    schedule = _grad_schedule(_initial_params((torch.complex64, torch.float32, torch.complex128)))
    options = spec.grid[-1]
    reference = _run_class(spec, options, _path_kwargs(path), schedule)
    _assert_same(reference, _run_functional(spec.ours, options, _path_kwargs(path), schedule, "step"), "complex")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_state_moves_into_the_class_optimizer(spec: Spec) -> None:
    """Two functional steps, then the state handed to the class optimizer for the last step:
    the same as three class steps (the state layouts are the same)."""
    schedule = _grad_schedule(_initial_params())
    options = {**spec.grid[-1], "lr": 0.01}
    reference = _run_class(spec, spec.grid[-1], {}, schedule)
    params = _initial_params()
    functional = spec.ours(params, **options)
    for grads in schedule[:-1]:
        functional.step([g.clone() for g in grads])
    leaves = [p.clone().requires_grad_() for p in params]
    optim = spec.class_optim(leaves, **options)
    state = {i: {k: v.clone() for k, v in functional.state[p].items()} for i, p in enumerate(params)}
    optim.load_state_dict({"state": state, "param_groups": optim.state_dict()["param_groups"]})
    for p, g in zip(leaves, schedule[-1], strict=True):
        p.grad = g.clone()
    optim.step()
    _assert_same(reference, ([p.detach() for p in leaves], [optim.state[p] for p in leaves]), "resumed")


# ----------------------------------------------------------------------------- sparse gradients

def _sparse_grad(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.tensor([[0, 2, 0], [1, 0, 1]])  # a repeated index: coalescing matters
    return torch.sparse_coo_tensor(indices, torch.randn(3, generator=gen), shape)


@pytest.mark.parametrize(("spec", "options"), [
    (SPECS[2], {"momentum": 0.9}), (SPECS[2], {"momentum": 0.9, "nesterov": True, "maximize": True}),
    (SPECS[4], {}), (SPECS[4], {"lr_decay": 0.1, "maximize": True})], ids=["sgd", "sgd-nesterov", "adagrad",
                                                                        "adagrad-decay"])
@pytest.mark.parametrize("foreach", [False, True])
def test_sparse_gradients_where_supported(spec: Spec, options: dict, foreach: bool) -> None:
    init = torch.randn(3, 2, generator=torch.Generator().manual_seed(3))
    ref = init.clone().requires_grad_()
    ours_param = init.clone()
    optim = spec.class_optim([ref], lr=0.1, foreach=foreach, **options)
    ours = spec.ours([ours_param], lr=0.1, foreach=foreach, **options)
    for step in range(STEPS):
        ref.grad = _sparse_grad((3, 2), step)
        optim.step()
        ours.step([_sparse_grad((3, 2), step)])
    assert torch.equal(ref.detach(), ours_param)


@pytest.mark.parametrize("cls", [_FunctionalAdam, _FunctionalAdamW, _FunctionalRMSprop, _FunctionalAdadelta,
                                 _FunctionalAdamax, _FunctionalRprop])
def test_sparse_gradient_refused_naming_the_index(cls: type) -> None:
    optim = cls([torch.zeros(3, 2), torch.zeros(3, 2)])
    with pytest.raises(RuntimeError, match=r"gradients\[1\] is a sparse gradient.*does not support sparse"):
        optim.step([torch.zeros(3, 2), _sparse_grad((3, 2), 0)])


@pytest.mark.parametrize(("cls", "options", "option_named"), [
    (_FunctionalAdagrad, {"weight_decay": 0.1}, "weight_decay=0.1"),
    (_FunctionalAdagrad, {"fused": True}, "fused=True"),
    (_FunctionalSGD, {"fused": True}, "fused=True")])
def test_sparse_gradient_refused_naming_the_option(cls: type, options: dict, option_named: str) -> None:
    optim = cls([torch.zeros(3, 2)], **options)
    with pytest.raises(RuntimeError, match=rf"gradients\[0\] is a sparse gradient, but {option_named}"):
        optim.step([_sparse_grad((3, 2), 0)])
    with pytest.raises(RuntimeError, match=r"grad is a sparse gradient"):
        optim.step_param(optim.param_group["params"][0], _sparse_grad((3, 2), 0))


def test_update_function_refuses_sparse_with_weight_decay() -> None:
    param, total, step = torch.zeros(3, 2), torch.zeros(3, 2), torch.tensor(0.0)
    with pytest.raises(RuntimeError, match="weight_decay is not supported with sparse"):
        adagrad_step([param], [_sparse_grad((3, 2), 0)], [total], [step], lr=0.1, lr_decay=0.0,
                     weight_decay=0.1, eps=1e-10, maximize=False)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_mismatched_gradient_count(spec: Spec) -> None:
    optim = spec.ours([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"got 1 gradients for 2 parameters"):
        optim.step([torch.zeros(2)])
    with pytest.raises(ValueError, match=r"step_params got 3 gradients for 2 parameters"):
        optim.step_params(optim.param_group["params"], [torch.zeros(2), torch.zeros(3), None])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_non_leaf_parameter_named_by_index(spec: Spec) -> None:
    leaf = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"params\[1\] is not a leaf tensor"):
        spec.ours([leaf, leaf * 2])
    optim = spec.ours([], _allow_empty_param_list=True)
    with pytest.raises(ValueError, match=r"param is not a leaf tensor"):
        optim.step_param(leaf * 2, torch.ones(2))


def test_gradient_shape_mismatch_named() -> None:
    optim = _FunctionalAdam([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"gradients\[1\] has shape \(2,\) but its parameter has shape \(3,\)"):
        optim.step([torch.zeros(2), torch.zeros(2)])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_empty_parameter_list(spec: Spec) -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        spec.ours([])
    assert spec.ours([], _allow_empty_param_list=True).param_group["params"] == []


@pytest.mark.parametrize(("cls", "options", "named"), [
    (_FunctionalAdam, {"lr": -1.0}, "lr=-1.0"), (_FunctionalAdam, {"betas": (1.0, 0.9)}, r"betas\[0\]=1.0"),
    (_FunctionalAdamW, {"eps": -1e-8}, "eps="), (_FunctionalSGD, {"momentum": -0.1}, "momentum=-0.1"),
    (_FunctionalSGD, {"nesterov": True}, "nesterov=True needs momentum"),
    (_FunctionalRMSprop, {"alpha": -0.5}, "alpha=-0.5"), (_FunctionalAdagrad, {"lr_decay": -1.0}, "lr_decay"),
    (_FunctionalAdadelta, {"rho": 1.5}, "rho=1.5"), (_FunctionalAdamax, {"betas": (0.9, 1.0)}, r"betas\[1\]"),
    (_FunctionalRprop, {"etas": (1.5, 1.2)}, "etas="), (_FunctionalAdam, {"foreach": True, "fused": True},
                                                        "foreach=True and fused=True")])
def test_invalid_options_named(cls: type, options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        cls([torch.zeros(2)], **options)


def test_fused_refuses_integer_parameters() -> None:
    with pytest.raises(RuntimeError, match=r"fused=True needs floating-point.*params\[0\] is torch.int64"):
        _FunctionalAdam([torch.zeros(2, dtype=torch.long)], fused=True)


def test_sgd_step_param_with_none_grad_is_a_noop() -> None:
    param = torch.ones(3)
    optim = _FunctionalSGD([param], lr=0.1, momentum=0.9)
    optim.step_param(param, None)  # PyTorch's raises IndexError here
    assert torch.equal(param, torch.ones(3)) and optim.state == {}


def test_adagrad_warmup_options_warn() -> None:
    with pytest.warns(UserWarning, match="warmup_lr_multiplier and warmup_num_iters have no effect"):
        _FunctionalAdagrad([torch.zeros(2)], warmup_num_iters=10)


# ----------------------------------------------------------------------------- as_functional_optim

def test_functional_optim_map_covers_the_eight() -> None:
    assert {cls.__name__ for cls in functional_optim_map} == {
        "Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Rprop"}
    for spec in SPECS:
        assert functional_optim_map[spec.class_optim] is spec.ours


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_as_functional_optim_steps_like_the_class(spec: Spec) -> None:
    schedule = _grad_schedule(_initial_params())
    options = spec.grid[-1]
    reference = _run_class(spec, options, {}, schedule)
    params = _initial_params()
    optim = as_functional_optim(spec.class_optim, lr=0.01, **options)
    assert isinstance(optim, spec.ours) and optim.param_group["params"] == []
    for grads in schedule:
        for p, g in zip(params, grads, strict=True):
            optim.step_param(p, g.clone())
    _assert_same(reference, (params, [optim.state[p] for p in params]), "as_functional_optim")


def test_as_functional_optim_unsupported_class_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"'LBFGS' has no functional form; supported: .*Adadelta.*SGD"):
        as_functional_optim(tp.optim.LBFGS, lr=0.1)


def test_functional_optim_from_accepts_class_options_that_are_off() -> None:
    params = [torch.zeros(2)]
    optim = functional_optim_from(tp.optim.Adam, params, lr=0.1, foreach=None, capturable=False,
                                  differentiable=False)
    assert isinstance(optim, _FunctionalAdam) and optim.param_group["params"] == params
    assert functional_optim_from(_FunctionalSGD, [], lr=0.1).defaults["lr"] == 0.1
    with pytest.raises(TypeError, match=r"_FunctionalAdam does not support capturable=True; its options are: lr"):
        functional_optim_from(tp.optim.Adam, params, capturable=True)


def test_only_pytorchs_deprecation_notice_from_ours() -> None:
    """Construction gives PyTorch's TorchScript notice (tests/unit/test_optim_deprecations.py); a step nothing."""
    with pytest.warns(DeprecationWarning, match="`TorchScript` support for functional optimizers is deprecated"):
        optim = _FunctionalAdam([torch.zeros(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim.step([torch.ones(2)])


def test_package_exports_are_ours() -> None:
    import tensorplay.distributed.optim as optim_pkg

    names = ["as_functional_optim", "apply_optimizer_in_backward", "_apply_optimizer_in_backward",
             "_get_in_backward_optimizers"] + [f"_Functional{spec.name}" for spec in SPECS]
    for name in names:
        assert name in optim_pkg.__all__, name
        assert getattr(optim_pkg, name).__module__.startswith("tensorplay.distributed.optim."), name
    assert optim_pkg._FunctionalAdam is _FunctionalAdam and optim_pkg.as_functional_optim is as_functional_optim


# --- the TorchScript updates an RPC owner runs (_script_updates) ---------------

SCRIPTED = [spec for spec in SPECS if spec.name in ("Adam", "AdamW", "SGD")]


def _run_scripted(spec: Spec, options: dict, schedule) -> tuple[list, list, int]:
    """Steps as a DistributedOptimizer owner takes them: the scripted update, or the Python step (which
    creates the state) where the script declines; returns the parameters, the states and the script's steps."""
    params = [p.clone() for p in _initial_params_for(schedule)]
    optim = spec.ours(params, lr=0.01, **options)
    script = torch.jit.script(optim._script_update())
    scripted = 0
    for grads in schedule:
        grads = [None if g is None else g.clone() for g in grads]
        if script.step(grads):
            scripted += 1
        else:
            optim.step(grads)
            script.set_state([optim.state.get(p, {}) for p in params])
    return params, [optim.state.get(p, {}) for p in params], scripted


@pytest.mark.parametrize(("spec", "options"), [pytest.param(spec, options, id=f"{spec.name}-{i}")
                                               for spec in SCRIPTED for i, options in enumerate(spec.grid)])
def test_scripted_update_matches_class_optimizer(spec: Spec, options: dict) -> None:
    schedule = _grad_schedule(_initial_params())
    params, states, scripted = _run_scripted(spec, options, schedule)
    _assert_same(_run_class(spec, options, _path_kwargs("single"), schedule), (params, states), "scripted")
    stateless = spec.name == "SGD" and not options.get("momentum")
    assert scripted == (STEPS if stateless else STEPS - 1)  # only the first step needs Python (the state)


@pytest.mark.parametrize("spec", SCRIPTED, ids=lambda s: s.name)
def test_scripted_update_waits_for_a_late_first_gradient(spec: Spec) -> None:
    """A parameter without a gradient on the first step has no state yet: its first step runs in Python."""
    schedule = _grad_schedule(_initial_params(), with_none=True)
    schedule[0][2] = None
    options = spec.grid[-1]
    params, states, scripted = _run_scripted(spec, options, schedule)
    _assert_same(_run_class(spec, options, _path_kwargs("single"), schedule), (params, states), "late gradient")
    assert scripted == STEPS - 2


def test_scripted_sgd_on_complex_parameters_matches_class() -> None:
    spec, options = SCRIPTED[-1], {"momentum": 0.9, "weight_decay": 0.1}
    schedule = _grad_schedule(_initial_params((torch.complex64, torch.float32, torch.complex128)))
    params, states, _ = _run_scripted(spec, options, schedule)
    _assert_same(_run_class(spec, options, _path_kwargs("single"), schedule), (params, states), "complex")


@pytest.mark.parametrize(("cls", "options"), [
    (_FunctionalSGD, {"foreach": True}), (_FunctionalSGD, {"fused": True}), (_FunctionalAdam, {"foreach": True}),
    (_FunctionalAdamW, {"fused": True}), (_FunctionalAdam, {"lr": torch.tensor(0.01)}),
    (_FunctionalRMSprop, {}),
])
def test_no_scripted_update_where_only_python_steps(cls: type, options: dict) -> None:
    assert cls([torch.zeros(2)], **options)._script_update() is None
    assert _FunctionalAdam([torch.zeros(2, dtype=torch.complex64)])._script_update() is None


def test_scripted_update_declines_a_sparse_or_misshapen_gradient() -> None:
    """Declined untouched, so the Python step raises its clear error."""
    param = torch.ones(3, 2)
    optim = _FunctionalSGD([param], lr=0.1)
    script = torch.jit.script(optim._script_update())
    assert not script.step([torch.ones(2, 3)])
    assert not script.step([torch.ones(3, 2).to_sparse()])
    assert torch.equal(param, torch.ones(3, 2))
