"""`honcho start` with a torch model, as docs/models.md tells a user to run one: one line in the
.env next to the Procfile, the Procfile unchanged."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from conftest import Cluster, honcho


@pytest.mark.solo
def test_stepbus_model_torch_in_the_env_file_solves_cartpole_under_honcho_and_exits_zero(
        cluster: Cluster) -> None:
    """Every process reads STEPBUS_MODEL from the .env: the broker acts with the torch MLP and
    the learner trains it to CartPole's reward threshold (475), checkpointing as safetensors;
    then the run stops itself, every process with rc 0, none left running."""
    (cluster.dir / ".env").write_text("STEPBUS_MODEL=torch\n")
    proc = honcho(cluster)
    try:
        rc: int | None = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        rc = None  # said below, with how far learning got
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (cluster.dir / "honcho.out").read_text()
    assert rc == 0, (rc, cluster.metrics()[-3:], out[-5000:])
    assert cluster.strays() == [], "no process is left behind"
    assert out.count("stopped (rc=0)") == 5, out[-5000:]
    assert "Traceback" not in out
    records = cluster.metrics()
    assert records[-1]["mean_return"] >= 475, records[-3:]
    run = cluster.runs_dir / "latest"
    assert (run / "checkpoint.safetensors").is_file()
    assert not (run / "checkpoint.npz").exists(), "the numpy MLP never ran"
