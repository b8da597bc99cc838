"""Dense peak FLOP/s per device and precision, for MFU. Unknown devices say so instead of guessing."""

from __future__ import annotations

# (name fragment, {precision: dense peak FLOP/s}); fp32 here is plain FP32 (no TF32), as torch uses by default.
_TABLE: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
)


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device at a precision, or None when unknown (CPUs, unlisted GPUs)."""
    for fragment, peaks in _TABLE:
        if fragment.lower() in device_name.lower():
            return peaks.get(precision)
    return None
