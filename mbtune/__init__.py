"""mbtune: profile real hardware to find the best batch configuration for pipeline-parallel training."""

__version__ = "0.1.0"
