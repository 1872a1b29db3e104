"""Agents mapped to distinct policies (`--policy-map`): each policy acts for its own agents with
its own weights and versions, and its trajectories reach only its own learner."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zmq
from conftest import Cluster, TrajectoryInbox, send_message, wait_for
from controller_probe import status_rows

from stepbus.bus import checks, policies
from stepbus.bus import protocol as p
from stepbus.models import mlp
from stepbus.policy import ActionSpace


def test_a_policy_map_picks_the_first_matching_pattern_and_falls_back_to_default():
    rules = policies.parse_map("adversary_*=red, agent_0=blue ,*_1=red")
    assert policies.policy_names(rules) == ["default", "red", "blue"]
    assert [policies.policy_of(a, rules) for a in
            ("adversary_0", "agent_0", "agent_1", "agent_2", "")] == [
        "red", "blue", "red", "default", "default"]
    assert policies.policy_of("", policies.parse_map("*=solo")) == "solo", \
        "a Gymnasium env's unnamed agent matches only *"
    for bad in ("red", "a*=", "=red", "a=b c"):
        with pytest.raises(ValueError):
            policies.parse_map(bad)
    with pytest.raises(ValueError, match="--trajectories"):
        policies.parse_endpoints("default=ipc:///tmp/x")


def test_per_row_policy_versions_out_of_range_are_refused():
    def experience(versions: np.ndarray) -> p.Experience:
        return p.Experience(worker="w", incarnation="i", epoch=0, seq=1, first=True,
                            policy_version=0, obs=np.zeros((2, 2), np.float32),
                            reward=np.zeros(2, np.float32), terminated=np.zeros(2, bool),
                            truncated=np.zeros(2, bool), final_obs=np.zeros((0, 2), np.float32),
                            policy_versions=versions)
    assert checks.experience_problem(experience(np.array([0, 7]))) == ""
    for bad in (np.array([2**64 - 1, 0], np.uint64), np.array([-2, 0]), np.array([0])):
        assert "policy_versions" in checks.experience_problem(experience(bad))


def weights(policy: str, version: int, favourite: int) -> p.Weights:
    """A 2-action policy that always picks `favourite`, so each row's action shows which
    policy chose it."""
    params = mlp.init_params(2, ActionSpace("discrete", n=2), (8,),
                             np.random.default_rng(0))
    params["pi.1.b"] = np.where(np.arange(2) == favourite, 50.0, 0.0)
    return p.Weights(trainer=f"t-{policy}", incarnation=f"{policy}1", policy=policy,
                     version=version, consumed_steps=0, batch_steps=256, starving=False,
                     params=params)


@pytest.fixture
def relay_two_policies(cluster: Cluster):
    """RelayTeam (agents a, b, c, d) with a and c on policy "red"; the test is both trainers."""
    red = f"ipc://{cluster.dir}/red"
    cluster.start("controller")
    cluster.start("broker", "--policy-map", "[ac]=red")
    cluster.start("assembler", "--policy-endpoints", f"red={red}")
    cluster.start("worker", "--env", "scripted_envs:relay_team", "--envs-per-worker", "2",
                  "--name", "w")
    trainers = cluster.socket(zmq.DEALER, cluster.endpoints["policy"])
    default_pull = TrajectoryInbox(cluster.socket(zmq.PULL, cluster.endpoints["trajectories"]))
    red_pull = TrajectoryInbox(cluster.socket(zmq.PULL, red))
    yield trainers, default_pull, red_pull
    for sock in (trainers, default_pull, red_pull):
        sock.close()


def test_each_policy_acts_for_its_agents_and_its_trajectories_reach_only_its_learner(
        cluster: Cluster, relay_two_policies):
    trainers, default_pull, red_pull = relay_two_policies
    send_message(trainers, weights("default", 3, favourite=0))
    # Red's agents have no weights yet: nobody steps (red's learner would be starved of them).
    assert not default_pull.poll(2000), "stepping waits for every policy that has agents"
    broker = wait_for(lambda: next((r for r in status_rows(cluster) if r["role"] == "broker"
                                    and r.get("held_by")), None), 10, "the broker's status")
    assert broker["held_by"] == "red: no weights"
    send_message(trainers, weights("red", 7, favourite=1))

    seen: dict[str, set[str]] = {"default": set(), "red": set()}
    while min(len(agents) for agents in seen.values()) < 4:  # two envs x two agents each
        for policy, pull in (("default", default_pull), ("red", red_pull)):
            if pull.poll(0):
                traj = pull.recv()
                assert isinstance(traj, p.Trajectory)
                version, action = (7, 1) if policy == "red" else (3, 0)
                assert traj.policy == policy
                assert traj.policy_versions.tolist() == [version] * len(traj.rewards)
                assert traj.actions.tolist() == [action] * len(traj.rewards), \
                    "each row was acted on with its own policy's weights"
                seen[policy].add(traj.agent)
        wait_for(lambda: default_pull.poll(0) or red_pull.poll(0), 20, "trajectories")
    assert seen == {"default": {"w/0/b", "w/0/d", "w/1/b", "w/1/d"},
                    "red": {"w/0/a", "w/0/c", "w/1/a", "w/1/c"}}

    # Figures travel with heartbeats (every 0.5 s): wait for one sent since red's weights came.
    broker = wait_for(lambda: next((r for r in status_rows(cluster) if r["role"] == "broker"
                                    and r.get("policy_version_red", -1) >= 0), None), 10,
                      "broker status")
    assert (broker["policy_version_default"], broker["policy_version_red"]) == (3, 7)
    assert (broker["policy_rows_default"], broker["policy_rows_red"]) == (4, 4)


def test_two_learners_each_train_their_own_policy_and_shut_down_clean(cluster: Cluster):
    red = f"ipc://{cluster.dir}/red"
    procs = {"controller": cluster.start("controller"),
             "broker": cluster.start("broker", "--policy-map", "[ac]=red"),
             "assembler": cluster.start("assembler", "--policy-endpoints", f"red={red}"),
             "worker": cluster.start("worker", "--env", "scripted_envs:relay_team",
                                     "--envs-per-worker", "4", "--name", "w")}
    small = ("--target-return", "0", "--batch-steps", "128")
    procs["default"] = cluster.start("trainer", *small)
    procs["red"] = cluster.start("trainer", *small, "--policy-name", "red", "--trajectories", red)

    def versions() -> dict | None:
        broker = next((r for r in status_rows(cluster) if r["role"] == "broker"), None)
        return broker and min(broker.get(f"policy_version_{name}", 0)
                              for name in ("default", "red")) >= 5

    wait_for(versions, 60, "both policies to be updated a few times")
    assembler_row = next(r for r in status_rows(cluster) if r["role"] == "assembler")
    assert assembler_row["trainer_swaps"] == 0, "two policies' learners are not a swap"
    run = cluster.runs_dir / "latest"
    for metrics in (run / "metrics.jsonl", run / "policy-red" / "metrics.jsonl"):
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert records and records[-1]["env_steps"] > 0, metrics
    assert (run / "policy-red" / "checkpoint.npz").exists()
    assert cluster.cli("shutdown").returncode == 0
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
    assembler = procs["assembler"].output()
    assert "0 never taken in by a learner" in assembler, assembler[-2000:]
    for name in ("default", "red"):
        assert "wrong policy" not in procs[name].output()


def test_a_policy_without_an_endpoint_is_dropped_loudly_and_counted(cluster: Cluster):
    cluster.start("controller")
    cluster.start("broker", "--policy-map", "[ac]=red")
    assembler = cluster.start("assembler")
    cluster.start("worker", "--env", "scripted_envs:relay_team", "--name", "w")
    trainers = cluster.socket(zmq.DEALER, cluster.endpoints["policy"])
    send_message(trainers, weights("default", 1, favourite=0))
    send_message(trainers, weights("red", 1, favourite=1))
    row = wait_for(lambda: next((r for r in status_rows(cluster) if r["role"] == "assembler"
                                 and r.get("unrouted")), None), 20, "unrouted count")
    assert row["unrouted"] > 0
    log = assembler.output()
    assert "--policy-endpoints red=ENDPOINT" in log and log.count("has no trajectories") == 1
    trainers.close()


def test_a_learner_on_another_policys_endpoint_refuses_its_trajectories_by_name(
        cluster: Cluster):
    cluster.start("controller")
    cluster.start("broker", "--policy-map", "[ac]=red")
    cluster.start("assembler", "--policy-endpoints", f"red=ipc://{cluster.dir}/red")
    cluster.start("worker", "--env", "scripted_envs:relay_team", "--name", "w")
    cluster.start("learner", "--target-return", "0")  # the default policy's learner
    red = cluster.start("learner", "--target-return", "0", "--policy-name", "red")
    row = wait_for(lambda: next((r for r in status_rows(cluster) if r.get("policy") == "red"
                                 and r.get("rejected_wrong_policy")), None), 30,
                   "the red learner to refuse the default policy's trajectories")
    assert row["env_steps"] == 0, "nothing of another policy is learned from"
    assert "is --trajectories the assembler's endpoint for it?" in red.output()


@pytest.mark.parametrize(("role", "args", "says"), [
    ("broker", ("--policy-map", "adversary_*"), "is not KEY=VALUE"),
    ("assembler", ("--policy-endpoints", "red=ipc:///tmp/a,red=ipc:///tmp/b"), "given twice"),
    ("assembler", ("--policy-endpoints", "red=ipc:///tmp/a,blue=ipc:///tmp/a"), "its own"),
    ("learner", ("--policy-name", "red team"), "--policy-name"),
])
def test_bad_policy_flags_exit_2_with_one_line_saying_why(cluster: Cluster, role: str,
                                                          args: tuple[str, ...], says: str):
    proc = cluster.start(role, *args)
    assert proc.wait(30) == 2
    assert says in proc.output()
