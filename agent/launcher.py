"""``rallypoint run``: the torchrun-compatible launcher.

Every torchrun flag keeps its meaning (dash and underscore spellings, and the
``PET_<FLAG>`` environment defaults), so ``torchrun ARGS`` becomes
``rallypoint run ARGS``. The differences:

* ``--rdzv-backend c10d``/``etcd`` use rallypoint's rendezvous (faster regrouping,
  dead-peer detection); ``torch-c10d``/``torch-etcd`` select torch's own.
* extra options: ``--stop-grace`` (``--shutdown-timeout`` in seconds with a
  fraction), ``--exit-barrier-timeout``, ``--bind-gpus`` (CUDA_VISIBLE_DEVICES per
  local rank).

Bad input exits with status 2 and one line on stderr; a failed job exits 1 after
printing the failure table. The other deliberate differences are listed in
docs/agent.md, "Differences from torchrun".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar, cast

from ..adapters.config import ETCD_BACKENDS, check_local_addr, check_protocol, split_scheme
from .config import (
    BACKEND_IMPLEMENTATIONS,
    DEFAULT_SIGNALS_TO_HANDLE,
    DEFAULT_STOP_GRACE,
    NUMA_BINDING_MODES,
    START_METHODS,
    ConfigError,
    LaunchConfig,
    RestartScope,
    check_nnodes,
    check_nproc,
    check_rdzv_id,
    parse_std,
)
from .health import HealthCheckConfig, HealthCheckConfigError
from .logs import make_log_root

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = ["PREFIX_TEMPLATE_ENV", "build_parser", "config_from_args", "main", "worker_argv"]

logger = logging.getLogger("rallypoint.agent")

#: Names of environment variables the launcher set for the agent process only.
_AGENT_ONLY_ENV = "RALLYPOINT_AGENT_ONLY_ENV"

#: torchrun reads the console prefix template of teed lines from here.
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"

#: torchrun's ``--master-port`` default (when no port is given at all, a single-node
#: static job runs on c10d on a free port instead).
_DEFAULT_MASTER_PORT = 29500


_T = TypeVar("_T")

#: The signals that stop the launcher before the agent takes over (the agent's own).
_SETUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class _SetupInterrupted(BaseException):
    """A stop signal arrived before the agent started (parsing, connecting).

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the
    way (in torch's imports, say) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise _SetupInterrupted(signum)


@contextlib.contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    """While setting up, a stop signal ends the launcher with 128 + its number and one
    line (no KeyboardInterrupt traceback, and no SIGTERM left pending)."""
    previous: dict[int, Any] = {}
    try:
        for sig in _SETUP_SIGNALS:
            try:
                previous[sig] = signal.signal(sig, _raise_interrupted)
            except ValueError:  # not the main thread: the caller handles signals
                break
        yield
    finally:
        for restored, old in previous.items():
            signal.signal(restored, old)


def _interruptible(call: Callable[[], _T]) -> _T:
    """``call()`` in a helper thread, the main thread waiting on it.

    Store clients block in C++ (TCPStore connects and retries, name resolution)
    where Python cannot run a signal handler until the call returns: 47 to 90 s
    after the signal. Waiting on a thread is interruptible, so the handler runs at
    once; the helper is a daemon and is abandoned with the process.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the main thread as is
            outcome["error"] = exc

    helper = threading.Thread(target=run, name="rallypoint-connect", daemon=True)
    helper.start()
    helper.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


class _InterruptibleRendezvous:
    """torch's handler, its ``next_rendezvous`` run through :func:`_interruptible`.

    torch's handlers open their store inside ``next_rendezvous`` (the static one
    connects to ``--master-addr`` there, retrying for its whole timeout), so the
    agent's signal handler could not run until that C++ call gave up. Everything
    else is the handler's own.
    """

    def __init__(self, handler: Any) -> None:
        self._handler = handler

    def next_rendezvous(self) -> Any:
        return _interruptible(self._handler.next_rendezvous)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


class _UsageError(ConfigError):
    """argparse's complaint about the command line (or a ``PET_*`` default)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


class _EnvDefault(argparse.Action):
    """torchrun's rule: ``PET_<DEST>`` in the environment is the flag's default.

    argparse converts a string default with the flag's ``type`` (so a bad number
    is reported as usual) but never checks it against ``choices``: that is done
    here, naming the variable.
    """

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kw: Any) -> None:
        env_name = f"PET_{dest.upper()}"
        default = os.environ.get(env_name, default)
        choices = kw.get("choices")
        if env_name in os.environ and choices is not None and default not in choices:
            raise _UsageError(
                f"{env_name}={default!r}: expected one of {', '.join(map(str, choices))}"
            )
        if default is not None:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)


_TRUE_WORDS = frozenset({"true", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "no", "off", ""})


def _env_bool(env_name: str, text: str) -> bool:
    # torchrun reads an integer (non-zero is true); the usual words are accepted too.
    word = text.strip().lower()
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    try:
        return int(word) != 0
    except ValueError:
        raise _UsageError(
            f"{env_name}={text!r}: expected 1 or 0 (or true/false, yes/no, on/off)"
        ) from None


class _EnvFlag(argparse.Action):
    """A switch whose default is ``PET_<DEST>`` (torchrun's rule)."""

    def __init__(self, dest: str, default: bool = False, **kw: Any) -> None:
        env_name = f"PET_{dest.upper()}"
        if env_name in os.environ:
            default = _env_bool(env_name, os.environ[env_name])
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, self.const)


def _filter_list(text: str) -> list[str]:
    """torchrun's filter list: comma-separated, ``,,`` stands for a literal comma."""
    marker = "\0"
    return [item.replace(marker, ",") for item in text.replace(",,", marker).split(",")]


#: Adds one flag: its names (each ``--dashed-name`` also as ``--underscored_name``,
#: as torchrun spells them) and ``argparse.add_argument``'s keywords.
_AddFlag = Callable[..., None]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: every torchrun flag, plus rallypoint's few extras."""
    p = _Parser(
        prog="rallypoint run",
        description="Launch an elastic job (torchrun-compatible flags).",
    )

    def opt(*names: str, **kw: Any) -> None:
        spelled = list(names)
        for name in names:
            if name.startswith("--") and "-" in name[2:]:
                spelled.append("--" + name[2:].replace("-", "_"))
        p.add_argument(*spelled, **kw)

    _add_job_flags(opt)
    _add_program_flags(opt)
    _add_output_flags(opt)
    _add_address_flags(opt)
    _add_worker_flags(opt)
    _add_recovery_flags(opt)
    p.add_argument("training_script", help="the script, module or program to run.")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _add_job_flags(opt: _AddFlag) -> None:
    """The job's shape, its rendezvous, and the agent's own loop."""
    env, flag = _EnvDefault, _EnvFlag
    opt("--nnodes", action=env, default="1:1", help="MIN:MAX nodes, or N.")
    opt(
        "--nproc-per-node",
        action=env,
        default="1",
        help="workers per node: N, gpu (CUDA devices), xpu, cpu, auto (the devices of "
        "torch's current accelerator, else CPUs) or a registered accelerator backend.",
    )
    opt("--rdzv-backend", action=env, default="static", help="c10d, etcd, etcd-embedded, ...")
    opt("--rdzv-endpoint", action=env, default="", help="host:port of the backend.")
    opt("--rdzv-id", action=env, default="none", help="the job id all nodes share.")
    opt("--rdzv-conf", action=env, default="", help="k1=v1,k2=v2 backend options.")
    opt("--standalone", action=flag, help="embedded c10d store on a free port (one node).")
    opt("--max-restarts", action=env, type=int, default=0, help="worker group restarts.")
    opt("--monitor-interval", action=env, type=float, default=0.1, help="seconds.")
    opt(
        "--start-method",
        action=env,
        default="spawn",
        choices=list(START_METHODS),
        help="accepted for torchrun compatibility; workers are always fresh processes.",
    )
    opt(
        "--event-log-handler",
        action=env,
        default="null",
        help="torch's event handler for agent and worker events: null, console, ...",
    )
    opt("--role", action=env, default="default", help="worker role name.")


def _add_program_flags(opt: _AddFlag) -> None:
    """How each worker runs the training script."""
    flag = _EnvFlag
    opt("-m", "--module", action=flag, help="run the script as a Python module (python -m).")
    opt("--no-python", action=flag, help="run the script as a program, not with python.")
    opt("--run-path", action=flag, help="run the script with runpy.run_path.")


def _add_output_flags(opt: _AddFlag) -> None:
    """Where the workers' output goes."""
    env = _EnvDefault
    opt("--log-dir", action=env, default=None, help="where per-attempt logs go.")
    opt("-r", "--redirects", action=env, default="0", help="0-3 or 0:1,1:2 (files only).")
    opt("-t", "--tee", action=env, default="0", help="0-3 or 0:1,1:2 (files and console).")
    opt("--local-ranks-filter", action=env, default="", help="local ranks shown on console.")
    opt(
        "--duplicate-stdout-filters",
        action=env,
        type=_filter_list,
        default=[],
        help="also write teed stdout lines containing any of these strings (a,b; ',,' "
        "for a comma) to the attempt's filtered_stdout.log.",
    )
    opt(
        "--duplicate-stderr-filters",
        action=env,
        type=_filter_list,
        default=[],
        help="the same for stderr (filtered_stderr.log).",
    )


def _add_address_flags(opt: _AddFlag) -> None:
    """The static backend's store, and this node's address."""
    env = _EnvDefault
    opt("--node-rank", action=env, type=int, default=0, help="node rank (static backend).")
    opt("--master-addr", action=env, default="127.0.0.1", help="store host (static backend).")
    opt(
        "--master-port",
        action=env,
        type=int,
        default=None,
        help=f"store port (static backend; {_DEFAULT_MASTER_PORT} unless given).",
    )
    opt("--local-addr", action=env, default=None, help="this node's reachable address.")


def _add_worker_flags(opt: _AddFlag) -> None:
    """Where the workers' files go, how they are bound, and how they are stopped."""
    env, flag = _EnvDefault, _EnvFlag
    opt(
        "--logs-specs",
        default=None,
        help="name of a torchrun.logs_specs entry point (a torch LogsSpecs class) "
        "that decides where worker output and error files go.",
    )
    opt(
        "--numa-binding",
        default=None,
        choices=list(NUMA_BINDING_MODES),
        help="bind each worker to the CPUs near the device of its local rank (torch's modes).",
    )
    opt(
        "--signals-to-handle",
        action=env,
        default=DEFAULT_SIGNALS_TO_HANDLE,
        help="signals on which the agent stops its workers and leaves (comma-separated).",
    )
    opt(
        "--shutdown-timeout",
        action=env,
        type=int,
        default=None,
        help="seconds between SIGTERM and SIGKILL when stopping workers "
        f"(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else {DEFAULT_STOP_GRACE:g}).",
    )
    opt(
        "--virtual-local-rank",
        action=flag,
        help="LOCAL_RANK=0 for every worker, each seeing only its own device.",
    )
    opt(
        "--stop-grace",
        action=env,
        type=float,
        default=None,
        help="rallypoint's spelling of --shutdown-timeout (fractions allowed).",
    )
    opt(
        "--exit-barrier-timeout",
        action=env,
        type=float,
        default=300.0,
        help="seconds a finished node waits for the others.",
    )
    opt("--bind-gpus", action=flag, help="CUDA_VISIBLE_DEVICES: one device per local rank.")


def _add_recovery_flags(opt: _AddFlag) -> None:
    """rallypoint's recovery options: a job-wide budget, exclusion, health checks,
    events (docs/agent.md, "Beyond torchrun")."""
    env, flag = _EnvDefault, _EnvFlag
    opt(
        "--restart-scope",
        action=env,
        default="agent",
        choices=[s.value for s in RestartScope],
        help="what --max-restarts counts: each agent's restarts (agent, torchrun's rule) or "
        "the whole job's failure-caused rounds, kept in the rendezvous (job).",
    )
    opt(
        "--health-check",
        action=flag,
        help="before each round's workers start, check this node (a matmul on each "
        "device, an all-reduce among the round's nodes); a node that fails sits out.",
    )
    opt("--health-check-timeout", action=env, type=float, default=60.0, help="seconds.")
    opt(
        "--health-check-command",
        action=env,
        default=None,
        help="a shell command the check also runs (exit 0: healthy); implies --health-check.",
    )
    opt(
        "--health-check-callable",
        action=env,
        default=None,
        help="module:function the check also calls (raising or returning False: "
        "unhealthy); implies --health-check.",
    )
    opt(
        "--exclude-after",
        action=env,
        type=int,
        default=0,
        help="a node whose workers fail this many times within --exclude-window excludes "
        "itself (0: never).",
    )
    opt("--exclude-window", action=env, type=float, default=600.0, help="seconds.")
    opt(
        "--exclusion-rounds",
        action=env,
        type=int,
        default=1,
        help="rounds an excluded node sits out, standing by as a spare.",
    )
    opt("--events-file", action=env, default=None, help="write structured events (JSON lines).")
    opt(
        "--live",
        action=flag,
        help="live regroup: workers that use rallypoint.agent.worker.live keep running across "
        "rounds and are handed the new one; only workers that are gone start again.",
    )
    opt(
        "--live-timeout",
        action=env,
        type=float,
        default=30.0,
        help="seconds a live worker has to take a new round before it is replaced.",
    )
    opt(
        "--progress-timeout",
        action=env,
        type=float,
        default=0.0,
        help="seconds a live worker may go without a step before it counts as failed (0: never).",
    )
    opt(
        "--no-live-spare",
        action=flag,
        help="with --live, keep no warm spare process (torch imported) for a lost worker.",
    )


def _recovery_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`LaunchConfig` fields of :func:`_add_recovery_flags`' flags."""
    return {
        "restart_scope": args.restart_scope,
        "exclusion_rounds": args.exclusion_rounds,
        "exclude_after": args.exclude_after,
        "exclude_window": args.exclude_window,
        "health_check": _health_check(args),
        "events_file": args.events_file,
        "live": args.live,
        "live_timeout": args.live_timeout,
        "progress_timeout": args.progress_timeout,
        "live_spare": not args.no_live_spare,
    }


def _health_check(args: argparse.Namespace) -> HealthCheckConfig:
    command, call = args.health_check_command, args.health_check_callable
    try:
        return HealthCheckConfig(
            enabled=bool(args.health_check or command or call),
            timeout=args.health_check_timeout,
            command=command,
            callable=call,
        )
    except HealthCheckConfigError as exc:
        raise ConfigError(f"--health-check: {exc}") from None


def _parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX``, checked (also under ``--standalone``, which
    then runs one node)."""
    try:
        if ":" in text:
            low, high = text.split(":", 1)
            nodes = int(low), int(high)
        else:
            nodes = int(text), int(text)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    check_nnodes(*nodes)
    return nodes


def _cuda_devices() -> tuple[str, ...]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible is not None and visible.strip():
        return tuple(v.strip() for v in visible.split(",") if v.strip())[:count]
    return tuple(str(i) for i in range(count))


def _cpu_count() -> int:
    # torch counts the CPUs this process may run on (taskset, cgroups), not all.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _parse_nproc(text: str) -> int:
    """torchrun's ``--nproc-per-node``: N, cpu, gpu, xpu, auto or the name of the
    registered out-of-tree (privateuse1) accelerator backend."""
    try:
        return int(text)
    except ValueError:
        pass
    if text == "cpu":
        return _cpu_count()
    import torch

    if text == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible")
        return int(torch.cuda.device_count())
    if text == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise ConfigError("--nproc-per-node xpu: no XPU device is visible")
        return int(xpu.device_count())
    if text == "auto":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            return int(accelerator.device_count())
        if accelerator is None and torch.cuda.is_available():  # torch before 2.6
            return int(torch.cuda.device_count())
        return _cpu_count()
    custom = torch._C._get_privateuse1_backend_name()
    if text == custom:
        module = getattr(torch, custom, None)
        available = getattr(module, "is_available", None)
        count = getattr(module, "device_count", None)
        if available is None or count is None:
            raise ConfigError(
                f"--nproc-per-node {text}: no device module is registered for the "
                f"{text} backend (torch._register_device_module)"
            )
        if not available():
            raise ConfigError(f"--nproc-per-node {text}: no {text} device is visible")
        return int(count())
    raise ConfigError(
        f"--nproc-per-node {text!r}: expected N, gpu, xpu, cpu, auto or the name of a "
        "registered accelerator backend"
    )


def _parse_rdzv_conf(text: str) -> dict[str, str]:
    unquoted = text.strip()
    if len(unquoted) >= 2 and unquoted[0] == unquoted[-1] and unquoted[0] in "'\"":
        # Shell quotes kept in an argument list (torch's own launcher tests pass
        # "--rdzv-conf='join_timeout=5,...'"): no key starts with a quote.
        logger.warning("--rdzv-conf %s: reading it without its quotes", text)
        text = unquoted[1:-1]
    result: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--rdzv-conf {text!r}: expected key=value pairs, got {item!r}")
        result[key.strip()] = value.strip()
    return result


def _split_etcd_scheme(
    backend: str, endpoint: str, rdzv_conf: dict[str, str]
) -> tuple[str, dict[str, str]]:
    """``https://HOST:PORT`` for rallypoint's etcd backends -> (``HOST:PORT``, the
    options with ``protocol=https``): the scheme is how torch's etcd users name TLS
    (:func:`rallypoint.adapters.config.split_scheme`, which the handler applies
    to torchrun's parameters)."""
    if backend not in ETCD_BACKENDS:
        return endpoint, rdzv_conf
    scheme, members = split_scheme(endpoint, "--rdzv-endpoint")
    if scheme is None:
        return endpoint, rdzv_conf
    given = rdzv_conf.get("protocol")
    check_protocol(given, scheme, option="--rdzv-conf", endpoint_option="--rdzv-endpoint")
    return members, {**rdzv_conf, "protocol": scheme}


def _check_entrypoint(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.no_python and args.module:
        raise ConfigError("--no-python and --module cannot be used together")
    if args.no_python:
        if not (os.path.isfile(script) or shutil.which(script)):
            raise ConfigError(f"program {script!r} not found")
    elif args.module:
        try:
            found = importlib.util.find_spec(script.split(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"module {script!r} not found on the Python path")
    elif not os.path.exists(script):
        raise ConfigError(f"training script {script!r} not found")
    else:
        problem = _unreadable_script(script)
        if problem is not None:
            raise ConfigError(f"training script {script!r} cannot be read: {problem}")


def _unreadable_script(path: str) -> str | None:
    """Why the workers' ``python PATH`` (or ``runpy.run_path``) could not read the
    script (None: it can); otherwise every worker fails at once and the restarts
    are spent on a typo."""
    if os.path.isdir(path):
        # Python runs a directory's __main__.py, as it runs a zip file's.
        if os.path.isfile(os.path.join(path, "__main__.py")):
            path = os.path.join(path, "__main__.py")
        else:
            return "it is a directory without a __main__.py"
    if not os.access(path, os.R_OK):
        return "permission denied"
    return None


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command each worker runs, as torchrun builds it (``PYTHON_EXEC``, when
    set, is the interpreter, as in torchrun)."""
    script, rest = args.training_script, list(args.training_script_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    if args.no_python:
        return [script, *rest]
    if args.module:
        return [python, "-u", "-m", script, *rest]
    if args.run_path:
        # In this interpreter, as torchrun runs it (a function; PYTHON_EXEC is not
        # used), and ended as function workers end (see agent/worker/function.py).
        code = (
            "import sys; from rallypoint.agent.worker.function import run_path; "
            "run_path(sys.argv[1], sys.argv[2:])"
        )
        return [sys.executable, "-u", "-c", code, os.path.abspath(script), *rest]
    return [python, "-u", script, *rest]


def _load_logs_specs(args: argparse.Namespace, ranks: frozenset[int] | None) -> Any:
    """torchrun's ``--logs-specs NAME``: the ``torchrun.logs_specs`` entry point NAME,
    a torch ``LogsSpecs`` class, built with the log options as torchrun builds it."""
    from importlib import metadata

    from torch.distributed.elastic.multiprocessing import Std as TorchStd

    group = metadata.entry_points(group="torchrun.logs_specs")
    found = [ep for ep in group if ep.name == args.logs_specs]
    if not found:
        known = ", ".join(sorted({ep.name for ep in group})) or "none is installed"
        raise ConfigError(
            f"--logs-specs {args.logs_specs!r}: no such torchrun.logs_specs entry point "
            f"(registered: {known})"
        )
    try:
        cls = found[0].load()
        return cls(
            log_dir=args.log_dir,
            redirects=TorchStd.from_str(args.redirects),
            tee=TorchStd.from_str(args.tee),
            local_ranks_filter=set(ranks) if ranks is not None else None,
        )
    except Exception as exc:
        raise ConfigError(
            f"--logs-specs {args.logs_specs!r}: cannot build it: {type(exc).__name__}: {exc}"
        ) from None


def _numa_options(mode: str | None) -> Any:
    if mode is None:
        return None
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(mode))


def _shutdown_timeout(args: argparse.Namespace) -> float | None:
    """``--shutdown-timeout`` or rallypoint's ``--stop-grace`` (either wins over
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``)."""
    timeout, grace = args.shutdown_timeout, args.stop_grace
    if timeout is not None and grace is not None and float(timeout) != grace:
        raise ConfigError(
            f"--shutdown-timeout {timeout} and --stop-grace {grace:g} disagree; give one of them"
        )
    return float(timeout) if timeout is not None else grace


class _Rendezvous(NamedTuple):
    """The rendezvous flags, as the agent uses them."""

    backend: str
    endpoint: str
    run_id: str
    configs: dict[str, str]
    standalone: bool


def _rendezvous_flags(args: argparse.Namespace, max_nodes: int) -> _Rendezvous:
    """``--rdzv-*`` and ``--standalone``: a standalone agent runs c10d under a fresh
    run id; an etcd endpoint's scheme becomes the ``protocol`` option. The
    backend and the endpoint are checked by :class:`LaunchConfig`."""
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    standalone = args.standalone or _standalone_by_default(args, max_nodes)
    if standalone:
        backend, endpoint, run_id = "c10d", "", str(uuid.uuid4())
    configs = _parse_rdzv_conf(args.rdzv_conf)
    endpoint, configs = _split_etcd_scheme(backend, endpoint, configs)
    return _Rendezvous(backend, endpoint, run_id, configs, standalone)


def _standalone_by_default(args: argparse.Namespace, max_nodes: int) -> bool:
    """torchrun (2.13) runs a single-node static job without a given port on c10d
    on a free port, as ``--standalone`` does, rather than on port 29500."""
    if args.rdzv_backend != "static" or args.rdzv_endpoint or args.master_port is not None:
        return False
    if max_nodes != 1:
        return False
    # Its run id is a fresh one; a malformed --rdzv-id is still a mistake worth reporting.
    if args.rdzv_id not in ("none", ""):
        check_rdzv_id(args.rdzv_id)
    return True


def _worker_env(nproc: int) -> dict[str, str]:
    """What every worker's environment gets on top of the agent's (torchrun's rule);
    :func:`_announce_worker_env` says so once the whole command line is accepted."""
    if "OMP_NUM_THREADS" in os.environ or nproc <= 1:
        return {}
    return {"OMP_NUM_THREADS": "1"}


def _announce_worker_env(config: LaunchConfig) -> None:
    # torchrun's notice; after validation, so that a usage error stays one line.
    if "OMP_NUM_THREADS" in config.env:
        print(
            "rallypoint: setting OMP_NUM_THREADS=1 for each worker to avoid overloading "
            "the system; set it yourself to tune performance.",
            file=sys.stderr,
        )


def _ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(rank) for rank in text.split(","))
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {text!r}: expected e.g. 0,1") from None


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validate parsed flags into a :class:`LaunchConfig`.

    Raises:
        ConfigError: any invalid value, with a one-line message.
    """
    min_nodes, max_nodes = _parse_nnodes(args.nnodes)
    nproc = _parse_nproc(str(args.nproc_per_node))
    check_nproc(nproc)  # before the per-rank tables below are built from it
    _check_entrypoint(args)
    rdzv = _rendezvous_flags(args, max_nodes)
    if rdzv.standalone:
        if max_nodes != 1:
            logger.warning("--standalone runs a single node: using --nnodes 1")
        min_nodes = max_nodes = 1
    env = _worker_env(nproc)
    ranks_filter = _ranks_filter(args.local_ranks_filter)
    devices = _cuda_devices() if args.bind_gpus else ()
    shutdown_timeout = _shutdown_timeout(args)
    logs_specs = _load_logs_specs(args, ranks_filter) if args.logs_specs else None
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=rdzv.run_id,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=rdzv.configs,
        role=args.role,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        stop_grace=args.stop_grace if args.stop_grace is not None else DEFAULT_STOP_GRACE,
        shutdown_timeout=shutdown_timeout,
        exit_barrier_timeout=args.exit_barrier_timeout,
        log_dir=args.log_dir,
        redirects=parse_std(args.redirects, nproc, "--redirects"),
        tee=parse_std(args.tee, nproc, "--tee"),
        local_ranks_filter=ranks_filter,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port if args.master_port is not None else _DEFAULT_MASTER_PORT,
        local_addr=args.local_addr,
        bind_gpus=args.bind_gpus,
        visible_devices=devices,
        env=env,
        standalone=rdzv.standalone,
        start_method=args.start_method,
        log_line_prefix_template=os.environ.get(PREFIX_TEMPLATE_ENV),
        event_log_handler=args.event_log_handler,
        numa_options=_numa_options(args.numa_binding),
        signals_to_handle=args.signals_to_handle,
        duplicate_stdout_filters=args.duplicate_stdout_filters,
        duplicate_stderr_filters=args.duplicate_stderr_filters,
        virtual_local_rank=args.virtual_local_rank,
        logs_specs=logs_specs,
        **_recovery_options(args),
    )
    config.rendezvous_endpoint()  # a missing endpoint fails now, before torch loads
    return config


def _setup_logging() -> None:
    """rallypoint's log lines go to stderr at ``LOGLEVEL`` (default INFO).

    Raises:
        ConfigError: ``LOGLEVEL`` is no level name. torch's elastic modules set their
            loggers to it as it is, so a name logging does not know (also a lower-case
            one) would end the launcher in a ValueError as soon as torch loads.
    """
    level = os.environ.get("LOGLEVEL", "INFO")
    # getLevelName maps a known name to its number (logging's own lookup in setLevel).
    if not isinstance(logging.getLevelName(level), int):
        raise ConfigError(
            f"LOGLEVEL={level!r}: expected one of CRITICAL, ERROR, WARNING, INFO, DEBUG "
            "(in capitals)"
        )
    root = logging.getLogger("rallypoint")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[rallypoint %(levelname)s] %(message)s"))
        root.addHandler(handler)
    root.setLevel(level)


def _quiet_agent_cpp_logs() -> None:
    # Store waits that time out by design (the monitor loop's change waits, the exit
    # barrier) make torch's C++ store client log a warning each time. Silence them
    # in the agent only (read once, when torch loads); workers get the user's setting.
    if "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        os.environ[_AGENT_ONLY_ENV] = "TORCH_CPP_LOG_LEVEL"


def check_run_extra(rdzv_backend: str) -> None:
    """ConfigError naming the extra ``run`` when what it installs is missing: torch
    (the core and the spec install without it), and the etcd client for
    rallypoint's etcd backends."""
    missing = [] if importlib.util.find_spec("torch") else ["torch"]
    if rdzv_backend in ETCD_BACKENDS and not importlib.util.find_spec("pyetcd"):
        missing.append("the etcd client (etcd-sdk-python)")
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)} not installed: 'rallypoint run' needs the extra"
            " 'run': pip install 'rallypoint[run]'"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rallypoint run`` with ``argv``; return the process exit status."""
    _quiet_agent_cpp_logs()
    log_root: str | None = None
    try:
        with _stop_signals_interrupt():
            _setup_logging()
            # Parsing and validation import torch only to count GPUs, so that bad
            # input is reported at once rather than after torch's 2-5 s import.
            args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
            check_run_extra(args.rdzv_backend)
            config = config_from_args(args)
            # A store host that does not exist fails now too, before torch loads.
            _interruptible(config.check_endpoint_resolves)
            log_root = make_log_root(config.log_dir, config.run_id)
            from .agent import AgentState, ElasticAgent
            from .errors import format_failures
            from .rendezvous import build_handler

            if config.local_addr:
                # torch's backends would also serve (and wait for) the workers' store there.
                check_local_addr(config.local_addr)
            handler = _interruptible(lambda: build_handler(config))
            if BACKEND_IMPLEMENTATIONS[config.rdzv_backend] == "torch":
                # A proxy: every attribute but next_rendezvous is the handler's own.
                handler = cast("RendezvousHandler", _InterruptibleRendezvous(handler))
            _announce_worker_env(config)
    except _SetupInterrupted as stop:
        _remove_empty(log_root)
        print(f"rallypoint run: stopped by {stop} before the job started", file=sys.stderr)
        return 128 + stop.signum
    except ConfigError as exc:  # also argparse's complaints (_UsageError)
        _remove_empty(log_root)
        print(f"rallypoint run: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the backend could not be reached or set up
        _remove_empty(log_root)
        print(f"rallypoint run: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    from ._reaper import become_subreaper
    from .api import record_end

    become_subreaper()  # orphaned helpers of the workers come back here (agent/workers.py)
    agent = ElasticAgent(config, worker_argv(args), handler, log_root=log_root)
    try:
        result = agent.run()
    except OSError as exc:
        record_end(agent, None)
        print(f"rallypoint run: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        record_end(agent, None)
        print(f"rallypoint run: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    record_end(agent, result)
    if result.state is AgentState.FAILED:
        print(format_failures(args.training_script, result.failures), file=sys.stderr)
        print(f"rallypoint run: {result.message}; logs in {agent.log_root}", file=sys.stderr)
    elif result.state is not AgentState.SUCCEEDED or result.message:
        print(f"rallypoint run: {result.message}", file=sys.stderr)
    return result.exit_code


def _remove_empty(log_root: str | None) -> None:
    # A run that never started leaves no empty log directory behind.
    if log_root is not None:
        with contextlib.suppress(OSError):
            os.rmdir(log_root)
