"""Muon on the hidden weight matrices and AdamW on the rest, as one object a training loop steps.

Muon users give embeddings, biases and norms to AdamW (PyTorch's Muon docstring says so). The training
loop wants one optimizer: :class:`OptimizerChain` steps and zeroes both, lists their ``param_groups``
in order (an LR schedule writes them all) and iterates as the list of its optimizers, which is what the
checkpoint API's ``get_state_dict(model, optimizers)`` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ._optimizer import ShardedMatrixOptimizer


class OptimizerChain:
    """Several optimizers stepped as one; iterating yields them."""

    optimizers: list[torch.optim.Optimizer]

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {param: state for optimizer in self.optimizers for param, state in optimizer.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)


def muon_and_adamw(model: nn.Module, lr: float, weight_decay: float = 0.01, **adamw_kwargs: Any) -> OptimizerChain:
    """``torch.optim.Muon`` (whole matrices, ``adjust_lr_fn="match_rms_adamw"`` so it shares AdamW's ``lr``)
    on every 2-D weight outside embeddings, ``torch.optim.AdamW`` on the rest.

    Works on DTensor (``fully_shard``) and plain parameters; classic FSDP's 1D views are not told apart here.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices: list[tuple[str, nn.Parameter]] = []
    rest: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        (matrices if param.ndim == 2 and id(param) not in embeddings else rest).append((name, param))
    muon = ShardedMatrixOptimizer(torch.optim.Muon, matrices, lr=lr, weight_decay=weight_decay,
                                  adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for _, p in rest], lr=lr, weight_decay=weight_decay, **adamw_kwargs)
    return OptimizerChain([muon, adamw])
