"""A compact terminal picture of one step's action timeline: one row per stage, one character per time slice."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Group, RenderableType
from rich.text import Text

from mbtune.actions import ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOSS
from mbtune.records import TimelineAction
from mbtune.report import fmt_seconds
from mbtune.sweeping.records import PointResult

# kind -> (character, style); idle slices are IDLE.
GLYPHS = {
    FORWARD: ("F", "green"),
    BACKWARD: ("B", "blue"),
    BACKWARD_INPUT: ("I", "cyan"),
    BACKWARD_WEIGHT: ("W", "magenta"),
    LOSS: ("L", "yellow"),
    ALLREDUCE: ("A", "red"),
}
IDLE = ("·", "dim")
OTHER_STAGE = " "  # the stage's rank is busy with another of its stages


def timeline_rows(actions: Sequence[TimelineAction], *, width: int) -> dict[int, str]:
    """Per stage, `width` characters: each slice shows the kind that covers most of it; where nothing of
    the stage runs, idle when its rank computes nothing and blank when the rank runs another stage."""
    if not actions:
        return {}
    slice_s = (max(a.end_s for a in actions) or 1.0) / width
    stage_cells = _coverage(actions, width, slice_s, key=lambda a: a.stage)
    rank_cells = _coverage(actions, width, slice_s, key=lambda a: a.rank)
    rank_of = {a.stage: a.rank for a in actions}
    rows = {}
    for stage, cells in sorted(stage_cells.items()):
        busy = rank_cells[rank_of[stage]]
        rows[stage] = "".join(
            GLYPHS.get(max(c, key=c.__getitem__), IDLE)[0] if c and sum(c.values()) >= slice_s / 2
            else OTHER_STAGE if sum(busy[i].values()) >= slice_s / 2 else IDLE[0]
            for i, c in enumerate(cells))
    return rows


def _coverage(actions: Sequence[TimelineAction], width: int, slice_s: float,
              key: Callable[[TimelineAction], int]) -> dict[int, list[dict[str, float]]]:
    """Per key (stage or rank), per slice: seconds of each kind inside it."""
    cover: dict[int, list[dict[str, float]]] = {}
    for a in actions:
        cells = cover.setdefault(key(a), [{} for _ in range(width)])
        first, last = int(a.start_s / slice_s), min(width - 1, int(a.end_s / slice_s))
        for i in range(max(0, first), last + 1):
            overlap = min(a.end_s, (i + 1) * slice_s) - max(a.start_s, i * slice_s)
            if overlap > 0:
                cells[i][a.kind] = cells[i].get(a.kind, 0.0) + overlap
    return cover


def timeline_renderable(actions: Sequence[TimelineAction] | PointResult, *, width: int = 80,
                        title: str = "", fit: int | None = None) -> RenderableType:
    """The timeline as rich text: a header, one coloured row per stage (with its rank, and its node when
    the ranks ran on several), a legend, and which hand-overs crossed a node boundary. `width` columns of
    time, or with `fit`, as many as fit in that many columns beside the labels."""
    result = actions if isinstance(actions, PointResult) else None
    if isinstance(actions, PointResult):
        title = title or f"Timeline of {actions.point.label} (median measured step)"
        actions = actions.timeline
    if not actions:
        return Text("no timeline recorded", style="dim")
    ranks = {a.stage: a.rank for a in actions}
    nodes = result.rank_nodes if result is not None and len({n.split(" (")[0] for n in result.rank_nodes}) > 1 else ()

    def _label(stage: int, rank: int) -> str:
        node = f", {nodes[rank].split(' (')[0]}" if rank < len(nodes) else ""
        return f"stage {stage} (rank {rank}{node})"

    label_width = max(len(_label(s, ranks[s])) for s in ranks)
    if fit is not None:  # the whole line, labels included, within `fit` columns
        width = max(40, fit - label_width - 2)
    rows = timeline_rows(actions, width=width)
    lines: list[RenderableType] = []
    if title:
        lines.append(Text(title, style="bold"))
    for stage, row in rows.items():
        line = Text(_label(stage, ranks[stage]).ljust(label_width) + " ")
        for char in row:
            line.append(char, style=_style_of(char))
        lines.append(line)
    end = fmt_seconds(max(a.end_s for a in actions))
    lines.append(Text(" " * (label_width + 1) + "0" + end.rjust(width - 1), style="dim"))
    legend = Text(" " * (label_width + 1))
    kinds = {a.kind for a in actions}
    for kind, (char, style) in [*((k, g) for k, g in GLYPHS.items() if k in kinds), ("idle", IDLE)]:
        legend.append(char, style=style)
        legend.append(f" {kind.replace('_', ' ')}  ")
    lines.append(legend)
    crossing = [f"{s} -> {s + 1}" for s in sorted(ranks)[:-1]
                if s + 1 in ranks and result is not None and result.crosses_nodes(ranks[s], ranks[s + 1])]
    if crossing:
        lines.append(Text(" " * (label_width + 1) + "hand-overs across nodes (inter-node link): stages "
                          + ", ".join(crossing), style="dim"))
    return Group(*lines)


def _style_of(char: str) -> str:
    for glyph, style in GLYPHS.values():
        if glyph == char:
            return style
    return IDLE[1]
