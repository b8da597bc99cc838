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
- With MBTUNE_CAP_WATCH, the report's `memory` holds the process's memory over time (a sampling thread), its
  evaluation passes and checkpoints (probing/memory_watch.py, loaded from that file).
- Where the script runs torch.distributed.pipelining's schedules, each schedule step and each of its stages'
  actions (forward, backward, weight backward, loss) is timed as mbtune's own ranks time theirs
  (pipeline/action_timer.py): the stage and schedule classes' methods are wrapped when the script imports
  the package, and the report's `pipeline` holds every schedule step with its actions, by optimizer step.
  On CUDA the actions are timed by events, read once they have completed (never a synchronize inside a step).
"""

import atexit
import importlib.abc
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
        if pipeline is not None:
            pipeline.resolve(wait=True)
        if count is not None:
            report["peak_bytes"], report["over_budget"] = count.peak_bytes, count.over_budget
            report.update(_oom_figures(count))
        elif torch.cuda.is_initialized():
            report["peak_bytes"] = int(torch.cuda.max_memory_allocated(index))
            report["device_uuids"] = _used_gpus(torch)
            if torch.cuda.memory_stats(index).get("num_ooms", 0):
                report["over_budget"] = "CUDA out of memory under the per-process memory fraction"
        path = os.path.join(os.environ["MBTUNE_CAP_REPORT"], f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as out:
            json.dump(report, out)
        os.replace(path + ".tmp", path)

    pipeline = _time_pipeline(report, device != "cpu")
    write = _watch_memory(report, write, count, torch, index)
    atexit.register(write)
    steps = int(os.environ.get("MBTUNE_CAP_STEPS") or 0)
    _count_steps(steps, report, write, pipeline)
    _end_when_asked(write)


def _oom_figures(count):
    """The bytes the operator that went past the budget asked for and those live before it, as numbers."""
    if count.over_budget_requested_bytes is None:
        return {}
    return {"oom_requested_bytes": count.over_budget_requested_bytes, "oom_live_bytes": count.over_budget_live_bytes}


def _used_gpus(torch):
    """The GPUs this process allocated on, as NVML names them ("GPU-..."): what its NVML samples are of."""
    used = []
    for i in range(torch.cuda.device_count()):
        if torch.cuda.max_memory_allocated(i) > 0:
            raw = str(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "")
            if raw:
                used.append(raw if raw.startswith(("GPU-", "MIG-")) else "GPU-" + raw)
    return used


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


def _count_steps(steps, report, write, pipeline):
    """Time every optimizer step (the schedule steps are told which one they belong to); with `steps`, after
    that many of them, report and end the process (exit code 0)."""
    last = [time.perf_counter()]

    def stepped(optimizer, args, kwargs):
        now = time.perf_counter()
        report["step_times_s"].append(now - last[0])
        report.setdefault("step_ends_unix_s", []).append(time.time())
        last[0] = now
        if pipeline is not None:
            pipeline.optimizer_steps = len(report["step_times_s"])
        if steps and len(report["step_times_s"]) >= steps:
            _end(write)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(stepped)


MAX_SCHEDULE_STEPS = 2000  # the report keeps the latest this many schedule steps


class _PipelineTimer:
    """Times torch.distributed.pipelining's schedule steps and their stages' actions in this process (see the
    module's text). Each schedule step: [optimizer steps done before it, start, end, actions], an action
    [stage, kind, micro-batch, start, end], all in perf_counter seconds of this process."""

    def __init__(self, report, cuda):
        self.report, self.cuda = report, cuda
        self.optimizer_steps = 0
        self.depth = 0
        self.step: list = []  # the schedule step being timed, [index, start, end, actions]; [] between steps
        self.events: tuple = ()  # CUDA, within a step: (its perf_counter start, start event, [(action, events)])
        self.pending = []  # CUDA: (step, start event, [(action, start event, end event)], end event)
        self.loss_of = None  # (stage, micro-batch) of the last stage's latest forward: its loss comes next

    def now(self):
        if not self.cuda:
            return time.perf_counter(), None
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return None, event

    def begin(self, schedule):
        pipe = self.report.setdefault("pipeline", {"schedule": type(schedule).__name__, "stages": [],
                                                   "num_stages": None, "micro_batches": None, "steps": []})
        pipe["micro_batches"] = getattr(schedule, "_n_microbatches", None)
        self.resolve(wait=False)
        start, event = self.now()
        self.step = [self.optimizer_steps, start, None, []]
        self.events = (time.perf_counter(), event, []) if event is not None else ()

    def end(self):
        step, self.step = self.step, []
        pipe = self.report["pipeline"]
        if self.events:
            cpu_start, start_event, spans = self.events
            _, end_event = self.now()
            step[1] = cpu_start
            self.pending.append((step, start_event, spans, end_event))
        else:
            step[2] = time.perf_counter()
        pipe["steps"].append(step)
        del pipe["steps"][:-MAX_SCHEDULE_STEPS]

    def resolve(self, wait):
        """CUDA: turn the events of finished schedule steps into times (all of them, waiting, with `wait`)."""
        while self.pending:
            step, start_event, spans, end_event = self.pending[0]
            if not wait and not end_event.query():
                return
            end_event.synchronize()
            origin = step[1]
            for action, begun, ended in spans:
                action[3] = origin + start_event.elapsed_time(begun) / 1000.0
                action[4] = origin + start_event.elapsed_time(ended) / 1000.0
                step[3].append(action)
            step[2] = origin + start_event.elapsed_time(end_event) / 1000.0
            self.pending.pop(0)

    def timed(self, stage, kind, microbatch, run):
        if not self.step:
            return run()
        pipe = self.report["pipeline"]
        if stage is not None:
            if stage.stage_index not in pipe["stages"]:
                pipe["stages"].append(stage.stage_index)
                pipe["stages"].sort()
            pipe["num_stages"] = stage.num_stages
        index = stage.stage_index if stage is not None else (self.loss_of or (None, None))[0]
        action = [index, kind, int(microbatch) if microbatch is not None else -1, None, None]
        start, begun = self.now()
        result = run()
        end, ended = self.now()
        if begun is None:
            action[3], action[4] = start, end
            self.step[3].append(action)
        else:
            self.events[2].append((action, begun, ended))
        return result


def _time_pipeline(report, cuda):
    """Wrap torch.distributed.pipelining's schedule and stage methods once the script imports them (now, if it
    already has); the timer, or None where this torch has no pipelining."""
    timer = _PipelineTimer(report, cuda)
    name = "torch.distributed.pipelining.schedules"

    def patch(schedules):
        stage_module = sys.modules.get("torch.distributed.pipelining.stage")
        base = getattr(stage_module, "_PipelineStageBase", None)
        if base is None:
            return
        for cls in (getattr(schedules, "PipelineScheduleSingle", None), getattr(schedules, "PipelineScheduleMulti", None)):
            if cls is not None and "step" in vars(cls):
                cls.step = _wrap_step(cls.step, timer)
        if hasattr(schedules, "_PipelineSchedule") and "_compute_loss" in vars(schedules._PipelineSchedule):
            compute_loss = schedules._PipelineSchedule._compute_loss

            def timed_loss(self, *args, **kwargs):
                microbatch = timer.loss_of[1] if timer.loss_of else None
                return timer.timed(None, "loss", microbatch, lambda: compute_loss(self, *args, **kwargs))

            schedules._PipelineSchedule._compute_loss = timed_loss
        for method, chunk, kind in (("forward_one_chunk", "fwd_chunk_id", None),
                                    ("backward_one_chunk", "bwd_chunk_id", "backward"),
                                    ("backward_weight_one_chunk", "bwd_chunk_id", "backward_weight")):
            if method in vars(base):
                setattr(base, method, _wrap_action(vars(base)[method], chunk, kind, timer))

    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _OnImport(name, patch))
    return timer


def _wrap_step(step, timer):
    import functools

    @functools.wraps(step)
    def timed_step(self, *args, **kwargs):
        if timer.depth:
            return step(self, *args, **kwargs)
        timer.depth += 1
        timer.begin(self)
        try:
            return step(self, *args, **kwargs)
        finally:
            timer.depth -= 1
            timer.end()

    return timed_step


def _wrap_action(method, chunk, kind, timer):
    import functools

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        microbatch = args[0] if args else kwargs.get(chunk)
        what = kind or "forward"
        if kind == "backward" and not kwargs.get("full_backward", True):
            what = "backward_input"
        result = timer.timed(self, what, microbatch, lambda: method(self, *args, **kwargs))
        if kind is None and self.is_last:
            timer.loss_of = (self.stage_index, microbatch)
        return result

    return timed


class _OnImport:
    """A meta path finder that runs `patch(module)` once the module `name` has been executed."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, patch = spec.loader, self.patch

        class Patching(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                try:
                    patch(module)
                except Exception:  # timing is a bonus: a torch whose internals moved still trains
                    pass

        spec.loader = Patching()
        return spec


def _watch_memory(report, write, count, torch, index):
    """Sample this process's memory over time and note its evaluation passes and checkpoints
    (probing/memory_watch.py, loaded from the file MBTUNE_CAP_WATCH names); `write`, made to put what was seen
    in the report's `memory` first."""
    path = os.environ.get("MBTUNE_CAP_WATCH")
    if not path:
        return write
    spec = importlib.util.spec_from_file_location("_mbtune_memory_watch", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    watch = module.start(torch, count, index)

    def written():
        report["memory"] = watch.finish()
        write()

    return written

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
