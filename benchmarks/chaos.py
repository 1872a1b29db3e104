"""Chaos soak: the real pipeline under `honcho start`, faults injected for N minutes, and a
ledger of its own that says what was learned once, twice or never.

    python benchmarks/chaos.py --minutes N [--seed S] [--workers 3] [--out DIR] [--plot]

The repository's Procfile runs in a temp directory (free TCP ports, as solve_time.py does)
with a `.env` choosing benchmarks/chaos_ledger.py's env and algorithm and no target, so it
runs until the harness stops it. Every 10-30 s (uniform, seeded; never two at once) one fault:
SIGKILL of a role's process (the child of the controller's, broker's, a worker's or the
assembler's supervisor, or the learner under the trainer slot), SIGSTOP of one for 2-8 s then
SIGCONT (its supervisor continues it sooner, at 1.5 s without a beat), or `stepbus trainer
swap --lr X` (X within 20% of 1e-3). After N minutes the faults
stop, the pipeline runs 15 s more, then `stepbus shutdown` ends it.

Sampled as it runs, from outside stepbus: env steps produced (each env instance's count file,
every 0.5 s: the stepping rate), the RSS of every process of the run by role (every 5 s), and
metrics.jsonl (env steps and policy version must never go back); and from `stepbus status
--json --watch 5`, the broker's, assembler's and learner's own figures (status.jsonl, to see
why a stretch ran slow). At the end: the last
checkpoint's ledger against what was produced (chaos_ledger.account), each hole in it matched
to the fault that explains it, RSS growth, shared-memory segments and processes left behind,
and the stepping time each fault cost (from the fault until the rate is back to half its
rate in the 5 s before). A table, then one JSON line. Nothing is left running, also on Ctrl-C:
the whole group is ended in a `finally`, and the temp dir removed unless --out names it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import chaos_ledger
import numpy as np
from solve_time import _exit_on_signal, in_work_dir

from stepbus.bus import launch
from stepbus.trainer import checkpoint

REPO = Path(__file__).resolve().parents[1]
TAG_VAR = "STEPBUS_CHAOS_TAG"  # in every process of the run, to find them all
FAULT_GAP_S = (10.0, 30.0)
FREEZE_S = (2.0, 8.0)
DRAIN_S = 15.0  # after the last fault, before the shutdown
STEPS_EVERY_S, RSS_EVERY_S = 0.5, 5.0
STATUS_EVERY_S = 5
STATUS_ROLES = ("broker", "assembler", "trainer")
RATE_WINDOW_S, BEFORE_S = 1.0, 5.0  # stall: a window's rate against the rate before a fault
SHUTDOWN_WAIT_S = 30.0
ROLES = ("controller", "broker", "worker", "assembler", "learner")
KINDS = ("kill", "stop", "swap")


@dataclass
class Fault:
    kind: str
    role: str
    pid: int
    at: float  # time.time()
    until: float = 0.0  # when it ended (SIGCONT, the swap's answer); `at` for a kill
    detail: str = ""
    stall_s: float | None = None


@dataclass
class Soak:
    """What the harness has seen of one run."""

    work: Path
    honcho: launch.Child[Any]
    env: dict[str, str]
    rng: random.Random
    workers: int
    t0: float = field(default_factory=time.time)
    steps: list[tuple[float, int]] = field(default_factory=list)  # (time, env steps produced)
    rss: list[tuple[float, dict[str, tuple[int, int]]]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    metrics_offset: int = 0
    faults: list[Fault] = field(default_factory=list)
    frozen: Fault | None = None
    swap: subprocess.Popen[bytes] | None = None
    next_fault: float = 0.0
    stopped: list[int] = field(default_factory=list)  # SIGSTOPped: thawed in any case
    clients: list[subprocess.Popen[bytes]] = field(default_factory=list)  # ended in any case

    @property
    def ledger_dir(self) -> Path:
        return self.work / "ledger"


# ----------------------------------------------------------------------------- processes

def prepare(work: Path, seed: int) -> dict[str, str]:
    """The Procfile (solve_time's, with `--seed`) and a .env choosing the ledger's env and
    algorithm, no target; the environment to start honcho in."""
    env = in_work_dir(work, seed, {})
    (work / "ledger").mkdir()
    (work / ".env").write_text("\n".join([
        "STEPBUS_ENV=benchmarks.chaos_ledger:make",
        "STEPBUS_ALGO=benchmarks.chaos_ledger:LedgerPPO",
        "STEPBUS_TARGET_RETURN=0",
        f"PYTHONPATH={REPO}",
        f"{chaos_ledger.DIR_ENV}={work / 'ledger'}"]) + "\n")
    return env


def process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every live process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def honcho_name(pid: int) -> str:
    """The Procfile line a process of honcho's runs (`worker.2`), or ''."""
    with contextlib.suppress(OSError):
        for item in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"):
            if item.startswith(b"HONCHO_PROCESS_NAME="):
                return item.split(b"=", 1)[1].decode()
    return ""


def cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    return b""


def role_pids(honcho_pid: int) -> dict[str, int]:
    """Every process of the run by role: honcho, its helper per Procfile line (`honcho
    worker.2`), each supervisor (`worker.2 supervisor`, the `trainer slot`) and its child
    (`worker.2`, `learner`). honcho runs each line from a helper process of its own."""
    table = {pid: ppid for pid, (ppid, state) in process_table().items() if state != "Z"}
    found = {"honcho": honcho_pid}
    helpers = [pid for pid, ppid in table.items()
               if ppid == honcho_pid and b"honcho" in cmdline(pid)]
    for pid, ppid in table.items():
        if ppid not in helpers:
            continue
        name = honcho_name(pid)
        line = name[:-2] if name.endswith(".1") and not name.startswith("worker") else name
        found[f"honcho {name}"] = ppid
        found["trainer slot" if line == "trainer" else f"{line} supervisor"] = pid
        for child, cppid in table.items():
            if cppid == pid:
                found["learner" if line == "trainer" else line] = child
    return found


def rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def ancestors() -> set[int]:
    """This process and those above it (their command lines may name the work dir)."""
    table, pid, out = process_table(), os.getpid(), set()
    while pid > 1 and pid not in out:
        out.add(pid)
        pid = table.get(pid, (1, ""))[0]
    return out


def left_behind(work: Path, tag: tuple[str, str] | None) -> list[str]:
    """Live processes of the run: its tag in their environment, the work dir as their
    directory or in their command line."""
    pids = set(launch.find_processes(cwd=work, tag=tag))
    needle, mine = str(work).encode(), ancestors()
    pids |= {int(e.name) for e in Path("/proc").iterdir()
             if e.name.isdigit() and needle in cmdline(int(e.name))}
    return [f"{pid} {shown(cmdline(pid))}" for pid in sorted(pids - mine) if cmdline(pid)]


def shown(command: bytes) -> str:
    return command.replace(b"\0", b" ").decode(errors="replace").strip()


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("stepbus-*")}


def stepbus(soak: Soak, *args: str) -> subprocess.Popen[bytes]:
    """A `stepbus` client command against this run (its endpoints are in soak.env)."""
    exe = shutil.which("stepbus", path=soak.env["PATH"]) or "stepbus"
    client = subprocess.Popen([exe, *args], env=soak.env, cwd=soak.work,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    soak.clients.append(client)
    return client


# ----------------------------------------------------------------------------- sampling

@dataclass
class StatusWatch:
    """`stepbus status --json --watch` as the soak runs: on until `stop_watching`; the lock
    keeps a new watcher from starting once it is off."""

    on: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    watcher: subprocess.Popen[bytes] | None = None


def watch_status(soak: Soak) -> StatusWatch:
    watch = StatusWatch()
    watch.thread = threading.Thread(target=keep_status, args=(soak, watch), daemon=True)
    watch.thread.start()
    return watch


def keep_status(soak: Soak, watch: StatusWatch) -> None:
    """The watcher's broker, assembler and learner (role trainer) rows appended to
    status.jsonl as they come; started again whenever it exits (its first look at a
    controller not up yet ends it). Its process is one of `soak.clients`."""
    with open(soak.work / "status.jsonl", "a") as out:
        while True:
            with watch.lock:
                if not watch.on:
                    return
                watcher = watch.watcher = stepbus(soak, "status", "--json", "--watch",
                                                  str(STATUS_EVERY_S))
            assert watcher.stdout is not None
            with watcher.stdout:
                for line in watcher.stdout:
                    with contextlib.suppress(ValueError, AttributeError, TypeError):
                        rows = json.loads(line).get("processes", [])
                        kept = [r for r in rows if r.get("role") in STATUS_ROLES]
                        out.write(json.dumps({"t_s": round(time.time() - soak.t0, 1),
                                              "rows": kept}) + "\n")
                        out.flush()
            watcher.wait()
            time.sleep(1.0)


def stop_watching(watch: StatusWatch) -> None:
    """End the status watch (before the shutdown, so it is not counted as left behind; again
    in any case)."""
    with watch.lock:
        watch.on = False
        if watch.watcher is not None and watch.watcher.poll() is None:
            watch.watcher.kill()
            watch.watcher.wait()
    if watch.thread is not None:
        watch.thread.join(timeout=5.0)


def sample_steps(soak: Soak, now: float) -> None:
    produced = chaos_ledger.produced(soak.ledger_dir)
    soak.steps.append((now, sum(steps for steps, _ in produced.values())))


def sample_rss(soak: Soak, now: float) -> None:
    pids = role_pids(soak.honcho.pid)
    soak.rss.append((now, {role: (pid, rss_kb(pid)) for role, pid in pids.items()}))


def new_lines(path: Path, offset: int) -> tuple[int, list[bytes]]:
    """The whole lines written to `path` after `offset` (one being written waits for its
    end), and the offset after them."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    whole = data[:data.rfind(b"\n") + 1]
    return offset + len(whole), whole.splitlines()


def read_metrics(soak: Soak) -> None:
    """New whole lines of the run's metrics.jsonl."""
    files = sorted(soak.work.glob("runs/*/metrics.jsonl"))
    if not files:
        return
    soak.metrics_offset, lines = new_lines(files[0], soak.metrics_offset)
    soak.records += [json.loads(line) for line in lines if line.strip()]


# ----------------------------------------------------------------------------- faults

def target(soak: Soak) -> tuple[str, int] | None:
    """A random role's process: (role, pid), or None if it is not running (restarting)."""
    role = soak.rng.choice(ROLES)
    if role == "worker":
        role = f"worker.{soak.rng.randint(1, soak.workers)}"
    pid = role_pids(soak.honcho.pid).get(role)
    return None if pid is None else (role, pid)


def start_fault(soak: Soak, now: float) -> None:
    kind = soak.rng.choice(KINDS)
    if kind == "swap":
        lr = round(1e-3 * soak.rng.uniform(0.8, 1.2), 6)
        soak.swap = stepbus(soak, "trainer", "swap", "--lr", str(lr))
        soak.faults.append(Fault("swap", "learner", 0, now, detail=f"--lr {lr}"))
        log(soak, f"swap --lr {lr}")
        return
    found = target(soak)
    if found is None:
        soak.next_fault = now + 1.0  # its role is restarting; choose again in a second
        return
    role, pid = found
    if kind == "kill":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        soak.faults.append(Fault("kill", role, pid, now, now))
        soak.next_fault = now + soak.rng.uniform(*FAULT_GAP_S)
        log(soak, f"SIGKILL {role} (pid {pid})")
        return
    freeze = soak.rng.uniform(*FREEZE_S)
    soak.stopped.append(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    soak.frozen = Fault("stop", role, pid, now, now + freeze, detail=f"{freeze:.1f} s")
    soak.faults.append(soak.frozen)
    log(soak, f"SIGSTOP {role} (pid {pid}) for {freeze:.1f} s")


def end_fault(soak: Soak, now: float) -> None:
    """A freeze whose time is up is thawed; a swap that answered is done. Either way the next
    fault is drawn from then on."""
    if soak.frozen is not None and now >= soak.frozen.until:
        with contextlib.suppress(ProcessLookupError):
            os.kill(soak.frozen.pid, signal.SIGCONT)
        soak.frozen = None
        soak.next_fault = now + soak.rng.uniform(*FAULT_GAP_S)
    if soak.swap is not None and soak.swap.poll() is not None:
        out = (soak.swap.stdout.read() if soak.swap.stdout else b"").decode(errors="replace")
        fault = soak.faults[-1]
        fault.until = now
        fault.detail += f", exit {soak.swap.returncode} after {now - fault.at:.1f} s"
        if soak.swap.returncode:
            fault.detail += f": {out.strip()[-200:]}"
        log(soak, f"swap answered: {fault.detail}")
        soak.swap = None
        soak.next_fault = now + soak.rng.uniform(*FAULT_GAP_S)


def log(soak: Soak, what: str) -> None:
    print(f"# {time.time() - soak.t0:7.1f} s  {what}", file=sys.stderr, flush=True)


def run_for(soak: Soak, until: float, faults: bool) -> None:
    """Sample (and inject faults if `faults`) until `until` (time.time())."""
    next_steps = next_rss = time.time()
    while True:
        now = time.time()
        if soak.honcho.poll() is not None:
            raise RuntimeError(f"honcho exited {soak.honcho.poll()} during the soak; its log: "
                               f"{soak.work / 'honcho.log'}")
        if now >= next_steps:
            sample_steps(soak, now)
            next_steps += STEPS_EVERY_S
        if now >= next_rss:
            sample_rss(soak, now)
            read_metrics(soak)
            next_rss += RSS_EVERY_S
        end_fault(soak, now)
        busy = soak.frozen is not None or soak.swap is not None
        if faults and not busy and now >= soak.next_fault:
            start_fault(soak, now)
        if now >= until and soak.frozen is None and soak.swap is None:
            return
        time.sleep(max(0.0, min(next_steps, next_rss, until) - time.time()) or 0.05)


# ----------------------------------------------------------------------------- results

def stall(steps: list[tuple[float, int]], at: float) -> float | None:
    """Seconds from `at` until a RATE_WINDOW_S window's stepping rate is back to half the
    rate of the BEFORE_S before `at` (None: no rate before it, or never back)."""
    t = np.array([s[0] for s in steps])
    n = np.array([s[1] for s in steps], np.float64)
    if len(t) < 2 or t[0] > at - BEFORE_S + STEPS_EVERY_S:
        return None
    before = (np.interp(at, t, n) - np.interp(at - BEFORE_S, t, n)) / BEFORE_S
    if before <= 0:
        return None
    for start in t[t >= at]:
        if start + RATE_WINDOW_S > t[-1]:
            break
        rate = (np.interp(start + RATE_WINDOW_S, t, n) - np.interp(start, t, n)) / RATE_WINDOW_S
        if rate >= before / 2:
            return round(float(start - at), 2)
    return None


def went_back(records: list[dict[str, Any]]) -> dict[str, int]:
    """Records whose env steps or policy version are below the record before."""
    out = {"env_steps": 0, "policy_version": 0}
    for prev, rec in itertools.pairwise(records):
        for key in out:
            if key in rec and key in prev and rec[key] < prev[key]:
                out[key] += 1
    return out


def stale_dropped(records: list[dict[str, Any]]) -> int:
    """Trajectories the learners dropped as acted on too old a policy (per learner process, so
    summed over generations)."""
    per_generation: dict[int, int] = {}
    for rec in records:
        gen = int(rec.get("generation", 0))
        per_generation[gen] = max(per_generation.get(gen, 0), int(rec.get("stale_dropped", 0)))
    return sum(per_generation.values())


# Faults after which stepbus loses steps by design (docs/operations.md, failure behaviour):
# a killed broker's in-flight step batches, a frozen worker's step (its late reply is stale),
# a killed assembler's partial and unsent trajectories. A stopped role is continued by its
# supervisor and loses nothing; nothing else loses a step.
LOSING = {("kill", "broker"), ("stop", "worker"), ("kill", "assembler")}


def explain(hole: chaos_ledger.Hole, faults: list[Fault]) -> str:
    """The losing fault whose time falls between the learned steps around a hole, or
    'other' (for the learners' stale drops to account for, or real loss)."""
    lo, hi = hole.after_ms / 1000 - 1.0, hole.before_ms / 1000 + 1.0
    for fault in faults:
        role = fault.role.split(".")[0]
        ended = max(fault.until, fault.at) + 3.0
        if (fault.kind, role) in LOSING and fault.at <= hi and ended >= lo:
            return f"{fault.kind} {role}"
    return "other"


@dataclass
class Final:
    """The ledger of the run's last checkpoint and the env steps its progress holds (settled:
    learned from, or dropped as stale), with what the envs had produced at that moment."""

    rows: np.ndarray
    trajectories: int
    settled_steps: int
    produced: dict[int, int]


def final_ledger(work: Path) -> Final:
    produced = {s: n for s, (n, _) in chaos_ledger.produced(work / "ledger").items()}
    paths = sorted(work.glob(f"runs/*/{checkpoint.NPZ_FILE}"))
    if not paths:
        return Final(np.zeros((0, 5), np.int64), 0, 0, produced)
    _, optimizer, progress = checkpoint.load(paths[0])
    arrays = chaos_ledger.Ledger.from_arrays(optimizer).to_arrays()
    return Final(arrays[chaos_ledger.STATE_KEY], int(arrays[chaos_ledger.COUNT_KEY]),
                 int(progress.get("env_steps", 0)), produced)


def rss_figures(soak: Soak, duration_s: float) -> dict[str, dict[str, Any]]:
    """Per role: RSS (kB) at 5 min (the first quarter of a shorter run) and at the end, the
    growth, and whether the process is the same one."""
    if not soak.rss:
        return {}
    early_at = soak.t0 + min(300.0, duration_s / 4)
    early = min(soak.rss, key=lambda s: abs(s[0] - early_at))[1]
    end = soak.rss[-1][1]
    out = {}
    for role in sorted(set(early) & set(end)):
        (pid0, kb0), (pid1, kb1) = early[role], end[role]
        out[role] = {"early_kb": kb0, "end_kb": kb1, "same_process": pid0 == pid1,
                     "growth_pct": round(100 * (kb1 - kb0) / kb0, 1) if kb0 else None}
    return out


def stall_figures(faults: list[Fault]) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind]
        stalls = [f.stall_s for f in mine if f.stall_s is not None]
        out[kind] = {"count": len(mine), "measured": len(stalls),
                     "median_s": round(statistics.median(stalls), 2) if stalls else None,
                     "max_s": max(stalls) if stalls else None}
    return out


def summary(soak: Soak, final: Final, ended: dict[str, Any],
            duration_s: float) -> dict[str, Any]:
    """The JSON line: the ledger's figures, what explains each hole, monotonicity, memory,
    what was left behind and the stall per fault kind."""
    acc = chaos_ledger.account(final.rows, final.produced)
    holes: dict[str, list[int]] = {}
    for hole in acc.holes:
        cause = holes.setdefault(explain(hole, soak.faults), [0, 0])
        cause[0], cause[1] = cause[0] + 1, cause[1] + hole.steps
    # every learning is settled once; what the checkpoint settled beyond them, unlearned, the
    # learners dropped as stale (policy lag over --max-policy-lag)
    learnings = int((final.rows[:, 2] - final.rows[:, 1] + 1).sum())
    stale = final.settled_steps - learnings
    other = holes.get("other", [0, 0])[1]
    rss = rss_figures(soak, duration_s)
    same = [r["growth_pct"] for r in rss.values()
            if r["same_process"] and r["growth_pct"] is not None]
    return {
        "minutes": round(duration_s / 60, 2), "streams": acc.streams,
        "produced_steps": acc.produced, "learned_steps": acc.once,
        "learned_once": acc.once - acc.twice, "learned_twice": acc.twice,
        "never_learned": acc.never, "never_learned_holes": len(acc.holes),
        "holes_by_cause": {k: {"holes": v[0], "steps": v[1]} for k, v in sorted(holes.items())},
        "stale_dropped_steps": stale, "stale_dropped": stale_dropped(soak.records),
        "unexplained_never_learned": max(0, other - stale),
        "tail_steps": acc.tail, "ledger_rows": len(final.rows),
        "ledger_trajectories": final.trajectories, "settled_steps": final.settled_steps,
        "went_back": went_back(soak.records),
        "policy_version": soak.records[-1].get("policy_version") if soak.records else None,
        "generation": soak.records[-1].get("generation") if soak.records else None,
        "rss_growth_pct": {role: r["growth_pct"] for role, r in rss.items()},
        "rss_growth_pct_max_same_process": max(same) if same else None,
        "leftover_processes": len(ended["left"]), "leftover_segments": len(ended["segments"]),
        "shutdown_s": ended["shutdown_s"], "honcho_exit": ended["honcho_exit"],
        "faults": len(soak.faults), "stall_s": stall_figures(soak.faults),
        "mean_steps_per_s": round(soak.steps[-1][1] / max(1.0, soak.steps[-1][0] - soak.t0))
        if soak.steps else None,
    }


def print_table(soak: Soak, result: dict[str, Any], ended: dict[str, Any],
                duration_s: float) -> None:
    print("fault log (s from start):")
    for f in soak.faults:
        stall_text = "-" if f.stall_s is None else f"{f.stall_s:.1f} s"
        print(f"  {f.at - soak.t0:7.1f}  {f.kind:5} {f.role:12} {f.detail:40} stall {stall_text}")
    print("\nledger (env steps):")
    for key in ("streams", "produced_steps", "learned_steps", "learned_once", "learned_twice",
                "never_learned", "never_learned_holes", "stale_dropped_steps",
                "stale_dropped", "unexplained_never_learned", "tail_steps", "ledger_rows",
                "ledger_trajectories", "settled_steps", "policy_version", "generation"):
        print(f"  {key:28} {result[key]}")
    for cause, figures in result["holes_by_cause"].items():
        print(f"  holes after {cause:16} {figures['holes']} holes, {figures['steps']} steps")
    print(f"  went back (metrics.jsonl)    {result['went_back']}")
    print("\nstepping lost per fault kind (s):")
    for kind, figures in result["stall_s"].items():
        print(f"  {kind:5} count {figures['count']:3}  measured {figures['measured']:3}  "
              f"median {figures['median_s']}  max {figures['max_s']}")
    print(f"\nRSS (kB) at {min(300.0, duration_s / 4):.0f} s and at the end:")
    for role, r in rss_figures(soak, duration_s).items():
        print(f"  {role:22} {r['early_kb']:8} {r['end_kb']:8}  {r['growth_pct']:>6}%"
              f"{'' if r['same_process'] else '  (restarted meanwhile)'}")
    print(f"\nshutdown: honcho exit {ended['honcho_exit']} after {ended['shutdown_s']} s; "
          f"processes left {len(ended['left'])}, segments left {len(ended['segments'])}")
    for line in ended["left"]:
        print(f"  left: {line[:160]}")


def write_series(soak: Soak, out: Path, result: dict[str, Any], plot: bool) -> None:
    """steps.csv (time, env steps, rate), rss.csv (time, role, pid, kB), faults and the
    result as JSON; with `plot`, chaos.png if matplotlib is there."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["t_s,env_steps,steps_per_s"]
    for (t0, n0), (t1, n1) in itertools.pairwise(soak.steps):
        lines.append(f"{t1 - soak.t0:.2f},{n1},{(n1 - n0) / max(t1 - t0, 1e-9):.1f}")
    (out / "steps.csv").write_text("\n".join(lines) + "\n")
    lines = ["t_s,role,pid,rss_kb"]
    for t, roles in soak.rss:
        lines += [f"{t - soak.t0:.2f},{role},{pid},{kb}" for role, (pid, kb) in roles.items()]
    (out / "rss.csv").write_text("\n".join(lines) + "\n")
    (out / "chaos.json").write_text(json.dumps(
        {"faults": [asdict(f) | {"t_s": round(f.at - soak.t0, 2)} for f in soak.faults],
         "result": result}, indent=1) + "\n")
    if plot:
        plot_steps(soak, out / "chaos.png")


def plot_steps(soak: Soak, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot: matplotlib is not installed", file=sys.stderr)
        return
    t = [b[0] - soak.t0 for b in soak.steps[1:]]
    rate = [(b[1] - a[1]) / max(b[0] - a[0], 1e-9) for a, b in itertools.pairwise(soak.steps)]
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.plot(t, rate, lw=0.8)
    for f in soak.faults:
        ax.axvline(f.at - soak.t0, color={"kill": "r", "stop": "b", "swap": "g"}[f.kind], lw=0.6)
        ax.text(f.at - soak.t0, max(rate or [1]), f.role.split(".")[0], rotation=90, fontsize=6)
    ax.set_xlabel("s")
    ax.set_ylabel("env steps/s (red kill, blue stop, green swap)")
    fig.savefig(path, dpi=120, bbox_inches="tight")


# ----------------------------------------------------------------------------- the run

def shut_down(soak: Soak, tag: tuple[str, str] | None, shm_before: set[str]) -> dict[str, Any]:
    """`stepbus shutdown`, honcho's exit awaited, then what is left 2 s later (before the
    harness ends anything by force)."""
    began = time.time()
    with contextlib.suppress(subprocess.TimeoutExpired):  # a client still waiting is ended
        stepbus(soak, "shutdown").wait(30)
    with contextlib.suppress(subprocess.TimeoutExpired):
        soak.honcho.wait(SHUTDOWN_WAIT_S)
    honcho_exit = soak.honcho.poll()
    shutdown_s = round(time.time() - began, 1)
    time.sleep(2.0)
    return {"honcho_exit": honcho_exit, "shutdown_s": shutdown_s,
            "left": left_behind(soak.work, tag), "segments": sorted(segments() - shm_before)}


def soak_run(args: argparse.Namespace, work: Path, group: launch.Group, stopped: list[int],
             clients: list[subprocess.Popen[bytes]]) -> int:
    shm_before = segments()
    env = prepare(work, args.seed)
    honcho = shutil.which("honcho", path=env["PATH"]) or "honcho"
    child = group.start([honcho, "start", "-c", f"worker={args.workers}"], env=env, cwd=work,
                        log=work / "honcho.log", name="honcho")
    soak = Soak(work, child, env | {TAG_VAR: group.tag[1] if group.tag else ""},
                random.Random(args.seed), args.workers, stopped=stopped, clients=clients)
    soak.next_fault = soak.t0 + soak.rng.uniform(*FAULT_GAP_S)
    duration_s = args.minutes * 60
    watch = watch_status(soak)
    try:
        run_for(soak, soak.t0 + duration_s, faults=True)
        log(soak, f"faults over; {DRAIN_S:.0f} s to drain")
        run_for(soak, time.time() + DRAIN_S, faults=False)
    finally:
        stop_watching(watch)
    sample_rss(soak, time.time())
    for fault in soak.faults:
        fault.stall_s = stall(soak.steps, fault.at)
    final = final_ledger(work)  # drained, still running: tails are what is in flight
    ended = shut_down(soak, group.tag, shm_before)
    read_metrics(soak)
    result = summary(soak, final, ended, duration_s)
    print_table(soak, result, ended, duration_s)
    if args.out:
        write_series(soak, Path(args.out), result, args.plot)
    print(json.dumps(result), flush=True)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--minutes", type=float, required=True,
                        help="how long faults are injected (then 15 s of draining)")
    parser.add_argument("--seed", type=int, default=0, help="faults, their times, the run")
    parser.add_argument("--workers", type=int, default=3,
                        help="worker processes (honcho start -c worker=N)")
    parser.add_argument("--out", default="", help="keep the run here, with the time series")
    parser.add_argument("--plot", action="store_true", help="with --out: chaos.png")
    args = parser.parse_args()
    if not args.minutes > 0:
        parser.error(f"--minutes must be above 0, not {args.minutes}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, not {args.workers}")
    if args.plot and not args.out:
        parser.error("--plot writes chaos.png into --out: name one")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so `finally` ends what it started
    work = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="sb-chaos-"))
    if args.out:
        work.mkdir(parents=True, exist_ok=False)
    group = launch.Group(dir=work, tag_var=TAG_VAR)
    stopped: list[int] = []
    clients: list[subprocess.Popen[bytes]] = []
    try:
        return soak_run(args, work, group, stopped, clients)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for client in clients:  # a trainer swap or shutdown still under way
            if client.poll() is None:
                client.kill()
                client.wait()
        group.stop()
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
