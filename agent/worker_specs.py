"""What each worker of a round is started with: its environment (torchrun's variables
plus ``RALLYPOINT_ROUND``), its command and where its output goes.

The group-wide round number is exported as ``RALLYPOINT_ROUND``: it is the same on
every worker of a round, unlike torch's ``TORCHELASTIC_RESTART_COUNT``, which counts
this agent's own restarts. A round's logs go under its attempt directory
(``attempt_N/<local rank>/``), where the function API's workers also write their
return values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from .config import LaunchConfig, numa_command_prefix
from .logs import WorkerLogs, console_prefix, worker_logs
from .ranks import Assignment
from .worker.function import RETURN_ENV
from .workers import WorkerLaunch

__all__ = ["ROUND_ENV", "return_files", "round_variables", "worker_env", "worker_launches"]

ROUND_ENV = "RALLYPOINT_ROUND"


def worker_launches(
    config: LaunchConfig,
    argv: Sequence[str],
    a: Assignment,
    *,
    attempt_dir: str,
    restarts: int,
    return_values: bool,
) -> list[WorkerLaunch]:
    """One :class:`WorkerLaunch` per local rank of this agent in the round ``a``.

    Args:
        config: the launch configuration.
        argv: the command every worker runs.
        a: this agent's place in the round.
        attempt_dir: the round's log directory.
        restarts: restarts spent so far (``TORCHELASTIC_RESTART_COUNT``).
        return_values: tell each worker where to write its return value.
    """
    base_env = config.worker_base_env()
    envs: dict[int, dict[str, str]] = {}
    for local_rank in range(config.nproc_per_node):
        env = worker_env(config, a, local_rank, base_env, restarts)
        if return_values:
            env[RETURN_ENV] = _return_file(attempt_dir, local_rank)
        envs[local_rank] = env
    # Sets TORCHELASTIC_ERROR_FILE (torch's LogsSpecs does it when one is given).
    logs = worker_logs(config, attempt_dir, envs)
    return [
        _launch(config, argv, a, env, logs[local_rank], attempt_dir, local_rank)
        for local_rank, env in envs.items()
    ]


def worker_env(
    config: LaunchConfig,
    a: Assignment,
    local_rank: int,
    base_env: Mapping[str, str],
    restarts: int,
) -> dict[str, str]:
    """The environment of local rank ``local_rank`` in round ``a``: ``base_env`` plus
    torchrun's worker variables and ``RALLYPOINT_ROUND``."""
    env = dict(base_env)
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(round_variables(config, a, local_rank, restarts))
    if config.virtual_local_rank:
        # torch's virtual local rank: each worker sees its device as device 0.
        env["CUDA_VISIBLE_DEVICES"] = config.virtual_device(local_rank)
    elif config.bind_gpus:
        env["CUDA_VISIBLE_DEVICES"] = config.visible_devices[local_rank]
    return env


def round_variables(
    config: LaunchConfig, a: Assignment, local_rank: int, restarts: int
) -> dict[str, str]:
    """The worker variables that a round decides (torchrun's, and ``RALLYPOINT_ROUND``):
    what a live worker is handed when it moves to the round ``a``."""
    return {
        # torch's virtual local rank: each worker sees its device as device 0.
        "LOCAL_RANK": "0" if config.virtual_local_rank else str(local_rank),
        "RANK": str(a.base_global_rank + local_rank),
        "GROUP_RANK": str(a.group_rank),
        "ROLE_RANK": str(a.base_role_rank + local_rank),
        "ROLE_NAME": config.role,
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "WORLD_SIZE": str(a.world_size),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_WORLD_SIZE": str(a.role_world_size),
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(a.use_agent_store),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle,
        ROUND_ENV: str(a.round),
    }


def return_files(attempt_dir: str, a: Assignment, nproc: int) -> dict[int, str]:
    """Global rank -> the file each of this agent's workers of round ``a`` was told to
    write its return value to."""
    return {
        a.base_global_rank + local_rank: _return_file(attempt_dir, local_rank)
        for local_rank in range(nproc)
    }


def _return_file(attempt_dir: str, local_rank: int) -> str:
    return os.path.join(attempt_dir, str(local_rank), "return.json")


def _launch(
    config: LaunchConfig,
    argv: Sequence[str],
    a: Assignment,
    env: dict[str, str],
    where: WorkerLogs,
    attempt_dir: str,
    local_rank: int,
) -> WorkerLaunch:
    global_rank = a.base_global_rank + local_rank
    numa: tuple[str, ...] = ()
    if config.numa_options is not None:
        numa = numa_command_prefix(config.numa_options, local_rank)
    return WorkerLaunch(
        local_rank=local_rank,
        global_rank=global_rank,
        argv=[*numa, *argv],
        env=env,
        log_dir=os.path.join(attempt_dir, str(local_rank)),
        error_file=where.error_file,
        redirect=where.redirect,
        tee=where.tee,
        console=where.console,
        prefix=console_prefix(
            config.log_line_prefix_template, config.role, global_rank, local_rank
        ),
        stdout_file=where.stdout_file,
        stderr_file=where.stderr_file,
        duplicate_stdout=where.duplicate_stdout,
        duplicate_stderr=where.duplicate_stderr,
    )
