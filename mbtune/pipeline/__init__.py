"""Pipeline parallelism: split a workload into stages, run torch.distributed.pipelining schedules, time them.

This package is the only place that imports torch.distributed.pipelining (in schedules.py). What is exported
here imports no torch, so planning code and the CLI can use it freely; runner.py and schedules.py import
torch and are loaded inside the rank processes.
"""

from __future__ import annotations

from mbtune.pipeline.launch import run_pipeline_point
from mbtune.pipeline.spec import PipelineSpec
from mbtune.pipeline.split import split_blocks
from mbtune.pipeline.theory import (
    SCHEDULE_NAMES,
    check_point,
    stage_to_rank,
    stages_of_rank,
    stages_per_rank,
    theoretical_bubble,
)
from mbtune.pipeline.timeline import (
    ActionRecord,
    PipelineOutcome,
    StageReport,
    bubble_from_reports,
    idle_shares,
    measured_bubble,
)

__all__ = [
    "SCHEDULE_NAMES",
    "ActionRecord",
    "PipelineOutcome",
    "PipelineSpec",
    "StageReport",
    "bubble_from_reports",
    "check_point",
    "idle_shares",
    "measured_bubble",
    "run_pipeline_point",
    "split_blocks",
    "stage_to_rank",
    "stages_of_rank",
    "stages_per_rank",
    "theoretical_bubble",
]
