"""ZeRO: :class:`ZeroRedundancyOptimizer` (``_optimizer.py``) and what it is built from: its argument checks
(``_checks.py``), the broadcasts of updated shards (``_sync.py``), the cache-sized local step
(``_chunked_step.py``), the state dicts (``_state.py``) and the overlap with DDP (``_overlap.py``)."""

from typing import Any

from . import _chunked_step, _sync
from ._optimizer import ZeroRedundancyOptimizer, _broadcast_object
from ._overlap import Overlap

__all__ = ["CHUNK_NUMEL", "SMALL_NUMEL", "Overlap", "ZeroRedundancyOptimizer", "_broadcast_object"]

#: Tunables read where they live (so a value set there, e.g. by a benchmark, is the one read here too).
_TUNABLES = {"CHUNK_NUMEL": _chunked_step, "SMALL_NUMEL": _sync}


def __getattr__(name: str) -> Any:
    if name in _TUNABLES:
        return getattr(_TUNABLES[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
