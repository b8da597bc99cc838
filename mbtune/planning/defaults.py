"""`mbtune plan`'s defaults, here so that the CLI reads them without importing the planner."""

from __future__ import annotations

# `mbtune plan`'s defaults (PlanConfig's), here so that the CLI reads them without importing the planner.
DEFAULT_PLAN_RANKS = 8


DEFAULT_PLAN_MICRO_BATCHES = (8, 16, 32)


DEFAULT_PLAN_VALIDATION = "leave-one-out"  # planning.validate.LEAVE_ONE_OUT


DEFAULT_PLAN_SCATTER = "measured"  # planning.records.SCATTER_MEASURED
