"""The live channel between an agent and its workers: messages and status files."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.agent.config import Std
from rallypoint.agent.worker.live_channel import (
    LiveMessage,
    Phase,
    StatusFile,
    decode_message,
    encode_message,
)
from rallypoint.agent.workers import WorkerLaunch, stream_targets


def test_an_assignment_survives_the_pipe() -> None:
    message = LiveMessage(7, {"RANK": "3", "WORLD_SIZE": "4"}, lost=True)
    line = encode_message(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_message(line.rstrip(b"\n")) == message


@pytest.mark.parametrize(
    "line",
    [b"", b"[]", b'{"round": "7", "env": {}}', b'{"round": 7, "env": {"RANK": 3}}', b"{bad"],
)
def test_a_line_that_is_not_an_assignment_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        decode_message(line)


def test_a_status_file_is_shared_between_two_mappings(tmp_path: Path) -> None:
    path = str(tmp_path / "status")
    agent_side = StatusFile(path, create=True)
    worker_side = StatusFile(path)
    first = agent_side.read()
    assert (first.round, first.step, first.phase, first.source) == (-1, 0, Phase.STARTED, -1)
    worker_side.write_round(3, joined_at=1.5)
    worker_side.write_phase(Phase.STEPPING)
    worker_side.write_step(42)
    worker_side.write_state(2.5, source=1, size=100)
    worker_side.write_beat(9, waiting=True)
    worker_side.write_phase(Phase.PAUSED)
    seen = agent_side.read()
    assert (seen.round, seen.step, seen.phase, seen.pauses) == (3, 42, Phase.PAUSED, 1)
    assert (seen.joined_at, seen.state_at, seen.source, seen.state_bytes) == (1.5, 2.5, 1, 100)
    assert (seen.beat, seen.waiting) == (9, 1)
    worker_side.write_round(4)  # a new round clears the last one's times and source
    again = agent_side.read()
    assert (again.round, again.state_at, again.source, again.state_bytes) == (4, 0.0, -1, 0)
    agent_side.close()
    worker_side.close()


def _launch(**kwargs: object) -> WorkerLaunch:
    fields: dict[str, object] = {
        "local_rank": 0,
        "global_rank": 0,
        "argv": ["python", "-u", "train.py"],
        "env": {},
        "log_dir": "/logs/0",
        "error_file": "/logs/0/error.json",
    }
    fields.update(kwargs)
    return WorkerLaunch(**fields)  # type: ignore[arg-type]


def test_an_adopted_process_routes_its_own_streams_and_leaves_teed_ones_to_the_agent() -> None:
    assert stream_targets(_launch()) == (None, None)
    assert stream_targets(_launch(redirect=Std.ALL)) == ("/logs/0/stdout.log", "/logs/0/stderr.log")
    assert stream_targets(_launch(redirect=Std.ERR, stderr_file="/x/err")) == (None, "/x/err")
    assert stream_targets(_launch(console=False)) == ("/dev/null", "/dev/null")
    # A teed stream stays on the pipe the agent tees from, whatever else is asked.
    assert stream_targets(_launch(tee=Std.OUT, redirect=Std.ALL)) == (None, "/logs/0/stderr.log")
    assert stream_targets(_launch(tee=Std.ALL, console=False)) == (None, None)


def test_a_spare_and_a_newcomer_report_ready_and_what_the_script_allows(tmp_path: Path) -> None:
    path = str(tmp_path / "status")
    agent_side = StatusFile(path, create=True)
    worker_side = StatusFile(path)
    assert (agent_side.read().may_shrink, agent_side.read().ready_at) == (0, 0.0)
    worker_side.write_may_shrink(True)
    worker_side.write_ready(7.5)
    seen = agent_side.read()
    assert (seen.phase, seen.ready_at, seen.may_shrink) == (Phase.READY, 7.5, 1)
    worker_side.write_adopted()  # a warm spare becomes a worker: it starts afresh
    again = agent_side.read()
    assert (again.phase, again.ready_at, again.may_shrink) == (Phase.STARTED, 0.0, 1)
    agent_side.close()
    worker_side.close()
