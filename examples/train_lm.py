"""Train a small byte-level GPT on the Python standard library's source, across local ranks.

    python -m tensorplay.distributed.run --nproc-per-node 2 examples/train_lm.py --strategy fully_shard
    python examples/train_lm.py --strategy ddp --resume runs/lm/checkpoints/step_000100   # 1 rank, resumed
    python examples/train_lm.py --help                                                    # every option
    python -m tensorplay.distributed.run --survive --nproc-per-node 4 --max-restarts 10 examples/train_lm.py \
        --survive --strategy fully_shard                  # a lost rank costs seconds, not a restart

A recipe to copy, in the spirit of torchtitan: a config (the flags below), one
``parallelize(model, strategy, mesh)`` function, and a train loop with a progress
bar, validation, distributed checkpoints and a report. Strategies:

  fully_shard  per-parameter sharding (FSDP2): each block one all-gather group, then the root
  hsdp         fully_shard on a 2-D mesh: replicate across one dim, shard across the other
  fsdp         the classic FullyShardedDataParallel wrapper, one flat parameter per block
  zero         DDP + ZeroRedundancyOptimizer: replicated parameters, sharded optimizer state
  ddp          DistributedDataParallel: everything replicated, gradients all-reduced
  localsgd     DDP for a warm-up, then local steps with the parameters averaged every few steps

Data: every ``*.py`` file of the standard library, sorted by name; every tenth
file is validation. ``--batch-size`` is the global batch: the rows of step s are
fixed by (seed, s), and each rank reads only its own slice of them, so a run
resumed at another world size continues on the same data.

``--survive`` (under ``tprun --survive``) trains through ``tensorplay.distributed.survive.Job``:
a rank that dies is dropped, the survivors regroup in their own processes and retry
the step in flight over the same global batch (its rows cut over the ranks alive by
``survive.Sampler``), and a replacement started by the launcher joins at a step
boundary. For ``fully_shard`` (with the buddy copy of each shard) and ``ddp``, on the
CPU (Gloo); no validation, checkpoints or sample (see docs/failures.md). Test hook:
``TENSORPLAY_KILL_AT=step:rank[:moment],...`` makes the rank of that index (of the
world at that step, modulo its size) SIGKILL itself once in step ``step``, at
``moment``: forward (the default), backward, commit (after backward) or optimizer
(inside the commit, after the ranks agreed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.checkpoint as dcp
import tensorplay.nn as nn
import tensorplay.nn.functional as F
from tensorplay.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from tensorplay.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from tensorplay.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from tensorplay.distributed.device_mesh import DeviceMesh, init_device_mesh
from tensorplay.distributed.estimate import BatchSpec, estimate_memory
from tensorplay.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from tensorplay.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tensorplay.distributed.fsdp.wrap import ModuleWrapPolicy
from tensorplay.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from tensorplay.distributed.optim.apply_optimizer_in_backward import (
    InBackwardOptions,
    _get_in_backward_optimizers,
    apply_optimizer_in_backward,
)
from tensorplay.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from lm_model import Block, ByteLM, LMConfig, generate, num_params  # noqa: E402
from lm_report import CommCounter, format_table, memory_row, plot_losses, tensors_bytes  # noqa: E402

warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # re-running into the same --out

STRATEGIES = ("fully_shard", "hsdp", "fsdp", "zero", "ddp", "localsgd")
SHARDED = ("fully_shard", "hsdp", "fsdp")
#: Strategies --survive trains: fully_shard with the buddy copy of each shard, ddp with everything replicated.
SURVIVABLE = ("fully_shard", "ddp")
KILL_MOMENTS = ("forward", "backward", "commit", "optimizer")
#: Strategies whose checkpoints go through get_state_dict / DCP (FQN-keyed, portable across strategies): all of
#: them (classic FSDP through its sharded state dict, ZeRO from each rank's own shard).
CHECKPOINTABLE = STRATEGIES
DTYPES = {"bf16": tp.bfloat16, "fp16": tp.float16}


@dataclass
class Config:
    strategy: str = "fully_shard"
    steps: int = 200
    batch_size: int = 16  # global: rows per step over all ranks and micro-batches
    seq_len: int = 128
    grad_accum: int = 1
    optim_in_backward: bool = False
    optim: str = "adamw"
    clip: float = 0.0  # 0: no clipping
    clip_mode: str = "exact"
    lr: float = 2e-3
    warmup: int = 15
    mp: str | None = None
    cpu_offload: bool = False
    ac: bool = False
    seed: int = 0
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    val_every: int = 25
    val_batches: int = 4
    ckpt_every: int = 0  # 0: only at the end
    stop_at: int = 0  # stop (with a checkpoint) after this step, as if preempted; 0: run all --steps
    resume: str | None = None
    localsgd_period: int = 4
    localsgd_warmup: int = 10
    out: str = "runs/lm"
    compare: list[str] = field(default_factory=list)
    sample_bytes: int = 160
    progress: bool = True
    plot: bool = True
    survive: bool = False
    survive_timeout: float = 30.0


HELP = {
    "strategy": "how the model is spread over the ranks (world size: tprun --nproc-per-node N)",
    "batch_size": "global batch (rows of --seq-len bytes per step, over all ranks and micro-batches)",
    "grad_accum": "micro-batches per step (gradients reduced once, on the last)",
    "optim_in_backward": "step AdamW inside backward, each parameter as soon as its gradient is reduced, and free "
                         "the gradient (fully_shard, hsdp)",
    "optim": "adamw, or muon: torch.optim.Muon on the hidden weight matrices (whole matrices, through "
             "ShardedMatrixOptimizer; lr matched to AdamW's) and AdamW on the rest (fully_shard, hsdp, ddp)",
    "clip": "clip the global gradient norm to this (0: off)",
    "clip_mode": "with --optim-in-backward --clip: 'exact' (keeps the sharded gradients until the norm is known) "
                 "or 'previous' (clips with the previous step's norm, frees each gradient at once)",
    "mp": "mixed precision: compute dtype (fp16 adds a ShardedGradScaler)",
    "cpu_offload": "keep sharded parameters, gradients and optimizer state on the CPU (sharded strategies)",
    "ac": "activation checkpointing: recompute each block in backward",
    "val_every": "validation loss every N steps (and at the last)",
    "ckpt_every": "DCP checkpoint every N steps (and always at the last)",
    "stop_at": "stop after this step with a checkpoint, as if preempted (the LR schedule still spans --steps)",
    "resume": "a checkpoint directory (any checkpointable strategy and world size); 'auto': the newest complete "
              "one under --out/checkpoints, or a fresh start if there is none (for tprun --max-restarts)",
    "out": "directory for log.json, loss.png and checkpoints/",
    "compare": "earlier runs' log.json files to draw in the same plot",
    "sample_bytes": "bytes to generate from the trained model at the end (0: none)",
    "survive": "survive a lost rank (under tprun --survive): the survivors regroup in-process and retry the step "
               "over the same global batch; fully_shard (buddy copy) or ddp, CPU, no validation or checkpoints",
    "survive_timeout": "--survive: the process group's timeout in seconds (a survivor blocked in DDP's own "
                       "all-reduce on a live peer that gave up wakes only then)",
}


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(Config()).items():
        flag, kwargs = "--" + name.replace("_", "-"), {"default": value, "help": HELP.get(name)}
        if name == "strategy":
            p.add_argument(flag, choices=STRATEGIES, **kwargs)
        elif name == "mp":
            p.add_argument(flag, choices=tuple(DTYPES), **kwargs)
        elif name == "compare":
            p.add_argument(flag, nargs="*", **kwargs)
        elif isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            p.add_argument(flag, type=type(value) if value is not None else str, **kwargs)
    return Config(**vars(p.parse_args(argv)))


def check_config(cfg: Config, world: int) -> None:
    if cfg.survive:
        check_survive(cfg, world)
    elif cfg.batch_size % (world * cfg.grad_accum):
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by world size x --grad-accum "
                         f"({world} x {cfg.grad_accum}): it is the global batch, split evenly over ranks and "
                         f"micro-batches")
    if cfg.cpu_offload and cfg.strategy not in SHARDED:
        raise ValueError(f"--cpu-offload needs a sharded strategy ({', '.join(SHARDED)}), got --strategy "
                         f"{cfg.strategy}")
    if (cfg.ckpt_every or cfg.resume) and cfg.strategy not in CHECKPOINTABLE:
        raise ValueError(f"--strategy {cfg.strategy} cannot save or resume a checkpoint in this recipe "
                         f"(choose one of {', '.join(CHECKPOINTABLE)}, or pass --ckpt-every 0)")
    if cfg.optim_in_backward and (cfg.strategy not in ("fully_shard", "hsdp") or cfg.mp == "fp16"):
        raise ValueError(f"--optim-in-backward needs --strategy fully_shard or hsdp (this recipe builds classic "
                         f"FSDP without use_orig_params and gives DDP its byte-counting hook; the library's "
                         f"_apply_optimizer_in_backward takes both) and no fp16 (its loss scaler steps after "
                         f"backward), got --strategy {cfg.strategy} --mp {cfg.mp}")
    if cfg.clip_mode not in ("exact", "previous"):
        raise ValueError(f"--clip-mode must be 'exact' or 'previous', got {cfg.clip_mode!r}")
    if cfg.seq_len > 512:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's 512 positions")


def check_survive(cfg: Config, world: int) -> None:
    """What ``--survive`` trains: the survivable strategies, one micro-batch, AdamW, no checkpoints."""
    if cfg.strategy not in SURVIVABLE:
        raise ValueError(f"--survive needs --strategy {' or '.join(SURVIVABLE)} (survive.Job regroups DDP and 1-D "
                         f"fully_shard with the buddy copy; not hsdp, classic fsdp, zero or localsgd yet), got "
                         f"--strategy {cfg.strategy}")
    unsupported = {"--grad-accum": cfg.grad_accum > 1, "--optim-in-backward": cfg.optim_in_backward,
                   "--optim muon": cfg.optim != "adamw", "--mp": bool(cfg.mp), "--cpu-offload": cfg.cpu_offload,
                   "--clip": bool(cfg.clip), "--ckpt-every": bool(cfg.ckpt_every), "--stop-at": bool(cfg.stop_at),
                   "--resume": bool(cfg.resume)}
    named = [flag for flag, on in unsupported.items() if on]
    if named:
        raise ValueError(f"--survive trains one micro-batch a step with AdamW in fp32 and keeps no checkpoints: "
                         f"drop {', '.join(named)}")
    if cfg.batch_size < world:
        raise ValueError(f"--survive: --batch-size {cfg.batch_size} must be at least the world size {world} "
                         f"(every rank gets a share of the global batch)")


# ----------------------------------------------------------------------------- data

def load_corpus() -> tuple[tp.Tensor, tp.Tensor]:
    """(train, validation) bytes of the standard library's ``*.py`` files; every tenth file validates."""
    files = sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))
    train = b"\n".join(f.read_bytes() for i, f in enumerate(files) if i % 10 != 9)
    val = b"\n".join(f.read_bytes() for i, f in enumerate(files) if i % 10 == 9)
    as_tensor = lambda data: tp.frombuffer(bytearray(data), dtype=tp.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(val)


def rows(data: tp.Tensor, seed: int, n_rows: int, seq_len: int, rank: int, world: int) -> tuple[tp.Tensor, tp.Tensor]:
    """This rank's slice of ``n_rows`` windows drawn by ``seed``: inputs and next-byte targets."""
    generator = tp.Generator().manual_seed(seed)
    starts = tp.randint(0, len(data) - seq_len - 1, (n_rows,), generator=generator)
    mine = starts.chunk(world)[rank]
    window = tp.stack([data[s:s + seq_len + 1] for s in mine.tolist()]).long()
    return window[:, :-1], window[:, 1:]


def train_batch(data: tp.Tensor, cfg: Config, step: int, rank: int, world: int) -> list[tuple[tp.Tensor, tp.Tensor]]:
    x, y = rows(data, cfg.seed * 1_000_003 + step, cfg.batch_size, cfg.seq_len, rank, world)
    return list(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum), strict=True))


# ----------------------------------------------------------------------------- parallelize

def make_mesh(strategy: str, device: tp.device) -> DeviceMesh:
    world = dist.get_world_size()
    if strategy == "hsdp":  # (replicate, shard): 2 replicas of a half-world shard group when it divides
        shard = max(world // 2, 1)
        return init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))


def parallelize(model: ByteLM, strategy: str, mesh: DeviceMesh, *, mp: tp.dtype | None = None,
                cpu_offload: bool = False, start_step: int = 0, localsgd_warmup: int = 10) -> nn.Module:
    """Shard or replicate ``model`` over ``mesh`` for ``strategy`` (see the module docstring)."""
    if strategy in ("fully_shard", "hsdp"):
        policy = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=tp.float32) if mp else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        return model
    group = mesh.get_group()
    if strategy == "fsdp":
        return FullyShardedDataParallel(
            model, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=MixedPrecision(param_dtype=mp, reduce_dtype=tp.float32) if mp else None,
            cpu_offload=CPUOffload(offload_params=cpu_offload))
    ddp = DistributedDataParallel(model, process_group=group)
    if strategy == "localsgd":
        state = PostLocalSGDState(process_group=group, subgroup=None,
                                  start_localSGD_iter=max(localsgd_warmup - start_step, 0),
                                  post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, post_localSGD_hook)
    else:  # DDP's own all-reduce, through Python so the report can count its bytes
        ddp.register_comm_hook(group, allreduce_hook)
    return ddp


def build_optimizer(model: nn.Module, cfg: Config, start_step: int = 0) -> tp.optim.Optimizer:
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": 0.01}
    if cfg.optim_in_backward:
        return StepsInBackward(model, kwargs, cfg)  # type: ignore[return-value]
    if cfg.optim == "muon" and cfg.strategy in ("fully_shard", "hsdp", "ddp"):
        from tensorplay.distributed.optim.matrix._recipe import muon_and_adamw
        return muon_and_adamw(model, cfg.lr, betas=(0.9, 0.95))  # type: ignore[return-value]
    if cfg.optim != "adamw":
        raise ValueError(f"--optim {cfg.optim}: 'adamw', or 'muon' with --strategy fully_shard, hsdp or ddp")
    if cfg.strategy == "zero":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=tp.optim.AdamW, **kwargs)
    optimizer = tp.optim.AdamW(model.parameters(), **kwargs)
    if cfg.strategy == "localsgd":
        averager = PeriodicModelAverager(period=cfg.localsgd_period, warmup_steps=cfg.localsgd_warmup)
        averager.step = start_step
        return PostLocalSGDOptimizer(optim=optimizer, averager=averager)
    return optimizer


class StepsInBackward:
    """AdamW applied in backward (``--optim-in-backward``), standing in for the optimizer: the LR schedule
    writes its ``param_groups``, checkpoints save its per-parameter optimizers, ``step`` has nothing to do."""

    def __init__(self, model: nn.Module, kwargs: dict[str, Any], cfg: Config) -> None:
        clip = {"max_norm": cfg.clip, "clip_mode": cfg.clip_mode} if cfg.clip else {}
        apply_optimizer_in_backward(tp.optim.AdamW, model.parameters(), kwargs, options=InBackwardOptions(**clip))
        self.optimizers = _get_in_backward_optimizers(model)
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def clip_grads(model: nn.Module, cfg: Config) -> None:
    """``--clip`` for an optimizer stepped after backward."""
    if cfg.strategy == "fsdp":
        model.clip_grad_norm_(cfg.clip)
    else:
        tp.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.clip)


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth (a function of the step: nothing to checkpoint)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------- checkpoints

def inner_optimizer(optimizer: tp.optim.Optimizer) -> tp.optim.Optimizer:
    """The AdamW whose state is checkpointed (post-local SGD wraps one; its averager restarts from the step)."""
    if isinstance(optimizer, StepsInBackward):
        return optimizer.optimizers  # type: ignore[return-value]  # a list: the checkpoint API takes several
    return optimizer.optim if isinstance(optimizer, PostLocalSGDOptimizer) else optimizer


def save_checkpoint(path: Path, model: nn.Module, optimizer: tp.optim.Optimizer, step: int,
                    history: dict[str, list]) -> None:
    model_sd, optim_sd = get_state_dict(model, inner_optimizer(optimizer))
    app = {"step": step, "history": json.dumps(history)}
    dcp.save({"model": model_sd, "optim": optim_sd, "app": app}, checkpoint_id=str(path))


def load_checkpoint(path: str, model: nn.Module, optimizer: tp.optim.Optimizer) -> tuple[int, dict[str, list]]:
    if not Path(path).is_dir():
        raise ValueError(f"--resume {path}: no such checkpoint directory")
    model_sd, optim_sd = get_state_dict(model, inner_optimizer(optimizer))
    state = {"model": model_sd, "optim": optim_sd, "app": {"step": 0, "history": ""}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, inner_optimizer(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return int(state["app"]["step"]), json.loads(state["app"]["history"])


# ----------------------------------------------------------------------------- training

def no_sync(model: nn.Module, strategy: str, sync: bool) -> Any:
    """Skip the gradient reduction on all but the last micro-batch."""
    if strategy in ("fully_shard", "hsdp"):
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    return nullcontext() if sync else model.no_sync()


def autocast(cfg: Config, device: tp.device) -> Any:
    """Replicated strategies compute in ``--mp`` through autocast; the sharded ones cast their parameters."""
    if cfg.mp and cfg.strategy not in SHARDED:
        return tp.autocast(device.type, dtype=DTYPES[cfg.mp])
    return nullcontext()


def loss_of(model: nn.Module, x: tp.Tensor, y: tp.Tensor) -> tp.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def global_mean(value: float, device: tp.device) -> float:
    t = tp.tensor([value], dtype=tp.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@tp.no_grad()
def evaluate(model: nn.Module, val: tp.Tensor, cfg: Config, device: tp.device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    total = 0.0
    for i in range(cfg.val_batches):
        x, y = rows(val, 10**9 + i, cfg.batch_size, cfg.seq_len, rank, world)
        with autocast(cfg, device):
            total += loss_of(model, x.to(device), y.to(device)).item()
    return global_mean(total / cfg.val_batches, device)


def train_step(model: nn.Module, optimizer: tp.optim.Optimizer, scaler: ShardedGradScaler | None,
               micro: list[tuple[tp.Tensor, tp.Tensor]], cfg: Config, device: tp.device) -> tuple[float, int]:
    """One optimizer step over the micro-batches; returns this rank's mean loss and its gradient bytes."""
    total = 0.0
    for i, (x, y) in enumerate(micro):
        with no_sync(model, cfg.strategy, sync=i == len(micro) - 1), autocast(cfg, device):
            loss = loss_of(model, x.to(device), y.to(device)) / len(micro)
            (scaler.scale(loss) if scaler else loss).backward()
        total += loss.item()
    grad_bytes = tensors_bytes(p.grad for p in model.parameters())
    if cfg.clip and not cfg.optim_in_backward:
        if scaler:
            scaler.unscale_(optimizer)
        clip_grads(model, cfg)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_bytes


def sample_text(model: nn.Module, cfg: Config, model_cfg: LMConfig, device: tp.device) -> str:
    """Gather the full weights to rank 0 and sample there (no collective per generated byte)."""
    if cfg.sample_bytes <= 0:
        return ""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return ""
    local = ByteLM(model_cfg)
    local.load_state_dict(full)
    local.eval()
    return generate(local, b"def ", cfg.sample_bytes, seed=cfg.seed).decode("utf-8", "replace")


def setup() -> tp.device:
    """Join the group tprun describes, or form a group of one when run as a plain script."""
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
        dist.init_process_group("nccl" if tp.cuda.is_available() else "gloo")
    if tp.cuda.is_available():
        device = tp.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        tp.cuda.set_device(device)
        return device
    return tp.device("cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_args(argv)
    if cfg.survive:
        return run_survive(cfg)  # survive.Job starts (and restarts) the process group itself
    owns_group = not dist.is_initialized()
    device = setup()
    try:
        return run(cfg, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


@dataclass
class Trainer:
    """What the loop needs, built by :func:`run`."""

    cfg: Config
    model: nn.Module
    optimizer: tp.optim.Optimizer
    scaler: ShardedGradScaler | None
    device: tp.device
    label: str
    history: dict[str, list] = field(default_factory=lambda: {"train": [], "val": []})
    step_times: list[float] = field(default_factory=list)
    comm: CommCounter = field(default_factory=CommCounter)
    grad_bytes: int = 0


def fit(t: Trainer, train_data: tp.Tensor, val_data: tp.Tensor, start: int, last: int) -> None:
    """Train steps ``start`` .. ``last``: progress bar, validation every N steps, checkpoints."""
    cfg, rank, world = t.cfg, dist.get_rank(), dist.get_world_size()
    bar = _progress(cfg, start, rank)
    for step in range(start, last):
        for group in t.optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        micro = train_batch(train_data, cfg, step, rank, world)
        begin = time.perf_counter()
        with t.comm.counting():
            loss, t.grad_bytes = train_step(t.model, t.optimizer, t.scaler, micro, cfg, t.device)
        seconds = time.perf_counter() - begin
        t.step_times.append(seconds)
        loss, done = global_mean(loss, t.device), step + 1
        t.history["train"].append([done, loss, t.label])
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.3f}, {cfg.batch_size * cfg.seq_len / seconds:,.0f} tok/s, "
                                f"{seconds * 1e3:.0f} ms/step")
        if done % cfg.val_every == 0 or done == last:
            val_loss = evaluate(t.model, val_data, cfg, t.device)
            t.history["val"].append([done, val_loss, t.label])
            if bar is not None:
                recent = [v for _, v, _ in t.history["train"][-cfg.val_every:]]
                bar.write(f"step {done:>5}  train loss {sum(recent) / len(recent):.4f} (mean of the last "
                          f"{len(recent)})  validation loss {val_loss:.4f}")
        if cfg.strategy in CHECKPOINTABLE and (done == last or cfg.ckpt_every and done % cfg.ckpt_every == 0):
            save_checkpoint(checkpoint_dir(cfg, done), t.model, t.optimizer, done, t.history)
    if bar is not None:
        bar.close()


def checkpoint_dir(cfg: Config, step: int) -> Path:
    return Path(cfg.out) / "checkpoints" / f"step_{step:06d}"


def newest_checkpoint(out: str) -> str | None:
    """The newest checkpoint under ``out``/checkpoints: saves publish whole (staged, then renamed), so a
    ``step_*`` directory with its metadata is complete."""
    found = sorted(p for p in (Path(out) / "checkpoints").glob("step_*") if (p / ".metadata").is_file())
    return str(found[-1]) if found else None


def run(cfg: Config, device: tp.device) -> dict[str, Any]:
    """Build, parallelize, (resume,) train, report; returns what the log holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    check_config(cfg, world)
    if cfg.resume == "auto":
        cfg.resume = newest_checkpoint(cfg.out)
    train_data, val_data = load_corpus()
    tp.manual_seed(cfg.seed)  # every rank builds the same initial model
    model_cfg = LMConfig(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, max_seq_len=512)
    model = ByteLM(model_cfg).to(device)
    model.checkpoint_blocks = cfg.ac
    full_bytes, n_params = tensors_bytes(model.parameters()), num_params(model)

    start = _peek_step(cfg.resume) if cfg.resume else 0  # post-local SGD's hook and averager need it
    model = parallelize(model, cfg.strategy, make_mesh(cfg.strategy, device), mp=DTYPES.get(cfg.mp or ""),
                        cpu_offload=cfg.cpu_offload, start_step=start, localsgd_warmup=cfg.localsgd_warmup)
    optimizer = build_optimizer(model, cfg, start)
    label = " ".join([f"{cfg.strategy} x{world}"] + [cfg.mp] * bool(cfg.mp) + ["offload"] * cfg.cpu_offload
                     + ["ac"] * cfg.ac + [f"accum {cfg.grad_accum}"] * (cfg.grad_accum > 1)
                     + ["optim-in-backward"] * cfg.optim_in_backward
                     + [f"clip {cfg.clip} {cfg.clip_mode if cfg.optim_in_backward else ''}".rstrip()] * bool(cfg.clip))
    trainer = Trainer(cfg, model, optimizer, ShardedGradScaler(device.type) if cfg.mp == "fp16" else None,
                      device, label)
    if cfg.resume:
        start, trainer.history = load_checkpoint(cfg.resume, model, optimizer)
    if rank == 0:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        print(f"{n_params / 1e6:.2f}M-parameter byte-level LM, {len(train_data) / 1e6:.1f} MB of stdlib source "
              f"({len(val_data) / 1e6:.1f} MB held out); --strategy {cfg.strategy} on {world} rank(s) "
              f"({dist.get_backend()})" + (f", resumed at step {start} from {cfg.resume}" if cfg.resume else ""),
              flush=True)
    last = min(cfg.stop_at or cfg.steps, cfg.steps)
    fit(trainer, train_data, val_data, start, last)

    row = memory_row(rank, model, optimizer, trainer.grad_bytes,
                     trainer.comm.bytes / max(len(trainer.step_times), 1))
    table: list[dict[str, float]] = [{}] * world
    dist.all_gather_object(table, row)
    out = Path(cfg.out)
    result = {"config": asdict(cfg), "world_size": world, "label": label, "params": n_params,
              "full_param_bytes": full_bytes, "train": trainer.history["train"], "val": trainer.history["val"],
              "step_times": trainer.step_times, "table": table,
              "sample": sample_text(model, cfg, model_cfg, device),
              "checkpoint": str(checkpoint_dir(cfg, last)) if cfg.strategy in CHECKPOINTABLE else None,
              "png": str(out / "loss.png") if cfg.plot else None, "log": str(out / "log.json"), "out_dir": str(out)}
    if rank == 0:
        _write_report(result, cfg)
    dist.barrier()
    return result


def _peek_step(path: str) -> int:
    """The step a checkpoint was saved at (read through DCP with a one-entry state dict)."""
    if not Path(path).is_dir():
        raise ValueError(f"--resume {path}: no such checkpoint directory")
    state = {"app": {"step": 0}}
    dcp.load(state, checkpoint_id=path)
    return int(state["app"]["step"])


def _progress(cfg: Config, start: int, rank: int) -> Any:
    if rank != 0 or not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=cfg.strategy, unit="step", dynamic_ncols=True, file=sys.stdout)


def _write_report(result: dict[str, Any], cfg: Config) -> None:
    runs = [json.loads(Path(p).read_text()) for p in cfg.compare] + [result]
    if cfg.plot:
        title = " vs ".join(" -> ".join(dict.fromkeys(label for *_, label in r["train"])) for r in runs)
        plot_losses(runs, result["png"], f"byte-level LM on the stdlib ({result['params'] / 1e6:.2f}M params): {title}")
    Path(result["log"]).write_text(json.dumps(result, indent=1))
    print(f"\nper-rank memory and traffic at the end ({result['label']}):")
    print(format_table(result["table"], result["full_param_bytes"]))
    sharded_mp = bool(cfg.mp) and cfg.strategy in SHARDED  # the replicated strategies autocast instead
    print("predicted by tensorplay.distributed.estimate_memory (live tensor bytes, not RSS):\n" + estimate_memory(
        lambda: ByteLM(LMConfig(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, max_seq_len=512)),
        BatchSpec((cfg.batch_size // result["world_size"], cfg.seq_len), tp.long), world_size=result["world_size"],
        strategy={"fsdp": "fsdp_full_shard", "localsgd": "ddp"}.get(cfg.strategy, cfg.strategy),
        optimizer_kwargs={"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": 0.01},
        loss_fn=lambda out, idx: F.cross_entropy(out.float().flatten(0, 1), idx.flatten()),
        param_dtype=DTYPES[cfg.mp] if sharded_mp else None, reduce_dtype=tp.float32 if sharded_mp else None,
        cpu_offload=cfg.cpu_offload, activation_checkpointing=cfg.ac, grad_accum=cfg.grad_accum,
        device="cuda" if tp.cuda.is_available() else "cpu", compare=False).rank_table())
    print(f"\nsample from the trained model (prompt 'def '):\n---\ndef {result['sample']}\n---")
    print(f"loss curve: {result['png']}\ncheckpoint: {result['checkpoint'] or '(none: ' + cfg.strategy + ')'}\n"
          f"log:        {result['log']}", flush=True)


# ----------------------------------------------------------------------------- --survive

def kill_plan(spec: str) -> list[tuple[int, int, str]]:
    """``TENSORPLAY_KILL_AT`` (a test hook): ``step:rank[:moment],...`` -> [(step, rank, moment)]."""
    plan = []
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        moment = parts[2] if len(parts) == 3 else "forward"
        if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].isdigit() or moment not in KILL_MOMENTS:
            raise ValueError(f"TENSORPLAY_KILL_AT: {item!r} is not step:rank[:moment] (moments: "
                             f"{', '.join(KILL_MOMENTS)})")
        plan.append((int(parts[0]), int(parts[1]), moment))
    return plan


class Killer:
    """The ``TENSORPLAY_KILL_AT`` hook: each planned kill happens once in the whole job (the launcher's store
    counts it), so the retried step and the replacements do not repeat it."""

    def __init__(self, plan: list[tuple[int, int, str]], log: Path) -> None:
        self.plan, self.log, self.store = plan, log, None
        if plan:
            self.store = _job_store()

    def __call__(self, job: Any, moment: str) -> None:
        for index, (step, rank, wanted) in enumerate(self.plan):
            if (job.step, job.rank, moment) == (step, rank % job.world_size, wanted) and self.store is not None \
                    and self.store.add(f"tensorplay_kill_at/{index}", 1) == 1:
                _append(self.log, {"kill": step, "rank": job.rank, "id": job.member_id, "moment": moment,
                                   "world": job.world_size, "time": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)


DONE_KEY = "tensorplay_train_lm/done"


def _job_store() -> Any:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=60))


def _leave_when_done(admitted: threading.Event) -> None:
    """A replacement's watcher: exit 0 if the job finishes before admitting it (nothing left to train)."""
    store = _job_store()
    while not admitted.is_set():
        if store.check([DONE_KEY]):
            print("train_lm --survive: the job finished before this replacement was admitted; exiting",
                  file=sys.stderr, flush=True)
            os._exit(0)
        time.sleep(0.5)


def _append(path: Path, record: dict[str, Any]) -> None:
    """One line, one write (O_APPEND): the ranks share the file and a killed rank leaves no half line."""
    with open(path, "a") as file:
        file.write(json.dumps(record) + "\n")


def run_survive(cfg: Config) -> dict[str, Any]:
    """``--survive``: the loop of docs/failures.md "Surviving a lost rank" over this recipe's model and data.

    Every rank appends each step it completes to ``--out``/survive_steps.jsonl (step, global mean loss, time,
    world); the rank 0 of the last generation reads the curve from there (a replacement saw only its part).
    """
    from tensorplay.distributed import survive
    from tensorplay.distributed._comm.collectives import all_reduce as watched_all_reduce

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_config(cfg, world)
    out, joining = Path(cfg.out), os.environ.get("TENSORPLAY_SURVIVE_JOIN") == "1"
    steps_log = out / "survive_steps.jsonl"
    if not joining and os.environ.get("RANK") == "0":  # before the Job: no rank writes before rank 0 joined
        out.mkdir(parents=True, exist_ok=True)
        steps_log.unlink(missing_ok=True)
    train_data, _ = load_corpus()
    model_cfg = LMConfig(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, max_seq_len=512)
    kill = Killer(kill_plan(os.environ.get("TENSORPLAY_KILL_AT", "")), steps_log)
    job: Any = None
    ddp_state: list[Any] = []  # DDP: one module and optimizer for every generation

    def build() -> tuple[nn.Module, tp.optim.Optimizer]:
        if cfg.strategy == "ddp":
            if not ddp_state:
                tp.manual_seed(cfg.seed)
                module = ByteLM(model_cfg)
                ddp_state.extend([module, build_optimizer(module, cfg)])
            model: nn.Module = DistributedDataParallel(ddp_state[0])
            model.register_comm_hook(None, allreduce_hook)  # watched: a survivor blocked on a dead peer wakes
            optimizer = ddp_state[1]
        else:  # a new module each generation: the resharded state replaces its values
            tp.manual_seed(cfg.seed)
            model = ByteLM(model_cfg)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            optimizer = build_optimizer(model, cfg)
        optimizer.register_step_pre_hook(lambda *_: kill(job, "optimizer"))
        return model, optimizer

    admitted = threading.Event()
    if joining:  # a replacement the job ends without admitting would wait in Job() for its admission
        threading.Thread(target=_leave_when_done, args=(admitted,), daemon=True).start()
    job = survive.Job(build, survive.Sampler(cfg.batch_size, cfg.batch_size),
                      timeout=timedelta(seconds=cfg.survive_timeout),
                      redundancy="buddy" if cfg.strategy == "fully_shard" else None)
    admitted.set()
    if job.rank == 0 and not joining:
        print(f"{num_params(ByteLM(model_cfg)) / 1e6:.2f}M-parameter byte-level LM; --strategy {cfg.strategy} "
              f"--survive on {job.world_size} rank(s) (gloo)", flush=True)
    history, lost_seen, pending = [], [], None
    while job.step < cfg.steps:
        step = job.step
        try:
            with job.attempt():
                for group in job.optimizer.param_groups:  # the buddy copy carries the rate it was sent with
                    group["lr"] = lr_at(cfg, step)
                x, y = rows(train_data, cfg.seed * 1_000_003 + step, cfg.batch_size, cfg.seq_len, 0, 1)
                begin, end = job.sampler.share(job.rank, job.world_size)  # this rank's rows of the global batch
                kill(job, "forward")
                loss = loss_of(job.model, x[begin:end], y[begin:end]) * job.weight()
                loss.backward()
                kill(job, "backward")
                total = tp.tensor([loss.item()], dtype=tp.float64)
                # the mean over the global batch (weights: see survive.Sampler.weight), through the watched
                # all-reduce: a survivor waiting here on a dead peer is woken in seconds, not at the group's timeout
                watched_all_reduce(total, where="train_lm --survive loss")
                pending = (step, total.item() / job.world_size)
                kill(job, "commit")
                job.commit()
        except survive.RankLost as lost:
            lost_seen.append({"lost": lost.lost, "step": lost.step})
            job.recover(lost)
        if pending is not None and job.step > pending[0]:  # committed here, or taken in the recovery
            done, value = pending[0] + 1, pending[1]
            history.append([done, value, f"{cfg.strategy} survive"])
            _append(steps_log, {"step": done, "loss": value, "time": time.time(), "id": job.member_id,
                                "world": job.world_size})
            pending = None
    _job_store().set(DONE_KEY, "1")  # every member: a replacement still waiting to join leaves
    result = {"config": asdict(cfg), "world_size": job.world_size, "generation": job.generation,
              "lost": lost_seen, "train": history, "log": str(out / "log.json"), "steps_log": str(steps_log)}
    if job.rank == 0:
        curve = {}
        for line in steps_log.read_text().splitlines():
            record = json.loads(line)
            if "step" in record:
                curve[record["step"]] = record["loss"]
        result["train"] = [[done, curve[done], f"{cfg.strategy} survive"] for done in sorted(curve)]
        (out / "log.json").write_text(json.dumps(result, indent=1))
        print(f"{cfg.strategy} --survive: {job.step} steps, final loss {result['train'][-1][1]:.4f}, "
              f"{len(lost_seen)} rank(s) lost, ended at world size {job.world_size} (generation {job.generation})"
              f"\nlog: {result['log']}", flush=True)
    return result


if __name__ == "__main__":
    main()
