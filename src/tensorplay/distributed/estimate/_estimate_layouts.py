"""The layouts the estimator knows: strategy names, their options, and how much they communicate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Every strategy, by the name the estimator, its table and its command line use.
STRATEGIES = ("fully_shard", "hsdp", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard",
              "fsdp_no_shard", "zero", "zero_bucket_view", "ddp")
#: Parameter bytes each strategy moves per rank and step, as multiples of the model's (ring collectives:
#: an all-gather or a reduce-scatter is one, an all-reduce two); fully_shard without resharding after
#: forward gathers once, not twice.
COMM_VOLUME = {"fully_shard": 3.0, "hsdp": 3.0, "fsdp_full_shard": 3.0, "fsdp_shard_grad_op": 2.0,
               "fsdp_hybrid_shard": 3.0, "fsdp_no_shard": 2.0, "zero": 3.0, "zero_bucket_view": 3.0, "ddp": 2.0}
SHARDED_PARAMS = ("fully_shard", "hsdp", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard")
CLASSIC = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard", "fsdp_no_shard")
#: The strategies our ``apply_optimizer_in_backward`` steps inside backward (ZeRO is an optimizer itself).
IN_BACKWARD = ("fully_shard", "hsdp", *CLASSIC, "ddp")
#: ``InBackwardOptions.clip_mode`` values.
CLIP_MODES = ("exact", "previous")


@dataclass(frozen=True)
class Layout:
    """How the model is spread over the ranks, with the options that change memory.

    ``reshard_after_forward`` None: the strategy's own (fully_shard/hsdp/FULL_SHARD/HYBRID: True,
    SHARD_GRAD_OP: False). ``hsdp_shard_size`` None: half the world (two replicas), as the recipe does.
    ``param_dtype``/``reduce_dtype``: mixed precision of the sharded strategies (parameters cast for
    compute, gradients reduced in ``reduce_dtype``). ``cpu_offload``: sharded parameters, gradients and
    optimizer state live on the host (sharded strategies). ``keep_low_precision_grads``: classic FSDP's
    ``MixedPrecision`` option, the sharded gradient stays in ``reduce_dtype``.

    ``optim_in_backward``: the optimizer is applied in backward (``_apply_optimizer_in_backward``): each
    parameter steps once its reduced gradient lands (fully_shard and HSDP per parameter group, classic FSDP
    per unit, DDP per bucket in its comm hook), which is then freed. ``clip_mode``: its global-norm
    clipping (``InBackwardOptions(max_norm=..., clip_mode=...)``): ``"exact"`` keeps the reduced gradients
    to the end of backward, ``"previous"`` frees each at once. With ``grad_accum`` the sharded strategies
    reduce every micro-batch and the sharded gradients accumulate (``accumulation_steps=grad_accum``); DDP
    accumulates under ``no_sync()``. See [Note: stepping in backward] (``_estimate_in_backward``).
    """

    strategy: str = "fully_shard"
    reshard_after_forward: bool | None = None
    hsdp_shard_size: int | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    grad_accum: int = 1
    keep_low_precision_grads: bool = False
    optim_in_backward: bool = False
    clip_mode: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is not one the estimator knows; choose one of "
                             f"{', '.join(STRATEGIES)}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.cpu_offload and self.strategy not in SHARDED_PARAMS:
            raise ValueError(f"cpu_offload needs a sharded strategy ({', '.join(SHARDED_PARAMS)}), got strategy "
                             f"{self.strategy!r}")
        if self.keep_low_precision_grads and self.strategy not in CLASSIC:
            raise ValueError(f"keep_low_precision_grads is classic FSDP's option ({', '.join(CLASSIC)}), got "
                             f"strategy {self.strategy!r} (fully_shard keeps its sharded gradients in the "
                             f"parameters' dtype)")
        self._check_in_backward()

    def _check_in_backward(self) -> None:
        if self.clip_mode is not None and self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {', '.join(CLIP_MODES)} or None, got {self.clip_mode!r}")
        if self.clip_mode is not None and not self.optim_in_backward:
            raise ValueError(f"clip_mode {self.clip_mode!r} is the clipping of an optimizer applied in backward; "
                             f"set optim_in_backward=True too")
        if self.optim_in_backward and self.strategy not in IN_BACKWARD:
            raise ValueError(f"optim_in_backward is not supported with strategy {self.strategy!r} (ZeRO is an "
                             f"optimizer itself); choose one of {', '.join(IN_BACKWARD)}")

    @property
    def reshards(self) -> bool:
        """Whether gathered parameters are freed after forward (and gathered again for backward)."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.strategy not in ("fsdp_shard_grad_op", "fsdp_no_shard")

    def shard_size(self, world_size: int) -> int:
        """Ranks one parameter is split over."""
        if self.strategy in ("zero", "zero_bucket_view", "ddp", "fsdp_no_shard"):
            return 1
        if self.strategy == "hsdp":
            return self.hsdp_shard_size or max(world_size // 2, 1)
        return world_size  # HYBRID_SHARD on one host: every rank is intra-node

    @property
    def label(self) -> str:
        parts = [self.strategy]
        if self.reshard_after_forward is not None and self.strategy in ("fully_shard", "hsdp"):
            parts.append(f"reshard={self.reshard_after_forward}")
        if self.param_dtype is not None:
            parts.append(str(self.param_dtype).removeprefix("torch."))
        parts += ["offload"] * self.cpu_offload + ["ac"] * self.activation_checkpointing
        parts += [f"accum {self.grad_accum}"] * (self.grad_accum > 1)
        parts += ["low-precision grads"] * self.keep_low_precision_grads
        if self.optim_in_backward:
            parts.append("in-backward" + (f" {self.clip_mode} clip" if self.clip_mode else ""))
        return " ".join(parts)
