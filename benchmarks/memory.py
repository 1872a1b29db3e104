"""Resident memory of every stepbus process over a long run: does anything grow?

    python benchmarks/memory.py                          # 60 s warm-up, then 10 minutes
    python benchmarks/memory.py --minutes 0.5 --warmup 5 # a quick look
    python benchmarks/memory.py --workers 2 --envs 32 --interval 5 --json rss.json

Starts the full pipeline as real processes, the same way `benchmarks/throughput.py` does (its
`Pipeline` is imported, not copied; `stepbus.bus.launch` starts and ends them): controller,
broker, workers on CartPole-v1, assembler, and a trainer slot whose learner consumes with
`stepbus.trainer.consume:ConsumeOnly`, so the pipeline steps flat out and every queue, buffer
and counter is exercised as fast as it can be (`--learner ppo` runs the real PPO learner, which
never stops: its target return is 0). After the warm-up it reads VmRSS from /proc/PID/status of
every process in the pipeline's process groups every `--interval` seconds and prints one row
per process: RSS after warm-up and at the end (medians over the first and the last minute, or
fifth of a shorter run, so one sample taken mid-burst does not decide), min, max, growth (end
vs after warm-up), peak (max vs after warm-up) and the least-squares trend. Verdict: PASS when
both growth and peak stay within `--limit` % (5): the RSS stayed flat, not only ended flat;
FAIL (growth) when it ended higher, FAIL (peak) when it rose and came back down.
Steps/s over the run are the assembler's step count from the controller's status, as
throughput.py reads it. Every process started is killed on every way out. Exit status: 0 when
the run was measured (whatever the verdicts; `--strict` makes any FAIL exit 1), 1 when the
pipeline did not come up or a process died.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stepbus.bus import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp

PPO = "stepbus.trainer.ppo:PPO"


@dataclasses.dataclass
class Track:
    """The RSS samples of one process, in KiB, with the figures the table prints."""

    role: str
    name: str
    pid: int
    samples: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (s, KiB)
    gone_at: float | None = None

    def window(self) -> float:
        """Seconds at each end of the run whose samples give the start and end figures: a
        minute (a fifth of a shorter run), so one sample taken mid-burst does not decide."""
        return min(60.0, self.samples[-1][0] / 5)

    @property
    def start(self) -> float:
        """Median RSS over the first window after warm-up."""
        first = [kib for t, kib in self.samples if t <= self.window()]
        return statistics.median(first)

    @property
    def end(self) -> float:
        """Median RSS over the last window of the run."""
        last_t = self.samples[-1][0]
        last = [kib for t, kib in self.samples if t >= last_t - self.window()]
        return statistics.median(last)

    @property
    def peak(self) -> int:
        return max(kib for _, kib in self.samples)

    @property
    def low(self) -> int:
        return min(kib for _, kib in self.samples)

    def growth(self) -> float:
        return 100.0 * (self.end - self.start) / self.start

    def peak_growth(self) -> float:
        return 100.0 * (self.peak - self.start) / self.start

    def verdict(self, limit: float) -> str:
        """PASS: ended within `limit` % of the start and never rose above it by more. FAIL
        (growth): the end is higher, memory grew; FAIL (peak): it came back down, but swung."""
        if not self.samples:
            return "FAIL (no sample)"
        if self.gone_at is not None:
            return f"FAIL (exited after {self.gone_at:.0f} s)"
        if self.growth() > limit:
            return "FAIL (growth)"
        return "FAIL (peak)" if self.peak_growth() > limit else "PASS"

    def slope_per_10min(self) -> float:
        """Least-squares trend in % of the start per 10 minutes: a slow leak shows here even
        when noise puts the last sample low."""
        if len(self.samples) < 3:
            return 0.0
        ts = [t for t, _ in self.samples]
        vs = [kib for _, kib in self.samples]
        mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
        var = sum((t - mt) ** 2 for t in ts)
        if var == 0:
            return 0.0
        slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / var
        return 100.0 * slope * 600 / self.start


def rss_kib(pid: int) -> int | None:
    """VmRSS of a live process in KiB (None once it is gone or a zombie)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def group_pids(pgids: set[int]) -> list[int]:
    """Live processes of these process groups: each role's leader and the slot's learner."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = tp._stat(entry)
            if fields is not None and fields[0] != "Z" and int(fields[2]) in pgids:
                pids.append(int(entry))
    return sorted(pids)


def discover(pipeline: tp.Pipeline, pgids: set[int]) -> list[Track]:
    """One track per process, named from the controller's status (role, name) by pid; a
    process without a row (none expected) is named by its command line."""
    _, rows = pipeline.full_status()
    by_pid = {r["pid"]: r for r in rows if isinstance(r.get("pid"), int)}
    tracks = []
    for pid in group_pids(pgids):
        row = by_pid.get(pid)
        if row is not None:
            role, name = str(row.get("role")), str(row.get("name"))
        else:
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            role, name = "?", " ".join(a.decode(errors="replace") for a in argv[1:4])
        tracks.append(Track(role, name, pid))
    order = ("controller", "broker", "worker", "assembler", "slot", "trainer")
    tracks.sort(key=lambda t: (order.index(t.role) if t.role in order else len(order), t.name))
    return tracks


def sample(tracks: list[Track], t: float) -> None:
    for track in tracks:
        if track.gone_at is not None:
            continue
        kib = rss_kib(track.pid)
        if kib is None:
            track.gone_at = t
        else:
            track.samples.append((t, kib))


def table(tracks: list[Track], limit: float) -> str:
    lines = [f"{'role':<10} {'name':<18} {'pid':>7} {'after warm-up':>13} {'end':>7} "
             f"{'min':>7} {'max':>7} {'growth':>7} {'peak':>7} {'trend/10min':>11}  verdict",
             f"{'':<10} {'':<18} {'':>7} {'MiB':>13} {'MiB':>7} {'MiB':>7} {'MiB':>7} "
             f"{'%':>7} {'%':>7} {'%':>11}"]
    for t in tracks:
        if not t.samples:
            lines.append(f"{t.role:<10} {t.name[:18]:<18} {t.pid:>7}  {t.verdict(limit)}")
            continue
        lines.append(f"{t.role:<10} {t.name[:18]:<18} {t.pid:>7} {t.start / 1024:>13.1f} "
                     f"{t.end / 1024:>7.1f} {t.low / 1024:>7.1f} {t.peak / 1024:>7.1f} "
                     f"{t.growth():>+7.2f} {t.peak_growth():>+7.2f} "
                     f"{t.slope_per_10min():>+11.2f}  {t.verdict(limit)}")
    return "\n".join(lines)


def queue_figures(rows: list[dict]) -> dict[str, Any]:
    """The numeric figures of each status row, keyed role:name (counts of what is held)."""
    return {f"{r.get('role')}:{r.get('name')}": {k: v for k, v in r.items()
                                                 if isinstance(v, int | float)}
            for r in rows}


def wait(pipeline: tp.Pipeline, seconds: float) -> None:
    """Sleep, checking every second that no process of the pipeline died."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        pipeline.check_alive()
        time.sleep(min(1.0, left))


@dataclasses.dataclass
class Measured:
    """What one run measured, for the report: every process's track and the pipeline's
    figures over the run."""

    tracks: list[Track]
    queues: list[tuple[float, dict[str, Any]]]  # (s, queue_figures), with --json only
    rate: float | None  # steps/s over the run
    other: float  # other processes' CPU over the run, % of one core
    learner_then: dict | None  # the learner's status row at the first sample
    learner_now: dict | None  # and at the last


def run(args: argparse.Namespace) -> int:
    info = tp.machine()
    setup = tp.Setup(args.workers, args.envs)
    measured = measure(args, setup)
    load_after = os.getloadavg()
    print_run(args, info, setup, measured, load_after)
    failed = print_verdicts(measured.tracks, args.limit)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": info, "load_after": load_after, "command": sys.argv,
            "steps_per_s": measured.rate, "other_load_percent": round(measured.other),
            "processes": [dataclasses.asdict(t) for t in measured.tracks],
            "status": measured.queues}, indent=1))
    return 1 if failed and args.strict else 0


def measure(args: argparse.Namespace, setup: tp.Setup) -> Measured:
    """Start the pipeline, warm it up, then sample every process of it to the end of the run;
    every process started is killed on every way out."""
    group = launch.Group()
    pipeline = None
    flags = {"trainer": ["--algo", PPO]} if args.learner == "ppo" else {}
    try:
        pipeline = tp.Pipeline(group, args.env, setup, args.transport, args.batch_steps, flags)
        pipeline.wait_ready(30 + 3 * args.workers)
        print(f"# pipeline up; warming up for {args.warmup:g} s", file=sys.stderr, flush=True)
        wait(pipeline, args.warmup)
        pgids = {proc.pid for proc in group.procs}
        tracks = discover(pipeline, pgids)
        t_first, rows0 = pipeline.full_status()
        steps0 = assembler_steps_at(t_first, rows0)
        meter = tp.LoadMeter(pgids)
        queues = sample_run(pipeline, tracks, args)
        t_last, rows1 = pipeline.full_status()
        steps1 = assembler_steps_at(t_last, rows1)
        other = meter.other_percent()
        learner_now = tp._row(rows1, "trainer")
        learner_then = tp._row(rows0, "trainer")
    finally:
        group.stop()
        if pipeline is not None:
            pipeline.close()
    rate = ((steps1[1] - steps0[1]) / max(steps1[0] - steps0[0], 1e-9)
            if steps0 and steps1 else None)
    return Measured(tracks, queues, rate, other, learner_then, learner_now)


def sample_run(pipeline: tp.Pipeline, tracks: list[Track],
               args: argparse.Namespace) -> list[tuple[float, dict[str, Any]]]:
    """Sample every track each `--interval` s for `--minutes`, with a line a minute on stderr
    so a long run shows it is alive; returns what each process held at each sample (with
    `--json` only)."""
    queues: list[tuple[float, dict[str, Any]]] = []
    t0 = time.monotonic()
    duration = args.minutes * 60
    next_print = t0 + 60
    while True:
        now = time.monotonic() - t0
        sample(tracks, now)
        if args.json is not None:  # what each process holds, to set against its RSS
            with contextlib.suppress(TimeoutError):
                queues.append((now, queue_figures(pipeline.status(1.0)[1])))
        if now >= duration:
            break
        if time.monotonic() >= next_print:
            next_print += 60
            print(f"# {now / 60:.0f} min: " + ", ".join(
                f"{t.role}:{t.name[:8]} {t.end / 1024:.0f}" for t in tracks if t.samples)
                + " MiB", file=sys.stderr, flush=True)
        wait(pipeline, min(args.interval, duration - now))
    return queues


def print_run(args: argparse.Namespace, info: dict[str, Any], setup: tp.Setup,
              measured: Measured, load_after: tuple[float, float, float]) -> None:
    """The machine, the command and the setup the table was measured on, then the table."""
    print(f"date: {info['date']}")
    print(f"machine: {info['cores']} cores, {info['cpu']}, Python {info['python']}, numpy "
          f"{info['numpy']}, pyzmq {info['pyzmq']} / libzmq {info['libzmq']}, gymnasium "
          f"{info['gymnasium']}")
    print("load average (1, 5, 15 min): before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}"
          .format(*info["load"], *load_after))
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    learner = CONSUME_OR_PPO[args.learner]
    tracks, rate = measured.tracks, measured.rate
    print(f"setup: {args.env}, {setup.label()}, {args.transport} endpoints, learner {learner}, "
          f"batch {args.batch_steps}; {args.warmup:g} s warm-up, then {args.minutes:g} min "
          f"sampled every {args.interval:g} s ({len(tracks[0].samples)} samples); "
          f"other processes' CPU over the run {measured.other:.0f}% of one core")
    print(f"steps/s over the run: {rate:.0f}" if rate else "steps/s over the run: -")
    then, now = measured.learner_then, measured.learner_now
    if then and now and then.get("pid") != now.get("pid"):
        print(f"note: the learner was replaced during the run (pid {then.get('pid')} -> "
              f"{now.get('pid')}); its row is the first one's")
    print(table(tracks, args.limit))


def print_verdicts(tracks: list[Track], limit: float) -> list[Track]:
    """Prints how many processes stayed within `limit`; returns those that did not."""
    failed = [t for t in tracks if t.verdict(limit) != "PASS"]
    print(f"verdict: {len(tracks) - len(failed)} of {len(tracks)} processes within "
          f"{limit:g}% of their after-warm-up RSS (growth and peak)"
          + (f"; over: {', '.join(f'{t.role}:{t.name}' for t in failed)}" if failed else ""))
    return failed


CONSUME_OR_PPO = {"consume": tp.CONSUME, "ppo": PPO}


def assembler_steps_at(t: float, rows: list[dict]) -> tuple[float, float] | None:
    """(when the figure was sent, monotonic; cumulative steps): the assembler's count, or the
    learner's when the assembler's row is missing (as throughput.py does)."""
    counts = tp._counts(t, rows)
    return counts.get("assembler") or counts.get("trainer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="measured run after warm-up (default 10)")
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="seconds of stepping before the first sample (default 60)")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="seconds between RSS samples (default 5)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs", type=int, default=32, help="envs per worker (default 32)")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--learner", choices=tuple(CONSUME_OR_PPO), default="consume",
                        help="consume: ConsumeOnly, the pipeline flat out (default); ppo: the "
                             "real PPO learner (slower; never stops, target return 0)")
    parser.add_argument("--batch-steps", type=int, default=2048,
                        help="the learner's batch (sets the broker's credit window)")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--limit", type=float, default=5.0,
                        help="%% over the after-warm-up RSS a process may reach (default 5)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any process FAILs")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every sample of every process here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, tp._exit_on_signal)  # so `finally` kills what it started
    try:
        return run(args)
    except (RuntimeError, TimeoutError) as exc:
        print(f"memory benchmark failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
