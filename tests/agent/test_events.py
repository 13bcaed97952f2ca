"""The agent's structured events: written as JSON lines, read back, printed."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from rallypoint.agent.events import EventFileError, EventKind, EventRecorder, read_events
from rallypoint.cli import main


def test_events_are_json_lines_and_log_records(tmp_path: Path, caplog) -> None:
    path = tmp_path / "events.jsonl"
    log = EventRecorder(str(path), "host_1_0")
    with caplog.at_level(logging.DEBUG, logger="rallypoint.events"):
        log.emit(EventKind.ROUND, 3, group_rank=1, group_world_size=2, rendezvous_s=0.25)
    log.close()
    (line,) = path.read_text().splitlines()
    doc = json.loads(line)
    assert doc["kind"] == "round" and doc["round"] == 3 and doc["node"] == "host_1_0"
    assert (doc["group_rank"], doc["group_world_size"], doc["rendezvous_s"]) == (1, 2, 0.25)
    assert any('"kind":"round"' in r.getMessage() for r in caplog.records)


def test_agents_sharing_a_file_never_tear_each_others_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    logs = [EventRecorder(path, f"n{i}") for i in range(4)]

    def write(log: EventRecorder) -> None:
        for i in range(200):
            log.emit(EventKind.FAILURE, i, detail="x" * 300)

    threads = [threading.Thread(target=write, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for log in logs:
        log.close()
    events = read_events([path])
    assert len(events) == 800
    assert len(Path(path).read_text().splitlines()) == 800


def test_reading_merges_files_by_time_and_skips_torn_lines(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        '{"time":2.0,"node":"a","kind":"restart","round":0,"cause":"failure"}\n{"time":5.0,"no'
    )
    b.write_text(
        '{"time":1.0,"node":"b","kind":"round","round":0}\n'
        "not json\n"
        '{"time":3.0,"node":"b","kind":"nonsense","round":0}\n'
        '{"time":4.0,"node":"b","kind":"round","round":1}\n'
    )
    events = read_events([str(a), str(b)])
    assert [(e.node, e.kind, e.round) for e in events] == [
        ("b", EventKind.ROUND, 0),
        ("a", EventKind.RESTART, 0),
        ("b", EventKind.ROUND, 1),
    ]
    assert events[1].fields == {"cause": "failure"}


def test_the_events_command_prints_a_table(tmp_path: Path, capsys) -> None:
    path = tmp_path / "events.jsonl"
    log = EventRecorder(str(path), "host_7_0")
    log.emit(EventKind.RESTART, 0, cause="failure", charged=True, decide_s=0.5)
    log.emit(EventKind.ROUND, 1, rendezvous_s=0.125)
    log.close()
    assert main(["events", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 events" in out and "host_7_0" in out and "restart" in out
    assert "rendezvous_s=0.125" in out and "cause=failure" in out
    assert main(["events", "--kind", "round", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["round"]


def test_a_missing_events_file_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:
    assert main(["events", str(tmp_path / "nope.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rallypoint events: ") and "cannot read" in err
    assert "Traceback" not in err


def test_an_events_file_in_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EventFileError, match=r"--events-file .*cannot open for appending"):
        EventRecorder(str(tmp_path / "no" / "such" / "events.jsonl"), "n")


def test_recoveries_show_each_live_regroup_phase_by_phase(tmp_path: Path, capsys) -> None:
    path = tmp_path / "events.jsonl"
    log = EventRecorder(str(path), "n0")
    log.emit(EventKind.ROUND, 4, group_rank=0, group_world_size=2, since_failure_s=0.125)
    log.emit(
        EventKind.LIVE_REGROUP, 4, handed=1, started=1, warm_started=1, newcomer_ready_s=0.0625,
        told_s=0.25, group_s=0.5, state_s=0.625, first_step_s=0.75, state_from=[1],
        state_bytes=99, step=12,
    )  # fmt: skip
    log.emit(EventKind.FAILURE, 4)
    log.close()
    assert main(["events", "--recoveries", str(path)]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "n0" in line]
    cells = row.split()
    assert cells == [
        "n0", "4", "1", "1*", "0.062", "0.125", "0.250", "0.500", "0.625", "0.750", "1",
    ]  # fmt: skip
