"""How the agents of a round agree on ranks, the round number and the master address.

After a rendezvous each agent knows its group rank and the number of agents, but not
the others' worker counts and roles. Through the round's store every agent publishes
its own; group rank 0 computes every agent's base ranks (in group-rank order), picks
the master, and publishes the result, which each agent reads back as its
:class:`Assignment`. Without a handler-provided round number, rank 0 also picks the
round as one past the largest round any participant has seen, so all agree on it.

A peer that dies during the exchange would leave the others blocked in
``store.get``; :func:`wait_for_key` gives up instead (:class:`RoundAbandoned`), and
the agent joins the next round.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Hashable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from .config import BACKEND_IMPLEMENTATIONS, LaunchConfig

__all__ = [
    "KEY_PREFIX",
    "Assignment",
    "RoundAbandoned",
    "agree_ranks",
    "assign_ranks",
    "choose_master",
    "wait_for_key",
]

#: Where the agents' keys live in a round's store.
KEY_PREFIX = "rallypoint/agent"
#: How long an agent waits for a peer's key before it gives the round up.
_STORE_GET_TIMEOUT = 300.0

#: (address, port, whether the workers use the agent's store)
Master = tuple[str, int, bool]


class RoundAbandoned(Exception):
    """The round's store exchange cannot finish: a peer died or the store failed."""


@dataclass(frozen=True)
class Assignment:
    """This agent's place in one round, agreed through the round's store."""

    round: int
    group_rank: int
    group_world_size: int
    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int
    master_addr: str
    master_port: int
    use_agent_store: bool


def agree_ranks(
    store: Store,
    group_rank: int,
    group_world_size: int,
    *,
    role: str,
    nproc: int,
    last_round: int,
    round_hint: int | None,
    choose_master: Callable[[], Master],
    dead_peers: Callable[[], Set[Hashable]],
) -> Assignment:
    """Agree with the round's other agents on this agent's :class:`Assignment`.

    Args:
        store: the round's store.
        group_rank, group_world_size: this agent's place in the rendezvous.
        role, nproc: this agent's role and worker count.
        last_round: the last round this agent took part in (-1: none).
        round_hint: the round number the handler reports, or None (then rank 0 picks
            one past the largest ``last_round`` of all agents).
        choose_master: called by group rank 0 only.
        dead_peers: the participants of the round presumed dead (see
            :func:`wait_for_key`).

    Raises:
        RoundAbandoned: a peer left, the store failed, or a key never appeared.
    """
    prefix = f"{KEY_PREFIX}/{round_hint if round_hint is not None else 'r'}"
    mine = {"role": role, "nproc": nproc, "seen": last_round}
    store.set(f"{prefix}/info/{group_rank}", json.dumps(mine))
    if group_rank == 0:
        infos = [
            json.loads(wait_for_key(store, f"{prefix}/info/{rank}", dead_peers))
            for rank in range(group_world_size)
        ]
        number = round_hint if round_hint is not None else max(int(i["seen"]) for i in infos) + 1
        for rank, assigned in enumerate(assign_ranks(infos, number, choose_master())):
            store.set(f"{prefix}/assigned/{rank}", json.dumps(assigned))
    got = json.loads(wait_for_key(store, f"{prefix}/assigned/{group_rank}", dead_peers))
    return Assignment(
        round=int(got["round"]),
        group_rank=group_rank,
        group_world_size=group_world_size,
        base_global_rank=int(got["base"]),
        world_size=int(got["world"]),
        base_role_rank=int(got["role_base"]),
        role_world_size=int(got["role_world"]),
        master_addr=str(got["master_addr"]),
        master_port=int(got["master_port"]),
        use_agent_store=bool(got["agent_store"]),
    )


def assign_ranks(
    infos: Sequence[Mapping[str, Any]], round_number: int, master: Master
) -> list[dict[str, Any]]:
    """What group rank 0 publishes for each agent (pure): ``infos[i]`` is agent ``i``'s
    ``{"role", "nproc"}``; global and role ranks follow the group ranks."""
    master_addr, master_port, agent_store = master
    world = sum(int(i["nproc"]) for i in infos)
    role_sizes: dict[str, int] = {}
    for i in infos:
        role_sizes[i["role"]] = role_sizes.get(i["role"], 0) + int(i["nproc"])
    base, role_base = 0, dict.fromkeys(role_sizes, 0)
    assigned = []
    for i in infos:
        assigned.append(
            {
                "round": round_number,
                "base": base,
                "world": world,
                "role_base": role_base[i["role"]],
                "role_world": role_sizes[i["role"]],
                "master_addr": master_addr,
                "master_port": master_port,
                "agent_store": agent_store,
            }
        )
        base += int(i["nproc"])
        role_base[i["role"]] += int(i["nproc"])
    return assigned


def wait_for_key(store: Store, key: str, dead_peers: Callable[[], Set[Hashable]]) -> bytes:
    """``store.get`` that gives up when a peer dies instead of blocking for minutes.

    Raises:
        RoundAbandoned: a peer left the round or stopped heartbeating, the store
            failed, or the key did not appear in time.
    """
    deadline = time.monotonic() + _STORE_GET_TIMEOUT
    pause = 0.002
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise RoundAbandoned(f"no {key!r} in the store after {_STORE_GET_TIMEOUT} s")
            dead = dead_peers()
            if dead:
                names = ", ".join(sorted(map(str, dead)))
                raise RoundAbandoned(
                    f"peer(s) {names} left the round or stopped heartbeating "
                    "while ranks were assigned"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return bytes(store.get(key))
    except (RuntimeError, ValueError) as exc:  # torch's store errors are RuntimeErrors
        raise RoundAbandoned(f"the round's store failed: {exc}") from exc


def choose_master(config: LaunchConfig, handler: RendezvousHandler, info: RendezvousInfo) -> Master:
    """The master address and port of the round's workers, and whether they use the
    agent's store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    if BACKEND_IMPLEMENTATIONS.get(config.rdzv_backend) == "torch":
        # torch's handlers decide, as under torchrun: the static one hosts its store
        # at the master address for the whole job; the c10d one shares the rank-0
        # agent's store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and the etcd-v1
        # one never does: then a free port is published for rank 0's first worker
        # to host.
        bootstrap = info.bootstrap_store_info
        if bootstrap is not None:
            shared = bool(handler.use_agent_store)
            return str(bootstrap.master_addr), int(bootstrap.master_port), shared
        if config.is_static:
            return config.master_addr, config.master_port, True
    # rallypoint's rendezvous: rank 0's first worker hosts a fresh store each
    # round (torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 behaviour), so nothing
    # from an earlier round (or from agents with a different restart count) leaks in.
    addr = config.local_addr or ("127.0.0.1" if config.standalone else socket.getfqdn())
    return addr, _free_port(addr), False


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])
