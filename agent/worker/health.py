"""The process side of the pre-flight health check (:mod:`rallypoint.agent.health`).

Run as ``python -m rallypoint.agent.worker.health`` by :func:`run_health_check`,
with the round's rendezvous variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``) in its environment and its instructions, as JSON, in
``RALLYPOINT_HEALTH_SPEC``. It reports on a status file, one JSON object a line:
``{"event": "stage", "stage": S}`` as each stage starts,
``{"event": "imported", "seconds": T}`` once torch is imported (``T`` from the
``spawned`` time in the instructions), and one final ``{"event": "result", ...}``.
A process that dies or is killed before its result line is judged by the caller
from the last stage it started.

The check's budget does not count the import: once it is done, the process moves
every deadline in its instructions on by ``T``, and the caller moves its own.

Stages, in order: ``torch`` (import it), ``matmul`` (a small matrix product on each
device checked against the CPU's), ``callable`` (the user's ``module:function``),
then, among several nodes, ``rendezvous`` (every node posts whether its local
stages passed; rank 0 decides and posts a verdict) and ``collective`` (an
all-reduce of ones through a fresh process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import Store

SPEC_ENV = "RALLYPOINT_HEALTH_SPEC"

#: Stages that check this node alone; a failure in one is this node's fault.
LOCAL_STAGES = ("command", "torch", "matmul", "callable")
#: Stages that need the round's other nodes.
GROUP_STAGES = ("rendezvous", "collective")

_POLL = 0.05
_MATMUL_SIZE = 128


@dataclass
class Outcome:
    """One check's verdict as the worker reports it (see ``HealthResult``)."""

    ok: bool
    stage: str = ""
    reason: str = ""
    fault: str = "none"
    peers: list[int] = field(default_factory=list)


class _StageFailed(Exception):
    """A stage failed for a reason already worded for the user."""


class _Reporter:
    def __init__(self, path: str) -> None:
        self._path = path

    def _write(self, record: dict[str, Any]) -> None:
        with open(self._path, "a", encoding="utf-8") as fp:
            fp.write(json.dumps(record) + "\n")
            fp.flush()

    def stage(self, name: str) -> None:
        self._write({"event": "stage", "stage": name})

    def imported(self, seconds: float) -> None:
        self._write({"event": "imported", "seconds": seconds})

    def result(self, outcome: Outcome, summary: str) -> None:
        self._write({"event": "result", "summary": summary, **asdict(outcome)})


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 400:
        first = first[:400] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _matmul(torch: Any, device: str) -> str:
    """Multiply two small integer-valued matrices on each device of ``device``'s kind.

    Small integers make the float32 product exact, so it must match the CPU's
    float64 result to the last digit on a healthy device.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise _StageFailed(f"unknown device {device!r}: {_describe(exc)}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise _StageFailed(
                f"device {device!r} requested but torch.cuda.is_available() is False "
                "(no driver, no visible device, or a CPU-only torch)"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise _StageFailed(f"device {device!r} requested but only {count} CUDA device(s)")
        indices = [dev.index] if dev.index is not None else list(range(count))
        targets = [torch.device("cuda", i) for i in indices]
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        targets = [dev]
    gen = torch.Generator().manual_seed(20240915)
    a = torch.randint(-4, 5, (_MATMUL_SIZE, _MATMUL_SIZE), generator=gen).float()
    b = torch.randint(-4, 5, (_MATMUL_SIZE, _MATMUL_SIZE), generator=gen).float()
    expected = a.double() @ b.double()
    for target in targets:
        try:
            got = (a.to(target) @ b.to(target)).cpu().double()
        except Exception as exc:
            raise _StageFailed(f"matmul on {target} failed: {_describe(exc)}") from None
        if not bool(torch.isfinite(got).all()) or not torch.allclose(
            got, expected, rtol=1e-4, atol=1e-3
        ):
            error = float((got - expected).abs().max())
            raise _StageFailed(
                f"matmul on {target} differs from the CPU result (max error {error:g})"
            )
    names = ", ".join(str(t) for t in targets)
    return f"matmul on {names}"


def _call_user(spec: str) -> str:
    from .function import load_function

    try:
        fn = load_function(spec)
    except BaseException as exc:
        raise _StageFailed(f"cannot load callable {spec}: {_describe(exc)}") from None
    try:
        value = fn()
    except SystemExit as exc:
        raise _StageFailed(f"callable {spec} exited with code {exc.code}") from None
    except BaseException as exc:
        raise _StageFailed(f"callable {spec} raised {_describe(exc)}") from None
    if value is not None and not value:
        raise _StageFailed(f"callable {spec} returned {value!r}")
    return f"callable {spec}"


#: The instructions' wall-clock deadlines, which do not count the import of torch.
_DEADLINES = ("started", "local_deadline", "rendezvous_deadline", "deadline")


def _import_torch(spec: dict[str, Any], report: _Reporter) -> Outcome | None:
    """Import torch (the stage ``torch``) and stop the budget's clock while it ran:
    the deadlines in ``spec`` move on by the time since the process was spawned.
    A failure to import is this node's; None when it worked."""
    report.stage("torch")
    try:
        import torch.distributed  # noqa: F401  (torch with it; the group stages need it)
    except BaseException as exc:
        return Outcome(False, "torch", f"cannot import torch: {_describe(exc)}", "self")
    took = max(0.0, time.time() - spec["spawned"])
    for key in _DEADLINES:
        spec[key] += took
    report.imported(took)
    return None


def _local_stages(spec: dict[str, Any], report: _Reporter, done: list[str]) -> Outcome:
    import torch

    report.stage("matmul")
    try:
        done.append(_matmul(torch, spec["device"]))
    except _StageFailed as exc:
        return Outcome(False, "matmul", str(exc), "self")
    if spec.get("callable"):
        report.stage("callable")
        try:
            done.append(_call_user(spec["callable"]))
        except _StageFailed as exc:
            return Outcome(False, "callable", str(exc), "self")
    overrun = time.time() - spec["local_deadline"]
    if overrun > 0:
        return Outcome(
            False,
            "callable" if spec.get("callable") else "matmul",
            f"timed out after {spec['local_budget']:g} s (the local checks' share of the "
            f"{spec['timeout']:g} s check)",
            "self",
        )
    return Outcome(True)


def _await_port(addr: str, port: int, deadline: float) -> str | None:
    """None once ``addr:port`` accepts a connection; the last error at ``deadline``."""
    last = "no answer"
    while True:
        remaining = deadline - time.time()
        if remaining <= 0:
            return last
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, remaining)):
                return None
        except OSError as exc:
            last = exc.strerror or str(exc)
        time.sleep(min(0.1, max(0.0, deadline - time.time())))


def _wait_for(store: Store, keys: list[str], deadline: float) -> bool:
    while True:
        if store.check(keys):
            return True
        if time.time() >= deadline:
            return False
        time.sleep(_POLL)


def _group_stages(
    spec: dict[str, Any], report: _Reporter, local: Outcome, done: list[str]
) -> Outcome:
    """Meet the round's other nodes, then, if all came and passed, run the collective."""
    return _Group(spec, local).run(report, done)


class _Group:
    """This node's part in the group stages, with the round's variables and deadlines.

    :meth:`run` takes the steps in order: wait for rank 0's port (other ranks),
    open the check's store, post this node's status, decide (rank 0) or await
    (the others) the verdict, then run the collective. Each step that fails says
    whom it blames; this node's own failure, if it has one, outranks that.
    """

    def __init__(self, spec: dict[str, Any], local: Outcome) -> None:
        self.spec = spec
        self.local = local
        self.addr = os.environ["MASTER_ADDR"]
        self.port = int(os.environ["MASTER_PORT"])
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.rdzv_deadline: float = spec["rendezvous_deadline"]
        self.deadline: float = spec["deadline"]
        # The nodes that posted a status; rank 0 keeps the store up until they are done.
        self.present = self.world

    def _rank0_failed(self, reason: str) -> Outcome:
        """Rank 0 (or its store) let this node down: blame it, unless this node failed."""
        return _combine(self.local, Outcome(False, "rendezvous", reason, "peers", [0]))

    def run(self, report: _Reporter, done: list[str]) -> Outcome:
        from torch.distributed import PrefixStore, TCPStore

        report.stage("rendezvous")
        if self.rank != 0:
            refused = self._await_rank0()
            if refused is not None:
                return refused
        addr, port, rank = self.addr, self.port, self.rank
        wait = timedelta(seconds=max(1.0, self.deadline - self.spec["margin"] - time.time()))
        try:
            raw = TCPStore(addr, port, self.world, rank == 0, wait, wait_for_workers=False)
        except Exception as exc:
            return self._unreachable(exc)
        store = PrefixStore(f"rallypoint-health/{os.environ.get('RALLYPOINT_ROUND', '')}/", raw)
        return self._meet(store, report, done)

    def _await_rank0(self) -> Outcome | None:
        # torch's client retries with a growing backoff and may overshoot its
        # timeout by seconds: wait for rank 0's port here, within the budget.
        refused = _await_port(self.addr, self.port, self.rdzv_deadline)
        if refused is None:
            return None
        waited = self.rdzv_deadline - self.spec["started"]
        return self._rank0_failed(
            f"rank 0 did not open the check's store at {self.addr}:{self.port} within "
            f"{waited:.3g} s ({refused})"
        )

    def _unreachable(self, exc: Exception) -> Outcome:
        """The check's store could not be hosted (rank 0) or reached (the others)."""
        if self.rank == 0:
            return Outcome(
                False,
                "rendezvous",
                f"cannot host the check's store on port {self.port}: {_describe(exc)}",
                "group",
            )
        return self._rank0_failed(
            f"cannot connect to rank 0's check store at {self.addr}:{self.port}: {_describe(exc)}"
        )

    def _meet(self, store: Store, report: _Reporter, done: list[str]) -> Outcome:
        """Post this node's status, get the verdict and, if nobody is blamed, run the collective."""
        rank, margin = self.rank, self.spec["margin"]
        try:
            store.set(f"status/{rank}", json.dumps(asdict(self.local)))
            if rank == 0:
                verdict = self._decide(store)
            elif _wait_for(store, ["verdict"], self.deadline - margin):
                verdict = json.loads(store.get("verdict"))
            else:
                waited = self.deadline - self.spec["started"]
                return self._rank0_failed(f"rank 0 posted no verdict within {waited:.3g} s")
            if not self.local.ok:
                return self.local
            blamed = _blame(verdict, rank)
            if blamed is not None:
                return blamed
            report.stage("collective")
            done.append(_collective(self.spec, store, rank, self.world))
            return Outcome(True)
        except _StageFailed as exc:
            return Outcome(False, "collective", str(exc), "group")
        except Exception as exc:
            return self._store_lost(exc)
        finally:
            _finish(store, rank, self.present, self.deadline - margin / 2)

    def _decide(self, store: Store) -> dict[str, Any]:
        """Rank 0: wait for every node's status, then post and return the verdict."""
        world = self.world
        keys = [f"status/{r}" for r in range(world)]
        _wait_for(store, keys, self.rdzv_deadline)
        missing = [r for r in range(world) if not store.check([keys[r]])]
        self.present = world - len(missing)
        failed: dict[str, str] = {}
        for r in range(world):
            if r in missing:
                continue
            status = json.loads(store.get(keys[r]))
            if not status["ok"]:
                failed[str(r)] = f"{status['stage']}: {status['reason']}"
        waited = self.rdzv_deadline - self.spec["started"]
        verdict = {"missing": missing, "failed": failed, "waited": waited}
        store.set("verdict", json.dumps(verdict))
        return verdict

    def _store_lost(self, exc: Exception) -> Outcome:
        """The store broke under us: its host, rank 0, went away."""
        if self.rank == 0:
            return _combine(
                self.local,
                Outcome(
                    False, "rendezvous", f"the check's store failed: {_describe(exc)}", "group"
                ),
            )
        return self._rank0_failed(f"lost rank 0's check store: {_describe(exc)}")


def _combine(local: Outcome, group: Outcome) -> Outcome:
    """This node's own failure, if it has one, outranks what it found out about others."""
    return local if not local.ok else group


def _blame(verdict: dict[str, Any], rank: int) -> Outcome | None:
    missing = [int(r) for r in verdict["missing"]]
    failed = {int(r): why for r, why in verdict["failed"].items()}
    if rank in missing:
        return Outcome(
            False,
            "rendezvous",
            f"joined after rank 0 stopped waiting ({verdict['waited']:.3g} s)",
            "group",
        )
    if not missing and not failed:
        return None
    parts = [f"rank {r} failed its check ({why})" for r, why in sorted(failed.items())]
    parts += [f"rank {r} did not join the check within {verdict['waited']:.3g} s" for r in missing]
    return Outcome(False, "rendezvous", "; ".join(parts), "peers", sorted([*failed, *missing]))


def _collective(spec: dict[str, Any], store: Store, rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    device = torch.device(spec["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    budget = max(1.0, spec["deadline"] - spec["margin"] - time.time())
    try:
        dist.init_process_group(
            backend,
            store=PrefixStore("pg/", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=budget),
        )
    except Exception as exc:
        raise _StageFailed(f"cannot form the {backend} group: {_describe(exc)}") from None
    try:
        tensor = torch.ones(4, device=device)
        dist.all_reduce(tensor)
        values = tensor.cpu()
        if not bool((values == world).all()):
            raise _StageFailed(
                f"all-reduce of ones among {world} nodes gave {values.tolist()}, not {world}"
            )
    except _StageFailed:
        raise
    except Exception as exc:
        raise _StageFailed(f"all-reduce ({backend}) failed: {_describe(exc)}") from None
    finally:
        # The group goes away with this process anyway.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return f"all-reduce among {world} nodes ({backend})"


def _finish(store: Store, rank: int, present: int, deadline: float) -> None:
    """Keep rank 0, the store's host, up until every node that joined is done with it."""
    try:
        count = store.add("done", 1)
        while rank == 0 and count < present and time.time() < deadline:
            time.sleep(_POLL)
            count = store.add("done", 0)
    except Exception:  # the store's host is gone: nothing left to wait for
        pass


def run(spec: dict[str, Any]) -> tuple[Outcome, str]:
    """Run the stages ``spec`` asks for; the outcome and a summary of what passed."""
    report = _Reporter(spec["status_file"])
    done: list[str] = []
    unimportable = _import_torch(spec, report)
    announced = spec.get("local_failure")
    if announced is not None:
        local = Outcome(False, announced["stage"], announced["reason"], "self")
    elif unimportable is not None:
        local = unimportable
    else:
        local = _local_stages(spec, report, done)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Without torch there is no store to tell the peers through: they find this
    # node missing instead.
    if spec["collective"] and world > 1 and unimportable is None:
        outcome = _group_stages(spec, report, local, done)
    else:
        outcome = local
    return outcome, ", ".join(done)


def main() -> None:
    spec = json.loads(os.environ[SPEC_ENV])
    outcome, summary = run(spec)
    _Reporter(spec["status_file"]).result(outcome, summary)
    # No interpreter teardown: a wedged device or communicator could hang it.
    os._exit(0)


if __name__ == "__main__":
    main()
