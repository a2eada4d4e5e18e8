"""The classic ``FullyShardedDataParallel`` wrapper: one flat parameter per wrapped unit."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

import tensorplay.distributed as dist

from ..api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ..wrap import auto_wrap
from . import comm_hook, construction, deprecation, runtime
from . import optim_state_dict as optim_sd
from . import state_dict as sd_hooks
from .arguments import check_fsdp_args, check_state_dict_type_args
from .flat_param import FlatParamHandle
from .join import ClassicJoinable
from .param_views import FlatParamViews, OrigParamViews
from .placement import Placement, Precision, compute_in_full_precision
from .plan_agreement import check_unit_plan
from .sharding_plan import ProcessGroupArg, make_plan
from .summon import summon_full_params

WRAPPED = "_fsdp_wrapped_module"
_WRAPPED_PREFIX = WRAPPED + "."


def clean_fqn(name: str) -> str:
    """``name`` without the wrapper's components (the FQN the unwrapped model uses)."""
    return name.replace(_WRAPPED_PREFIX, "")


class FullyShardedDataParallel(ClassicJoinable, nn.Module):
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
    ``limit_all_gathers`` needs no rate limiter here: a unit waits for its own
    gather before it prefetches the next unit's, so at most one all-gather is in
    flight (PyTorch's limiter allows two). ``register_comm_hook`` takes
    PyTorch's FSDP hooks; with an ``auto_wrap_policy``, ``MixedPrecision``'s
    ``_module_classes_to_ignore`` (batch norms) get their own full-precision
    units, as in PyTorch.

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
    """

    _fsdp_wrapped_module: nn.Module
    _handle: FlatParamHandle | None
    _root_state: runtime.RootState | None
    _is_root: bool | None
    _sync_gradients: bool          # False inside no_sync()
    _ran_pre_backward: bool        # this iteration's backward has reached the unit
    _training_state: runtime.TrainingState
    _compute_device: torch.device

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
        check_fsdp_args(module, process_group, sharding_strategy, cpu_offload, auto_wrap_policy, backward_prefetch,
                        mixed_precision, ignored_modules, param_init_fn, device_id,
                        dict(sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                             limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params),
                        ignored_states, device_mesh)
        super().__init__()
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module is already a FullyShardedDataParallel; wrap its inner module instead")
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            deprecation.container(module)
        plan = make_plan(sharding_strategy or ShardingStrategy.FULL_SHARD, process_group, device_mesh)
        if plan.strategy is ShardingStrategy.NO_SHARD and plan.replicate_world > 1:
            deprecation.no_shard()
        ignored_modules_set, ignored_params = construction.resolve_ignored(module, ignored_modules, ignored_states)
        if auto_wrap_policy is not None:
            child_kwargs = dict(
                process_group=plan.group_arg, sharding_strategy=plan.strategy, cpu_offload=cpu_offload,
                backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                ignored_modules=ignored_modules, param_init_fn=param_init_fn, device_id=device_id,
                sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params, ignored_states=ignored_states)
            full_precision = _full_precision_classes(module, mixed_precision, ignored_modules_set)

            def wrap_fn(child: nn.Module, overrides: dict[str, Any]) -> FullyShardedDataParallel:
                if isinstance(child, full_precision):
                    overrides = {**overrides, "mixed_precision": None}
                unit = FullyShardedDataParallel(child, **{**child_kwargs, **overrides})
                unit._device_mesh = device_mesh  # nested units share the root's groups, given as a mesh
                return unit

            auto_wrap(module, auto_wrap_policy, wrap_fn=wrap_fn,
                      skip=lambda m: isinstance(m, FullyShardedDataParallel) or m in ignored_modules_set,
                      counted=lambda m: sum(p.numel() for p in m.parameters()
                                            if p not in ignored_params and not _is_flat(p)),
                      individually=full_precision)
        self._fsdp_wrapped_module = module
        self._device_mesh = device_mesh
        self._plan, self._cpu_offload = plan, cpu_offload or CPUOffload()
        self._mixed_precision, self._use_orig_params = mixed_precision, use_orig_params
        self._backward_prefetch, self._forward_prefetch = backward_prefetch, forward_prefetch
        self._limit_all_gathers = limit_all_gathers
        self._ignored_modules, self._ignored_params = ignored_modules_set, ignored_params
        self._root_state, self._is_root, self._sync_gradients, self._ran_pre_backward = None, None, True, False
        self._training_state = runtime.TrainingState.IDLE
        self._comm_hook: comm_hook.CommHook | None = None
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config: StateDictConfig = sd_hooks.default_config(StateDictType.FULL_STATE_DICT)
        self._optim_state_dict_config: OptimStateDictConfig = optim_sd.default_config(
            StateDictType.FULL_STATE_DICT)
        self._handle = self._build_handle(module, device_id, param_init_fn, sync_module_states)
        sd_hooks.register_hooks(self)

    def _build_handle(self, module: nn.Module, device_id: int | torch.device | None,
                      param_init_fn: Callable[[nn.Module], None] | None,
                      sync_module_states: bool) -> FlatParamHandle | None:
        device = self._compute_device = construction.compute_device(module, device_id, self._ignored_params)
        modules = construction.own_modules(module, lambda m: isinstance(m, FullyShardedDataParallel),
                                           self._ignored_modules)
        # Refuse a bad unit before anything below changes the module (materialize, move, flatten).
        construction.check_uniform(*construction.managed_params(modules, self._ignored_params, _is_flat),
                                   self._use_orig_params, type(module).__name__)
        construction.materialize(module, modules, device, param_init_fn)
        placement = Placement.resolve(device, self._cpu_offload)
        construction.move_to(modules, device)
        params, slots = construction.managed_params(modules, self._ignored_params, _is_flat)
        if sync_module_states:
            check_unit_plan(params, slots, self._plan, type(module).__name__)
            construction.sync_module_states(params, modules, self._plan)
        self._precision = Precision.resolve(self._mixed_precision, params[0].dtype if params else torch.float32)
        if not params:
            return None
        construction.check_uniform(params, slots, self._use_orig_params, type(module).__name__)
        views = OrigParamViews(params) if self._use_orig_params else FlatParamViews()
        handle = FlatParamHandle(params, slots, self._plan, placement, self._precision, views)
        handle.flat_param._fsdp_flattened = True  # type: ignore[attr-defined]  # PyTorch's marker attribute
        views.register(handle, module)
        handle.on_grad_ready = lambda _: runtime.post_backward(self)
        return handle

    # ---- module glue ------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    # PyTorch's public attributes, read-only here.

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._plan.strategy

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group parameters are sharded over (HYBRID: within a node; NO_SHARD: the replicas)."""
        return self._plan.shard_group if self._plan.shard_group is not None else self._plan.replicate_group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def compute_device(self) -> torch.device:
        return self._compute_device

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._cpu_offload

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._mixed_precision or MixedPrecision()

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._limit_all_gathers

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's flat parameter (the sharded storage of its original parameters), if it has one."""
        return [self._handle.flat_param] if self._handle is not None else []

    @property
    def training_state(self) -> runtime.TrainingState:
        return self._training_state

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's full parameters shown (and written back), e.g. for init."""
        with summon_full_params([self], writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False):
            return super().apply(fn)

    def __getitem__(self, key: int) -> Any:
        wrapped: Any = self._fsdp_wrapped_module  # a container module (Sequential, ModuleList)
        return wrapped[key]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runtime.lazy_init(self, FullyShardedDataParallel.fsdp_modules(self))
        args, kwargs = runtime.pre_forward(self, args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self, output)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP unit in ``module``'s tree (``root_only``: only the outermost ones), pre-order."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        nested = {id(inner) for unit in units for inner in unit.modules() if inner is not unit}
        return [unit for unit in units if id(unit) not in nested]

    def check_is_root(self) -> bool:
        runtime.lazy_init(self, FullyShardedDataParallel.fsdp_modules(self))
        return bool(self._is_root)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Like ``nn.Module.named_parameters``; inside ``summon_full_params`` the names are the unwrapped ones."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield (clean_fqn(name) if self._in_summon() else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (clean_fqn(name) if self._in_summon() else name), buffer

    def _in_summon(self) -> bool:
        return any(unit._training_state is runtime.TrainingState.SUMMON_FULL_PARAMS
                   for unit in FullyShardedDataParallel.fsdp_modules(self))

    # ---- gradients -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the first backward after the context reduces them."""
        units = FullyShardedDataParallel.fsdp_modules(self)
        previous = [unit._sync_gradients for unit in units]
        for unit in units:
            unit._sync_gradients = False
        try:
            yield
        finally:
            for unit, sync in zip(units, previous, strict=True):
                unit._sync_gradients = sync

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global ``norm_type`` norm is at most ``max_norm``; return that norm.

        Sharded gradients are summed over their shard group, replicated ones
        (NO_SHARD units, ignored parameters) counted once.
        """
        if not self.check_is_root():
            raise RuntimeError("clip_grad_norm_ must be called on the root FSDP module (the outermost wrapper)")
        norm_type = float(norm_type)
        sharded: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        seen: set[int] = set()
        for unit in FullyShardedDataParallel.fsdp_modules(self):
            if unit._handle is not None:
                # The parameters the optimizer sees: the flat one, or the originals (as PyTorch groups them).
                params = unit._handle.views.registered(unit._handle)
                target = sharded if unit._handle.is_sharded_over_ranks else replicated
                target += [p.grad for p in params if p.grad is not None]
                seen.update(id(p) for p in params)
        replicated += [p.grad for p in self.parameters() if id(p) not in seen and p.grad is not None]
        if not sharded and not replicated:
            warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning "
                          "the total norm in the default dtype", UserWarning, stacklevel=3)
        device = self.compute_device
        sharded_norm = _norm(sharded, norm_type, device)
        replicated_norm = _norm(replicated, norm_type, device)
        group = self._plan.shard_group
        if norm_type == math.inf:
            total = torch.maximum(sharded_norm, replicated_norm)
            if group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = sharded_norm ** norm_type
            if group is not None:
                dist.all_reduce(total, group=group)
            total = (total + replicated_norm ** norm_type) ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in sharded + replicated:
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        for (grad_device, dtype), grads in by_kind.items():  # one cast of the coefficient and one kernel per kind
            torch._foreach_mul_(grads, coefficient.to(grad_device, dtype))
        return total

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
        comm_hook.register(FullyShardedDataParallel.fsdp_modules(self), state, hook)

    # ---- parameters in full ----------------------------------------------------------------------

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> contextlib.AbstractContextManager:
        """Show the full, full-precision parameters on every unit in ``module`` (``recurse=False``: only its own)."""
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not recurse:
            units = units[:1] if isinstance(module, FullyShardedDataParallel) else units
        return summon_full_params(units, writeback=writeback, rank0_only=rank0_only,
                                  offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    # ---- state dicts -----------------------------------------------------------------------------

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config: StateDictConfig | None = None,
                            optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
        """Make ``state_dict``/``optim_state_dict`` of every unit in ``module`` use this type; return the previous."""
        deprecation.state_dict_type()
        check_state_dict_type_args(module, state_dict_type, state_dict_config, optim_state_dict_config)
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not units:
            raise ValueError("set_state_dict_type: module contains no FullyShardedDataParallel unit")
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        config = state_dict_config or sd_hooks.default_config(state_dict_type)
        optim_config = optim_state_dict_config or optim_sd.default_config(state_dict_type)
        sd_hooks.check_config(state_dict_type, config, optim_config)
        for unit in units:
            unit._state_dict_type, unit._state_dict_config = state_dict_type, config
            unit._optim_state_dict_config = optim_config
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not units:
            raise ValueError("get_state_dict_type: module contains no FullyShardedDataParallel unit")
        first = units[0]
        return StateDictSettings(first._state_dict_type, first._state_dict_config, first._optim_state_dict_config)

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

    # ---- optimizer state dicts -------------------------------------------------------------------

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None,
                         group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """``optim``'s state keyed by the unwrapped model's parameter FQNs, in the model's state-dict type.

        The state is read from ``optim`` itself; ``optim_state_dict`` and ``group`` are accepted for
        compatibility with PyTorch's signature.
        """
        return optim_sd.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict[str, Any], is_named_optimizer: bool = False,
                                 load_directly: bool = False,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The inverse of :meth:`optim_state_dict`: a state dict ``optim.load_state_dict`` accepts."""
        loadable = optim_sd.optim_state_dict_to_load(model, optim_sd.param_groups(model, optim), optim_state_dict)
        if load_directly:
            optim.load_state_dict(loadable)
        return loadable

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                    optim_input: Any = None,
                                    optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict, loadable with ``optim.load_state_dict``.

        Without ``optim``, the optimizer is taken to be over ``optim_input`` (or ``model.parameters()``).
        """
        deprecation.legacy_optim_state_dict("shard_full_optim_state_dict", "optim_state_dict_to_load")
        deprecation.optim_input(optim_input)
        groups = optim_sd.param_groups(model, optim, optim_input)
        return optim_sd.optim_state_dict_to_load(model, groups, full_optim_state_dict)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                         optim: torch.optim.Optimizer) -> dict[str, Any]:
        """Like :meth:`shard_full_optim_state_dict`, from a :meth:`sharded_optim_state_dict` (collective)."""
        deprecation.legacy_optim_state_dict("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
        return optim_sd.optim_state_dict_to_load(model, optim_sd.param_groups(model, optim),
                                                 sharded_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                      optim_input: Any = None, optim: torch.optim.Optimizer | None = None,
                                      group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Send rank 0's full optimizer state dict to every rank of ``group``; return each rank's part."""
        deprecation.legacy_optim_state_dict("scatter_full_optim_state_dict", "optim_state_dict_to_load")
        deprecation.optim_input(optim_input)
        groups = optim_sd.param_groups(model, optim, optim_input)
        holder = [full_optim_state_dict]
        dist.broadcast_object_list(holder, group=group, group_src=0)
        full = holder[0]
        assert full is not None, "rank 0 must pass full_optim_state_dict"
        return optim_sd.optim_state_dict_to_load(model, groups, full)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Full, FQN-keyed optimizer state (an empty dict on ranks other than 0 when ``rank0_only``)."""
        deprecation.legacy_optim_state_dict("full_optim_state_dict", "optim_state_dict")
        deprecation.optim_input(optim_input)
        return optim_sd.full_optim_state_dict(model, optim, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """FQN-keyed optimizer state whose tensors are ``ShardedTensor`` s sharded along dim 0."""
        deprecation.legacy_optim_state_dict("sharded_optim_state_dict", "optim_state_dict")
        return optim_sd.sharded_optim_state_dict(model, optim)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                               model: nn.Module, optim_input: Any = None,
                               optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Re-key a full optimizer state dict by parameter ID (for an unwrapped model) or by FQN.

        IDs are positions in ``optim``'s parameters (else ``optim_input``'s, else ``model.parameters()``).
        """
        deprecation.optim_input(optim_input)
        groups = optim_sd.param_groups(model, optim, optim_input)
        return optim_sd.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, groups)


def _full_precision_classes(module: nn.Module, mixed_precision: MixedPrecision | None,
                            ignored: set[nn.Module]) -> tuple[type[nn.Module], ...]:
    """The module classes auto-wrapping gives their own unit without mixed precision (PyTorch's BatchNorm rule)."""
    if mixed_precision is None:
        return ()
    classes = tuple(dict.fromkeys(mixed_precision._module_classes_to_ignore))
    found = [m for m in module.modules() if isinstance(m, classes) and m not in ignored]
    if found:
        warnings.warn("Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
                      f"module has submodules of type {sorted({type(m).__name__ for m in found})}: they are "
                      "wrapped as separate FSDP units with mixed precision disabled (set "
                      "MixedPrecision(_module_classes_to_ignore=()) to keep them in the surrounding units)",
                      UserWarning, stacklevel=4)
    for found_module in found:
        compute_in_full_precision(found_module)
    return classes


def _is_flat(param: nn.Parameter) -> bool:
    return getattr(param, "_fsdp_flattened", False)


def _norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type).to(device) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type)
