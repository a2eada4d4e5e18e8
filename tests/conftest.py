"""Shared fixtures. Multi-rank tests use tensorplay.testing.distributed (pooled workers)."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
