"""What an out-of-memory error says about the memory it needed: the bytes its failing allocation asked for and
the bytes the budget already held, read from the allocator's own words. Their sum is a lower bound of the
failing batch's peak (the step had more to allocate after the allocation that failed).

- CPU (device/tensor_bytes.py): "... you tried to allocate 17002496 bytes (aten.mm.default) with 50193408
  bytes (47.87 MiB) of the 64.00 MiB memory budget in live tensors": both exact.
- CUDA (c10's caching allocator, torch 2.x): "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a
  total capacity of ... Of the allocated memory 14.51 GiB is allocated by PyTorch, and 15.90 MiB is reserved
  by PyTorch but unallocated." The allocator held both figures (the per-process memory fraction caps what it
  reserves); each is printed to two decimals, so each is read at the low end of what it rounds.

Pure text in, figures out: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB)"
_CPU = re.compile(r"you tried to allocate (\d+) bytes \(.*?\) with (\d+) bytes")
_CUDA_TRIED = re.compile(r"out of memory\. Tried to allocate " + _SIZE)
_CUDA_HELD = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, "
                        r"(?:with .*? allocated in private pools .*?\), )?and " + _SIZE +
                        r" is reserved by PyTorch but unallocated")


@dataclass(frozen=True, kw_only=True)
class OomFigures:
    """The failing allocation's bytes, and the bytes the budget held when it was asked for."""

    requested_bytes: int
    live_bytes: int

    @property
    def need_bytes(self) -> int:
        """What the budget would have had to hold: a lower bound of the failing batch's peak."""
        return self.requested_bytes + self.live_bytes


def oom_figures(message: str) -> OomFigures | None:
    """The figures an out-of-memory message names (None where it names none: an allocator that says less,
    or an error that is not one)."""
    cpu = _CPU.search(message)
    if cpu:
        return OomFigures(requested_bytes=int(cpu.group(1)), live_bytes=int(cpu.group(2)))
    tried, held = _CUDA_TRIED.search(message), _CUDA_HELD.search(message)
    if tried and held:
        allocated, unallocated = held.groups()[:2], held.groups()[2:]
        return OomFigures(requested_bytes=_low_bytes(*tried.groups()),
                          live_bytes=_low_bytes(*allocated) + _low_bytes(*unallocated))
    return None


def oom_fields(message: str) -> dict[str, int]:
    """The figures an out-of-memory message names, under the names a trial's outcome and the cap's report give
    them (oom_requested_bytes, oom_live_bytes); empty where it names none."""
    figures = oom_figures(message)
    if figures is None:
        return {}
    return {"oom_requested_bytes": figures.requested_bytes, "oom_live_bytes": figures.live_bytes}


def _low_bytes(value: str, unit: str) -> int:
    """A size as the allocator printed it, at the low end of what it rounds (two decimals of a KiB, MiB or
    GiB; bytes are exact)."""
    if unit == "bytes":
        return int(value)
    return max(0, int((float(value) - 0.005) * _UNITS[unit]))
