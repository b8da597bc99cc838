"""The dynamic batcher's rules, as pure logic over a clock the caller reads: the real server (server.py)
and the queueing simulator (simulate.py) both decide through `next_batch`, so what is simulated is what
runs.

The rules are Triton Inference Server's `dynamic_batching`:

- requests wait in one queue and are served in arrival order;
- when the model is free and the oldest request has waited the max queue delay, the batcher sends what
  has gathered (at most the max batch size); a delay of 0 sends whatever is queued at once;
- before that, it sends at once the largest preferred size the queue can fill (with no preferred sizes,
  the max batch size is the one preferred size), and otherwise waits;
- a request that waited longer than the queue timeout (when one is set) is rejected, not served.
"""

from __future__ import annotations

from dataclasses import dataclass

from mbtune.serving.records import BatchConfig


@dataclass(frozen=True)
class Decision:
    """What the batcher does now: send the `take` oldest requests, or wait until `wait_until` (None: until
    the next request arrives)."""

    take: int = 0
    wait_until: float | None = None


def next_batch(rules: BatchConfig, queued: int, oldest_arrival_s: float | None, now_s: float) -> Decision:
    """The batcher's decision with the model free, `queued` requests waiting (the oldest arrived at
    `oldest_arrival_s`) at time `now_s`: once the oldest has waited the delay, everything queued (up to
    the max batch size) goes; before that, the largest preferred size the queue fills goes at once."""
    if queued <= 0 or oldest_arrival_s is None:
        return Decision()
    deadline = oldest_arrival_s + rules.max_queue_delay_s
    if now_s >= deadline:
        return Decision(take=min(queued, rules.max_batch_size))
    ready = [size for size in rules.sizes if size <= min(queued, rules.max_batch_size)]
    if ready:
        return Decision(take=max(ready))
    return Decision(wait_until=deadline)


def expired(arrival_s: float, now_s: float, queue_timeout_s: float | None) -> bool:
    """Whether a request that arrived at `arrival_s` has waited past the queue timeout (it is rejected)."""
    return queue_timeout_s is not None and now_s - arrival_s > queue_timeout_s
