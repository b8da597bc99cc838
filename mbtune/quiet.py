"""Python's and torch's own machinery kept off the user's screen: what they would print is about mbtune's
processes, not the user's job, and it would come before (or after) mbtune's one line. MBTUNE_DEBUG=1 shows
it all; TORCH_LOGS keeps torch's loggers as the user set them."""

from __future__ import annotations

import logging
import os
import sys


def quiet_library_logs() -> None:
    """torch's loggers say nothing below CRITICAL in this process: a failed schedule logs its whole action
    table, the fake-tensor mode the traceback of an operator a workload's block cannot run."""
    if os.environ.get("MBTUNE_DEBUG") or os.environ.get("TORCH_LOGS"):
        return
    logging.getLogger("torch").setLevel(logging.CRITICAL)


def quiet_resource_tracker() -> None:
    """Start Python's resource tracker (shared by every process mbtune starts) with its stderr on the null
    device. It still removes what a killed trial or rank left (a library's lock: torch.fx's progress bar
    makes one in every rank), but its warning at shutdown ("There appear to be 1 leaked semaphore objects")
    never reaches the user."""
    if os.environ.get("MBTUNE_DEBUG"):
        return
    from multiprocessing import resource_tracker

    kept, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(null, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(null)
