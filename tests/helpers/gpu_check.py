"""The GPU checks of live regroup and the launcher: ``python tests/helpers/gpu_check.py``.

Where no CUDA device is present it prints one line saying so and exits 0 (the
test suite runs it that way too). On a GPU machine each check prints PASS or FAIL
with what it saw, and the exit status is the number of failures:

* ``launch``: ``rallypoint run --standalone --nproc-per-node gpu --live`` trains
  examples/train.py with NCCL, rank 0 crashes once, and the job finishes;
* ``abort``: in one process, an NCCL group is aborted and a new one formed and used
  (what a live worker does when a round is lost);
* ``live``: live_steps.py with NCCL, one worker SIGKILLed mid-run. With two or more
  devices: its sibling keeps its process, aborts the lost round's communicator and
  sends the state to the newcomer; with one device (NCCL refuses two ranks on one
  GPU) the warm spare takes over and the job finishes;
* ``sharded``: with two or more devices, live_sharded.py (FSDP2 on CUDA, NCCL, a
  snapshot every 10 steps) on two agents of one device each; one worker SIGKILLed:
  the others keep their processes, every rank rolls back to the newest whole
  snapshot (the lost shard's copy kept by its buddy on the other agent, sent over
  the new round's groups), the steps trained again carry the same bits as the first
  time, and the job finishes;
* ``resharded``: with two or more devices, the same job on two agents with
  ``--nnodes 1:2``; the second agent and its worker SIGKILLed for good: the
  survivor keeps its process and trains alone from the newest whole snapshot,
  resharded in memory from 2 shards (its own and its buddy's copy) into 1, whose
  whole state is bit for bit the one recorded at that step, and the job finishes;
* ``health``: the pre-flight health check (matmul on the device, NCCL all-reduce).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "-m", "rallypoint.run", "--standalone", "--nproc-per-node", "gpu"]


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def _records(out_dir: Path) -> list[dict[str, Any]]:
    """What the training script's workers recorded so far (``OUT/records.jsonl``)."""
    records = out_dir / "records.jsonl"
    if not records.exists():
        return []
    return [json.loads(x) for x in records.read_text().splitlines() if x.strip()]


def check_launch() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as ckpt:
        example = str(ROOT / "examples" / "train.py")
        out = _run([*RUN, "--live", "--max-restarts", "2", example, "--steps", "600",
                    "--crash-at-step", "255", "--checkpoint-dir", ckpt])  # fmt: skip
    text = out.stdout + out.stderr
    ok = out.returncode == 0 and "(nccl)" in text and "final loss" in text and "step 255" in text
    lines = [line for line in out.stdout.splitlines() if "round" in line or "final" in line]
    return ok, f"exit {out.returncode}; " + " | ".join(lines)[-600:]


_ABORT = r"""
import os, torch, torch.distributed as dist
from datetime import timedelta
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.cuda.set_device(0)
for attempt, port in enumerate((29611, 29612)):
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", timeout=timedelta(seconds=30), device_id=device)
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"attempt {attempt}: all_reduce ok {t.tolist()}", flush=True)
    dist.group.WORLD.abort()
    dist.destroy_process_group()
print("abort and re-form ok")
"""


def check_abort() -> tuple[bool, str]:
    out = _run([sys.executable, "-c", _ABORT], timeout=120)
    return out.returncode == 0 and "re-form ok" in out.stdout, (out.stdout + out.stderr)[-600:]


def check_live(devices: int) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        env = dict(os.environ, LIVE_STEPS_BACKEND="nccl")
        agent = subprocess.Popen(
            [*RUN, "--live", "--max-restarts", "2", "--monitor-interval", "0.05",
             str(ROOT / "tests" / "helpers" / "live_steps.py"), str(out_dir), "3000", "0.005"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            while not any(r["event"] == "step" and int(r["step"]) > 200 for r in _records(out_dir)):  # type: ignore[call-overload]
                if time.monotonic() > deadline or agent.poll() is not None:
                    return False, "no training: " + (agent.stdout.read() if agent.stdout else "")[
                        -800:
                    ]
                time.sleep(0.1)
            steps = [r for r in _records(out_dir) if r["event"] == "step"]
            victim = max(steps, key=lambda r: (r["rank"], r["time"]))  # type: ignore[arg-type]
            sibling_pid = next((r["pid"] for r in steps if r["rank"] == 0), None)
            os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
            (out_dir / "sprint").touch()
            code = agent.wait(timeout=240)
            text = agent.stdout.read() if agent.stdout else ""
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        recs = _records(out_dir)
        steps = [r for r in recs if r["event"] == "step"]
        wrong = [r for r in steps if r["value"] != r["step"] * (r["step"] + 1) / 2]  # type: ignore[operator]
        rounds = [r for r in recs if r["event"] == "round" and r["round"] != 0]
        done = [r for r in recs if r["event"] == "done"]
        later = [(r["rank"], r["step"]) for r in rounds]
        detail = f"exit {code}; later rounds {later}; done {len(done)}; wrong values {len(wrong)}"
        ok = code == 0 and not wrong and bool(done)
        if devices >= 2:
            newcomer = [r for r in rounds if r["pid"] == victim["pid"]]
            kept = any(r["pid"] == sibling_pid for r in rounds)
            got_state = any(int(r["step"]) > 0 for r in rounds if r["pid"] != sibling_pid)  # type: ignore[call-overload]
            ok = ok and kept and got_state and not newcomer
            detail += f"; sibling kept {kept}; newcomer got state {got_state}"
        return ok, detail + " | " + text[-300:].replace("\n", " / ")


def _sharded_agents(out_dir: Path, nnodes: str, run_id: str, **env: str) -> list[Any]:
    """Two agents of one device each on 127.0.0.1 training live_sharded.py (FSDP2 on
    CUDA, NCCL, a snapshot every 10 steps), 300 steps of 0.01 s."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = str(ROOT / "tests" / "helpers" / "live_sharded.py")
    agents = []
    for node in (0, 1):
        variables = dict(
            os.environ, CUDA_VISIBLE_DEVICES=str(node), LIVE_SHARDED_BACKEND="nccl",
            LIVE_SHARDED_MESH="fsdp", LIVE_SHARDED_SNAPSHOT_EVERY="10", **env,
        )  # fmt: skip
        host = "true" if node == 0 else "false"
        conf = f"keep_alive_interval=1,keep_alive_max_attempt=2,is_host={host}"
        command = [
            sys.executable, "-m", "rallypoint.run", "--nnodes", nnodes, "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, "--rdzv-conf", conf, "--local-addr", "127.0.0.1",
            "--live", "--max-restarts", "2", "--monitor-interval", "0.05",
            script, str(out_dir), "300", "0.01",
        ]  # fmt: skip
        agents.append(
            subprocess.Popen(
                command,
                env=variables,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return agents


def _trained_past(out_dir: Path, agents: list[Any], step: int) -> str:
    """Wait until a step after ``step`` was committed: '' then, else what went wrong."""
    deadline = time.monotonic() + 180
    while not any(r["event"] == "step" and r["step"] > step for r in _records(out_dir)):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            return "no training: " + " / ".join(
                (a.stdout.read() if a.stdout and a.poll() is not None else "")[-400:]
                for a in agents
            )
        time.sleep(0.1)
    return ""


def _stop(agents: list[Any]) -> None:
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def check_sharded(devices: int) -> tuple[bool, str]:
    if devices < 2:
        return True, "skipped: needs two devices (NCCL refuses two ranks on one)"
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        agents = _sharded_agents(out_dir, "2", "gpu-sharded")
        try:
            trouble = _trained_past(out_dir, agents, 35)
            if trouble:
                return False, trouble
            steps = [r for r in _records(out_dir) if r["event"] == "step"]
            pids = {r["rank"]: r["pid"] for r in steps}
            last = max(r["step"] for r in steps)
            os.kill(pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not any(r["event"] == "round" and r["round"] > 0 for r in _records(out_dir)):
                if time.monotonic() > deadline:
                    return False, "no round after the kill"
                time.sleep(0.1)
            (out_dir / "sprint").touch()
            codes = [a.wait(timeout=240) for a in agents]
            text = " / ".join((a.stdout.read() if a.stdout else "")[-300:] for a in agents)
        finally:
            _stop(agents)
        recs = _records(out_dir)
        digests: dict[tuple[int, int], set[str]] = {}
        for r in recs:
            if r["event"] == "step":
                digests.setdefault((r["step"], r["shard"]), set()).add(r["digest"])
        differing = [key for key, seen in digests.items() if len(seen) > 1]
        later = [r for r in recs if r["event"] == "round" and r["round"] > 0]
        resumed = min((r["step"] for r in later), default=-1)
        restored = {r["pid"] for r in recs if r["event"] == "restore"}
        checks = {
            "both agents exit 0": codes == [0, 0],
            "every step committed": {step for step, _ in digests} == set(range(1, 301)),
            "steps trained again carry the same bits": not differing,
            "the survivor kept its process": pids[0] in {r["pid"] for r in later},
            "rolled back to a snapshot": resumed % 10 == 0 and resumed >= last - 20,
            "only the first workers restored": restored == {pids[0], pids[1]},
        }
        failed = [what for what, held in checks.items() if not held]
        detail = f"exits {codes}; killed after step {last}, rolled back to {resumed}"
        detail += f"; failed: {', '.join(failed)}" if failed else ""
        return not failed, detail + " | " + text.replace("\n", " / ")


def check_resharded(devices: int) -> tuple[bool, str]:
    if devices < 2:
        return True, "skipped: needs two devices (NCCL refuses two ranks on one)"
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        agents = _sharded_agents(out_dir, "1:2", "gpu-resharded", LIVE_SHARDED_WHOLE="1")
        try:
            trouble = _trained_past(out_dir, agents, 35)
            if trouble:
                return False, trouble
            steps = [r for r in _records(out_dir) if r["event"] == "step"]
            survivor = next(r["pid"] for r in steps if r["rank"] == 0)
            os.killpg(agents[1].pid, signal.SIGKILL)  # the second node, for good
            agents[1].wait()
            deadline = time.monotonic() + 120
            while not any(
                r["event"] == "round" and r["world"] == 1 for r in _records(out_dir)
            ):  # fmt: skip
                if time.monotonic() > deadline:
                    return False, "no round of one rank after the node's loss"
                time.sleep(0.1)
            (out_dir / "sprint").touch()
            code = agents[0].wait(timeout=240)
            text = (agents[0].stdout.read() if agents[0].stdout else "")[-300:]
        finally:
            _stop(agents)
        recs = _records(out_dir)
        wholes = {r["step"]: r["whole"] for r in recs if r["event"] == "step" and r["world"] == 2}
        alone = [r for r in recs if r["event"] == "round" and r["world"] == 1]
        resumed = alone[0]["step"] if alone else -1
        checks = {
            "the agent left exits 0": code == 0,
            "the survivor kept its process": bool(alone) and alone[0]["pid"] == survivor,
            "rolled back to a snapshot": resumed > 0 and resumed % 10 == 0,
            "the resharded state is the snapshot's, bit for bit": bool(alone)
            and alone[0]["whole"] == wholes.get(resumed),
            "every step committed": {r["step"] for r in recs if r["event"] == "step"}
            == set(range(1, 301)),
        }
        failed = [what for what, held in checks.items() if not held]
        detail = f"exit {code}; resumed alone at step {resumed}"
        detail += f"; failed: {', '.join(failed)}" if failed else ""
        return not failed, detail + " | " + text.replace("\n", " / ")


def check_health() -> tuple[bool, str]:
    out = _run([*RUN, "--health-check", "-m", "json.tool", "--help"], timeout=240)
    return out.returncode == 0, f"exit {out.returncode}; " + (out.stderr[-300:]).replace(
        "\n", " / "
    )


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu_check: skipped (torch is not installed)")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: skipped (no CUDA device)")
        return 0
    devices = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    print(f"gpu_check: {devices} CUDA device(s): {name}, torch {torch.__version__}")
    failures = 0
    for name, check in (
        ("launch", check_launch),
        ("abort", check_abort),
        ("live", lambda: check_live(devices)),
        ("sharded", lambda: check_sharded(devices)),
        ("resharded", lambda: check_resharded(devices)),
        ("health", check_health),
    ):
        started = time.monotonic()
        try:
            ok, detail = check()
        except Exception as exc:  # a check that breaks is a failed check, reported
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        failures += not ok
        print(
            f"{'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - started:.1f} s): {detail}",
            flush=True,
        )
    return failures


if __name__ == "__main__":
    sys.exit(main())
