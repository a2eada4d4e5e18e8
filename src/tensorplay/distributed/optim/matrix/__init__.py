"""Whole-matrix optimizers over sharded parameters: :class:`ShardedMatrixOptimizer` (``_optimizer.py``) steps
each matrix whole on an owner rank (``_layout.py``, ``_sources.py``, ``_exchange.py``) or factored across the
shards (``_factored.py``); its state dicts (``_state.py``, ``_full_state.py``); the Muon + AdamW chain
(``_recipe.py``)."""

from ._layout import step_cost
from ._optimizer import ShardedMatrixOptimizer
from ._recipe import OptimizerChain
from ._state import fqn_state_dict, load_fqn_state_dict

__all__ = ["OptimizerChain", "ShardedMatrixOptimizer", "fqn_state_dict", "load_fqn_state_dict", "step_cost"]
