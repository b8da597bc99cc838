"""What a qualification runs and the bounds it holds the results to (QualifySpec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mbtune.errors import ConfigError
from mbtune.probing.config import ProbeConfig
from mbtune.sweeping.config import SweepConfig
from mbtune.validation import check_types
from mbtune.validation import require as _require

THRESHOLD_KEYS = ("min_ceiling", "min_safe_batch", "min_best_samples_per_s", "max_best_bubble", "min_rate_at_p99")


SERVE_THRESHOLDS = ("min_rate_at_p99",)  # judged on `mbtune serve`'s answer (a spec's [serve] section)


@dataclass(frozen=True, kw_only=True)
class QualifySpec:
    """What `mbtune qualify` runs and the bounds it holds the results to (from flags and/or a TOML file)."""

    baseline: str | None = None
    probe: ProbeConfig | None = None  # None: take it from the baseline
    sweep: SweepConfig | None = None  # None: re-run the baseline's points
    tolerance: float = 0.10
    thresholds: tuple[tuple[str, float], ...] = ()
    allow_different_device: bool = False
    # A [serve] section: `mbtune serve` runs too, for min_rate_at_p99. A ServeConfig (serving/config.py,
    # which builds on this module, so it is checked by name rather than by annotation).
    serve: Any = None

    def __post_init__(self) -> None:
        check_types(self)
        _require(self.serve is None or type(self.serve).__name__ == "ServeConfig", "serve", self.serve,
                 "a ServeConfig or nothing")
        if any(k in SERVE_THRESHOLDS for k, _ in self.thresholds) and self.serve is None:
            raise ConfigError("threshold min_rate_at_p99 needs a [serve] section in the spec (with its p99 budget)",
                              hint='Add [serve] with p99 = "50ms" (and any mbtune serve setting).')
        if self.baseline is None and self.probe is None and self.serve is None:
            raise ConfigError("nothing to qualify against: no baseline and no workload in the spec",
                              hint="Pass --baseline profiles/<device>/<workload>.json or --spec qualify.toml.")
        _require(0 <= self.tolerance < 1, "tolerance", self.tolerance, "0% to 99%")
        unknown = [k for k, _ in self.thresholds if k not in THRESHOLD_KEYS]
        _require(not unknown, "thresholds", ",".join(unknown), " | ".join(THRESHOLD_KEYS))
