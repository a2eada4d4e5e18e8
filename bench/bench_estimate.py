"""The memory estimator's predicted peak against the measured one, every strategy at 1, 2 and 4 Gloo ranks.

Three models: the recipe's byte-level LM (``examples/lm_model.py``, a small
config), a wide MLP, and a model with tied input/output weights. For each
(model, strategy, world size) the estimate (``tensorplay.distributed.estimate_memory``:
meta device, no process group) is compared with a real step of our
implementation on the CPU, measured by a tracker of live tensor bytes per rank
(``estimate._estimate_measure``: every storage alive at the step's start plus
each one an op allocates, dropped when freed; peak after each op). Printed:
predicted and measured peak of the rank with the largest measured peak, the
error, and the model-state part (parameters, gradients, optimizer state)
predicted and measured. ``--plot`` draws the bars into ``bench/report/``.

    .venv/bin/python bench/bench_estimate.py [--world 1 2 4] [--models lm mlp tied] [--plot]
    .venv/bin/python bench/bench_estimate.py --options --world 2      # mixed precision, AC, accumulation
    .venv/bin/python bench/bench_estimate.py --in-backward --world 2  # optimizer in backward, ZeRO stage 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lm_model import ByteLM, LMConfig  # noqa: E402
from tensorplay.distributed.estimate import STRATEGIES, Layout, estimate_memory  # noqa: E402
from tensorplay.distributed.estimate._estimate_measure import measure_step  # noqa: E402
from tensorplay.testing.distributed import run_distributed  # noqa: E402

LM = LMConfig(dim=128, n_layers=2, n_heads=4, max_seq_len=64)
ROWS, SEQ, WIDE = 4, 64, 512


class WideMLP(nn.Module):
    def __init__(self, width: int = WIDE, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.out = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


class TiedLM(nn.Module):
    """Embedding and output head share one weight (both in the root unit)."""

    def __init__(self, vocab: int = 512, dim: int = 128, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.ReLU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_lm() -> nn.Module:
    return ByteLM(LM)


def lm_batch() -> torch.Tensor:
    return torch.randint(0, 256, (ROWS, SEQ))


def lm_loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), idx.flatten())


def mlp_batch() -> torch.Tensor:
    return torch.randn(ROWS * 8, WIDE)


def mlp_loss(out: torch.Tensor, _: Any) -> torch.Tensor:
    return out.float().square().mean()


def tied_batch() -> torch.Tensor:
    return torch.randint(0, 512, (ROWS, SEQ))


def tied_loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), idx.flatten() % 512)


MODELS = {"lm": (build_lm, lm_batch, lm_loss), "mlp": (WideMLP, mlp_batch, mlp_loss),
          "tied": (TiedLM, tied_batch, tied_loss)}
LAYOUTS = [Layout(s) for s in STRATEGIES] + [Layout("fully_shard", reshard_after_forward=False)]
#: ``--options``: the memory options, at the ``--world`` sizes given.
OPTION_LAYOUTS = [Layout("fully_shard", param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  Layout("fsdp_full_shard", param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  Layout("fully_shard", activation_checkpointing=True), Layout("ddp", activation_checkpointing=True),
                  Layout("fully_shard", grad_accum=2), Layout("fsdp_full_shard", grad_accum=2),
                  Layout("ddp", grad_accum=2), Layout("zero", grad_accum=2)]
#: ``--in-backward``: the optimizer applied in backward (``_apply_optimizer_in_backward``), its exact clipping and
#: accumulation, and the ZeRO stage-2 mapping (classic SHARD_GRAD_OP keeping bf16 gradient shards).
IN_BACKWARD_LAYOUTS = [Layout("fully_shard", optim_in_backward=True),
                       Layout("fully_shard", optim_in_backward=True, clip_mode="exact"),
                       Layout("fully_shard", optim_in_backward=True, grad_accum=2),
                       Layout("hsdp", optim_in_backward=True),
                       Layout("fsdp_full_shard", optim_in_backward=True),
                       Layout("fsdp_full_shard", optim_in_backward=True, clip_mode="exact"),
                       Layout("ddp", optim_in_backward=True),
                       Layout("ddp", optim_in_backward=True, clip_mode="exact"),
                       Layout("fsdp_shard_grad_op", param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                              keep_low_precision_grads=True)]
OPTIMIZER, OPTIMIZER_KWARGS = torch.optim.AdamW, {"lr": 1e-3}


def optimizer_for(layout: Layout) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """AdamW, but plain SGD over bf16 gradient shards (PyTorch's Adam refuses bf16 gradients of fp32 parameters)."""
    return (torch.optim.SGD, {"lr": 1e-3}) if layout.keep_low_precision_grads else (OPTIMIZER, OPTIMIZER_KWARGS)


def measured(model: str, layout: Layout) -> dict[str, Any]:
    build, batch, loss = MODELS[model]
    return measure_step(build, batch, layout, *optimizer_for(layout), loss)


def rows_batch(model: str, layout: Layout) -> object:
    """One rank's batch of a step: ``grad_accum`` micro-batches of the model's rows."""
    batch = MODELS[model][1]
    return torch.cat([batch() for _ in range(layout.grad_accum)])


def compare(model: str, layout: Layout, world: int) -> dict[str, Any]:
    build, _, loss = MODELS[model]
    optimizer, kwargs = optimizer_for(layout)
    predicted = estimate_memory(build, rows_batch(model, layout), world_size=world, strategy=layout,
                                optimizer_class=optimizer, optimizer_kwargs=kwargs, loss_fn=loss, compare=False,
                                device="cpu").ranks
    real = run_distributed(measured, model, layout, world_size=world, timeout=600)
    worst = max(range(world), key=lambda r: real[r]["peak"])
    p, m = predicted[worst], real[worst]
    return {"model": model, "layout": layout.label, "world": world, "predicted": p.peak, "measured": m["peak"],
            "error": (p.peak - m["peak"]) / m["peak"], "where_p": p.where, "where_m": m["where"],
            "states_p": p.model_states, "states_m": m["model_states"],
            "states_error": (p.model_states - m["model_states"]) / m["model_states"]}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | strategy | ranks | predicted peak (KiB) | measured peak (KiB) | error | where (predicted) | "
           "model states predicted / measured (KiB) | error |", "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['layout']} | {r['world']} | {r['predicted'] / 1024:,.0f} | "
                   f"{r['measured'] / 1024:,.0f} | {100 * r['error']:+.1f}% | {r['where_p']} | "
                   f"{r['states_p'] / 1024:,.0f} / {r['states_m'] / 1024:,.0f} | {100 * r['states_error']:+.2f}% |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), len(worlds), figsize=(5 * len(worlds), 3.4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, world in enumerate(worlds):
            ax, sel = axes[i][j], [r for r in rows if r["model"] == model and r["world"] == world]
            xs = range(len(sel))
            ax.bar([x - 0.2 for x in xs], [r["predicted"] / 2**20 for r in sel], 0.4, label="predicted")
            ax.bar([x + 0.2 for x in xs], [r["measured"] / 2**20 for r in sel], 0.4, label="measured")
            ax.set_xticks(list(xs), [r["layout"] for r in sel], rotation=40, ha="right", fontsize=7)
            ax.set_title(f"{model}, {world} rank(s)", fontsize=9)
            ax.set_ylabel("peak MiB per rank", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    p.add_argument("--plot", action="store_true")
    p.add_argument("--options", action="store_true", help="mixed precision, activation checkpointing, gradient "
                   "accumulation instead of the strategies")
    p.add_argument("--in-backward", action="store_true", help="the optimizer applied in backward and the ZeRO "
                   "stage-2 mapping instead of the strategies")
    args = p.parse_args()
    layouts = OPTION_LAYOUTS if args.options else IN_BACKWARD_LAYOUTS if args.in_backward else LAYOUTS
    rows = []
    for model in args.models:
        for world in args.world:
            for layout in layouts:
                try:
                    rows.append(compare(model, layout, world))
                except (RuntimeError, TimeoutError) as error:  # a rank failed or timed out: say so, go on
                    print(f"  {model} {layout.label} x{world}: FAILED {str(error)[-300:]}", file=sys.stderr, flush=True)
                    continue
                print(f"  {model} {layout.label} x{world}: {100 * rows[-1]['error']:+.1f}%", file=sys.stderr,
                      flush=True)
    print(table(rows))
    worst = max(abs(r["error"]) for r in rows)
    worst_states = max(abs(r["states_error"]) for r in rows)
    print(f"\nlargest peak error {100 * worst:.1f}%, largest model-state error {100 * worst_states:.2f}% "
          f"({len(rows)} cases)")
    if args.plot:
        name = "estimate_options.png" if args.options else "estimate_in_backward.png" if args.in_backward \
            else "estimate.png"
        path = Path(__file__).parent / "report" / name
        plot(rows, path)
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
