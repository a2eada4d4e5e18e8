"""fully_shard with optimizers applied in backward: step each sharded parameter once its reduce-scatter lands.

    fully_shard(layer) for each layer; fully_shard(model)
    apply_optimizer_in_backward(tp.optim.AdamW, model.parameters(), {"lr": 1e-3})
    model(x).sum().backward()   # each group stepped as its gradients land; sharded gradients freed

The parameter group calls :func:`sharded_grads_ready` once the reduced,
divided gradients are in the sharded parameters' ``.grad`` (HSDP: after the
all-reduce across replicas). Under ``set_requires_gradient_sync(False)`` no
reduce-scatter runs and nothing steps: the unsharded gradients accumulate and
the step happens in the backward that synchronizes them. The sharded gradient
is a DTensor, so the clipping norm is summed over its ``Shard`` mesh
dimensions (``optim/in_backward/_clip.py``). The parameters are handed over
through the "gradient ready" hook point (``_sharding/grad_ready.py``), on which
the optimizers in backward register: this front end does not import them.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorplay.distributed._sharding.grad_ready import grad_ready, has_grad_ready_hook

from ._fsdp_param import FSDPParam

__all__ = ["sharded_grads_ready"]


def sharded_grads_ready(fsdp_params: Sequence[FSDPParam], got_grads: Sequence[bool]) -> None:
    """The parameters with ``got_grads`` True have their sharded gradient: hand them to their optimizers."""
    ready = [p.sharded_param for p, got in zip(fsdp_params, got_grads, strict=True)
             if got and has_grad_ready_hook(p.sharded_param)]
    if not ready:
        return
    for param in ready:
        grad_ready(param)
