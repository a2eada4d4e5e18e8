"""What examples/train_lm.py measures and shows: bytes per rank, bytes communicated, the loss-curve PNG.

* :class:`CommCounter` counts the bytes this rank hands to collectives while it is
  active, by wrapping the c10d functions the sharding layer calls
  (``tensorplay.distributed.all_reduce`` ... are PyTorch's own functions; the
  wrapper only adds up tensor sizes) and the shared-memory transport's
  operations (``HostArena``: ranks on one host skip c10d for the bytes; counted
  when they ran, so a fallback to c10d is not counted twice). DDP's C++ reducer bypasses Python, so the
  recipe registers the plain all-reduce comm hook, which calls
  ``dist.all_reduce`` and is counted the same way.
* :func:`memory_row` sizes what one rank holds: parameters, gradients and
  optimizer state (local shards of DTensors), and the peak resident set size.
* :func:`plot_losses` draws training and validation loss, one colour per run segment.
"""

from __future__ import annotations

import functools
import resource
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as _torch_dist

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed._comm.host_memory import HostArena

MiB = 2**20

#: collective -> (position, name) of the argument whose size is this rank's payload (all-gathers: the output).
_PAYLOAD_ARG = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
                "all_gather": (0, "tensor_list"), "all_gather_into_tensor": (0, "output_tensor"),
                "reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"),
                "all_to_all_single": (1, "input"), "scatter": (1, "scatter_list"), "gather": (0, "tensor")}
#: shared-memory operation -> its payload in bytes from (arena, args) (all-gathers: the output; reduce-scatters:
#: the input). Every shared-memory collective goes through one of these four (``all_gather`` and ``reduce_scatter``
#: call the first two), so each is counted once.
_HOST_PAYLOAD: dict[str, Callable[[HostArena, tuple], int]] = {
    "all_gather_into": lambda arena, args: arena.world * _nbytes(args[1]),
    "reduce_scatter_from": lambda arena, args: arena.world * args[1].numel() * args[2].itemsize,
    "all_reduce": lambda arena, args: _nbytes(args[0]),
    "broadcast": lambda arena, args: _nbytes(args[0]),
}


def _nbytes(value: Any) -> int:
    if isinstance(value, tp.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CommCounter:
    """Adds up the payload bytes of every collective called while :meth:`counting` is active."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def _wrap(self, name: str, fn: Any) -> Any:
        index, keyword = _PAYLOAD_ARG[name]

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += _nbytes(args[index] if len(args) > index else kwargs.get(keyword))
            return fn(*args, **kwargs)

        return counted

    def _wrap_host(self, name: str, method: Any) -> Any:
        payload = _HOST_PAYLOAD[name]

        @functools.wraps(method)
        def counted(arena: HostArena, *args: Any, **kwargs: Any) -> Any:
            issued = method(arena, *args, **kwargs)
            if issued is not None:  # None: no room in /dev/shm, the caller goes through c10d (counted there)
                self.calls += 1
                self.bytes += payload(arena, args)
            return issued

        return counted

    @contextmanager
    def counting(self) -> Iterator[CommCounter]:
        saved = {(m, n): getattr(m, n) for m in (dist, _torch_dist) for n in _PAYLOAD_ARG}
        saved.update({(HostArena, n): getattr(HostArena, n) for n in _HOST_PAYLOAD})
        try:
            for (owner, name), fn in saved.items():
                setattr(owner, name, self._wrap_host(name, fn) if owner is HostArena else self._wrap(name, fn))
            yield self
        finally:
            for (owner, name), fn in saved.items():
                setattr(owner, name, fn)


def _local(t: tp.Tensor) -> tp.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensors_bytes(tensors: Iterable[tp.Tensor | None]) -> int:
    return sum(_nbytes(_local(t)) for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: tp.optim.Optimizer) -> int:
    """The state this rank keeps (ZeRO and post-local SGD keep theirs in a local ``.optim``)."""
    inner = getattr(optimizer, "optim", optimizer)
    return tensors_bytes(t for state in inner.state.values() for t in state.values() if isinstance(t, tp.Tensor))


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_row(rank: int, model: tp.nn.Module, optimizer: tp.optim.Optimizer, grad_bytes: int,
               comm_bytes_per_step: float) -> dict[str, float]:
    return {"rank": rank, "param_bytes": tensors_bytes(model.parameters()), "grad_bytes": grad_bytes,
            "optim_bytes": optimizer_state_bytes(optimizer), "peak_rss_bytes": peak_rss_bytes(),
            "comm_bytes_per_step": comm_bytes_per_step}


def format_table(rows: list[dict[str, float]], full_param_bytes: int) -> str:
    head = (f"{'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'peak RSS MiB':>13} "
            f"{'comm MiB/step':>14}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['param_bytes'] / MiB:>11.2f} {r['grad_bytes'] / MiB:>10.2f} "
                     f"{r['optim_bytes'] / MiB:>10.2f} {r['peak_rss_bytes'] / MiB:>13.0f} "
                     f"{r['comm_bytes_per_step'] / MiB:>14.2f}")
    lines.append(f"(full fp32 model: {full_param_bytes / MiB:.2f} MiB; comm = payload bytes this rank handed to "
                 f"collectives per training step, counted by wrapping them)")
    return "\n".join(lines)


def plot_losses(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """One colour per run segment (label); solid: training loss, dots: validation loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colours = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    for run in runs:
        for label in dict.fromkeys(p[2] for p in run["train"]):
            colour = next(colours)
            train = [(s, loss) for s, loss, lab in run["train"] if lab == label]
            val = [(s, loss) for s, loss, lab in run["val"] if lab == label]
            ax.plot(*zip(*train, strict=True), color=colour, lw=1, alpha=0.8, label=f"{label} train")
            if val:
                ax.plot(*zip(*val, strict=True), "o--", color=colour, ms=4, label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
