"""The classic ``FullyShardedDataParallel`` wrapper: one flat parameter per wrapped unit."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

import tensorplay.distributed as dist
from tensorplay.distributed._not_traced import not_traced
from tensorplay.distributed._sharding.param_entries import offer_param_entries
from tensorplay.distributed._torch_identity import as_ours, identity_only

from .. import _torch_types as torch_fsdp
from .._load_guard import check_loads_through_parents
from ..api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ..wrap import auto_wrap
from . import comm_hook, construction, deprecation, foreign_helpers, runtime
from . import optim_state_dict as optim_sd
from . import state_dict as sd_hooks
from .arguments import check_fsdp_args, check_state_dict_type_args
from .flat_param import FlatParamHandle
from .grad_norm import clip_grad_norm_
from .join import ClassicJoinable
from .load_check import check_loadable
from .optim_methods import OptimStateDictMethods
from .sharding_plan import HYBRID_STRATEGIES, ProcessGroupArg, make_plan
from .summon import summon_full_params
from .torch_state_view import TorchStateView
from .unit_state import WRAPPED, TrainingState, UnitOptions, UnitState, clean_fqn, named_states


@identity_only
class FullyShardedDataParallel(ClassicJoinable, OptimStateDictMethods, TorchStateView,
                               torch_fsdp.FullyShardedDataParallel):
    """Shard a module's parameters, gradients and optimizer state across ranks, one flat parameter per unit.

    ``auto_wrap_policy`` makes chosen submodules their own units (gathered and
    freed one at a time); the root unit takes the remaining parameters. Arguments
    and defaults follow PyTorch's class of the same name. Unlike PyTorch's,
    ``CPUOffload(offload_params=True)``, ``FullStateDictConfig(offload_to_cpu=True)``
    and ``HYBRID_SHARD`` with explicit groups work without an accelerator, and
    ``device_id`` may be the CPU; a forward without backward (evaluation with
    grad enabled) does not leave gathered parameters behind that a later
    iteration would use stale after ``optimizer.step()``; and with
    ``use_orig_params=True`` the optimizer state dict keeps ``exp_avg`` and
    ``exp_avg_sq`` apart on CPU (PyTorch 2.13 returns the latter for both).
    ``limit_all_gathers`` is accepted for compatibility and changes nothing (it
    is only read back as the attribute of that name): PyTorch's rate limiter
    keeps the CPU thread from issuing all-gathers far ahead of the GPU streams
    (at most two in flight), and ours never runs ahead: a unit waits for its own
    gather before it prefetches the next unit's, so at most one all-gather is in
    flight, with ``limit_all_gathers`` True or False and with or without streams. ``register_comm_hook`` takes
    PyTorch's FSDP hooks; with an ``auto_wrap_policy``, ``MixedPrecision``'s
    ``_module_classes_to_ignore`` (batch norms) get their own full-precision
    units, as in PyTorch. The optimizer state-dict static methods are inherited
    from :class:`~.optim_methods.OptimStateDictMethods`. It is also PyTorch's
    ``FullyShardedDataParallel`` for ``isinstance`` (Lightning's ``FSDPStrategy``,
    transformers): PyTorch's static methods called with it give PyTorch's result
    or refuse before any change ([Note: PyTorch's helpers on classic FSDP]).

    Example::

        import functools
        import tensorplay as tp
        from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from tensorplay.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy,
                                   transformer_layer_cls={tp.nn.TransformerEncoderLayer})
        model = FSDP(model, auto_wrap_policy=policy, mixed_precision=MixedPrecision(param_dtype=tp.bfloat16))
        optim = tp.optim.Adam(model.parameters(), lr=1e-3)
        model(batch).sum().backward()
        optim.step()

    Example:
        >>> import tensorplay as tp
        >>> from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
        >>> model = FSDP(tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.Linear(16, 4)),
        ...              auto_wrap_policy=ModuleWrapPolicy({tp.nn.Linear}))
        >>> optimizer = tp.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model(tp.randn(2, 8)).sum().backward()
        >>> optimizer.step()
    """

    _fsdp_wrapped_module: nn.Module
    _fsdp_state: UnitState          # everything the runtime, state-dict and summon code work on

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroupArg = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Module | nn.Parameter] | None = None,
        device_mesh: Any | None = None,
    ) -> None:
        sharding_strategy, cpu_offload = as_ours(sharding_strategy, ShardingStrategy), as_ours(cpu_offload, CPUOffload)
        backward_prefetch = as_ours(backward_prefetch, BackwardPrefetch)
        mixed_precision = as_ours(mixed_precision, MixedPrecision)  # PyTorch's options are taken as ours
        check_fsdp_args(module, process_group, sharding_strategy, cpu_offload, auto_wrap_policy, backward_prefetch,
                        mixed_precision, ignored_modules, param_init_fn, device_id,
                        dict(sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                             limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params),
                        ignored_states, device_mesh)
        nn.Module.__init__(self)  # never PyTorch's __init__: [Note: type identity only]
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module is already a FullyShardedDataParallel; wrap its inner module instead")
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            deprecation.container(module)
        plan = make_plan(sharding_strategy or ShardingStrategy.FULL_SHARD, process_group, device_mesh)
        if plan.strategy is ShardingStrategy.NO_SHARD and plan.replicate_size > 1:
            deprecation.no_shard()
        ignored_modules_set, ignored_params = construction.resolve_ignored(module, ignored_modules, ignored_states)
        construction.refuse_tensor_parallel(module, ignored_params)
        if auto_wrap_policy is not None:
            child_kwargs = dict(
                process_group=plan.group_arg, sharding_strategy=plan.strategy, cpu_offload=cpu_offload,
                backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                ignored_modules=ignored_modules, param_init_fn=param_init_fn, device_id=device_id,
                sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params, ignored_states=ignored_states)
            full_precision = construction.full_precision_classes(module, mixed_precision, ignored_modules_set)

            def wrap_fn(child: nn.Module, overrides: dict[str, Any]) -> FullyShardedDataParallel:
                if isinstance(child, full_precision):
                    overrides = {**overrides, "mixed_precision": None}
                unit = FullyShardedDataParallel(child, **{**child_kwargs, **overrides})
                unit._fsdp_state.device_mesh = device_mesh  # nested units share the root's groups, given as a mesh
                return unit

            auto_wrap(module, auto_wrap_policy, wrap_fn=wrap_fn,
                      skip=lambda m: isinstance(m, FullyShardedDataParallel) or m in ignored_modules_set,
                      counted=lambda m: sum(p.numel() for p in m.parameters()
                                            if p not in ignored_params and not construction.is_flat(p)),
                      individually=full_precision)
        self._fsdp_wrapped_module = module
        options = UnitOptions(cpu_offload or CPUOffload(), mixed_precision, use_orig_params, backward_prefetch,
                              forward_prefetch, limit_all_gathers)
        settings = StateDictSettings(StateDictType.FULL_STATE_DICT,
                                     sd_hooks.default_config(StateDictType.FULL_STATE_DICT),
                                     optim_sd.default_config(StateDictType.FULL_STATE_DICT))
        state = construction.build_unit(module, plan, options, settings, device_id, param_init_fn,
                                        sync_module_states, (ignored_modules_set, ignored_params),
                                        lambda m: isinstance(m, FullyShardedDataParallel))
        state.device_mesh = device_mesh
        if state.handle is not None:
            state.handle.on_grad_ready = lambda _: runtime.post_backward(state)
            state.handle.grad_target = lambda _: runtime.grad_target(state)
            state.handle.reduces_on_ready = lambda _: state.sync_gradients
            state.handle.takes_full_dtype = lambda _: runtime.take_full_dtype(state)
        self._fsdp_state = state
        check_loads_through_parents(self)  # first: [Note: load through a plain parent]
        offer_param_entries(self, optim_sd.param_entries)  # the FQNs its flat parameters stand for
        sd_hooks.register_hooks(self, state)

    # ---- module glue ------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    # PyTorch's public attributes, read-only here.

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp_state.plan.strategy

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group parameters are sharded over (HYBRID: within a node; NO_SHARD: the replicas)."""
        return self._fsdp_state.plan.process_group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def compute_device(self) -> torch.device:
        return self._fsdp_state.compute_device

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._fsdp_state.options.cpu_offload

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._fsdp_state.options.mixed_precision or MixedPrecision()

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._fsdp_state.options.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._fsdp_state.options.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._fsdp_state.options.limit_all_gathers

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's flat parameter (the sharded storage of its original parameters), if it has one."""
        handle = self._fsdp_state.handle
        return [handle.flat_param] if handle is not None else []

    @property
    def training_state(self) -> runtime.TrainingState:
        return self._fsdp_state.training_state

    # PyTorch's private attributes that accelerate's FSDP plugin (version 1) reads after wrapping.

    @property
    def _has_params(self) -> bool:
        return self._fsdp_state.handle is not None

    @property
    def _handle(self) -> FlatParamHandle | None:
        return self._fsdp_state.handle

    @property
    def _flat_param(self) -> nn.Parameter | None:
        """The unit's flat parameter; its ``_fqns`` names the original parameters under the unit, in order."""
        handle = self._fsdp_state.handle
        return handle.flat_param if handle is not None else None

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's full parameters shown (and written back), e.g. for init."""
        with summon_full_params([self._fsdp_state], writeback=True, rank0_only=False, offload_to_cpu=False,
                                with_grads=False):
            return nn.Module.apply(self, fn)

    def __getitem__(self, key: int) -> Any:
        wrapped: Any = self._fsdp_wrapped_module  # a container module (Sequential, ModuleList)
        return wrapped[key]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._enter_forward(args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self._fsdp_state, output)

    @not_traced
    def _enter_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        return runtime.pre_forward(self._fsdp_state, args, kwargs)

    def _lazy_init(self) -> None:
        if self._fsdp_state.root is None:
            runtime.lazy_init(self._fsdp_state, self, named_states(self))

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP unit in ``module``'s tree (``root_only``: only the outermost ones), pre-order."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        nested = {id(inner) for unit in units for inner in unit.modules() if inner is not unit}
        return [unit for unit in units if id(unit) not in nested]

    def check_is_root(self) -> bool:
        self._lazy_init()
        return bool(self._fsdp_state.is_root)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Like ``nn.Module.named_parameters``; inside ``summon_full_params`` the names are the unwrapped ones."""
        for name, param in nn.Module.named_parameters(self, *args, **kwargs):
            yield (clean_fqn(name) if self._in_summon() else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buffer in nn.Module.named_buffers(self, *args, **kwargs):
            yield (clean_fqn(name) if self._in_summon() else name), buffer

    def _fqn_modifiers(self) -> dict[str, str]:
        """Asked only by PyTorch's ``torch.distributed.checkpoint.state_dict`` helpers, which would corrupt ours.

        Refuses (see :mod:`.foreign_helpers`): those helpers call this on every rank before anything else.
        """
        raise foreign_helpers.refusal()

    def _in_summon(self) -> bool:
        return any(unit.training_state is TrainingState.SUMMON_FULL_PARAMS for _, unit in named_states(self))

    # ---- gradients -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the first backward after the context reduces them."""
        units = _states(self)
        previous = [unit.sync_gradients for unit in units]
        for unit in units:
            unit.sync_gradients = False
        try:
            yield
        finally:
            for unit, sync in zip(units, previous, strict=True):
                unit.sync_gradients = sync

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global ``norm_type`` norm is at most ``max_norm``; return that norm.

        Sharded gradients are summed over their shard group, replicated ones
        (NO_SHARD units, ignored parameters) counted once.
        """
        if not self.check_is_root():
            raise RuntimeError("clip_grad_norm_ must be called on the root FSDP module (the outermost wrapper)")
        return clip_grad_norm_(_states(self), self.parameters(), max_norm, norm_type, self.compute_device,
                               self._fsdp_state.plan.shard_group)

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Let ``hook`` reduce the gradients of every unit of this (root) model, instead of the default reduction.

        Sharded units call ``hook(state, grad, output)`` (the padded flat unsharded
        gradient; a tensor to receive this rank's reduced shard), NO_SHARD units
        ``hook(state, grad)`` (reduce in place). PyTorch's FSDP default hooks and
        their states work as they do with PyTorch's class. Register once, on the
        root, before training; not supported with hybrid strategies.
        """
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance (the outermost "
                                 "FullyShardedDataParallel), not on a nested unit")
        _register_comm_hook(_states(self), state, hook)

    # ---- parameters in full ----------------------------------------------------------------------

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> contextlib.AbstractContextManager:
        """Show the full, full-precision parameters on every unit in ``module`` (``recurse=False``: only its own)."""
        units = _states(module)
        if not recurse:  # only ``module``'s own unit: none if it is not a unit, as in PyTorch
            units = units[:1] if isinstance(module, FullyShardedDataParallel) else []
        return summon_full_params(units, writeback=writeback, rank0_only=rank0_only,
                                  offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    # ---- state dicts -----------------------------------------------------------------------------

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config: StateDictConfig | None = None,
                            optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
        """Make ``state_dict``/``optim_state_dict`` of every unit in ``module`` use this type; return the previous."""
        deprecation.state_dict_type()
        state_dict_type = as_ours(state_dict_type, StateDictType)
        state_dict_config = as_ours(state_dict_config, StateDictConfig)
        optim_state_dict_config = as_ours(optim_state_dict_config, OptimStateDictConfig)
        check_state_dict_type_args(module, state_dict_type, state_dict_config, optim_state_dict_config)
        units = _states(module, "set_state_dict_type")
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        config = state_dict_config or sd_hooks.default_config(state_dict_type)
        optim_config = optim_state_dict_config or optim_sd.default_config(state_dict_type)
        sd_hooks.check_config(state_dict_type, config, optim_config)
        for unit in units:
            unit.state_dict_settings = StateDictSettings(state_dict_type, config, optim_config)
        return previous

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """``nn.Module.load_state_dict`` in the state-dict type set, all or nothing on every rank (collective).

        Every key and shape is checked on every rank before anything is copied: a
        problem on any rank raises one ``StateDictLoadError`` (a ``RuntimeError``)
        on every rank, listing every missing, unexpected and wrong-shape key, and
        no rank's parameters or buffers change. ``strict=False`` allows missing
        and unexpected keys (and returns them), not wrong shapes.
        """
        plan = self._fsdp_state.plan
        groups = [group for group in (plan.shard_group, plan.replicate_group) if group is not None]
        check_loadable(self, _states(self), state_dict, strict, groups)
        return nn.Module.load_state_dict(self, state_dict, strict, assign)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        return dataclasses.replace(_states(module, "get_state_dict_type")[0].state_dict_settings)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> Iterator[None]:
        """Within the context, ``state_dict``/``load_state_dict`` (and the optimizer's) use ``state_dict_type``."""
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(module, previous.state_dict_type,
                                                         previous.state_dict_config,
                                                         previous.optim_state_dict_config)


def _register_comm_hook(units: list[UnitState], state: object, hook: Callable[..., None]) -> None:
    """Make ``hook`` reduce the gradients of every unit in ``units`` (all checked before any is changed)."""
    if not callable(hook):
        raise ValueError(f"The communication hook must be callable but got {hook!r}")
    for unit in units:
        strategy = unit.plan.strategy
        if strategy in HYBRID_STRATEGIES:
            raise AssertionError(f"Communication hook is not supported for hybrid strategies: {strategy} "
                                 f"(unit {unit.name!r}); use FULL_SHARD or SHARD_GRAD_OP")
        if unit.comm_hook is not None:
            raise AssertionError("A communication hook is already registered "
                                 f"(unit {unit.name!r}); register one hook, once, on the root")
        if unit.handle is not None:
            comm_hook.check_signature(hook, unit.handle.is_sharded_over_ranks, strategy)
    hook_of_units = comm_hook.CommHook(state, hook, compresses=comm_hook.is_compressing_hook(hook))
    for unit in units:
        unit.comm_hook = hook_of_units
        if unit.handle is not None:
            unit.handle.comm_hook = hook_of_units


def _states(module: nn.Module, needed_by: str | None = None) -> list[UnitState]:
    """The state of every unit in ``module``'s tree, pre-order (``needed_by``: refuse a tree without units)."""
    units = [unit for _, unit in named_states(module)]
    if needed_by is not None and not units:
        raise ValueError(f"{needed_by}: module contains no FullyShardedDataParallel unit")
    return units
