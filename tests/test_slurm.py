"""Slurm: deploy/slurm/stepbus.sbatch runs a whole stepbus run as one two-node job, its central
processes on one node and its workers on the other (TCP, CURVE), which solves CartPole and exits
0; a second job (stepbus-workers.sbatch) adds workers to a running run and scancel takes them
away while the run goes on; scancel of the run ends every process of it on both nodes, each by
its own SIGTERM handling, within 5 s (Slurm's KillWait here, after which it would SIGKILL).

Needs the two-node cluster of `deploy/slurm/local-cluster.sh` (as root: it installs Debian's
packages and starts a slurmd per node, each in a network namespace of its own, `stepbus-NODE`).
Without it the tests skip, saying so, unless STEPBUS_REQUIRE_SLURM=1 (CI sets it), which makes a
missing cluster a failure.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, wait_for
from controller_probe import status_at

SBATCH = REPO / "deploy" / "slurm" / "stepbus.sbatch"
WORKERS_SBATCH = REPO / "deploy" / "slurm" / "stepbus-workers.sbatch"
REQUIRED = os.environ.get("STEPBUS_REQUIRE_SLURM") == "1"
START = "`deploy/slurm/local-cluster.sh` (as root) starts the two-node cluster"


@functools.cache
def slurm_missing() -> str:
    """Why no Slurm job can run here, or "" when one can."""
    if not all(shutil.which(tool) for tool in ("sbatch", "squeue", "scancel", "sinfo", "ip")):
        return f"no Slurm commands (or no `ip`) on PATH: {START}, installing Debian's packages"
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer within 30 s: {START}"
    taking = [line.split()[0] for line in res.stdout.splitlines()
              if line.split()[1:] in (["idle"], ["mix"], ["alloc"])]
    if res.returncode != 0 or len(taking) < 2:
        return (f"not two Slurm nodes taking jobs (sinfo: "
                f"{res.stdout.strip() or res.stderr.strip()}): {START}")
    if not all(Path(f"/run/netns/stepbus-{node}").exists() for node in nodes()):
        return f"the nodes {nodes()} have no network namespaces stepbus-NODE: {START}"
    return ""


@functools.cache
def nodes() -> list[str]:
    """The cluster's nodes; the first is the one a job spanning both starts on."""
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                         timeout=30)
    return sorted(set(res.stdout.split()))


def node_of(pid: int) -> str:
    """The node in whose network namespace the process runs ("" for none of them)."""
    with contextlib.suppress(OSError):
        net = os.stat(f"/proc/{pid}/ns/net").st_ino
        for node in nodes():
            if os.stat(f"/run/netns/stepbus-{node}").st_ino == net:
                return node
    return ""


def left_on_nodes(*jobs: str) -> dict[str, list[str]]:
    """Live processes of the jobs in each node's network namespace, as "PID NAME": their
    processes by SLURM_JOB_ID in the environment, their slurmstepds by the command line
    (`slurmstepd: [JOB.STEP]`). Only these jobs': other tests' jobs may share the nodes."""
    env = {f"SLURM_JOB_ID={job}".encode() for job in jobs}
    steps = tuple(f"slurmstepd: [{job}.".encode() for job in jobs)
    left: dict[str, list[str]] = {}
    for node in nodes():
        res = subprocess.run(["ip", "netns", "pids", f"stepbus-{node}"], capture_output=True,
                             text=True, timeout=10)
        for pid in res.stdout.split():
            try:
                proc = Path(f"/proc/{pid}")
                environ = set((proc / "environ").read_bytes().split(b"\0"))
                cmdline = (proc / "cmdline").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                comm = (proc / "comm").read_text().strip()
            except OSError:
                continue
            if state != "Z" and (env & environ or cmdline.startswith(steps)):
                left.setdefault(node, []).append(f"{pid} {comm}")
    return left


@pytest.fixture
def submit_dir() -> Iterator[Path]:
    """A submit directory; every job submitted from it is cancelled and every process working
    in it killed afterwards, also when the test fails."""
    reason = slurm_missing()
    if reason:
        if REQUIRED:
            pytest.fail(f"STEPBUS_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    path = Path(tempfile.mkdtemp(prefix="stepbus-slurm-"))
    try:
        yield path
    finally:
        for job in jobs_of(path):
            subprocess.run(["scancel", job], timeout=10)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not processes_in(path), 10, "the jobs' processes to end")
        for pid in processes_in(path):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)


def job_env() -> dict[str, str]:
    """The submitting shell: this venv's stepbus on PATH, no STEPBUS_* settings of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPBUS_", "SLURM_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def sbatch(submit_dir: Path, *args: str, wait: bool = False,
           timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--parsable", f"--chdir={submit_dir}",
                           *(["--wait"] if wait else []), *args],
                          env=job_env(), capture_output=True, text=True, timeout=timeout)


def jobs_of(submit_dir: Path) -> list[str]:
    res = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True,
                         timeout=10)
    return [line.split()[0] for line in res.stdout.splitlines()
            if line.split()[1:] == [str(submit_dir)]]


def processes_in(submit_dir: Path) -> list[int]:
    """Live processes working in the submit directory: every process the jobs started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if cwd == str(submit_dir) and state != "Z":
                pids.append(int(entry.name))
    return pids


def status(job_dir: Path, keys: Path | None = None) -> list[dict]:
    """`stepbus status --json` rows of the run ([] while its controller does not answer),
    asked from this process: the tests poll it every half second."""
    endpoints = job_dir / "endpoints.env"
    if not endpoints.exists():
        return []
    controller = endpoints.read_text().split("=", 1)[1].strip()
    return status_at(controller, 2.0, str(keys or job_dir / "keys"))


def stepping_workers(job_dir: Path) -> set[str]:
    return {row["name"] for row in status(job_dir)
            if row["role"] == "worker" and (row.get("steps_per_s") or 0) > 0}


def own_worker_steps(job_dir: Path, job: str) -> int:
    """Env steps of the run job's own worker (-1 while it is not in the status)."""
    rows = [r for r in status(job_dir) if r["role"] == "worker" and f"-{job}-" in r["name"]]
    return int(rows[0].get("env_steps", 0)) if rows else -1


def logs(job_dir: Path) -> str:
    return "\n".join(f"----- {p.name}\n{p.read_text()[-3000:]}"
                     for p in sorted((job_dir / "logs").glob("*.log")))


@pytest.mark.timeout(240)  # a loaded 2-core CI machine: the job is given 180 s
def test_the_sbatch_job_solves_cartpole_and_exits_0(submit_dir: Path) -> None:
    t0 = time.time()
    res = sbatch(submit_dir, "--nodes=2", "--ntasks-per-node=2", str(SBATCH), wait=True,
                 timeout=180)
    elapsed = time.time() - t0
    job = res.stdout.strip().split(";")[0]
    job_dir = submit_dir / f"stepbus-{job}"
    out = (submit_dir / f"stepbus-{job}.out").read_text()
    assert res.returncode == 0, f"{res.stderr}\n{out}\n{logs(job_dir)}"
    assert f"job {job} done, exit 0" in out
    records = [json.loads(line) for line in
               (job_dir / "runs" / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["mean_return"] >= 475
    assert oct((job_dir / "keys" / "client.key_secret").stat().st_mode & 0o777) == "0o600"
    assert (job_dir / "keys").stat().st_mode & 0o077 == 0, "the keys are the job user's only"
    assert processes_in(submit_dir) == []
    assert_central_on_first_node_workers_on_second(job_dir, out)
    wait_for(lambda: not left_on_nodes(job), 10, "nothing of the job left on either node")
    first, last = records[0], records[-1]
    rate = (last["env_steps"] - first["env_steps"]) / max(1e-9, last["time"] - first["time"])
    print(f"\nslurm: sbatch to first policy update {first['time'] - t0:.1f} s, solved "
          f"(mean return {last['mean_return']:.0f}) at {last['env_steps']} env steps, "
          f"{rate:.0f} env steps/s, sbatch --wait returned after {elapsed:.1f} s")


def assert_central_on_first_node_workers_on_second(job_dir: Path, out: str) -> None:
    """Each process's log names its host (`ROLE-HOST-PID`): the central processes' the first
    node, the 2 workers' the second, which reached the first over TCP by its name."""
    head, other = nodes()
    assert f"central processes on {head}, controller tcp://{head}:" in out, out
    assert f"2 workers on {other}," in out, out
    assert f"trainer slot trainer-{head}-" in out, out
    for role in ("controller", "broker", "assembler"):
        text = (job_dir / "logs" / f"{role}.log").read_text()
        assert f"supervising {role} {role}-{head}-" in text, text
    workers = [p.read_text() for p in sorted((job_dir / "logs").glob("worker-*.log"))]
    assert len(workers) == 2, logs(job_dir)
    for text in workers:
        assert f"supervising worker worker-{other}-" in text, text
        assert f"connecting to tcp://{head}:" in text, text


def assert_placed_by_node(job_dir: Path) -> None:
    """Every process of the run says its host in the status, and its network namespace is that
    node's: the central processes on the first node, the run's own worker (and its supervisor,
    `worker-HOST-PID`) on the second."""
    head, other = nodes()
    rows = status(job_dir)
    assert {row["role"] for row in rows} >= {"controller", "broker", "assembler", "worker"}, rows
    for row in rows:
        side = other if row["role"] == "worker" or row["name"].startswith("worker-") else head
        assert row["host"] == node_of(row["pid"]) == side, (row, rows)


@pytest.mark.timeout(240)
def test_a_second_job_adds_workers_and_scancel_ends_each_job_cleanly(submit_dir: Path) -> None:
    t0 = time.time()
    run = sbatch(submit_dir, "--nodes=2", "--ntasks-per-node=1", str(SBATCH),
                 "--target-return", "0")
    assert run.returncode == 0, run.stderr
    job = run.stdout.strip().split(";")[0]
    job_dir = submit_dir / f"stepbus-{job}"
    wait_for(lambda: stepping_workers(job_dir), 60, "the run's worker to step", interval=0.5)
    started = time.time() - t0
    assert_placed_by_node(job_dir)
    assert set(left_on_nodes(job)) == set(nodes()), "the run's processes seen on both nodes"

    more = sbatch(submit_dir, "--nodes=2", "--ntasks-per-node=1", str(WORKERS_SBATCH),
                  str(job_dir))
    assert more.returncode == 0, more.stderr
    added = more.stdout.strip().split(";")[0]
    wait_for(lambda: len({n for n in stepping_workers(job_dir) if f"-{added}-" in n}) == 2, 60,
             "the second job's 2 workers to step", interval=0.5)
    assert (job_dir / "keys" / "authorized" / f"keys-workers-{added}.key").exists()
    assert {row["host"] for row in status(job_dir) if f"-{added}-" in row["name"]} \
        == set(nodes()), "the second job's workers: one on each node"

    subprocess.run(["scancel", added], check=True, timeout=10)
    wait_for(lambda: not any(f"-{added}-" in n for n in stepping_workers(job_dir)), 15,
             "the second job's workers to leave", interval=0.5)
    wait_for(lambda: added not in jobs_of(submit_dir), 15, "the workers job to end")
    wait_for(lambda: not left_on_nodes(added), 10, "nothing of the workers job on either node")
    assert not (job_dir / "keys" / "authorized" / f"keys-workers-{added}.key").exists()
    before = own_worker_steps(job_dir, job)
    wait_for(lambda: own_worker_steps(job_dir, job) > before, 10,
             "the run to go on stepping with its own worker", interval=0.5)

    t_cancel = time.monotonic()
    subprocess.run(["scancel", job], check=True, timeout=10)
    wait_for(lambda: not processes_in(submit_dir), 10, "every process of the run to end")
    gone = time.monotonic() - t_cancel
    wait_for(lambda: not left_on_nodes(job, added), 10, "nothing of the jobs left on either node")
    text = logs(job_dir)
    out = (submit_dir / f"stepbus-{job}.out").read_text()
    assert gone < 5, f"{gone:.1f} s\n{text}"
    assert "Traceback" not in text + out, text + out
    assert "assembler stopping" in (job_dir / "logs" / "assembler.log").read_text(), text
    assert "learner stopping" in out, out
    wait_for(lambda: job not in jobs_of(submit_dir), 15, "the run's job to end")
    print(f"\nslurm: sbatch to a worker stepping {started:.1f} s; scancel of the run to no "
          f"process left {gone:.2f} s")
