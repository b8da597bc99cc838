"""What one process of a capped command holds over time, and the evaluation passes and checkpoints it runs.

The cap (probing/cap/sitecustomize.py) loads this file by its path in every Python process of a confirmed or
probed command, so it imports nothing of mbtune, and nothing but the standard library at its top (torch is
handed in). The parent reads what it wrote through probing/high_water.py.

- Samples: a daemon thread reads the process's memory every SAMPLE_S: the seconds since the watch began,
  the live bytes, the high-water mark so far, the optimizer steps made; on CUDA also the allocator's reserved
  bytes, its retries (num_alloc_retries: a cudaMalloc that failed, the cache freed, then tried again) and its
  fragmentation (reserved but not allocated; inactive_split_bytes: free pieces of split blocks). At most
  MAX_SAMPLES are kept: past that, neighbours are merged in pairs (`halve`, every figure its larger, the time
  the later) and the interval doubles, so a run of any length keeps its highs.
- An evaluation pass: a forward of an outermost module (not called from another module's forward, so a
  reentrant activation checkpoint inside a training step is not one) whose parameters require grad, run
  with grad disabled (torch.no_grad or torch.inference_mode): what the transformers Trainer, Lightning and
  plain loops do to evaluate. A pass ends at the next forward with grad enabled, optimizer step, checkpoint
  or the end; forwards with no optimizer step between them are one pass. Not seen: an evaluation run with
  grad enabled, or in eval() mode alone. A frozen model without requires_grad(False) run under no_grad every
  step (a teacher) reads as one.
- A checkpoint: a call of torch.save (the transformers Trainer and Lightning save through it; safetensors
  and torch.distributed.checkpoint are not seen); calls with no optimizer step between them are one.
- Each pass records the high-water mark when it began and when it ended: the pass raised it where the two
  differ. The first FIRST_STEPS optimizer steps record when they ended and the high-water mark then.
"""

import functools
import sys
import threading
import time
import traceback

SAMPLE_S = 0.5
MAX_SAMPLES = 512  # past this, samples are merged in pairs
MAX_EVENTS = 64  # passes kept as they come; past this, only those that raised the high-water mark
FIRST_STEPS = 16
EVALUATION, CHECKPOINT = "evaluation", "checkpoint"
FIELDS = ("t_s", "live_bytes", "peak_bytes", "steps")
CUDA_FIELDS = FIELDS + ("reserved_bytes", "num_alloc_retries", "unallocated_reserved_bytes", "inactive_split_bytes")


def halve(samples):
    """Neighbouring samples merged in pairs: the later time, every other figure the larger of the two (a
    last odd one kept as it is)."""
    merged = [[b[0], *(max(x, y) for x, y in zip(a[1:], b[1:]))] for a, b in zip(samples[0::2], samples[1::2])]
    return merged + ([list(samples[-1])] if len(samples) % 2 else [])


class Watch:
    """One process's memory over time and its passes (see the module's text). `read()` gives the figures
    after `t_s` (live, peak, then the CUDA ones), or None while there is nothing to read."""

    def __init__(self, read, fields, interval_s=SAMPLE_S, clock=time.perf_counter):
        self.read, self.fields, self.interval_s, self.clock = read, fields, interval_s, clock
        self.started, self.began = time.time(), clock()
        self.samples, self.events, self.first_steps = [], [], []
        self.counts = {EVALUATION: 0, CHECKPOINT: 0}
        self.steps, self.high, self.open, self.done = 0, 0, None, None
        self.lock = threading.RLock()

    def now(self):
        return self.clock() - self.began

    def peak(self):
        """The high-water mark now (the larger of what the counter says and what was seen before: a peak
        that the script reset is not forgotten)."""
        figures = self.read()
        if figures is not None:
            self.high = max(self.high, figures[1])
        return self.high

    def sample(self):
        with self.lock:
            figures = self.read()
            if figures is None:
                return
            self.high = max(self.high, figures[1])
            self.samples.append([round(self.now(), 3), figures[0], self.high, self.steps, *figures[2:]])
            if len(self.samples) > MAX_SAMPLES:
                self.samples = halve(self.samples)
                self.interval_s *= 2

    def run(self):
        while self.done is None:
            time.sleep(self.interval_s)
            self.sample()

    def begin(self, kind):
        """A pass of this kind is under way (joined to the open one of its kind where no step came between)."""
        with self.lock:
            if self.open is not None and self.open["kind"] == kind and self.open["step"] == self.steps:
                return
            self.close()
            self.counts[kind] += 1
            self.open = {"kind": kind, "start_s": round(self.now(), 3), "end_s": None, "step": self.steps,
                         "peak_before_bytes": self.peak(), "peak_after_bytes": None}

    def close(self):
        """The open pass, if any, ends now."""
        with self.lock:
            event, self.open = self.open, None
            if event is None:
                return
            event["end_s"], event["peak_after_bytes"] = round(self.now(), 3), self.peak()
            raised = event["peak_after_bytes"] > event["peak_before_bytes"]
            if len(self.events) < MAX_EVENTS or (raised and len(self.events) < 2 * MAX_EVENTS):
                self.events.append(event)

    def stepped(self, *_):
        """An optimizer step ended."""
        with self.lock:
            self.close()
            self.steps += 1
            if len(self.first_steps) < FIRST_STEPS:
                self.first_steps.append([round(self.now(), 3), self.peak()])

    def finish(self):
        """What the watch saw, for the process's report (the same on a second call)."""
        with self.lock:
            if self.done is None:
                self.close()
                self.sample()
                self.done = {"started": self.started, "fields": list(self.fields), "samples": self.samples,
                             "sample_interval_s": self.interval_s, "events": self.events,
                             "num_evaluations": self.counts[EVALUATION], "num_checkpoints": self.counts[CHECKPOINT],
                             "num_steps": self.steps, "first_steps": self.first_steps}
            return self.done


def start(torch, count, index):
    """Watch this process: its memory (`count`, the CPU's TensorBytes, else CUDA device `index`), its
    evaluation passes (a global forward pre-hook), checkpoints (torch.save) and optimizer steps (a global
    step hook); the sampling thread started. Returns the Watch."""
    if count is not None:
        watch = Watch(lambda: (count.live_bytes, count.peak_bytes), FIELDS)
    else:
        watch = Watch(lambda: _cuda_figures(torch, index), CUDA_FIELDS)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(watch.stepped)
    torch.nn.modules.module.register_module_forward_pre_hook(_forward_hook(torch, watch))
    _watch_saves(torch, watch)
    threading.Thread(target=watch.run, name="mbtune-cap-memory", daemon=True).start()
    return watch


def _cuda_figures(torch, index):
    if not torch.cuda.is_initialized():
        return None
    stats = torch.cuda.memory_stats(index)
    allocated, reserved = stats.get("allocated_bytes.all.current", 0), stats.get("reserved_bytes.all.current", 0)
    return (allocated, stats.get("allocated_bytes.all.peak", 0), reserved, stats.get("num_alloc_retries", 0),
            reserved - allocated, stats.get("inactive_split_bytes.all.current", 0))


def _forward_hook(torch, watch):
    call = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)

    def outermost():
        """No other module's forward is under way on this thread (one _call_impl frame: this module's)."""
        if call is None:
            return True
        calls = 0
        for frame, _ in traceback.walk_stack(sys._getframe(2)):
            calls += frame.f_code is call
            if calls > 1:
                return False
        return True

    def pre(module, args):
        if torch.is_grad_enabled():
            if watch.open is not None:
                watch.close()
            return
        if watch.open is not None and watch.open["kind"] == EVALUATION:
            return
        parameter = next(module.parameters(), None)
        if parameter is not None and parameter.requires_grad and outermost():
            watch.begin(EVALUATION)

    return pre


def _watch_saves(torch, watch):
    save = torch.save

    @functools.wraps(save)
    def saved(*args, **kwargs):
        watch.begin(CHECKPOINT)
        return save(*args, **kwargs)

    torch.save = torch.serialization.save = saved
