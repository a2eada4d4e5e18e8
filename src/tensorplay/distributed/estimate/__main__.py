"""``python -m tensorplay.distributed.estimate MODEL --world-size N --budget 80GiB``: the table, and a plan.

MODEL is a Python file (``examples/lm_model.py``), optionally with an expression
evaluated in it (``examples/lm_model.py:ByteLM(LMConfig(dim=1024))``); without
one, its ``build_model()`` or else the last ``nn.Module`` class it defines that
can be built from defaults (a dataclass config argument is built with its
defaults). The model is built on the meta device.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import STRATEGIES, BatchSpec, MemoryEstimate, estimate_memory, plan

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int64": torch.int64,
          "long": torch.int64, "float": torch.float32}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``512 MB``, ``1e9`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not match or (match.group(2) and match.group(2).upper() not in UNITS):
        raise argparse.ArgumentTypeError(f"--budget {text!r}: a number of bytes with an optional unit "
                                         f"({', '.join(u for u in UNITS if u != 'B')}), e.g. 80GiB")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "B").upper()])


def load_model(spec: str) -> nn.Module:
    """The model ``spec`` names (see the module docstring), built on the meta device."""
    path, _, expression = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or module_spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"model {spec!r}: {path} is not a Python file")
    sys.path.insert(0, str(Path(path).resolve().parent))
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    module_spec.loader.exec_module(module)
    namespace = vars(module)
    with torch.device("meta"):
        if expression:
            return eval(expression, namespace)  # noqa: S307 (the user's own expression, as on a Python prompt)
        if callable(namespace.get("build_model")):
            return namespace["build_model"]()
        classes = [v for v in namespace.values() if inspect.isclass(v) and issubclass(v, nn.Module)
                   and v.__module__ == module.__name__]
        for cls in reversed(classes):
            model = _from_defaults(cls, namespace)
            if model is not None:
                return model
    raise SystemExit(f"model {spec!r}: no build_model() and no nn.Module class buildable from defaults; "
                     f"write {path}:Expression(...)")


def _from_defaults(cls: type[nn.Module], namespace: dict[str, Any]) -> nn.Module | None:
    args = []
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.default is not inspect.Parameter.empty:
            continue
        annotation = namespace.get(str(param.annotation)) if isinstance(param.annotation, str) else param.annotation
        if not inspect.isclass(annotation):
            return None
        args.append(annotation())
    try:
        return cls(*args)
    except TypeError:
        return None


def main(argv: list[str] | None = None) -> MemoryEstimate:
    p = argparse.ArgumentParser(prog="python -m tensorplay.distributed.estimate", description=__doc__.split("\n")[0])
    p.add_argument("model", help="FILE.py or FILE.py:EXPRESSION (built on the meta device)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--budget", type=parse_bytes, help="bytes per rank, e.g. 80GiB: adds the plan")
    p.add_argument("--strategy", choices=STRATEGIES, default="fully_shard")
    p.add_argument("--batch", default="8x256", help="one rank's batch shape per step, e.g. 8x256")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="the batch's dtype (default: int64 when the model "
                   "starts with an embedding, else float32)")
    p.add_argument("--mp", choices=("bf16", "fp16"), help="mixed precision: parameters cast for compute")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every unit")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--optim-in-backward", nargs="?", const="none", choices=("none", "exact", "previous"),
                   help="the optimizer applied in backward (_apply_optimizer_in_backward), with its global-norm "
                   "clip mode (InBackwardOptions.clip_mode; none: no clipping)")
    p.add_argument("--keep-low-precision-grads", action="store_true", help="classic FSDP: reduce in the --mp "
                   "dtype and keep the sharded gradients in it (MixedPrecision.keep_low_precision_grads)")
    p.add_argument("--optimizer", default="AdamW", help="a torch.optim class name (default AdamW)")
    p.add_argument("--plot", metavar="PNG", help="draw the per-strategy bars into this file")
    args = p.parse_args(argv)
    model = load_model(args.model)
    shape = tuple(int(n) for n in args.batch.lower().split("x"))
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.int64 if any(isinstance(m, nn.Embedding) for m in model.modules()) else torch.float32)
    options: dict[str, Any] = {"reshard_after_forward": args.reshard_after_forward, "cpu_offload": args.cpu_offload,
                               "activation_checkpointing": args.ac, "grad_accum": args.grad_accum}
    if args.mp:
        options.update(param_dtype=DTYPES[args.mp], reduce_dtype=torch.float32)
    if args.keep_low_precision_grads:
        if not args.mp:
            p.error("--keep-low-precision-grads needs --mp (the low precision the gradients are reduced and kept in)")
        options.update(reduce_dtype=DTYPES[args.mp], keep_low_precision_grads=True)
    if args.optim_in_backward:
        options.update(optim_in_backward=True,
                       clip_mode=None if args.optim_in_backward == "none" else args.optim_in_backward)
    optimizer_class = getattr(torch.optim, args.optimizer)
    batch = BatchSpec(shape, dtype)
    try:
        estimate = estimate_memory(model, batch, world_size=args.world_size, strategy=args.strategy,
                                   optimizer_class=optimizer_class, **options)
    except ValueError as error:  # a layout the estimator refuses: say which option, as argparse does
        p.error(str(error))
    n = sum(q.numel() for q in model.parameters())
    print(f"{type(model).__name__}: {n / 1e6:.2f}M parameters; batch {shape} {str(dtype).removeprefix('torch.')} "
          f"per rank; {args.world_size} ranks; {args.optimizer}; the rank with the largest peak:\n")
    print(estimate.table())
    if args.budget is not None:
        fits = plan(model, batch, args.world_size, args.budget, strategy=args.strategy,
                    optimizer_class=optimizer_class, **options)
        print(f"\nplan for {args.budget / 2**30:.1f} GiB per rank (least communication first):\n")
        print("| strategy | peak | moved per step | largest batch (rows per rank) |\n|---|---:|---:|---:|")
        for e in fits:
            print(f"| {e.layout.label} | {e.peak / 2**30:.2f} GiB | {e.comm_bytes / 2**30:.2f} GiB | {e.max_batch} |")
        if not fits:
            print("| (nothing fits) | | | |")
    if args.plot:
        plot(estimate, args.plot)
        print(f"\nplot: {args.plot}")
    return estimate


def plot(estimate: MemoryEstimate, path: str) -> None:
    """Stacked bars per strategy (the rank with the largest peak): parameters, gradients, state, activations, comm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(estimate.layout.label, estimate.ranks), *estimate.others.items()]
    parts = ("params", "grads", "optimizer_state", "activations", "comm_buffers")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [label for label, _ in rows]
    bottoms = [0.0] * len(rows)
    for part in parts:
        values = [getattr(max(r, key=lambda m: m.peak), part) / 2**20 for _, r in rows]
        ax.bar(labels, values, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    peaks = [max(m.peak for m in r) / 2**20 for _, r in rows]
    ax.scatter(labels, peaks, marker="_", s=600, color="black", label="peak (the rest: temporaries)", zorder=3)
    ax.set_ylabel("MiB per rank at the peak")
    ax.set_title(f"predicted peak per strategy, {estimate.world_size} ranks")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
