"""The action timeline as Chrome trace-event JSON (opens in Perfetto or chrome://tracing): one process per
rank, one thread (track) per stage, one complete event per action, times in microseconds."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mbtune.actions import ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.atomic import write_atomic
from mbtune.records import TimelineAction
from mbtune.sweeping.records import PointResult

# Reserved trace-viewer colour names, so each kind keeps its colour in chrome://tracing.
_COLOURS = {FORWARD: "thread_state_running", BACKWARD: "thread_state_iowait", BACKWARD_INPUT: "rail_load",
            BACKWARD_WEIGHT: "rail_animation", LOSS: "yellow", ALLREDUCE: "terrible"}


def trace_events(actions: Sequence[TimelineAction], *, label: str = "",
                 nodes: Sequence[str] = ()) -> dict[str, Any]:
    """The trace document: metadata naming every rank (and its node, where `nodes` names them per rank)
    and stage track, then one 'X' event per action."""
    events: list[dict[str, Any]] = []
    tracks = sorted({(a.rank, a.stage) for a in actions})
    for rank in sorted({rank for rank, _ in tracks}):
        name = f"rank {rank}" + (f" on {nodes[rank]}" if rank < len(nodes) else "") + (f" - {label}" if label else "")
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, stage in tracks:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": f"stage {stage}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": stage,
                       "args": {"sort_index": stage}})
    for a in sorted(actions, key=lambda a: (a.start_s, a.rank)):
        event = {"name": f"{a.kind} {a.microbatch}", "cat": a.kind, "ph": "X", "pid": a.rank, "tid": a.stage,
                 "ts": round(a.start_s * 1e6, 3), "dur": round(max(0.0, a.end_s - a.start_s) * 1e6, 3),
                 "args": {"microbatch": a.microbatch, "accum": a.accum, "stage": a.stage, "rank": a.rank}}
        if a.kind in _COLOURS:
            event["cname"] = _COLOURS[a.kind]
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": "mbtune", "label": label}}


def write_trace(result: PointResult | Sequence[TimelineAction], path: str | os.PathLike[str], *,
                label: str = "") -> Path:
    """Write the timeline (of a PointResult's median measured step, or any actions) as trace-event JSON,
    atomically; returns the path written."""
    nodes: Sequence[str] = ()
    if isinstance(result, PointResult):
        label = label or result.point.label
        actions: Sequence[TimelineAction] = result.timeline
        nodes = result.rank_nodes
    else:
        actions = result
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(trace_events(actions, label=label, nodes=nodes)))
