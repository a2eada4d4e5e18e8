"""Model averaging: average parameters across ranks every few steps (local SGD, hierarchical SGD).

``averagers`` holds :class:`ModelAverager` and :class:`PeriodicModelAverager`,
``hierarchical_model_averager`` the :class:`HierarchicalModelAverager`, and
``utils`` the flat-buffer averaging they share.
"""

from __future__ import annotations

from . import averagers, hierarchical_model_averager, utils
from .averagers import ModelAverager, PeriodicModelAverager
from .hierarchical_model_averager import HierarchicalModelAverager
from .utils import average_parameters, average_parameters_or_parameter_groups, get_params_to_average

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "average_parameters",
    "average_parameters_or_parameter_groups",
    "averagers",
    "get_params_to_average",
    "hierarchical_model_averager",
    "utils",
]
