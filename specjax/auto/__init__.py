"""``depth="auto"``: each step picks its verify window and each row its draft count, by
per-row acceptance estimates and a step-cost table (``policy``), as the engine's step
controller (``controller.AutoDepth``); the table is given, cached or measured (``cost``)."""

from specjax.auto.controller import AutoDepth, auto_state
from specjax.auto.cost import cost_cache_path, measure_cost
from specjax.auto.policy import AutoState, CostTable, DepthPolicy, choose, decide

__all__ = ["AutoDepth", "AutoState", "CostTable", "DepthPolicy", "auto_state", "choose", "cost_cache_path", "decide",
           "measure_cost"]
