"""Draw docs/architecture.png, the layer diagram of docs/architecture.md.

    .venv/bin/python docs/_draw_architecture.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

OURS, CORE, TORCH, USER = "#cfe3f7", "#e4eefa", "#eeeeee", "#fff4d6"

#: (x, y, width, height, colour, title, lines)
BOXES = [
    (0.0, 9.0, 12.0, 1.0, USER, "your program", ["import tensorplay as tp;  tprun --nproc-per-node N train.py"]),
    (0.0, 7.4, 12.0, 1.2, TORCH, "PyTorch's objects under our names (tensorplay._alias)",
     ["tp.Tensor, tp.nn, tp.optim, tp.amp, DDP, process groups, collectives, RPC, DeviceMesh, DTensor, launcher"]),
    (0.0, 4.6, 2.9, 2.4, OURS, "optim/", ["zero/  ZeRO", "matrix/  Muon, Adafactor",
                                          "in_backward/  step in backward", "functional/  _Functional*",
                                          "post-local SGD, RPC optimizer"]),
    (3.0, 4.6, 3.0, 2.4, OURS, "fsdp/", ["fully_shard (FSDP2), HSDP", "FullyShardedDataParallel",
                                         "policies, wrap policies", "ShardedGradScaler",
                                         "(imports nothing of optim/)"]),
    (6.1, 4.6, 2.9, 2.4, OURS, "algorithms/", ["model_averaging: averagers", "ddp_comm_hooks: default,",
                                               "post-local SGD, PowerSGD,", "quantization, ZeRO overlap"]),
    (9.1, 4.6, 2.9, 2.4, OURS, "checkpoint/", ["DCP's API: atomic save,", "a CRC-32 manifest,",
                                               "allow-listed metadata,", "all-or-nothing load"]),
    (0.0, 2.6, 3.9, 1.6, CORE, "_sharding/", ["plan, layout, placement, ZeRO partition",
                                              "(pure functions); the gradient-ready", "hook point"]),
    (4.05, 2.6, 3.9, 1.6, CORE, "_comm/", ["the one door to c10d: collectives,", "agreement, object collectives,",
                                           "shared memory, pipe barrier, watch"]),
    (8.1, 2.6, 3.9, 1.6, CORE, "_checks/", ["argument checks, plan agreement,", "all-or-nothing load checks"]),
    (0.0, 0.8, 12.0, 1.2, TORCH, "PyTorch 2.13",
     ["autograd and kernels, c10d: Gloo (CPU) / NCCL (GPU), TensorPipe RPC"]),
]


def draw(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 8.2))
    for x, y, w, h, colour, title, lines in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    facecolor=colour, edgecolor="#555555", linewidth=1))
        ax.text(x + w / 2, y + h - 0.28, title, ha="center", va="center", fontsize=11, weight="bold")
        ax.text(x + w / 2, y + h - 0.55, "\n".join(lines), ha="center", va="top", fontsize=8.5, linespacing=1.5)
    for y_from, y_to in ((9.0, 8.6), (7.4, 7.0), (4.6, 4.2), (2.6, 2.0)):
        ax.annotate("", xy=(6.0, y_to), xytext=(6.0, y_from), arrowprops={"arrowstyle": "->", "color": "#555555"})
    ax.text(12.1, 5.8, "ours: PyTorch's API,\nnever imports PyTorch's\nversions of these", fontsize=9, va="center")
    ax.text(12.1, 3.4, "shared by the\nthree front ends", fontsize=9, va="center")
    ax.set_xlim(-0.1, 14.0)
    ax.set_ylim(0.6, 10.2)
    ax.axis("off")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    draw(Path(__file__).resolve().parent / "architecture.png")
