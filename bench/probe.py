"""Benchmark: mbtune's model-guided probe against plain doubling + bisection and, where installed, PyTorch
Lightning's `Tuner.scale_batch_size(mode="binsearch")` and Hugging Face Accelerate's
`find_executable_batch_size`, on the same workload, the same memory budget and the same training step.

Prints trials and wall time of each, how far each landed from the true ceiling (found by stepping every
granule up from mbtune's smallest answer until two OOMs in a row, stepping down first if that answer does
not run), and whether each method's answer runs in fresh
isolated trials. mbtune and doubling + bisection run one fresh process per trial; each peer runs its whole
search in one fresh process capped exactly like an mbtune CPU trial, catching OOMs and retrying inside it
(see bench/peers.py). Run: .venv/bin/python bench/probe.py [--workload mlp -O width=64 --memory-budget 256MiB]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from dataclasses import dataclass

from peers import PEERS, PeerRun, missing_reason, run_peer

from mbtune.probing.ceiling_prediction import predict_ceiling
from mbtune.probing.config import ProbeConfig
from mbtune.probing.records import TrialOutcome
from mbtune.probing.search import search_ceiling
from mbtune.probing.trial import run_classified_trial
from mbtune.records import OK
from mbtune.units import parse_bytes, parse_options
from mbtune.worker import run_isolated

MBTUNE, DOUBLING = "mbtune probe", "doubling + bisection"
PEER_ROWS = {"lightning": "lightning binsearch", "accelerate": "accelerate find_exec"}
_NO_LIMIT = 1 << 31


@dataclass(frozen=True)
class Found:
    """One method's answer in one repeat."""

    ceiling: int | None  # None: the method gave no answer
    trials: int | None
    wall_s: float
    peer: PeerRun | None = None


def doubling_bisection(run, granularity: int) -> tuple[int, int, int]:
    """The classic search: double until OOM, then bisect. Returns (ceiling, trials, first failing size)."""
    trials, lo, size = 0, 0, granularity
    while True:
        trials += 1
        if not run(size).ok:
            hi = first_oom = size
            break
        lo, size = size, size * 2
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        trials += 1
        lo, hi = (mid, hi) if run(mid).ok else (lo, mid)
    return lo, trials, first_oom


def truth_ceiling(run, start: int, granularity: int) -> int:
    """Step every granule up from start; the truth is the last size before two consecutive OOMs. A start
    that does not run (an answer that overshot) steps down first, so it cannot set the truth itself."""
    size = start
    while size > granularity and not run(size).ok:
        size -= granularity
    last_ok, misses, size = size, 0, size + granularity
    while misses < 2:
        if run(size).ok:
            last_ok, misses = size, 0
        else:
            misses += 1
        size += granularity
    return last_ok


def probe_kwargs(config: ProbeConfig) -> dict:
    """search_ceiling's keywords as this bench has always passed them, plus the config's value of any newer
    keyword the installed search_ceiling accepts."""
    kwargs = dict(granularity=config.granularity, memory_budget_bytes=config.memory_budget_bytes, margin=config.margin,
                  confirm=config.confirm or 1)  # as the probe resolves it on the CPU
    accepted = inspect.signature(search_ceiling).parameters
    for name in ("resolution",):
        if name in accepted:
            kwargs[name] = getattr(config, name, None)
    return kwargs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("-O", "--option", action="append", default=[])
    parser.add_argument("--memory-budget", default="1GiB")
    parser.add_argument("--granularity", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--peers", default=None,
                        help=f"comma list of {','.join(PEERS)}, or 'none' (default: every one installed)")
    parser.add_argument("--no-truth", action="store_true", help="skip the brute-force true ceiling")
    parser.add_argument("--verify", type=int, default=2, metavar="N",
                        help="fresh isolated trials run at each method's answer (default 2; 0 skips)")
    parser.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds for one peer's whole search")
    parser.add_argument("--peer-max-trials", type=int, default=40,
                        help="cap on a peer's attempts (Lightning's max_trials counts its successes)")
    parser.add_argument("--accelerate-start", type=int, default=None,
                        help="Accelerate's starting_batch_size (default: the first size doubling ran out at)")
    args = parser.parse_args()
    if args.peers is None:
        args.peers = ",".join(PEERS)
    wanted = [] if args.peers.strip() == "none" else [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        parser.error(f"unknown peer {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    args.peer_list = wanted
    return args


def main() -> None:
    args = parse_args()
    config = ProbeConfig(workload=args.workload, workload_options=parse_options(args.option), device="cpu",
                         memory_budget_bytes=parse_bytes(args.memory_budget), granularity=args.granularity)
    trial = config.trial(batch_size=config.granularity, device="cpu")
    skipped = {name: why for name in args.peer_list if (why := missing_reason(name))}
    peers = [name for name in args.peer_list if name not in skipped]
    print_settings(args, config, trial, peers, skipped)

    def run(batch: int) -> TrialOutcome:
        # As mbtune probe runs them: an error under the cap is re-checked with more room before it counts.
        return run_classified_trial(config.trial(batch_size=batch, device="cpu"), config.trial_timeout_s)

    rows: dict[str, list[Found]] = {MBTUNE: [], DOUBLING: [], **{PEER_ROWS[name]: [] for name in peers}}
    for repeat in range(args.repeats):
        started = time.perf_counter()
        predicted = run_isolated(predict_ceiling, trial, config.memory_budget_bytes, config.granularity,
                                 config.max_batch, timeout_s=config.load_timeout_s + config.trial_timeout_s)
        start = predicted.value.ceiling if predicted.status == OK and predicted.value else None
        predict_s = time.perf_counter() - started
        found = search_ceiling(run, **probe_kwargs(config), start=start)
        rows[MBTUNE].append(Found(found.ceiling, len(found.trials), time.perf_counter() - started))
        print(f"  repeat {repeat + 1}: mbtune probe -> {found.ceiling}, safe {found.safe_batch}; predicted {start} "
              f"in {predict_s:.1f} s; trials " + " ".join(f"{t.batch_size}:{t.status}({t.wall_s:.1f}s)" for t in found.trials))
        started = time.perf_counter()
        ceiling, trials, first_oom = doubling_bisection(run, config.granularity)
        rows[DOUBLING].append(Found(ceiling, trials, time.perf_counter() - started))
        for name in peers:
            start = config.granularity if name == "lightning" else (args.accelerate_start or first_oom)
            peer = run_peer(name, trial, start_batch=start, max_batch=config.max_batch or _NO_LIMIT,
                            max_trials=args.peer_max_trials, timeout_s=args.peer_timeout)
            answer = peer.log.answer if peer.log else None
            tried = len(peer.log.attempts) if peer.log else None
            rows[PEER_ROWS[name]].append(Found(answer, tried, peer.wall_s, peer))
            print(f"  repeat {repeat + 1}: {PEER_ROWS[name]} -> {answer if answer is not None else peer.failure} "
                  f"(started at {start}, {tried if tried is not None else '?'} attempts, {peer.wall_s:.1f} s)")

    truth = None
    if not args.no_truth:
        truth = truth_ceiling(run, min(r.ceiling for r in rows[MBTUNE]), config.granularity)
        print(f"true ceiling (stepping up from mbtune's answer until two OOMs in a row): {truth}")
    checks = verify_answers(run, rows, args.verify)
    print_table(rows, truth, checks, args.verify)
    print_notes(rows, peers)


def verify_answers(run, rows: dict[str, list[Found]], runs: int) -> dict[int, list[str]]:
    """Fresh isolated trials at every size some method answered: size -> the status of each of `runs` trials."""
    sizes = sorted({f.ceiling for found in rows.values() for f in found if f.ceiling is not None})
    return {size: [run(size).status for _ in range(runs)] for size in sizes}


def print_settings(args: argparse.Namespace, config: ProbeConfig, trial, peers: list[str],
                   skipped: dict[str, str]) -> None:
    print(f"workload {config.workload} {dict(config.workload_options)}, budget {args.memory_budget} "
          f"({config.memory_budget_bytes} bytes), granularity {config.granularity}, repeats {args.repeats}")
    print(f"training step: {trial.steps} steps of forward, loss, backward, {trial.optimizer} step, "
          f"precision {trial.precision}, torch threads {trial.threads or 'all cores'}; every process capped as "
          f"mbtune's CPU trials are (live tensor bytes counted against the budget)")
    print(f"mbtune search_ceiling keywords: {probe_kwargs(config)}")
    print(f"peers: {', '.join(peers) or 'none'}" + "".join(f"; skipped {name}: {why}" for name, why in skipped.items()))
    if "lightning" in peers:
        print(f"  lightning: Tuner.scale_batch_size(mode='binsearch', init_val={config.granularity}, margin=0, "
              f"steps_per_trial={trial.steps}, max_trials={args.peer_max_trials}), one process, OOMs caught in it")
    if "accelerate" in peers:
        start = args.accelerate_start or "the first size doubling + bisection ran out at"
        print(f"  accelerate: find_executable_batch_size(starting_batch_size={start}), one process, "
              f"OOMs caught in it, model and optimizer rebuilt each attempt")
    checked = f"answers checked in {args.verify} fresh isolated trial(s) each"
    print(checked if args.verify > 0 else "answers not checked")


def print_table(rows: dict[str, list[Found]], truth: int | None, checks: dict[int, list[str]], runs: int) -> None:
    print(f"{'method':<24}{'ceilings':>18}{'trials (median)':>17}{'wall s (median)':>17}{'off by (median)':>17}"
          f"  its answer in a fresh process")
    for name, results in rows.items():
        answered = [r for r in results if r.ceiling is not None]
        ceilings = ",".join(str(r.ceiling) if r.ceiling is not None else "failed" for r in results)
        trials = [r.trials for r in results if r.trials is not None]
        off = "n/a"
        if answered and truth is not None:
            off = f"{statistics.median(r.ceiling - truth for r in answered):+g}"
        print(f"{name:<24}{ceilings:>18}{_median(trials):>17}{statistics.median(r.wall_s for r in results):>17.1f}"
              f"{off:>17}  {_verdict(answered, checks, runs)}")


def _median(values: list) -> str:
    return f"{statistics.median(values):g}" if values else "n/a"


def _verdict(answered: list[Found], checks: dict[int, list[str]], runs: int) -> str:
    if runs <= 0 or not answered:
        return "n/a"
    statuses = [status for r in answered for status in checks[r.ceiling]]
    ran = statuses.count(OK)
    failed = sorted({status for status in statuses if status != OK})
    return f"{'ok' if not failed else '/'.join(s.upper() for s in failed)} ({ran} of {len(statuses)} ran)"


def print_notes(rows: dict[str, list[Found]], peers: list[str]) -> None:
    print("doubling + bisection reports a single pass, unconfirmed and with no safe-batch run; "
          "mbtune's count includes confirmation and the safe-batch verification")
    for name in peers:
        for repeat, found in enumerate(rows[PEER_ROWS[name]], 1):
            peer = found.peer
            if peer is None or peer.log is None:
                print(f"{name} repeat {repeat}: no result ({peer.failure if peer else 'not run'})")
                continue
            log = peer.log
            said = sum(1 for _, yes, _ in log.seen if yes)
            tried = " ".join(f"{a[0]}:{a[2]}" for a in log.attempts)
            below = _went_below(log.attempts)
            print(f"{name} {log.version} repeat {repeat}: its OOM check recognises the CPU allocator's message "
                  f"('DefaultCPUAllocator: can't allocate memory'): {'yes' if log.recognises_cpu_message else 'NO'}; "
                  f"errors shown to it {len(log.seen)}, called OOM by it {said}, translated by the bench "
                  f"{log.translated}; attempts {tried}" + (f"; failed: {peer.failure}" if peer.failure else ""))
            if below:
                print(f"  {name} tried {below} size(s) below one that had already run in its process"
                      + (" (Lightning 2.6's binsearch resets its next size to its default max_val 8192 after "
                         "an OOM, whatever max_val was passed)" if name == "lightning" and _reset_to_8192(log.attempts)
                         else ""))
            if peer.failure:
                passed = [a[0] for a in log.attempts if a[2] == OK]
                print(f"  {name}'s last size that ran before it failed: {passed[-1] if passed else 'none'}")
            for message, yes, shim in log.seen:
                if not yes:
                    print(f"  not recognised by {name}{' (translated to an OOM)' if shim else ''}: {message}")


def _reset_to_8192(attempts: list[list]) -> bool:
    return any(prev[2] == "oom" and size == 8192 for prev, (size, _, _) in zip(attempts, attempts[1:]))


def _went_below(attempts: list[list]) -> int:
    """Attempts at a size below the largest that already ran in the same process."""
    best, below = 0, 0
    for size, _, status in attempts:
        below += size < best
        if status == OK:
            best = max(best, size)
    return below


if __name__ == "__main__":
    main()
