"""The etcd chaos scenarios: real agents, a real etcd, faults injected.

Each scenario runs ``rallypoint run`` agents (etcd backend on 127.0.0.1, ``--nnodes
2:3``, one worker each) on a small training script that checkpoints its step
counter to a file (``chaos_etcd_harness.TRAIN``), injects an etcd fault, and
asserts what a user cares about: every agent exits 0, the checkpoint holds exactly
the number of steps asked for (each step made, none counted twice), and no process
of the job is left. Scenarios:

* etcd SIGKILL + restart during training, during a regroup (a third node joins),
  and during a first join (the second node even starts while etcd is down);
* etcd SIGSTOP + SIGCONT during training;
* a 3-member etcd cluster (``--rdzv-endpoint`` lists the members): the leader
  SIGKILLed during training and during a rendezvous.

While training runs, the workers need no etcd: an outage must not stop them, and
must not cost a regroup (the scenarios during training assert a single round).

Reduced form by default (2 s outages, one fault, 10-20 s per scenario); with
``RALLYPOINT_CHAOS_FULL=1`` (``make chaos``) 5 s outages, three faults per
training scenario and a longer job. The reduced form runs the scenarios in
turn on fewer jobs (their agents, etcd server or cluster and training are what
costs CPU): on one server, an outage during the first join, SIGKILL then SIGSTOP
during training, and an outage during a regroup; on a 3-member cluster, the
leader killed during training, then (the member back) the new leader during a
rendezvous. Between two faults the agents are back on etcd and have renewed
their leases, as between the full form's repeats, and each fault keeps its own
assertions.

The closing table (fault -> agents running a new round, etcd back -> that round,
the outage the agents saw, steps made during it, processes left) is printed at
the end of the module (no ``-s`` needed), and appended as JSON lines to the file
named by ``RALLYPOINT_CHAOS_REPORT`` if set::

    RALLYPOINT_CHAOS_FULL=1 .venv/bin/python -m pytest -p no:cacheprovider \\
        -m chaos tests/chaos/test_chaos_etcd.py
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.etcd_jobs import FULL, Job, Outcome, print_after_tests, table

from rallypoint.adapters.etcd import EtcdCluster, EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

#: How long etcd stays down (or stopped), and how often a training scenario
#: injects its fault.
OUTAGE = 5.0 if FULL else 2.0
#: After an outage, long enough for every agent to write a heartbeat again: two
#: keep-alive intervals of the harness's settings (2 s each).
RENEWAL_S = 4.0
REPEAT = 3 if FULL else 1
STEP_TIME = 0.1
#: Enough steps that training outlasts every fault (and its recovery); a scenario
#: with a third node needs room for its start and the regroup too.
STEPS = 60 + REPEAT * int((OUTAGE + 3.0) / STEP_TIME) if FULL else 45
REGROUP_STEPS = STEPS + 45
#: A reduced-form pair of scenarios on one job: room for both (the steps left
#: when the job is finished run without their step time, so room costs nothing).
PAIR_STEPS = 600
#: The reduced form's four single-server scenarios on one job (see PAIR_STEPS).
TURNS_STEPS = 1500
#: Bounds that only detect hangs.
START_TIMEOUT = 120.0
FINISH_TIMEOUT = 180.0 + REGROUP_STEPS * STEP_TIME


_OUTCOMES: list[Outcome] = []


@pytest.fixture(scope="module", autouse=True)
def closing_table(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not _OUTCOMES:
        return
    text = f"etcd chaos ({'full' if FULL else 'reduced'} form):\n{table(_OUTCOMES)}"
    print_after_tests(request, text.splitlines())


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(endpoint: str, steps: int = STEPS) -> Job:
        directory = tmp_path / f"job{len(jobs)}"
        directory.mkdir()
        jobs.append(Job(directory, endpoint, steps, STEP_TIME))
        return jobs[-1]

    try:
        yield make
    finally:
        for job in jobs:
            job.stop_all()


def _training(job: Job, steps: int = 5) -> None:
    """Start agents a and b and wait until training runs."""
    job.start("a")
    job.start("b")
    job.wait_for(lambda: job.step() >= steps, f"step {steps}", START_TIMEOUT)


def _new_rounds(job: Job) -> int:
    """How many times an agent stopped its workers for a new round (whole logs)."""
    return sum(
        (job.dir / f"{name}.log").read_text(errors="replace").count("starting a new round")
        for name in job.agents
    )


def _regrouping(job: Job, before: int = 0) -> None:
    """Wait until an agent stops its workers for a new round (a third node joined)
    beyond the ``before`` it had stopped them for."""
    job.wait_for(lambda: _new_rounds(job) > before, "a regroup", START_TIMEOUT)


def _finished(job: Job, *outcomes: Outcome, one_round: bool) -> None:
    """Assert the job's success, step count and leftovers; record the outcomes (a
    reduced-form pair of scenarios on one job: one each)."""
    codes = job.finish(FINISH_TIMEOUT)
    leftovers, rounds, checkpoint = job.leftovers(), len(job.rounds()), job.ckpt.read_text()
    final_step, agent_outage_s = job.step(), job.agent_outage()
    ended = f"exit codes {sorted(codes.values())}, checkpoint {checkpoint}/{job.steps}"
    for outcome in outcomes:  # the job's figures, in each scenario's row
        outcome.rounds = rounds
        outcome.final_step = final_step
        outcome.agent_outage_s = agent_outage_s
        outcome.leftovers = leftovers
        outcome.outcome = ended
        _OUTCOMES.append(outcome)
        outcome.report()
    assert set(codes.values()) == {0}, job.logs()
    assert int(checkpoint) == job.steps
    made = sorted({r["step"] for r in job.records() if r["event"] == "step"})
    assert made == list(range(1, job.steps + 1)), made
    assert not leftovers, leftovers
    if one_round:
        assert rounds == 1, f"a regroup the outage should not cause\n{job.logs()}"


def _back_and_renewed(job: Job) -> None:
    """Between two faults of a reduced-form pair: every agent reached etcd again and
    had the time to renew its lease (see ``_ride_out``)."""
    job.wait_for(job.back_on_etcd, "the agents back on etcd", 60)
    time.sleep(RENEWAL_S)


def _ride_out(
    job: Job, outcome: Outcome, fault: Callable[[], None], heal: Callable[[], None]
) -> None:
    """Inject ``fault`` REPEAT times during training, ``heal`` OUTAGE s later;
    training must go on meanwhile."""
    during = 0
    for repeat in range(REPEAT):
        before = job.step()
        down = time.time()
        fault()
        time.sleep(OUTAGE)
        heal()
        during += job.steps_between(down, time.time())
        job.wait_for(lambda b=before: job.step() >= b + 5, "training after the fault", 60)
        # Every agent reached etcd again before the next fault (else two faults
        # would be one long outage to it), and had the time to renew its lease:
        # one call answering is not yet a heartbeat written, and a beat sent
        # while etcd was down waits out its attempt timeout (a keep-alive
        # interval). Faults closer than that add up, for the lease, to one long
        # outage, which fences every node by design (docs/design.md, decision 7).
        job.wait_for(job.back_on_etcd, "the agents back on etcd", 60)
        if repeat < REPEAT - 1:
            time.sleep(RENEWAL_S)
    outcome.steps_during_outage = during
    assert during > 0, "training stopped while etcd was down"


# --- one etcd server ---------------------------------------------------------------

#: The scenarios the reduced form runs in turn on one job.
_PAIRED = pytest.mark.skipif(not FULL, reason="the reduced form runs it with others on one job")
_PAIR = pytest.mark.skipif(FULL, reason="the full form runs each scenario on a job of its own")


def _kill_restart(server: EtcdServer) -> tuple[Callable[[], None], Callable[[], None]]:
    return lambda: server.stop(kill=True), server.start


@_PAIRED
def test_etcd_killed_and_restarted_during_training(
    etcd_server_factory: Callable[[], EtcdServer], job_factory: Callable[..., Job]
) -> None:
    server = etcd_server_factory()
    job = job_factory(server.endpoint)
    outcome = Outcome("etcd SIGKILL + restart during training")
    _training(job)
    _ride_out(job, outcome, *_kill_restart(server))
    _finished(job, outcome, one_round=True)


@_PAIRED
def test_etcd_stopped_and_continued_during_training(
    etcd_server_factory: Callable[[], EtcdServer], job_factory: Callable[..., Job]
) -> None:
    server = etcd_server_factory()
    job = job_factory(server.endpoint)
    outcome = Outcome("etcd SIGSTOP + SIGCONT during training")
    _training(job)
    _ride_out(job, outcome, server.pause, server.resume)
    _finished(job, outcome, one_round=True)


def _outage_during_a_regroup(job: Job, server: EtcdServer, outcome: Outcome) -> None:
    """Agents a and b train; c joins, and etcd is SIGKILLed while they regroup,
    restarted OUTAGE s later; a round of 3 starts."""
    before = _new_rounds(job)
    job.start("c")
    _regrouping(job, before)
    down = time.time()
    server.stop(kill=True)
    time.sleep(OUTAGE)
    server.start()
    back = time.time()
    started = job.wait_for(lambda: job.round_started(down, 3), "a round of 3", START_TIMEOUT)
    outcome.fault_to_new_round_s = started - down
    outcome.back_to_new_round_s = started - back


def _outage_during_a_first_join(job: Job, server: EtcdServer, outcome: Outcome) -> None:
    """a joins; etcd is SIGKILLed, b starts and joins while it is down; etcd is
    restarted OUTAGE s later, and the first round (of 2) starts."""
    import pyetcd

    job.start("a")
    client = pyetcd.client("127.0.0.1", server.client_port, timeout=5)
    try:
        state = f"/rallypoint/{job.run_id}/state"
        job.wait_for(lambda: client.get(state)[0] is not None, "a's first join", START_TIMEOUT)
    finally:
        client.close()
    down = time.time()
    server.stop(kill=True)
    job.start("b")  # starts and joins while etcd is down
    time.sleep(OUTAGE)
    server.start()
    back = time.time()
    started = job.wait_for(lambda: job.round_started(down, 2), "the first round", START_TIMEOUT)
    outcome.fault_to_new_round_s = started - down
    outcome.back_to_new_round_s = started - back


@_PAIRED
def test_etcd_killed_and_restarted_during_a_regroup(
    etcd_server_factory: Callable[[], EtcdServer], job_factory: Callable[..., Job]
) -> None:
    server = etcd_server_factory()
    job = job_factory(server.endpoint, REGROUP_STEPS)
    outcome = Outcome("etcd SIGKILL + restart during a regroup (3rd node joins)")
    _training(job, steps=1)
    _outage_during_a_regroup(job, server, outcome)
    _finished(job, outcome, one_round=False)


@_PAIRED
def test_etcd_killed_and_restarted_during_a_first_join(
    etcd_server_factory: Callable[[], EtcdServer], job_factory: Callable[..., Job]
) -> None:
    server = etcd_server_factory()
    job = job_factory(server.endpoint)
    outcome = Outcome("etcd SIGKILL + restart during a first join")
    _outage_during_a_first_join(job, server, outcome)
    _finished(job, outcome, one_round=True)


@_PAIR
def test_etcd_faults_in_turn_on_one_job(
    etcd_server_factory: Callable[[], EtcdServer], job_factory: Callable[..., Job]
) -> None:
    """The four scenarios above on one server and job, in turn: an outage during
    the first join, SIGKILL + restart then SIGSTOP + SIGCONT during training
    (training goes on through each; none of the three costs a regroup: one round
    until c starts), and an outage during the regroup c's start causes, which
    ends in a round of 3."""
    server = etcd_server_factory()
    job = job_factory(server.endpoint, TURNS_STEPS)
    first = Outcome("etcd SIGKILL + restart during a first join")
    killed = Outcome("etcd SIGKILL + restart during training")
    stopped = Outcome("etcd SIGSTOP + SIGCONT during training")
    regroup = Outcome("etcd SIGKILL + restart during a regroup (3rd node joins)")
    _outage_during_a_first_join(job, server, first)
    job.wait_for(lambda: job.step() >= 5, "step 5", START_TIMEOUT)
    _back_and_renewed(job)
    _ride_out(job, killed, *_kill_restart(server))
    time.sleep(RENEWAL_S)  # _ride_out waited until the agents were back on etcd
    _ride_out(job, stopped, server.pause, server.resume)
    time.sleep(RENEWAL_S)
    assert len(job.rounds()) == 1, f"a regroup an outage should not cause\n{job.logs()}"
    _outage_during_a_regroup(job, server, regroup)
    _finished(job, first, killed, stopped, regroup, one_round=False)


# --- a 3-member etcd cluster -------------------------------------------------------------


def _leader_killed_during_training(job: Job, cluster: EtcdCluster, outcome: Outcome) -> int:
    """Kill the leader REPEAT times during training (the full form restarts each, so
    that the next fault kills another leader); the last one killed."""
    killed: list[int] = []

    def kill_leader() -> None:
        killed.append(cluster.leader())
        cluster.members[killed[-1]].stop(kill=True)

    def heal() -> None:
        if FULL:  # bring it back, so that the next fault kills another leader
            cluster.members[killed[-1]].start()

    _ride_out(job, outcome, kill_leader, heal)
    return killed[-1]


def _leader_killed_during_a_rendezvous(job: Job, cluster: EtcdCluster, outcome: Outcome) -> None:
    """c joins; the leader is SIGKILLed (not restarted) while the agents regroup;
    after the election a round of 3 starts."""
    before = _new_rounds(job)
    job.start("c")
    _regrouping(job, before)
    leader = cluster.leader()
    down = time.time()
    cluster.members[leader].stop(kill=True)  # not restarted
    cluster.leader(excluding={leader})  # the election
    back = time.time()
    started = job.wait_for(lambda: job.round_started(down, 3), "a round of 3", START_TIMEOUT)
    outcome.fault_to_new_round_s = started - down
    outcome.back_to_new_round_s = max(0.0, started - back)


@_PAIRED
def test_cluster_leader_killed_during_training(
    etcd_cluster_factory: Callable[..., EtcdCluster], job_factory: Callable[..., Job]
) -> None:
    cluster = etcd_cluster_factory(3)
    job = job_factory(cluster.endpoints)
    outcome = Outcome("3-member cluster, leader SIGKILL during training")
    _training(job)
    _leader_killed_during_training(job, cluster, outcome)
    _finished(job, outcome, one_round=True)


@_PAIRED
def test_cluster_leader_killed_during_a_rendezvous(
    etcd_cluster_factory: Callable[..., EtcdCluster], job_factory: Callable[..., Job]
) -> None:
    cluster = etcd_cluster_factory(3)
    job = job_factory(cluster.endpoints, REGROUP_STEPS)
    outcome = Outcome("3-member cluster, leader SIGKILL during a rendezvous (3rd node joins)")
    _training(job, steps=1)
    _leader_killed_during_a_rendezvous(job, cluster, outcome)
    _finished(job, outcome, one_round=False)


@_PAIR
def test_cluster_leader_killed_during_training_then_during_a_rendezvous(
    etcd_cluster_factory: Callable[..., EtcdCluster], job_factory: Callable[..., Job]
) -> None:
    """The two scenarios above on one cluster and job: the leader killed during
    training costs no regroup (one round until c starts); it is restarted (as
    between the full form's repeats: two members lost would be no quorum), and
    the new leader is killed during the rendezvous c's start causes."""
    cluster = etcd_cluster_factory(3)
    job = job_factory(cluster.endpoints, PAIR_STEPS)
    training = Outcome("3-member cluster, leader SIGKILL during training")
    rendezvous = Outcome("3-member cluster, leader SIGKILL during a rendezvous (3rd node joins)")
    _training(job)
    killed = _leader_killed_during_training(job, cluster, training)
    assert len(job.rounds()) == 1, f"a regroup the outage should not cause\n{job.logs()}"
    cluster.members[killed].start()  # healthy: back in the cluster, which has a leader
    _back_and_renewed(job)
    _leader_killed_during_a_rendezvous(job, cluster, rendezvous)
    _finished(job, training, rendezvous, one_round=False)
