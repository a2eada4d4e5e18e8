"""Host time per module per step, ours vs PyTorch's, split by phase, on PyTorch's fake process group.

On the fake group every collective returns at once, so a step is pure host
work: the Python and dispatch cost that starves a GPU when modules are small
or many. Each world size W runs in a fresh process that joins a fake world of
W as rank 0 and builds, side by side, ours and PyTorch's fully_shard, classic
FSDP (FSDP1), ZeRO over DDP, and DDP with the all-reduce comm hook, on blocks
of ``Linear(16, 16)`` + ReLU (one FSDP unit per block, plus the root) or on an
8-block transformer at width 64 (one unit per block), Adam, with the
mixed-precision policy off and on (bf16 parameters, fp32 reduction; FSDP
front ends only). Steps alternate between the implementations, and each phase
is the cheapest over the timed steps of process CPU time (``time.process_time``).

Phases are timed by wrappers the bench installs, before the models are built,
around each implementation's own entry points (the same wrapper for ours and
PyTorch's; a phase entered inside another counts only for the inner one):
pre/post forward, pre/post backward, reduce (the gradient reduction's
issue and hand-out), the end-of-backward callback, the optimizer step and
``zero_grad``. ``other`` is the rest of the step: the modules' own compute
and autograd, the same model for every row.

[Note: no DDP on the fake group]
The fake group's works complete with a future that holds no value, and
DDP's reducer (and every comm hook, ours and PyTorch's) reads the reduced
bucket from that future: DDP's backward raises on the fake group. ZeRO's
rows therefore run its optimizer over the plain model (its host time is its
step: the sharded update and the parameter broadcasts); the DDP comm hook
path is measured on real Gloo ranks by ``bench_comm_hooks.py``.

    .venv/bin/python bench/bench_host_time.py            # quick: W = 8; 16 and 256 blocks, transformer
    .venv/bin/python bench/bench_host_time.py --full     # W = 8 and 1,024; 16, 256, 2,048 blocks, transformer
        [--steps N] [--worlds 8 1024] [--models blocks16 ...] [--only fully_shard ...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).parent
OUT = HERE / "out"
PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward", "reduce", "end_of_backward",
          "optimizer_step", "zero_grad", "other")
PAIRS = ("fully_shard", "classic_fsdp", "zero")


# ---- phase timing ---------------------------------------------------------------------------------
class PhaseClock:
    """Exclusive process CPU time per phase: time in a phase entered inside another counts for the inner one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[tuple[str, float]] = []

    def reset(self) -> None:
        self.seconds = {}

    def enter(self, phase: str) -> None:
        now = time.process_time()
        if self._stack:
            outer, since = self._stack[-1]
            self.seconds[outer] = self.seconds.get(outer, 0.0) + now - since
        self._stack.append((phase, now))

    def leave(self) -> None:
        now = time.process_time()
        phase, since = self._stack.pop()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        if self._stack:
            self._stack[-1] = (self._stack[-1][0], now)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave()


CLOCK = PhaseClock()  # the bench's own process: one clock for every implementation, used one step at a time


def _timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        CLOCK.enter(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.leave()
    return wrapper


def _entry_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, phase) for each implementation's hook entry points (looked up at call time)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as torch_group
    import torch.distributed.fsdp._fully_shard._fsdp_state as torch_state
    import torch.distributed.fsdp._runtime_utils as torch_runtime
    import torch.distributed.fsdp.fully_sharded_data_parallel as torch_fsdp1

    import tensorplay.distributed.fsdp._classic.runtime as our_classic
    import tensorplay.distributed.fsdp._fully_shard._fsdp_param_group as our_group
    import tensorplay.distributed.fsdp._fully_shard._fsdp_state as our_state
    return [
        (our_state.FSDPState, "pre_forward", "pre_forward"),
        (our_state.FSDPState, "post_forward", "post_forward"),
        (our_state.FSDPState, "pre_backward", "pre_backward"),
        (our_state.FSDPState, "_post_backward", "post_backward"),
        (our_group.FSDPParamGroup, "_reduce_grads", "reduce"),
        (our_group.FSDPParamGroup, "_hand_out_grads", "reduce"),
        (our_state.FSDPState, "_root_final_callback", "end_of_backward"),
        (torch_state.FSDPState, "_pre_forward", "pre_forward"),
        (torch_state.FSDPState, "_post_forward", "post_forward"),
        (torch_state.FSDPState, "_pre_backward", "pre_backward"),
        (torch_group.FSDPParamGroup, "post_backward", "post_backward"),
        (torch_group, "foreach_reduce", "reduce"),
        (torch_state.FSDPState, "_root_post_backward_final_callback", "end_of_backward"),
        (our_classic, "pre_forward", "pre_forward"),
        (our_classic, "post_forward", "post_forward"),
        (our_classic, "pre_backward", "pre_backward"),
        (our_classic, "post_backward", "post_backward"),
        (our_classic, "end_of_backward", "end_of_backward"),
        (torch_fsdp1, "_root_pre_forward", "pre_forward"),
        (torch_fsdp1, "_pre_forward", "pre_forward"),
        (torch_fsdp1, "_post_forward", "post_forward"),
        (torch_runtime, "_pre_backward_hook", "pre_backward"),
        (torch_runtime, "_post_backward_hook", "post_backward"),
        (torch_runtime, "_reduce_grad", "reduce"),
        (torch_runtime, "_post_backward_final_callback", "end_of_backward"),
    ]


@contextlib.contextmanager
def timing_hooks() -> Iterator[None]:
    """Wrap every entry point of :func:`_entry_points` while the models are built and run."""
    saved = []
    for owner, name, phase in _entry_points():
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, _timed(phase, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


# ---- models and implementations -------------------------------------------------------------------
WIDTH, ROWS = 16, 4
#: Adam's foreach implementation, PyTorch's default on GPUs (for DTensor parameters too); on the CPU its default
#: is the per-parameter loop (``--no-foreach``).
FOREACH = True


def blocks_model(count: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(count)])


def transformer_model(blocks: int = 8, width: int = 64) -> nn.Sequential:
    return nn.Sequential(*[nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                                      batch_first=True) for _ in range(blocks)])


MODELS: dict[str, tuple[Callable[[], nn.Sequential], tuple[int, ...]]] = {
    "blocks16": (functools.partial(blocks_model, 16), (ROWS, WIDTH)),
    "blocks256": (functools.partial(blocks_model, 256), (ROWS, WIDTH)),
    "blocks2048": (functools.partial(blocks_model, 2048), (ROWS, WIDTH)),
    "transformer8x64": (transformer_model, (2, 8, 64)),
}


@dataclass
class Impl:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    modules: int


def _mp(ours: bool, on: bool, classic: bool = False) -> dict[str, Any]:
    """The mixed-precision keyword (bf16 parameters, fp32 reduction) of fully_shard, or of classic FSDP."""
    if not on:
        return {}
    fsdp = importlib.import_module("tensorplay.distributed.fsdp" if ours else "torch.distributed.fsdp")
    if classic:
        return {"mixed_precision": fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    return {"mp_policy": fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def build_fully_shard(model: nn.Sequential, ours: bool, mp: bool) -> nn.Module:
    if ours:
        from tensorplay.distributed.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model:
        fully_shard(block, **_mp(ours, mp))
    fully_shard(model, **_mp(ours, mp))
    return model


def build_classic(model: nn.Sequential, ours: bool, mp: bool) -> nn.Module:
    if ours:
        from tensorplay.distributed.fsdp import FullyShardedDataParallel as FSDP
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    options = {"device_id": torch.device("cpu"), **_mp(ours, mp, classic=True)}  # PyTorch's wants it on CPU
    wrapped = [FSDP(block, **options) for block in model]
    return FSDP(nn.Sequential(*wrapped), **options)


def make_impl(kind: str, ours: bool, model_name: str, mp: bool) -> Impl:
    torch.manual_seed(0)
    factory, _ = MODELS[model_name]
    model = factory()
    modules = len(model)
    if kind == "zero":  # see [Note: no DDP on the fake group]
        if ours:
            from tensorplay.distributed.optim import ZeroRedundancyOptimizer
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
        return Impl(model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                                   foreach=FOREACH), modules)
    build = {"fully_shard": build_fully_shard, "classic_fsdp": build_classic}[kind]
    wrapped = build(model, ours, mp)
    return Impl(wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3, foreach=FOREACH), modules)


def run_step(impl: Impl, batch: torch.Tensor) -> dict[str, float]:
    """One training step; exclusive CPU seconds per phase."""
    CLOCK.reset()
    CLOCK.enter("other")
    impl.model(batch).float().sum().backward()
    with CLOCK.phase("optimizer_step"):
        impl.optimizer.step()
    with CLOCK.phase("zero_grad"):
        impl.optimizer.zero_grad()
    CLOCK.leave()
    return dict(CLOCK.seconds)


@dataclass
class Cell:
    """One implementation in one configuration: cheapest CPU microseconds per module per step, by phase."""

    phases: dict[str, float] = field(default_factory=dict)
    total: float = float("inf")


def measure(model_name: str, mp: bool, kinds: list[str], steps: int, warmup: int = 3) -> dict[str, Cell]:
    """Every implementation on ``model_name``, steps alternating between them (who goes first alternates)."""
    impls = {}
    for kind in kinds:
        if mp and kind == "zero":
            continue
        for ours in (True, False):
            impls[f"{kind}/{'ours' if ours else 'torch'}"] = make_impl(kind, ours, model_name, mp)
    batch = torch.randn(MODELS[model_name][1])
    cells = {key: Cell() for key in impls}
    keys = list(impls)
    for i in range(warmup + steps):
        for key in keys if i % 2 == 0 else reversed(keys):
            seconds = run_step(impls[key], batch)
            if i < warmup:
                continue
            per = 1e6 / impls[key].modules
            cell = cells[key]
            cell.total = min(cell.total, sum(seconds.values()) * per)
            for phase in PHASES:
                cell.phases[phase] = min(cell.phases.get(phase, float("inf")), seconds.get(phase, 0.0) * per)
    return cells


def child(world: int, models: list[str], kinds: list[str], steps: int) -> None:
    """Rank 0 of a fake world of ``world``: every configuration; JSON on standard output."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    import tensorplay.distributed.fsdp  # noqa: F401  (our modules exist before the hooks are wrapped)
    from tensorplay.testing.scale import CountingStore
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=CountingStore(0, world), rank=0, world_size=world)
    results = []
    try:
        with timing_hooks():
            for model_name in models:
                for mp in (False, True):
                    steps_here = max(3, steps // 4) if model_name == "blocks2048" else steps
                    for key, cell in measure(model_name, mp, kinds, steps_here).items():
                        kind, who = key.split("/")
                        results.append({"world": world, "model": model_name, "mp": mp, "impl": kind, "who": who,
                                        "total": cell.total, "phases": cell.phases})
    finally:
        dist.destroy_process_group()
    print(json.dumps(results))


# ---- report ---------------------------------------------------------------------------------------
def _fmt(value: float) -> str:
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration and implementation: ours / PyTorch's us per module, per phase, and the ratio."""
    cell = {(r["world"], r["model"], r["mp"], r["impl"], r["who"]): r for r in rows}
    short = {"pre_forward": "pre fwd", "post_forward": "post fwd", "pre_backward": "pre bwd",
             "post_backward": "post bwd", "reduce": "reduce", "end_of_backward": "end bwd",
             "optimizer_step": "optim", "zero_grad": "zero_grad", "other": "other"}
    lines = ["| W | model | mp | front end | " + " | ".join(short[p] for p in PHASES) + " | total | ratio |",
             "|---" * (len(PHASES) + 6) + "|"]
    for key in dict.fromkeys((r["world"], r["model"], r["mp"], r["impl"]) for r in rows):
        ours, theirs = cell.get((*key, "ours")), cell.get((*key, "torch"))
        if ours is None or theirs is None:
            continue
        phases = [f"{_fmt(ours['phases'][p])} / {_fmt(theirs['phases'][p])}" for p in PHASES]
        world, model, mp, impl = key
        lines.append(f"| {world} | {model} | {'bf16' if mp else 'off'} | {impl} | " + " | ".join(phases)
                     + f" | {_fmt(ours['total'])} / {_fmt(theirs['total'])} | {ours['total'] / theirs['total']:.2f} |")
    return "\n".join(lines)


def vs_classic(rows: list[dict[str, Any]]) -> str:
    """Our fully_shard against our classic FSDP, per configuration (us per module per step, total)."""
    cell = {(r["world"], r["model"], r["mp"], r["impl"], r["who"]): r["total"] for r in rows}
    lines = ["| W | model | mp | our fully_shard | our classic FSDP | ratio |", "|---|---|---|---|---|---|"]
    for world, model, mp in dict.fromkeys((r["world"], r["model"], r["mp"]) for r in rows):
        fs, classic = cell.get((world, model, mp, "fully_shard", "ours")), \
            cell.get((world, model, mp, "classic_fsdp", "ours"))
        if fs is not None and classic is not None:
            lines.append(f"| {world} | {model} | {'bf16' if mp else 'off'} | {_fmt(fs)} | {_fmt(classic)} | "
                         f"{fs / classic:.2f} |")
    return "\n".join(lines)


def draw(rows: list[dict[str, Any]]) -> Path:
    """Stacked bars of the phases, ours beside PyTorch's, for each front end at the first world size, mp off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = rows[0]["world"]
    picked = [r for r in rows if r["world"] == world and not r["mp"]]
    models = list(dict.fromkeys(r["model"] for r in picked))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 2, 4.4), dpi=110, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        bars = [r for r in picked if r["model"] == model]
        labels = [f"{r['impl']}\n{r['who']}" for r in bars]
        bottom = [0.0] * len(bars)
        for k, phase in enumerate(PHASES):
            heights = [r["phases"][phase] for r in bars]
            ax.bar(range(len(bars)), heights, bottom=bottom, color=f"C{k}", label=phase if model == models[0] else None)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(bars)), labels, fontsize=6, rotation=90)
        ax.set_title(f"{model}, W={world}", fontsize=9)
        ax.set_ylabel("CPU us per module per step")
    fig.legend(fontsize=7, loc="center right")
    fig.suptitle("Host time by phase (fake process group, cheapest step, mixed precision off)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 0.93))
    OUT.mkdir(exist_ok=True)
    path = OUT / "host_time.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="W = 8 and 1,024; 16, 256 and 2,048 blocks")
    parser.add_argument("--worlds", type=int, nargs="*")
    parser.add_argument("--models", nargs="*", choices=list(MODELS))
    parser.add_argument("--only", nargs="*", choices=PAIRS, help="front ends to run (default: all)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-foreach", action="store_true", help="Adam's per-parameter loop (its CPU default)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global FOREACH
    FOREACH = not args.no_foreach
    kinds = args.only or list(PAIRS)
    models = args.models or (list(MODELS) if args.full else ["blocks16", "blocks256", "transformer8x64"])
    if args.child is not None:
        child(args.child, models, kinds, args.steps)
        return
    worlds = args.worlds or ([8, 1024] if args.full else [8])
    rows: list[dict[str, Any]] = []
    for world in worlds:
        command = [sys.executable, __file__, "--child", str(world), "--steps", str(args.steps),
                   "--models", *models, "--only", *kinds, *(["--no-foreach"] if args.no_foreach else [])]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"bench_host_time: W={world} failed:\n{done.stderr[-4000:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    OUT.mkdir(exist_ok=True)
    (OUT / "host_time.json").write_text(json.dumps(rows, indent=1))
    print(f"## Host time per module per step, ours / PyTorch's (CPU us, fake process group, rank 0; cheapest of "
          f"{args.steps} steps per phase, steps alternating; one thread; Adam "
          f"{'foreach' if FOREACH else 'per-parameter loop'})\n")
    print(table(rows))
    print("\n## Our fully_shard against our classic FSDP (CPU us per module per step)\n")
    print(vs_classic(rows))
    print(f"\nchart: {draw(rows).relative_to(HERE)}")


if __name__ == "__main__":
    main()
