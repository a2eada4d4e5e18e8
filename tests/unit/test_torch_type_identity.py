"""Our objects pass the isinstance checks frameworks make against PyTorch's, and take PyTorch's options.

Type identity only ([Note: type identity only]): the MRO walk proves that no
attribute of ours resolves to a PyTorch class's ``__dict__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.optim as torch_optim
from torch import nn

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.fsdp as fsdp
import tensorplay.distributed.optim as optim
from tensorplay.distributed._torch_identity import OBJECT_BASICS, is_identity_class
from tensorplay.distributed.fsdp._fully_shard._fully_shard import _fsdp_class

CONFIGS = ["MixedPrecision", "CPUOffload", "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig",
           "ShardedStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig", "LocalOptimStateDictConfig",
           "ShardedOptimStateDictConfig", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"]
CLASSES = [(getattr(fsdp, n), getattr(torch_fsdp, n)) for n in CONFIGS] + [
    (fsdp.FSDPModule, torch_fsdp.FSDPModule), (_fsdp_class(tp.nn.Linear), torch_fsdp.FSDPModule),
    (_fsdp_class(tp.nn.Sequential), torch_fsdp.FSDPModule),
    (fsdp.DataParallelMeshDims, torch_fsdp.DataParallelMeshDims),
    (optim.ZeroRedundancyOptimizer, torch_optim.ZeroRedundancyOptimizer),
    (optim.PostLocalSGDOptimizer, torch_optim.PostLocalSGDOptimizer),
    (fsdp.FullyShardedDataParallel, torch_fsdp.FullyShardedDataParallel),
]


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """fully_shard and the classic FSDP need a default group: one rank in this process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _torch_owned_names(cls: type) -> dict[str, type]:
    """Every attribute of ``cls`` that resolves to one of PyTorch's identity classes, with that class."""
    found = {}
    for name in dir(cls):
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is not None and is_identity_class(owner) and name not in OBJECT_BASICS:
            found[name] = owner
    return found


@pytest.mark.parametrize(("ours", "theirs"), CLASSES, ids=lambda c: getattr(c, "__qualname__", str(c)))
def test_ours_is_torchs_for_isinstance_and_nothing_resolves_to_torch(ours: type, theirs: type) -> None:
    assert issubclass(ours, theirs)
    assert any(is_identity_class(c) for c in ours.__mro__)  # the walk below has something to find
    assert _torch_owned_names(ours) == {}


def test_the_walk_finds_a_torch_attribute() -> None:
    """The MRO walk can fail: a subclass of PyTorch's without the decorator leaks PyTorch's methods."""
    leaky = type("Leaky", (torch_fsdp.FSDPModule,), {})
    assert "unshard" in _torch_owned_names(leaky)
    leaky_classic = type("LeakyClassic", (torch_fsdp.FullyShardedDataParallel,), {})
    assert {"optim_state_dict", "_unshard", "__init__"} <= _torch_owned_names(leaky_classic).keys()


def test_torch_private_method_refuses_loudly() -> None:
    model = fsdp.fully_shard(tp.nn.Linear(4, 4))
    assert isinstance(model, torch_fsdp.FSDPModule)
    with pytest.raises(NotImplementedError, match=r"FSDPModule._set_unshard_async_op: .* does not offer it"):
        model._set_unshard_async_op(True)
    with pytest.raises(AttributeError, match=r"_orig_cls_mro_index"):
        _ = model._orig_cls_mro_index


@pytest.mark.parametrize("name", ENUMS)
def test_enum_members_equal_and_hash_as_torchs(name: str) -> None:
    ours, theirs = getattr(fsdp, name), getattr(torch_fsdp, name)
    for member in theirs:
        assert ours[member.name] == member and member == ours[member.name]
        assert {member: 1}[ours[member.name]] == 1
        assert all(other != ours[member.name] for other in theirs if other is not member)
    assert ours[next(iter(theirs)).name] != next(iter(theirs)).name  # not equal to a plain string


def test_configs_take_torchs_fields() -> None:
    from tensorplay.distributed._torch_identity import as_ours

    theirs = torch_fsdp.MixedPrecision(param_dtype=tp.bfloat16, keep_low_precision_grads=True)
    ours = as_ours(theirs, fsdp.MixedPrecision)
    assert type(ours) is fsdp.MixedPrecision and ours == fsdp.MixedPrecision(tp.bfloat16,
                                                                              keep_low_precision_grads=True)
    assert type(as_ours(torch_fsdp.CPUOffloadPolicy(pin_memory=False), fsdp.OffloadPolicy)) is fsdp.CPUOffloadPolicy
    assert as_ours(torch_fsdp.ShardingStrategy.NO_SHARD, fsdp.ShardingStrategy) is fsdp.ShardingStrategy.NO_SHARD


def test_fully_shard_takes_torchs_policies_bitwise() -> None:
    def run(mp: object, offload: object) -> tuple[torch.Tensor, torch.Tensor]:
        tp.manual_seed(0)
        model = fsdp.fully_shard(tp.nn.Linear(8, 4), mp_policy=mp, offload_policy=offload)
        out = model(tp.randn(2, 8, generator=torch.Generator().manual_seed(1)))
        out.float().sum().backward()
        return out.detach(), model.weight.grad.full_tensor()

    ours = run(fsdp.MixedPrecisionPolicy(param_dtype=tp.bfloat16), fsdp.CPUOffloadPolicy(pin_memory=False))
    theirs = run(torch_fsdp.MixedPrecisionPolicy(param_dtype=tp.bfloat16), torch_fsdp.CPUOffloadPolicy(False))
    assert ours[0].dtype == tp.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_torchs_bad_policy_is_refused_with_our_message() -> None:
    with pytest.raises(TypeError, match=r"MixedPrecisionPolicy: param_dtype must be a torch.dtype"):
        fsdp.fully_shard(tp.nn.Linear(4, 4), mp_policy=torch_fsdp.MixedPrecisionPolicy(param_dtype="bf16"))


def test_classic_fsdp_takes_torchs_enums_and_configs() -> None:
    model = fsdp.FullyShardedDataParallel(tp.nn.Linear(8, 4), sharding_strategy=torch_fsdp.ShardingStrategy.NO_SHARD,
                                          backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
                                          mixed_precision=torch_fsdp.MixedPrecision(param_dtype=tp.bfloat16))
    assert model.sharding_strategy is fsdp.ShardingStrategy.NO_SHARD
    assert model.sharding_strategy == torch_fsdp.ShardingStrategy.NO_SHARD
    assert model.mixed_precision.param_dtype == tp.bfloat16
    with pytest.warns(FutureWarning), fsdp.FullyShardedDataParallel.state_dict_type(
            model, torch_fsdp.StateDictType.FULL_STATE_DICT, torch_fsdp.FullStateDictConfig(rank0_only=False)):
        state = model.state_dict()
        settings = fsdp.FullyShardedDataParallel.get_state_dict_type(model)
    assert sorted(state) == ["bias", "weight"]
    assert settings.state_dict_type == torch_fsdp.StateDictType.FULL_STATE_DICT
    assert isinstance(settings, torch_fsdp.StateDictSettings)
    assert isinstance(settings.state_dict_config, torch_fsdp.FullStateDictConfig)


def test_optimizer_load_of_none_needs_rank0_only() -> None:
    """accelerate's FSDP plugin v1 passes None on ranks other than 0 under a rank0_only config (loaded from rank 0,
    tests/parity/test_frameworks.py); None without that config, or on rank 0, is refused naming the fix."""
    model = fsdp.FullyShardedDataParallel(tp.nn.Linear(4, 4))
    optimizer = tp.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"optim_state_dict is None on rank 0; pass the optimizer state dict on "
                                         r"every rank, or set .*FullOptimStateDictConfig\(rank0_only=True\)"):
        fsdp.FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, None)
    with pytest.warns(FutureWarning), fsdp.FullyShardedDataParallel.state_dict_type(
            model, fsdp.StateDictType.FULL_STATE_DICT, optim_state_dict_config=fsdp.FullOptimStateDictConfig(
                rank0_only=True)), pytest.raises(ValueError, match=r"rank0_only, but rank 0 passed None"):
        fsdp.FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, None)


def test_accelerates_private_reads_of_a_classic_unit() -> None:
    """``_has_params``, ``_flat_param._fqns`` and ``_handle._orig_param_dtype``, as accelerate's v1 upcast reads
    them; a new dtype without the flat parameter's data in it is refused, nothing changed."""
    model = fsdp.FullyShardedDataParallel(tp.nn.Sequential(tp.nn.Linear(4, 4), tp.nn.ReLU()))
    assert model._has_params and model._flat_param is model.params[0]
    assert model._flat_param._fqns == ("0.weight", "0.bias")
    assert model._handle._orig_param_dtype == tp.float32
    model._handle._orig_param_dtype = tp.float32  # writing back the same dtype is a no-op
    with pytest.raises(NotImplementedError, match=r"built in torch.float32; setting it to torch.bfloat16 is taken "
                                                  r"only before .* the data is torch.float32: load the model"):
        model._handle._orig_param_dtype = tp.bfloat16
    assert model._flat_param.dtype == model._handle._orig_param_dtype == tp.float32


def _upcast_as_accelerate(model: nn.Module, fsdp_cls: type) -> None:
    """accelerate's ``prepare`` for a model loaded in low precision under FSDP v1 (accelerator.py, "upcasting")."""
    for unit in fsdp_cls.fsdp_modules(model):
        if unit._has_params:
            unit._flat_param.data = unit._flat_param.data.to(tp.float32)
            unit._handle._orig_param_dtype = tp.float32


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_accelerates_upcast_of_a_low_precision_model_is_pytorchs(use_orig_params: bool) -> None:
    """A bf16 model wrapped, then upcast by accelerate before its first forward, trains as PyTorch's classic FSDP
    does after the same upcast, bitwise (compute in bf16, fp32 master weights and gradients)."""
    from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy

    def run(api: Any, extra: dict[str, Any]) -> list[torch.Tensor]:
        tp.manual_seed(0)
        model = tp.nn.Sequential(tp.nn.Linear(8, 16), tp.nn.ReLU(), tp.nn.Linear(16, 4)).to(tp.bfloat16)
        model = api.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({tp.nn.Linear}),
                                             mixed_precision=api.MixedPrecision(param_dtype=tp.bfloat16),
                                             use_orig_params=use_orig_params, **extra)
        _upcast_as_accelerate(model, api.FullyShardedDataParallel)
        optimizer = tp.optim.Adam(model.parameters(), lr=0.1)
        seen = []
        for step in range(2):
            loss = model(tp.randn(4, 8, generator=torch.Generator().manual_seed(step)).bfloat16()).float().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(loss.detach())
        with api.FullyShardedDataParallel.summon_full_params(model):
            return seen + [p.detach().clone() for p in model.parameters()]

    with pytest.warns(UserWarning):  # PyTorch's: NO_SHARD at one rank
        theirs = run(torch_fsdp, {"device_id": torch.device("cpu")})
    ours = run(fsdp, {})
    assert ours[-1].dtype == tp.float32 and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_upcast_after_the_first_forward_is_refused_and_put_back() -> None:
    model = fsdp.FullyShardedDataParallel(tp.nn.Linear(4, 4).to(tp.bfloat16))
    model(tp.randn(2, 4).bfloat16())
    before = model._flat_param.detach().clone()
    with pytest.raises(NotImplementedError, match=r"built in torch.bfloat16; setting it to torch.float32 is taken "
                                                  r"only before the model's first forward.* \(put back to "
                                                  r"torch.bfloat16\)"):
        _upcast_as_accelerate(model, fsdp.FullyShardedDataParallel)
    assert model._flat_param.dtype == tp.bfloat16 and torch.equal(model._flat_param, before)


def test_torchs_classic_state_dict_type_on_fully_shard_refuses_as_on_pytorchs() -> None:
    """PyTorch's ``FSDP.state_dict_type`` is for its classic wrapper: on a fully_shard model (ours or PyTorch's) it
    raises KeyError; ours is left as it was."""
    for api in (fsdp, torch_fsdp):
        model = api.fully_shard(tp.nn.Linear(4, 4))
        before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        with pytest.raises(KeyError), pytest.warns(FutureWarning), torch_fsdp.FullyShardedDataParallel.state_dict_type(
                model, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
            model.state_dict()
        assert all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items())


# ---- PyTorch's own helpers on our classic FSDP ([Note: PyTorch's helpers on classic FSDP]) ------------------

def _classic_trained() -> tuple[fsdp.FullyShardedDataParallel, torch.optim.Optimizer]:
    from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy

    tp.manual_seed(0)
    model = fsdp.FullyShardedDataParallel(tp.nn.Sequential(tp.nn.Linear(4, 4), tp.nn.ReLU(), tp.nn.Linear(4, 2)),
                                          auto_wrap_policy=ModuleWrapPolicy({tp.nn.Linear}))
    optimizer = tp.optim.Adam(model.parameters(), lr=0.1)
    model(tp.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_every_fsdp_state_attribute_is_ours_or_refused() -> None:
    """Each instance attribute of PyTorch's ``_FSDPState`` is a property of ours (offered or refused), so PyTorch's
    helpers never read the wrapped module's attribute of that name (our ``__getattr__`` falls through to it)."""
    from torch.distributed.fsdp._common_utils import _FSDPState

    ours = fsdp.FullyShardedDataParallel
    for name in vars(_FSDPState()):
        owner = next((c for c in ours.__mro__ if name in c.__dict__), None)
        assert owner is not None and not is_identity_class(owner), name
        assert isinstance(owner.__dict__[name], property), name


def test_torchs_helpers_find_our_classic_units() -> None:
    from torch.distributed.fsdp._common_utils import _get_module_fsdp_state

    model, _ = _classic_trained()
    assert isinstance(model, torch_fsdp.FullyShardedDataParallel) and _get_module_fsdp_state(model) is model
    assert torch_fsdp.FullyShardedDataParallel.fsdp_modules(model) == fsdp.FullyShardedDataParallel.fsdp_modules(model)


def test_torchs_state_dict_type_sets_ours() -> None:
    """PyTorch's ``FSDP.state_dict_type`` on ours sets our settings (PyTorch's types to PyTorch's getter, ours to
    ours) and restores them after; the state dicts it gives are checked against PyTorch's FSDP in
    tests/parity/test_frameworks_torch_paths.py."""
    model, _ = _classic_trained()
    torch_cls = torch_fsdp.FullyShardedDataParallel
    config = torch_fsdp.FullStateDictConfig(rank0_only=False)
    with pytest.warns(FutureWarning), torch_cls.state_dict_type(model, torch_fsdp.StateDictType.LOCAL_STATE_DICT):
        ours = fsdp.FullyShardedDataParallel.get_state_dict_type(model)
        theirs = torch_cls.get_state_dict_type(model)
    assert ours.state_dict_type is fsdp.StateDictType.LOCAL_STATE_DICT
    assert type(ours.state_dict_config) is fsdp.LocalStateDictConfig
    assert type(theirs.state_dict_config) is torch_fsdp.LocalStateDictConfig
    with pytest.warns(FutureWarning):
        torch_cls.set_state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, config)
    restored = fsdp.FullyShardedDataParallel.get_state_dict_type(model)
    assert restored.state_dict_type is fsdp.StateDictType.FULL_STATE_DICT
    assert type(restored.state_dict_config) is fsdp.FullStateDictConfig and not restored.state_dict_config.rank0_only


def _torchs_helpers(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Callable[[], Any]]:
    torch_cls = torch_fsdp.FullyShardedDataParallel
    return {
        "FullyShardedDataParallel.optim_state_dict": lambda: torch_cls.optim_state_dict(model, optimizer),
        "FullyShardedDataParallel.optim_state_dict_to_load": lambda: torch_cls.optim_state_dict_to_load(
            model, optimizer, optimizer.state_dict()),
        "FullyShardedDataParallel.full_optim_state_dict": lambda: torch_cls.full_optim_state_dict(model, optimizer),
        "FullyShardedDataParallel.clip_grad_norm_": lambda: torch_cls.clip_grad_norm_(model, 0.1),
        "FullyShardedDataParallel.summon_full_params": lambda: torch_cls.summon_full_params(model).__enter__(),
        "FullyShardedDataParallel.no_sync": lambda: torch_cls.no_sync(model).__enter__(),
        "FullyShardedDataParallel.fsdp_modules": lambda: torch_cls.fsdp_modules(model, root_only=True),
        "FullyShardedDataParallel.register_comm_hook": lambda: torch_cls.register_comm_hook(model, None, print),
    }


@pytest.mark.parametrize("helper", list(_torchs_helpers(nn.Identity(), torch.optim.SGD([torch.zeros(1)]))))
def test_torchs_helper_on_classic_refuses_before_any_change(helper: str) -> None:
    """PyTorch's static methods would run PyTorch's FSDP runtime on ours: each refuses, naming itself and ours,
    and the parameters, gradients and optimizer state are as they were."""
    model, optimizer = _classic_trained()
    before = [t.clone() for t in (*model.parameters(), *(p.grad for p in model.parameters()),
                                  *(v for s in optimizer.state.values() for v in s.values()))]
    from tensorplay.distributed.fsdp._classic.foreign_helpers import ForeignFSDPHelperError

    name = helper.rsplit(".", 1)[1]
    with pytest.raises(ForeignFSDPHelperError, match=(
            rf"PyTorch's torch\.distributed\.fsdp\.fully_sharded_data_parallel\.{helper}\(\) read _FSDPState\._\w+, "
            rf"PyTorch's private FSDP state, .* nothing was changed\. Call tensorplay\.distributed\.fsdp\."
            rf"FullyShardedDataParallel\.{name} \(the same arguments\); .*use_as_torch\(\)")):
        _torchs_helpers(model, optimizer)[helper]()
    after = [*model.parameters(), *(p.grad for p in model.parameters()),
             *(v for s in optimizer.state.values() for v in s.values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(unit.training_state is fsdp.fully_sharded_data_parallel.TrainingState.IDLE
               for unit in fsdp.FullyShardedDataParallel.fsdp_modules(model))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torchs_rekey_on_classic_is_as_on_pytorchs(use_orig_params: bool) -> None:
    """Our flat parameter is PyTorch's FlatParameter for isinstance, so PyTorch's ``rekey_optim_state_dict`` maps it
    to the FQNs it holds, as on PyTorch's classic FSDP: the same keys, or (flat parameters to names) the same error."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    def rekey(api: Any, extra: dict[str, Any]) -> list[Any]:
        tp.manual_seed(0)
        model = api.FullyShardedDataParallel(tp.nn.Sequential(tp.nn.Linear(4, 4), tp.nn.Linear(4, 2)),
                                             use_orig_params=use_orig_params, **extra)
        assert isinstance(model._flat_param, FlatParameter)
        optimizer = tp.optim.Adam(model.parameters())
        model(tp.randn(2, 4)).sum().backward()
        optimizer.step()
        by_id = optimizer.state_dict()
        try:
            by_name = torch_fsdp.FullyShardedDataParallel.rekey_optim_state_dict(
                by_id, torch_fsdp.OptimStateKeyType.PARAM_NAME, model)
        except RuntimeError as error:
            return [str(error)]
        back = torch_fsdp.FullyShardedDataParallel.rekey_optim_state_dict(
            by_name, torch_fsdp.OptimStateKeyType.PARAM_ID, model)
        return [list(by_name["state"]), by_name["param_groups"][0]["params"], list(back["state"])]

    with pytest.warns(UserWarning):  # PyTorch's: NO_SHARD at one rank
        theirs = rekey(torch_fsdp, {"device_id": torch.device("cpu")})
    assert rekey(fsdp, {}) == theirs
    assert len(theirs) == (3 if use_orig_params else 1)  # flat parameters name four FQNs: PyTorch's error


def test_fsdp_state_read_outside_pytorchs_helpers_refuses_too() -> None:
    from tensorplay.distributed.fsdp._classic.foreign_helpers import ForeignFSDPHelperError

    model, _ = _classic_trained()
    with pytest.raises(ForeignFSDPHelperError, match=r"^Code outside PyTorch's FSDP read _FSDPState\._is_root, .* "
                                                     r"Call tensorplay\.distributed\.fsdp\.FullyShardedDataParallel's"):
        _ = model._is_root
    assert model._device_mesh is None and model._state_dict_type == torch_fsdp.StateDictType.FULL_STATE_DICT
