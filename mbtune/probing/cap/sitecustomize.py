"""Put each Python process that `mbtune confirm` starts under the cap a probe trial runs under, before the
script's first line; write what it held when it ends.

This folder goes first on PYTHONPATH of the confirmed command only, and does nothing unless
MBTUNE_CAP_BUDGET is set. It imports nothing of mbtune's package (the command may run another
environment's Python): the counter is loaded from its file, named by MBTUNE_CAP_COUNTER.
A sitecustomize of the command's own environment is run after it, as Python would have run it.

- CPU: this thread's live tensor bytes are counted as a trial counts them (device/tensor_bytes.py); past
  the budget an operator raises torch.OutOfMemoryError.
- CUDA: the device's allocator is held to the budget with the per-process memory fraction, set when CUDA
  starts, on the device LOCAL_RANK names (0 without it).
- With MBTUNE_CAP_STEPS (a probe's trial of the user's own command): every optimizer step of every torch
  optimizer is timed by a global step hook (torch.optim.optimizer.register_optimizer_step_post_hook); after
  that many steps the process writes its report and ends with exit code 0, before the script's epochs,
  evaluation or checkpointing go on.
- Asked to stop (the file `stop` appears in the report folder: the command printed its last counted step, or
  ran past its time), the process writes its report and ends with exit code 0; a daemon thread watches for it.
"""

import atexit
import importlib.machinery
import importlib.util
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_counter():
    spec = importlib.util.spec_from_file_location("_mbtune_tensor_bytes", os.environ["MBTUNE_CAP_COUNTER"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # findable for tracebacks and pickling
    spec.loader.exec_module(module)
    return module


def _cap():
    budget = int(os.environ["MBTUNE_CAP_BUDGET"])
    device = os.environ.get("MBTUNE_CAP_DEVICE", "cpu")
    rank = os.environ.get("RANK", "")
    report = {"pid": os.getpid(), "rank": int(rank) if rank.isdigit() else None, "started": time.time(),
              "argv": list(sys.argv), "device": device, "memory_budget_bytes": budget,
              "peak_bytes": None, "over_budget": "", "exception": "", "step_times_s": []}
    import torch

    count = None
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cpu":
        count = _load_counter().TensorBytes(memory_budget_bytes=budget)
        count.__enter__()
    else:
        def fraction():
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)

        torch.cuda._lazy_call(fraction)

    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):
        report["exception"] = f"{kind.__module__}.{kind.__qualname__}: {value}"
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook

    def write():
        if count is not None:
            report["peak_bytes"], report["over_budget"] = count.peak_bytes, count.over_budget
        elif torch.cuda.is_initialized():
            report["peak_bytes"] = int(torch.cuda.max_memory_allocated(index))
            if torch.cuda.memory_stats(index).get("num_ooms", 0):
                report["over_budget"] = "CUDA out of memory under the per-process memory fraction"
        path = os.path.join(os.environ["MBTUNE_CAP_REPORT"], f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as out:
            json.dump(report, out)
        os.replace(path + ".tmp", path)

    atexit.register(write)
    steps = int(os.environ.get("MBTUNE_CAP_STEPS") or 0)
    if steps:
        _end_after(steps, report, write, torch)
    _end_when_asked(write)


def _end(write):
    atexit.unregister(write)
    write()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_when_asked(write):
    """Report and end once the file `stop` appears in the report folder."""
    import threading

    stop = os.path.join(os.environ["MBTUNE_CAP_REPORT"], "stop")

    def watch():
        while not os.path.exists(stop):
            time.sleep(0.05)
        _end(write)

    threading.Thread(target=watch, name="mbtune-cap-stop", daemon=True).start()


def _end_after(steps, report, write, torch):
    """Time every optimizer step; after `steps` of them, report and end the process (exit code 0)."""
    last = [time.perf_counter()]

    def stepped(optimizer, args, kwargs):
        now = time.perf_counter()
        report["step_times_s"].append(now - last[0])
        last[0] = now
        if len(report["step_times_s"]) >= steps:
            _end(write)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(stepped)


def _run_the_environments_own():
    """The sitecustomize this one stands in front of, if the environment has one."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("MBTUNE_CAP_BUDGET"):
    _cap()
_run_the_environments_own()
