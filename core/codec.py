"""The wire form of :class:`RendezvousState`: versioned JSON, validated on decode.

Plain data only (docs/design.md, decision 3): the backend is shared by every node and anyone who
can write to it; decoding it must never execute code, and anything malformed must
raise :class:`RendezvousStateError` with a message that says what is wrong.

Format, version 4 (keys are short because the state is rewritten often)::

    {"v": 4, "round": 0, "complete": false, "closed": false, "world": 0,
     "p": [[addr, pid, local_id, rank], ...],     # participants
     "w": [[addr, pid, local_id], ...],           # wait list
     "r": [[addr, pid, local_id], ...],           # redundancy list
     "hb": [[addr, pid, local_id, counter], ...], # heartbeat counters
     "lc": null | arming, "lcs": arming_seq,
     "lr": [[addr, pid, local_id, rank], ...],    # last ranks (stable-ranks option)
     "hs": heartbeat_seq,
     "ph": phase, "ic": intent_cursor,                # version 2 added these two
     "rs": restarts, "ct": charged_through,          # version 3 added these three
     "x": [[addr, pid, local_id, until], ...],       # excluded nodes
     "rt": [[addr, pid, local_id], ...],             # returning nodes (version 4
     "rg": regroup}                                  # added these two)

Decoding checks more than the format: a state that breaks a safety property, or
that no node could make progress from (a member without a heartbeat entry, so
nobody can tell whether it is alive; a complete round nobody is in), is rejected
as well, so that a bad write surfaces as an error at once instead of stalling every
node until its join timeout. Given the node's :class:`Settings`, the checks that
depend on min/max nodes run too.

The version is the integer 4: ``4.0`` or ``true`` is another format. Two things
that look odd are accepted because the protocol writes them:

* a returning node that is neither a member nor beating (``rt`` lists it, ``hb``
  does not): every participant that leaves a complete round to join the next one
  is that until its join lands. If it never lands (the node died in between),
  nobody can declare it dead, having no counter to watch, and none needs to: it
  only keeps the round from completing at quorum at once (``everyone_back``), so
  the round waits out its last call, as one that may still see a newcomer does,
  and a completion forgets it. It never becomes a participant, holds no rank
  and blocks no join.
* ``rg`` true in a complete round of any number, round 0 included: a completion
  sets it, meaning "the next open round is a regroup of this one". What is
  refused is the regroup mark, or a returning node, in round 0 before it
  completed: no node writes that, and the mark would let round 0 complete at
  quorum without its last call.

The size of a state's encoding is also kept incrementally across writes
(:class:`EncodedSize`, from the same layout), for executors and simulations that
count bytes without encoding every state they see.

The settings the state's validity depends on are published once per run beside
it (:func:`encode_shared_settings`); :func:`shared_settings_differences` compares
a node's own with them, so nodes started with different node counts are told so
instead of failing on a state that is valid only for some of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from immutables import Map

from .errors import RendezvousStateError
from .state import NodeDesc, RendezvousState, Settings

__all__ = [
    "FORMAT_VERSION",
    "MAX_STATE_BYTES",
    "SHARED_SETTINGS",
    "EncodedSize",
    "decode_state",
    "encode_shared_settings",
    "encode_state",
    "shared_settings_differences",
]

FORMAT_VERSION = 4
#: Larger input is rejected before parsing (about 100k nodes' worth of state). The
#: backends hold less (a TCPStore value 8 MiB, an etcd request 1.5 MiB by default):
#: the adapters check a write against the smaller of the two.
MAX_STATE_BYTES = 16 * 1024 * 1024
_MAX_ADDR_LEN = 1024
_KEYS = frozenset(
    {"v", "round", "complete", "closed", "world", "p", "w", "r", "hb", "lc", "lcs", "lr", "hs"}
    | {"ph", "ic"}
    | {"rs", "ct", "x"}
    | {"rt", "rg"}
)


_SEPARATORS = (",", ":")
#: The state's node collections as the format lists them: (key, the state's field,
#: whether an entry holds a value after the node: a rank, a counter).
_COLLECTIONS: tuple[tuple[str, str, bool], ...] = (
    ("p", "participants", True),
    ("w", "wait_list", False),
    ("r", "redundancy_list", False),
    ("hb", "heartbeats", True),
    ("lr", "last_ranks", True),
    ("x", "excluded", True),
    ("rt", "returning", False),
)


def _entry(node: NodeDesc, *value: int) -> list[Any]:
    """A node's entry in a collection: address, pid, local id, then its value."""
    return [node.addr, node.pid, node.local_id, *value]


def _listed(state: RendezvousState, field: str, valued: bool) -> list[list[Any]]:
    """The entries of one collection of ``state``, in node order."""
    members = getattr(state, field)
    if valued:
        return [_entry(n, v) for n, v in sorted(members.items())]
    return [_entry(n) for n in sorted(members)]


def encode_state(state: RendezvousState) -> bytes:
    """The canonical bytes of ``state`` (equal states give equal bytes)."""
    lists = {key: _listed(state, field, valued) for key, field, valued in _COLLECTIONS}
    doc = {
        "v": FORMAT_VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "world": state.world_size,
        "p": lists["p"],
        "w": lists["w"],
        "r": lists["r"],
        "hb": lists["hb"],
        "lc": state.last_call,
        "lcs": state.last_call_seq,
        "lr": lists["lr"],
        "hs": state.heartbeat_seq,
        "ph": state.phase,
        "ic": state.intent_cursor,
        "rs": state.restarts,
        "ct": state.charged_through,
        "x": lists["x"],
        "rt": lists["rt"],
        "rg": state.regroup,
    }
    return json.dumps(doc, separators=_SEPARATORS, ensure_ascii=True).encode("ascii")


# -- the encoded size, kept incrementally --------------------------------------------


def _entry_size(node: NodeDesc, *value: int) -> int:
    return len(json.dumps(_entry(node, *value), separators=_SEPARATORS, ensure_ascii=True))


def _size_in(members: Any, valued: bool, node: NodeDesc) -> int | None:
    """The size of ``node``'s entry in a collection, None if it has none."""
    if not valued:
        return _entry_size(node) if node in members else None
    value = members.get(node)
    return None if value is None else _entry_size(node, value)


#: The state's fields outside the collections: the size of the state with its
#: collections empty depends on them only.
_SCALARS = tuple(
    f.name for f in fields(RendezvousState) if f.name not in {c[1] for c in _COLLECTIONS}
)
_EMPTIED: dict[str, object] = {
    field: Map() if valued else frozenset() for _, field, valued in _COLLECTIONS
}


#: The collections a completion or a new round may change for nodes the write
#: did not touch.
_RECOUNTED = frozenset({"p", "lr", "x", "rt", "w", "r"})


class EncodedSize:
    """``len(encode_state(state))``, kept incrementally across writes.

    :func:`encode_state` writes each collection as a JSON list of per-node
    entries; the size of a state is the size of the state with empty collections
    plus, per non-empty collection, the sizes of its entries and the commas
    between them. A write changes the entries of the nodes it touched (the writer,
    the nodes its sanitize removed and the nodes it admitted), except when ranks
    are assigned or the round advances, when the participants (and the exclusions
    a new round ends, the returning nodes a completion forgets and the waiting
    nodes it moves to the redundancy list) are counted again, and the returning
    nodes when a newcomer ends a regroup.
    """

    def __init__(self, state: RendezvousState) -> None:
        self._state = state
        #: per collection key: (the sizes of its entries summed, their count)
        self._parts = {key: _full(state, field, valued) for key, field, valued in _COLLECTIONS}
        self._base_key: tuple[object, ...] | None = None
        self._base = 0
        self.value = self._total(state)

    def update(self, new: RendezvousState, touched: Iterable[NodeDesc]) -> int:
        """The size of ``new``, a state written over the previous one by a step
        that touched only ``touched`` (plus what ranking or a new round changes)."""
        old = self._state
        touched = tuple(dict.fromkeys(touched))  # a node may be named twice
        rerank = old.complete != new.complete or old.round != new.round
        for key, field, valued in _COLLECTIONS:
            before, after = getattr(old, field), getattr(new, field)
            if before is after:
                continue
            if (rerank and key in _RECOUNTED) or (key == "rt" and old.regroup != new.regroup):
                self._parts[key] = _full(new, field, valued)
                continue
            total, count = self._parts[key]
            for node in touched:
                was, now = _size_in(before, valued, node), _size_in(after, valued, node)
                if was is not None:
                    total, count = total - was, count - 1
                if now is not None:
                    total, count = total + now, count + 1
            self._parts[key] = (total, count)
        self._state = new
        self.value = self._total(new)
        return self.value

    def _total(self, state: RendezvousState) -> int:
        # Encode the state with empty collections again only when one of the
        # fields its size depends on changed.
        key = tuple(getattr(state, name) for name in _SCALARS)
        if key != self._base_key:
            self._base_key = key
            self._base = len(encode_state(state.evolve(**_EMPTIED)))
        size = self._base
        for total, count in self._parts.values():
            if count:
                size += total + count - 1
        return size


def _full(state: RendezvousState, field: str, valued: bool) -> tuple[int, int]:
    """The sizes of the entries of one collection, summed, and their count."""
    members = getattr(state, field)
    if valued:
        sizes = [_entry_size(n, v) for n, v in members.items()]
    else:
        sizes = [_entry_size(n) for n in members]
    return sum(sizes), len(sizes)


def _json_object(data: bytes, fail: Callable[[str], RendezvousStateError]) -> dict[str, Any]:
    """The JSON object ``data`` holds; ``fail`` makes the error for anything else."""
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(f"not valid JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(doc, dict):
        raise fail("the top level must be an object")
    return doc


def _fail(what: str) -> RendezvousStateError:
    return RendezvousStateError(f"corrupt rendezvous state: {what}")


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"{what} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise _fail(f"{what} must be >= {minimum}, got {value}")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(f"{what} must be true or false, got {type(value).__name__}")
    return value


def _node(entry: Any, what: str, extra: int) -> tuple[NodeDesc, list[Any]]:
    if not isinstance(entry, list) or len(entry) != 3 + extra:
        raise _fail(f"each entry of {what} must be a list of {3 + extra} values")
    addr, pid, local_id = entry[:3]
    if not isinstance(addr, str) or not addr or len(addr) > _MAX_ADDR_LEN:
        raise _fail(f"a node address in {what} must be a non-empty string of <= {_MAX_ADDR_LEN}")
    node = NodeDesc(addr, _int(pid, f"a pid in {what}"), _int(local_id, f"a local id in {what}"))
    return node, entry[3:]


def _valid_node(entry: Any, size: int) -> bool:
    """The fast check of one entry (the common case); :func:`_node` says what is
    wrong with one that fails it. ``type(x) is int`` rejects bools too."""
    if type(entry) is not list or len(entry) != size:
        return False
    addr, pid, local_id = entry[0], entry[1], entry[2]
    return (
        type(addr) is str
        and 0 < len(addr) <= _MAX_ADDR_LEN
        and type(pid) is int
        and pid >= 0
        and type(local_id) is int
        and local_id >= 0
    )


def _node_map(doc: dict[str, Any], key: str, what: str) -> dict[NodeDesc, int]:
    entries = doc[key]
    if not isinstance(entries, list):
        raise _fail(f"{what} must be a list")
    result: dict[NodeDesc, int] = {}
    for entry in entries:
        if _valid_node(entry, 4) and type(entry[3]) is int and entry[3] >= 0:
            node = NodeDesc(entry[0], entry[1], entry[2])
            value = entry[3]
        else:
            node, (raw,) = _node(entry, what, 1)
            value = _int(raw, f"the value of {node} in {what}")
        if node in result:
            raise _fail(f"node {node} appears twice in {what}")
        result[node] = value
    return result


def _node_set(doc: dict[str, Any], key: str, what: str) -> frozenset[NodeDesc]:
    entries = doc[key]
    if not isinstance(entries, list):
        raise _fail(f"{what} must be a list")
    nodes = [
        NodeDesc(e[0], e[1], e[2]) if _valid_node(e, 3) else _node(e, what, 0)[0] for e in entries
    ]
    if len(set(nodes)) != len(nodes):
        raise _fail(f"a node appears twice in {what}")
    return frozenset(nodes)


def decode_state(data: bytes, settings: Settings | None = None) -> RendezvousState:
    """Parse and validate bytes written by :func:`encode_state`.

    Args:
        data: the stored bytes.
        settings: the reading node's settings; with them, the properties that
            depend on min/max nodes and the restart budget are checked too (see
            :func:`_check_against`).

    Raises:
        RendezvousStateError: the input is oversize, not JSON, of another format
            version, has missing/unknown/ill-typed fields, negative or duplicate
            ranks, breaks a safety property of the state, or is a state no node
            could make progress from.
    """
    state = _state_of(_document(data))
    if settings is not None:
        _check_against(
            settings,
            state.round,
            state.complete,
            state.world_size,
            len(state.participants),
            state.last_call,
            bool(state.wait_list),
        )
    _check_round(state)
    _check_members(state)
    if settings is not None:
        _check_budget(state, settings.restart_budget)
    return state


def _document(data: bytes) -> dict[str, Any]:
    """The JSON object in ``data``, of this format version, with exactly its keys."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_STATE_BYTES:
        raise _fail(f"{len(data)} bytes exceeds the limit of {MAX_STATE_BYTES}")
    doc = _json_object(data, _fail)
    version = doc.get("v")
    if type(version) is not int or version != FORMAT_VERSION:  # 4.0 and true are not 4
        raise _fail(f"format version {version!r} is not supported (expected {FORMAT_VERSION})")
    missing = _KEYS - doc.keys()
    unknown = doc.keys() - _KEYS
    if missing or unknown:
        raise _fail(f"missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    return doc


def _state_of(doc: dict[str, Any]) -> RendezvousState:
    """The state ``doc`` holds, each field of its type (nothing checked across fields)."""
    return RendezvousState(
        round=_int(doc["round"], "round"),
        complete=_bool(doc["complete"], "complete"),
        closed=_bool(doc["closed"], "closed"),
        world_size=_int(doc["world"], "world size"),
        participants=Map(_node_map(doc, "p", "participants")),
        wait_list=_node_set(doc, "w", "wait list"),
        redundancy_list=_node_set(doc, "r", "redundancy list"),
        heartbeats=Map(_node_map(doc, "hb", "heartbeats")),
        last_call=None if doc["lc"] is None else _int(doc["lc"], "last call", 1),
        last_call_seq=_int(doc["lcs"], "last call sequence"),
        last_ranks=Map(_node_map(doc, "lr", "last ranks")),
        heartbeat_seq=_int(doc["hs"], "heartbeat sequence"),
        phase=_int(doc["ph"], "phase"),
        intent_cursor=_int(doc["ic"], "intent cursor"),
        restarts=_int(doc["rs"], "restarts"),
        charged_through=_int(doc["ct"], "charged-through round"),
        excluded=Map(_node_map(doc, "x", "excluded nodes")),
        returning=_node_set(doc, "rt", "returning nodes"),
        regroup=_bool(doc["rg"], "regroup"),
    )


def _check_round(state: RendezvousState) -> None:
    """A complete round has distinct ranks within its world size and no last call;
    an incomplete one has neither a world size nor ranks."""
    participants = state.participants
    world = state.world_size
    if state.complete:
        if not participants:
            # The departure of a complete round's last participant advances the round.
            raise _fail(f"complete round {state.round} has no participants")
        ranks = list(participants.values())
        if len(set(ranks)) != len(ranks):
            raise _fail("two participants share a rank")
        if len(participants) > world or any(r >= world for r in ranks):
            raise _fail(f"a rank or the participant count exceeds the world size {world}")
        if state.last_call is not None:
            raise _fail("a complete round has an armed last call")
    else:
        if world != 0:
            raise _fail("an incomplete round has a world size")
        if any(ranks := [r for r in participants.values() if r != 0]):
            raise _fail(f"an incomplete round has assigned ranks {ranks}")
    last_ranks = sorted(state.last_ranks.values())
    if last_ranks != list(range(len(last_ranks))):
        # They are the ranks a round completed with: exactly 0..n-1.
        raise _fail(f"the last ranks {last_ranks[:20]} are not 0..n-1")
    if state.last_call is not None and state.last_call > state.last_call_seq:
        raise _fail("the last call is newer than its sequence")
    if state.charged_through > state.round + 1:
        raise _fail(
            f"failures are counted through round {state.charged_through - 1}, "
            f"after round {state.round}"
        )
    if state.charged_through and not state.restarts:
        raise _fail("failures are counted but the restart count is 0")
    if state.round == 0 and not state.complete and (state.regroup or state.returning):
        # Only a completion sets the regroup mark and only a complete round's
        # participant returns: before round 0 completes there is no round to come
        # back from. Accepted, the mark would let round 0 complete at quorum
        # without its last call, leaving out the nodes still on their way.
        raise _fail(
            "round 0 has not completed, yet it is marked a regroup or has returning "
            "nodes: there is no earlier round to return from"
        )


def _check_members(state: RendezvousState) -> None:
    """Each node is in one list at most, with a heartbeat entry; excluded nodes
    only stand by."""
    participants = frozenset(state.participants)
    wait_list, redundancy_list = state.wait_list, state.redundancy_list
    if participants & wait_list or participants & redundancy_list:
        raise _fail("a node is both a participant and waiting or redundant")
    if wait_list & redundancy_list:
        raise _fail("a node is both waiting and redundant")
    if participants & state.returning:
        raise _fail("a participant is also returning to the round")
    _check_exclusions(state)
    _check_heartbeats(state)


def _check_budget(state: RendezvousState, budget: int | None) -> None:
    """The failure after the last restart of the budget closed the rendezvous."""
    if budget is None:
        return
    if state.restarts > budget + 1:
        raise _fail(f"{state.restarts} restarts overspend the restart budget of {budget}")
    if state.restarts > budget and not state.closed:
        raise _fail(f"the restart budget of {budget} is spent but the rendezvous is open")


def _check_exclusions(state: RendezvousState) -> None:
    """An excluded node never waits or takes part, and an exclusion that has run
    out is gone (a new round drops them)."""
    for node, until in state.excluded.items():
        if until <= state.round:
            raise _fail(f"node {node}'s exclusion ended at round {until} but is still listed")
        if node in state.participants or node in state.wait_list:
            raise _fail(f"node {node} is excluded until round {until} but is a member")


def _check_heartbeats(state: RendezvousState) -> None:
    """Every member has a heartbeat entry and nobody else does; every counter is one
    the sequence handed out (1..heartbeat_seq)."""
    heartbeats = state.heartbeats
    heartbeat_seq = state.heartbeat_seq
    members = state.members()
    counted = frozenset(heartbeats)
    if members != counted:
        # A member without an entry could never be found dead (nor alive): the
        # round would wait for it forever. An entry without a member is a
        # removal that was half written.
        if without := sorted(members - counted):
            raise _fail(
                f"node {without[0]} is a member but has no heartbeat entry "
                f"({len(without)} such node(s))"
            )
        stray = sorted(counted - members)
        raise _fail(
            f"node {stray[0]} has a heartbeat entry but is not a member ({len(stray)} such node(s))"
        )
    if heartbeats:
        if (low := min(heartbeats.values())) < 1:
            raise _fail(f"a heartbeat counter is {low}; counters start at 1")
        if (high := max(heartbeats.values())) > heartbeat_seq:
            # A new entry starts above the sequence: it would repeat this counter.
            raise _fail(
                f"a heartbeat counter ({high}) is above the heartbeat sequence ({heartbeat_seq})"
            )


def _check_against(
    settings: Settings,
    round_: int,
    complete: bool,
    world: int,
    count: int,
    last_call: int | None,
    waiting: bool = False,
) -> None:
    """The properties that depend on min/max nodes (``check_state``'s, and what the
    protocol needs to move on): a complete round's world size is within them, and
    a full one has nobody waiting (a node waits only beside a round with room,
    and one still waiting when a round completes stands by instead); an
    incomplete round has room for one more participant (one that reaches max_nodes
    completes at once), and its last call is armed exactly while it has min_nodes
    participants (armed on reaching min_nodes, disarmed on dropping below)."""
    low, high = settings.min_nodes, settings.max_nodes
    hint = (
        f" (this node has min_nodes={low}, max_nodes={high}: were the nodes started "
        "with different node counts?)"
    )
    if complete:
        if not low <= world <= high:
            raise _fail(
                f"complete round {round_} has world size {world}, outside [{low}, {high}]{hint}"
            )
        if waiting and count >= high:
            raise _fail(
                f"complete round {round_} is full ({count} participants) and a node waits "
                "beside it, which no node writes (a node still waiting when a round forms "
                f"without it stands by instead){hint}"
            )
        return
    if count >= high:
        raise _fail(
            f"incomplete round {round_} already holds {count} participants: nobody can join "
            f"it and it never completes{hint}"
        )
    if last_call is None and count >= low:
        raise _fail(
            f"incomplete round {round_} has {count} participants but no last call is armed: "
            f"it would never complete{hint}"
        )
    if last_call is not None and count < low:
        raise _fail(
            f"incomplete round {round_} has a last call armed with {count} participants, "
            f"below min_nodes{hint}"
        )


# -- the settings a run shares -----------------------------------------------------

#: The settings every node of one run must agree on: the ones the validity of the
#: shared state (min/max nodes), the ranks (stable ranks) and the liveness window
#: (a node beats every keep_alive_interval; its peers declare it dead after their
#: own interval times attempts), the job-wide restart budget and the length of an
#: exclusion depend on. Timeouts are each node's own business.
SHARED_SETTINGS = (
    "min_nodes",
    "max_nodes",
    "stable_ranks",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "restart_budget",
    "exclusion_rounds",
)
_SETTINGS_VERSION = 2


def encode_shared_settings(settings: Settings) -> bytes:
    """The canonical bytes of the :data:`SHARED_SETTINGS` of ``settings``."""
    doc: dict[str, Any] = {"v": _SETTINGS_VERSION}
    doc.update((name, getattr(settings, name)) for name in SHARED_SETTINGS)
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("ascii")


def _settings_fail(what: str) -> RendezvousStateError:
    return RendezvousStateError(f"corrupt published settings: {what}")


def _decode_shared_settings(data: bytes) -> dict[str, Any]:
    if len(data) > 4096:
        raise _settings_fail(f"{len(data)} bytes is far more than settings take")
    doc = _json_object(data, _settings_fail)
    if type(doc.get("v")) is not int or doc.get("v") != _SETTINGS_VERSION:
        raise _settings_fail(f"format version {doc.get('v')!r} is not supported")
    # Fields a later version adds are not ours to compare; every field of ours must be
    # there, of the type Settings holds.
    for name in SHARED_SETTINGS:
        if name not in doc:
            raise _settings_fail(f"field {name!r} is missing")
        value = doc[name]
        if name == "stable_ranks":
            ok = isinstance(value, bool)
        elif name == "restart_budget":
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif name == "keep_alive_interval":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok:
            raise _settings_fail(f"field {name!r} has a value of type {type(value).__name__}")
    return doc


def shared_settings_differences(settings: Settings, published: bytes) -> list[str]:
    """How ``settings`` differ from the ``published`` ones (bytes of
    :func:`encode_shared_settings`), one ``"<name>: <ours> on this node, <theirs>
    for the run"`` line per field; empty when they agree.

    Raises:
        RendezvousStateError: ``published`` is not settings this module wrote.
    """
    theirs = _decode_shared_settings(published)
    return [
        f"{name}: {getattr(settings, name)!r} on this node, {theirs[name]!r} for the run"
        for name in SHARED_SETTINGS
        if getattr(settings, name) != theirs[name]
    ]
