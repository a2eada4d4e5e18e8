"""What one rank of a world of W pays for our machinery, simulated in one process.

    from tensorplay.testing.scale import simulate
    counts = simulate("fully_shard", 4096)          # this process stands for rank 0 of 4,096
    counts.phases["step"].collectives                 # {"all_gather": 5, "reduce_scatter": 4, ...} per step

[Note: the scale simulation]
The process joins PyTorch's ``fake`` process group (every collective returns at
once, nothing moves) over a :class:`CountingStore` and runs a front end on a
small model through four phases: ``construction`` (wrapping the model),
``lazy_init`` (the first step: forward, where lazy initialisation and the plan
agreement run, backward, optimizer step), ``step`` (the mean of the next
``steps`` steps) and ``dcp_save`` (a ``tensorplay.distributed.checkpoint.save``
of the model's state dict into a temporary folder). Per phase it counts, for
this one rank:

- collectives by kind, with the bytes this rank puts in (its input), through a
  dispatch mode that sees every ``c10d`` and functional-collective op; the
  integer and byte ones are our bookkeeping (agreements, object collectives),
  the floating ones the data;
- store operations by kind (calls and keys touched), from the calling thread
  and, separately, from background threads (the watch's heartbeat);
- threads started (``threading.Thread.start``);
- the host time spent in functions defined under ``src/tensorplay`` (cProfile
  ``tottime``, the per-step phase only).

After the phases it sizes what we keep: the watch objects, Python objects
allocated on our lines (``tracemalloc``, still alive), idle pooled buffers, and
the sharded state (parameters, gradients, optimizer state held by this rank).

Every other rank is taken to behave exactly like this one:

- a gathering collective (all-gather, gather, the functional all-gather) fills
  every rank's slot with this rank's input, so agreements that compare the
  gathered values (plan agreement, object collectives of DCP's planning) see
  every rank agree; all-reduces leave the tensor as it is (the fake group's
  behaviour);
- the store answers ``add(key, v)`` with W times the sum this rank added (the
  size of the group, for the watch's keys ``tensorplay_watch/<group name>/...``);
  a key ending in another rank's number (``.../fp/5/17``) reads as the key
  this rank set with its own number there; ``get`` of a key never set raises
  at once.

The watch skips backends other than Gloo and NCCL; ``watch=True`` lets it watch
the fake groups too (the harness adds ``"fake"`` to the watched backends while
it runs).
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FRONT_ENDS", "Counts", "CountingStore", "PhaseCounts", "simulate", "simulate_in_subprocess"]

_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../src/tensorplay


# ---- the store ------------------------------------------------------------------------------------
class CountingStore(dist.Store):
    """A key-value store in this process that counts every operation, as every rank would (see the note)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self._data: dict[str, bytes] = {}
        self._numbered: dict[str, str] = {}  # head -> the key this rank set there with its number last
        self._lock = threading.Lock()
        self._main = threading.main_thread()
        self.calls: dict[str, int] = {}
        self.keys: dict[str, int] = {}
        self.background_calls: dict[str, int] = {}

    def _count(self, kind: str, keys: int = 1) -> None:
        with self._lock:
            if threading.current_thread() is not self._main:
                self.background_calls[kind] = self.background_calls.get(kind, 0) + 1
                return
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.keys[kind] = self.keys.get(kind, 0) + keys

    def _resolve(self, key: str) -> str | None:
        """``key``, or the key this rank set in its place (same head, this rank's number last)."""
        if key in self._data:
            return key
        head, _, last = key.rpartition("/")
        if not head or not last.isdigit() or int(last) >= self.world_size:
            return None
        return self._numbered.get(head)

    def _ranks_adding(self, key: str) -> int:
        """How many ranks add to ``key``: the size of the group the watch's prefix names, else the world."""
        match = _WATCH_PREFIX.search(key)
        if match is not None:
            for group, name in dist.distributed_c10d._world.pg_names.items():
                if name == match.group(1):
                    return dist.get_world_size(group)
        return self.world_size

    def _put(self, key: str, value: bytes) -> None:
        self._data[key] = value
        head, _, last = key.rpartition("/")
        if head and last.isdigit():
            self._numbered[head] = key

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        self._put(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        self._count("get")
        found = self._resolve(key)
        if found is None:
            raise dist.DistStoreError(f"CountingStore: key {key!r} was never set (simulated rank {self.rank})")
        return self._data[found]

    def add(self, key: str, value: int) -> int:
        self._count("add")
        total = int(self._data.get(key, b"0")) + int(value)
        self._data[key] = str(total).encode()
        return total * self._ranks_adding(key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set")
        current = self._data.get(key)
        if current is None and not _as_bytes(expected) or current == _as_bytes(expected):
            self._put(key, _as_bytes(desired))
        return self._data.get(key, _as_bytes(expected))

    def check(self, keys: list[str]) -> bool:
        self._count("check", len(keys))
        return all(self._resolve(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait", len(keys))
        missing = [key for key in keys if self._resolve(key) is None]
        if missing:
            raise dist.DistStoreError(f"CountingStore: wait for keys never set: {missing[:3]}")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get", len(keys))
        return [self.get_quiet(key) for key in keys]

    def get_quiet(self, key: str) -> bytes:
        found = self._resolve(key)
        if found is None:
            raise dist.DistStoreError(f"CountingStore: key {key!r} was never set")
        return self._data[found]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count("multi_set", len(keys))
        for key, value in zip(keys, values, strict=True):
            self._put(key, _as_bytes(value))

    def append(self, key: str, value: Any) -> None:
        self._count("append")
        self._put(key, self._data.get(key, b"") + _as_bytes(value))

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        self._count("num_keys")
        return len(self._data)

    def set_timeout(self, timeout: timedelta) -> None:
        pass

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.calls), dict(self.keys), dict(self.background_calls)


_WATCH_PREFIX = re.compile(r"tensorplay_watch/([^/]+)/")


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


# ---- collectives ----------------------------------------------------------------------------------
_GATHERS = {"allgather_", "_allgather_base_", "gather_", "all_gather_into_tensor", "all_gather_into_tensor_out"}
_NOT_COLLECTIVES = {"wait_tensor", "barrier", "monitored_barrier_", "wrap_tensor_autograd"}


class _CollectiveCounter(TorchDispatchMode):
    """Counts the c10d and functional collectives, and fills gathered outputs as if every rank sent the same."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._opname
            if name not in _NOT_COLLECTIVES:
                self._record(name, args)
            if name in _GATHERS:
                _mirror(name, args, out)
        return out

    def _record(self, name: str, args: tuple) -> None:
        inputs = _input_tensors(name, args)
        control = any(not t.is_floating_point() for t in inputs)
        kind = f"{_KINDS.get(name.strip('_'), name.strip('_'))}{' (control)' if control else ''}"
        self.count[kind] = self.count.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in inputs)

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.count), dict(self.bytes)


_KINDS = {"allgather": "all_gather", "allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
          "allreduce": "all_reduce", "all_reduce": "all_reduce", "reduce_scatter_base": "reduce_scatter",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter", "broadcast": "broadcast",
          "gather": "gather", "scatter": "scatter", "alltoall_base": "all_to_all", "reduce": "reduce"}


def _input_tensors(name: str, args: tuple) -> list[torch.Tensor]:
    """The tensors this rank contributes to collective ``name`` (c10d in-place ops put the input second)."""
    if name in ("allgather_", "gather_", "_allgather_base_", "_reduce_scatter_base_", "reduce_scatter_",
                "scatter_", "alltoall_base_"):
        candidate = args[1]
    else:
        candidate = args[0]
    return [t for t in _flatten(candidate) if isinstance(t, torch.Tensor)]


def _flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


def _mirror(name: str, args: tuple, out: Any) -> None:
    """Fill every rank's slot of a gathered output with this rank's input (as if every rank sent the same)."""
    with torch.no_grad():
        if name in ("allgather_", "gather_"):
            source = next(_flatten(args[1]), None)
            for slot in (list(_flatten(args[0])) if isinstance(source, torch.Tensor) else []):
                slot.copy_(source)
        elif name == "_allgather_base_":
            output, source = args[0], args[1]
            if source.numel():
                output.view(-1, source.numel()).copy_(source.reshape(1, -1))
        elif name.startswith("all_gather_into_tensor"):
            source, result = args[0], (out if isinstance(out, torch.Tensor) else args[-1])
            if source.numel():
                result.view(-1, source.numel()).copy_(source.reshape(1, -1))


# ---- counts ---------------------------------------------------------------------------------------
@dataclass
class PhaseCounts:
    """What one rank did in one phase (the ``step`` phase: per step)."""

    collectives: dict[str, float] = field(default_factory=dict)
    collective_bytes: dict[str, float] = field(default_factory=dict)
    store_calls: dict[str, float] = field(default_factory=dict)
    store_keys: dict[str, float] = field(default_factory=dict)
    threads: float = 0
    seconds: float = 0.0
    error: str = ""

    def total(self, what: str, control_only: bool = False) -> float:
        values: dict[str, float] = getattr(self, what)
        return sum(v for k, v in values.items() if not control_only or "(control)" in k)


@dataclass
class Counts:
    """One rank of a world of ``world_size`` running ``front_end`` (see [Note: the scale simulation])."""

    front_end: str
    world_size: int
    rank: int
    phases: dict[str, PhaseCounts] = field(default_factory=dict)
    #: Background store operations per second (the watch's heartbeats), measured over the run.
    background_store_ops_per_s: float = 0.0
    background_store_calls: dict[str, int] = field(default_factory=dict)
    watch_bytes: int = 0
    our_python_bytes: int = 0
    pooled_buffer_bytes: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_state_bytes: int = 0
    #: What the front end shards across the ranks (parameters, gradients and/or optimizer state), per rank.
    sharded_bytes: int = 0
    our_host_ms_per_step: float = 0.0
    step_ms: float = 0.0
    watched: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Counts:
        phases = {name: PhaseCounts(**value) for name, value in data.pop("phases").items()}
        return cls(phases=phases, **data)


class _Meter:
    """Collectives, store operations and threads counted between :meth:`start` and :meth:`stop`."""

    def __init__(self, store: CountingStore, collectives: _CollectiveCounter) -> None:
        self.store, self.collectives = store, collectives
        self.threads = 0
        self._base: tuple = ()

    def start(self) -> None:
        self._base = (self.collectives.snapshot(), self.store.snapshot(), self.threads, time.perf_counter())

    def stop(self, per: int = 1) -> PhaseCounts:
        (count0, bytes0), (calls0, keys0, _), threads0, t0 = self._base
        count1, bytes1 = self.collectives.snapshot()
        calls1, keys1, _ = self.store.snapshot()
        return PhaseCounts(_diff(count1, count0, per), _diff(bytes1, bytes0, per), _diff(calls1, calls0, per),
                           _diff(keys1, keys0, per), (self.threads - threads0) / per,
                           (time.perf_counter() - t0) / per)


def _diff(after: dict[str, int], before: dict[str, int], per: int) -> dict[str, float]:
    return {k: (v - before.get(k, 0)) / per for k, v in after.items() if v != before.get(k, 0)}


@contextlib.contextmanager
def _counting_threads(meter: _Meter) -> Iterator[None]:
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        meter.threads += 1
        original(thread)

    threading.Thread.start = start  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _watching_fake(enabled: bool) -> Iterator[None]:
    from tensorplay.distributed._comm import watch
    original = watch.WATCHED_BACKENDS
    if enabled:
        watch.WATCHED_BACKENDS = (*original, "fake")  # type: ignore[assignment]
    try:
        yield
    finally:
        watch.WATCHED_BACKENDS = original


# ---- the model and the front ends -----------------------------------------------------------------
WIDTH = 16


def scale_model(hidden: int, blocks: int = 2) -> nn.Sequential:
    """Blocks of ``Linear(16, hidden)``, ReLU, ``Linear(hidden, 16)``: every weight has a dim of ``hidden``."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers.append(nn.Sequential(nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Linear(hidden, WIDTH)))
    return nn.Sequential(*layers)


@dataclass
class Job:
    """A wrapped model, its optimizer and what runs after each optimizer step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    after_step: Callable[[], None] | None = None
    #: Which of parameters, gradients, optimizer state are split across ranks.
    sharded: tuple[str, ...] = ("param", "grad", "optim")


def _largest_dim(param: nn.Parameter) -> Any:
    from torch.distributed.tensor import Shard
    return Shard(max(range(param.dim()), key=lambda d: param.shape[d]))


def _fully_shard(model: nn.Sequential, mesh: Any) -> Job:
    from tensorplay.distributed.fsdp import fully_shard
    for block in model:
        fully_shard(block, mesh=mesh, shard_placement_fn=_largest_dim)
    fully_shard(model, mesh=mesh, shard_placement_fn=_largest_dim)
    return Job(model, torch.optim.Adam(model.parameters(), lr=1e-3))


def _fully_shard_1d(model: nn.Sequential, world: int) -> Job:
    return _fully_shard(model, _mesh((world,), ("shard",)))


def _fully_shard_hsdp(model: nn.Sequential, world: int) -> Job:
    return _fully_shard(model, _mesh(_two_d(world), ("replicate", "shard")))


def _fully_shard_tp(model: nn.Sequential, world: int) -> Job:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _mesh(_two_d(world), ("dp", "tp"))
    for block in model:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return _fully_shard(model, mesh["dp"])


def _classic(strategy: str) -> Callable[[nn.Sequential, int], Job]:
    def build(model: nn.Sequential, world: int) -> Job:
        from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
        from tensorplay.distributed.fsdp import ShardingStrategy
        hybrid = "HYBRID" in strategy
        mesh = _mesh(_two_d(world), ("replicate", "shard")) if hybrid else None
        kind = ShardingStrategy[strategy]
        blocks = [FSDP(block, sharding_strategy=kind, device_mesh=mesh) for block in model]
        wrapped = FSDP(nn.Sequential(*blocks), sharding_strategy=kind, device_mesh=mesh)
        sharded = ("optim",) if strategy == "NO_SHARD" else ("param", "grad", "optim")
        return Job(wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3), sharded=sharded)
    return build


def _zero(bucket_view: bool) -> Callable[[nn.Sequential, int], Job]:
    def build(model: nn.Sequential, world: int) -> Job:
        from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                            parameters_as_bucket_view=bucket_view)
        return Job(model, optimizer, sharded=("optim",))
    return build


def _averager(model: nn.Sequential, world: int) -> Job:
    from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    averager = PeriodicModelAverager(period=2, warmup_steps=0)
    params = list(model.parameters())
    return Job(model, torch.optim.SGD(params, lr=1e-3), lambda: averager.average_parameters(params), sharded=())


def _two_d(world: int) -> tuple[int, int]:
    inner = min(8, world)
    return world // inner, inner


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


FRONT_ENDS: dict[str, Callable[[nn.Sequential, int], Job]] = {
    "fully_shard": _fully_shard_1d,
    "fully_shard_hsdp": _fully_shard_hsdp,
    "fully_shard_tp": _fully_shard_tp,
    "fsdp_full_shard": _classic("FULL_SHARD"),
    "fsdp_shard_grad_op": _classic("SHARD_GRAD_OP"),
    "fsdp_no_shard": _classic("NO_SHARD"),
    "fsdp_hybrid_shard": _classic("HYBRID_SHARD"),
    "fsdp_hybrid_zero2": _classic("_HYBRID_SHARD_ZERO2"),
    "zero": _zero(bucket_view=False),
    "zero_bucket_view": _zero(bucket_view=True),
    "averager": _averager,
}


# ---- the simulation -------------------------------------------------------------------------------
PHASES = ("construction", "lazy_init", "step", "dcp_save")
DEFAULT_HIDDEN = 32768  # every weight has a dim of 32,768: a 1/W shard is non-empty up to W = 32,768


def simulate(front_end: str, world_size: int, *, rank: int = 0, steps: int = 3, hidden: int = DEFAULT_HIDDEN,
             watch: bool = True, dcp: bool = True, linger_s: float = 1.0) -> Counts:
    """Run ``front_end`` as rank ``rank`` of a fake world of ``world_size``; what this rank paid, per phase.

    Joins (and at the end destroys) the default process group of this process: run it where no other
    group is initialised (:func:`simulate_in_subprocess` gives each world size a fresh process).
    ``linger_s``: how long the run stays up after the steps so background threads (heartbeats) are measured.
    """
    _check_arguments(front_end, world_size, rank, steps, hidden)
    if dist.is_initialized():
        raise RuntimeError("simulate: a default process group is already initialised in this process; "
                           "call it in a fresh process (simulate_in_subprocess)")
    _import_front_ends()
    store = CountingStore(rank, world_size)
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    counts = Counts(front_end, world_size, rank, watched=watch)
    started = time.perf_counter()
    try:
        with _watching_fake(watch):
            job = _run_phases(counts, store, front_end, world_size, steps, hidden, dcp)
            counts.step_ms = _median_step_ms(job, steps)
            time.sleep(linger_s)
        _, _, background = store.snapshot()
        counts.background_store_calls = background
        counts.background_store_ops_per_s = sum(background.values()) / (time.perf_counter() - started)
    finally:
        dist.destroy_process_group()
    return counts


def _import_front_ends() -> None:
    """Import what the phases use first, so construction is not charged for imports."""
    import torch.distributed.checkpoint.default_planner  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    import tensorplay.distributed.algorithms.model_averaging.averagers  # noqa: F401
    import tensorplay.distributed.checkpoint.state_dict  # noqa: F401
    import tensorplay.distributed.fsdp  # noqa: F401
    import tensorplay.distributed.optim  # noqa: F401


def _check_arguments(front_end: str, world_size: int, rank: int, steps: int, hidden: int) -> None:
    if front_end not in FRONT_ENDS:
        raise ValueError(f"simulate: front_end must be one of {sorted(FRONT_ENDS)}, got {front_end!r}")
    if not isinstance(world_size, int) or world_size < 8 or world_size % 8:
        raise ValueError(f"simulate: world_size must be a multiple of 8 (the 2-D meshes are W/8 x 8), "
                         f"got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"simulate: rank must be in [0, world_size={world_size}), got {rank!r}")
    if steps < 1:
        raise ValueError(f"simulate: steps must be >= 1, got {steps!r}")
    if hidden < 1:
        raise ValueError(f"simulate: hidden must be >= 1, got {hidden!r}")


def _run_phases(counts: Counts, store: CountingStore, front_end: str, world_size: int, steps: int, hidden: int,
                dcp: bool) -> Job:
    collectives = _CollectiveCounter()
    meter = _Meter(store, collectives)
    torch.manual_seed(0)
    model = scale_model(hidden)
    batch = torch.randn(2, WIDTH)
    tracemalloc.start()
    with _counting_threads(meter), collectives:
        meter.start()
        job = FRONT_ENDS[front_end](model, world_size)
        counts.phases["construction"] = meter.stop()
        meter.start()
        _step(job, batch)
        counts.phases["lazy_init"] = meter.stop()
        profiler = cProfile.Profile()
        meter.start()
        profiler.enable()
        for _ in range(steps):
            _step(job, batch)
        profiler.disable()
        counts.phases["step"] = meter.stop(per=steps)
        counts.our_host_ms_per_step = _our_seconds(profiler) * 1e3 / steps
        _measure_state(counts, job)
        if dcp:
            meter.start()
            error = _save(job)
            counts.phases["dcp_save"] = meter.stop()
            counts.phases["dcp_save"].error = error
    return job


def _step(job: Job, batch: torch.Tensor) -> None:
    job.optimizer.zero_grad(set_to_none=True)
    job.model(batch).sum().backward()
    job.optimizer.step()
    if job.after_step is not None:
        job.after_step()


def _median_step_ms(job: Job, steps: int) -> float:
    """Wall time of one step, out of the dispatch mode and the profiler (median of ``steps``)."""
    batch = torch.randn(2, WIDTH)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(job, batch)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _our_seconds(profiler: cProfile.Profile) -> float:
    """The time spent in functions defined under ``src/tensorplay`` (their own time, not their callees').

    The harness itself (``tensorplay/testing``, its dispatch mode) is not ours to count.
    """
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    harness = os.path.join(_SRC, "testing")
    return sum(row[2] for (filename, _, _), row in stats.items()
               if filename.startswith(_SRC) and not filename.startswith(harness))


def _save(job: Job) -> str:
    """A DCP save of the model's and optimizer's state dict into a temporary folder; the error, if any."""
    from tensorplay.distributed import checkpoint as dcp
    from tensorplay.distributed.checkpoint.state_dict import get_state_dict
    try:
        model_state, optim_state = get_state_dict(job.model, job.optimizer)
        with tempfile.TemporaryDirectory(prefix="tp_scale_") as folder, _every_plan_valid():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    except Exception as error:  # the counts up to the failure still tell what ran
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    return ""


@contextlib.contextmanager
def _every_plan_valid() -> Iterator[None]:
    """Skip DCP's check that the ranks' chunks tile each tensor: every rank's plan here is this rank's."""
    from torch.distributed.checkpoint import default_planner
    original = default_planner._validate_global_plan
    default_planner._validate_global_plan = lambda *args, **kwargs: []
    try:
        yield
    finally:
        default_planner._validate_global_plan = original


# ---- sizes ----------------------------------------------------------------------------------------
def _measure_state(counts: Counts, job: Job) -> None:
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    ours = snapshot.filter_traces([tracemalloc.Filter(True, os.path.join(_SRC, "*")),
                                   tracemalloc.Filter(False, os.path.join(_SRC, "testing", "*"))])
    counts.our_python_bytes = sum(stat.size for stat in ours.statistics("filename"))
    counts.watch_bytes = _watch_bytes()
    counts.pooled_buffer_bytes = _pooled_bytes()
    params = list(job.model.parameters())
    counts.param_bytes = sum(_local_bytes(p) for p in params)
    counts.grad_bytes = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    local = getattr(job.optimizer, "optim", job.optimizer)
    counts.optim_state_bytes = sum(_local_bytes(value) for state in local.state.values()
                                   for value in state.values() if isinstance(value, torch.Tensor))
    counts.sharded_bytes = sum(getattr(counts, f"{what}_bytes" if what != "optim" else "optim_state_bytes")
                               for what in job.sharded)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


_WATCH_SKIP = {"_group_ref", "_store", "_beat", "_diagnosing", "options"}


def _watch_bytes() -> int:
    """The size of every GroupWatch's own containers (records, codes, ranks, pending checks)."""
    from tensorplay.distributed._comm import watch
    seen: set[int] = set()
    total = 0
    for group_watch in list(watch._WATCHES.values()):
        total += sys.getsizeof(group_watch)
        for name, value in vars(group_watch).items():
            if name not in _WATCH_SKIP:
                total += _deep_size(value, seen)
    return total


def _deep_size(value: Any, seen: set[int]) -> int:
    if id(value) in seen or isinstance(value, (torch.Tensor, nn.Module, threading.Thread)):
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
        size += sum(_deep_size(item, seen) for item in value)
    return size


def _pooled_bytes() -> int:
    """Bytes of the idle buffers every live ``BufferPool`` keeps."""
    from tensorplay.distributed._sharding.storage import BufferPool
    pools = [obj for obj in gc.get_objects() if isinstance(obj, BufferPool)]
    return sum(buffer.numel() * buffer.element_size()
               for pool in pools for idle in pool._idle.values() for buffer in idle)


# ---- one process per world size ----------------------------------------------------------------------
def simulate_in_subprocess(front_ends: list[str], world_size: int, *, timeout_s: float = 900.0,
                           **options: Any) -> list[Counts]:
    """:func:`simulate` each of ``front_ends`` at ``world_size`` in one fresh Python process, in turn.

    ``dcp`` may also be a list: the front ends whose DCP save is simulated (rank 0's DCP planning grows with W).
    """
    for front_end in front_ends:
        _check_arguments(front_end, world_size, options.get("rank", 0), options.get("steps", 3),
                         options.get("hidden", DEFAULT_HIDDEN))
    request = json.dumps({"front_ends": front_ends, "world_size": world_size, "options": options})
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "tensorplay.testing.scale", request], capture_output=True,
                          text=True, timeout=timeout_s, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"simulate_in_subprocess: {front_ends} at W={world_size} failed "
                           f"(exit {done.returncode}):\n{done.stderr[-4000:]}")
    return [Counts.from_json(row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def _main(request: str) -> None:
    import warnings
    warnings.simplefilter("ignore")
    args = json.loads(request)
    torch.set_num_threads(1)  # one rank's host work; the counts do not depend on it
    rows = []
    options = args["options"]
    dcp = options.pop("dcp", True)
    for front_end in args["front_ends"]:
        saves = front_end in dcp if isinstance(dcp, list) else bool(dcp)
        rows.append(simulate(front_end, args["world_size"], dcp=saves, **options).to_json())
    sys.stdout.write(json.dumps(rows) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the watch's exit handlers would wait for peers that do not exist


if __name__ == "__main__":
    _main(sys.argv[1])
