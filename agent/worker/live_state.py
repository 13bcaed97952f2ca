"""Moving a worker's registered state to its peers as tensors, never through pickle.

Runs in the worker's process (:mod:`rallypoint.agent.worker.live`). A state tree (the
nested dicts, lists and tuples that ``state_dict()`` returns, with tensors and
plain values at the leaves) is split in two:

* a **layout**: the tree with every tensor replaced by its place in the transfers,
  encoded as JSON (plain data only: decoding it runs no code, and anything
  malformed is refused with :class:`StateTransferError`);
* the **transfers**: each large tensor on its own, sent from its memory as it is
  (no copy on the sender), and the small ones packed into one buffer per device,
  so that an optimizer's many scalar tensors cost one message, not hundreds.

A sharded tensor (a ``DTensor``: FSDP2, HSDP, tensor parallel) travels as its
local shard; the receiver puts it back into a ``DTensor`` of its own mesh, taking
the placements from its own state at the same place (:func:`unpack_state`'s
``like``). Which shard a rank holds, and so which peers hold the same one, is
:func:`shard_of`.

:func:`exchange_state` moves the trees point to point, every sender to each of its
receivers at once (in a sharded job several shards move in one exchange). Every
message is ``uint8`` bytes, so any dtype travels on any backend. A CUDA tensor goes
over the round's own group when that is NCCL, and over the CPU group otherwise; a
receiver builds it on its own current device. What cannot travel (an object of a
class of the script's) is reported by the sender to its receivers, and every rank
of the exchange then fails alike, instead of waiting for a state that never comes.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...core.reshard import Box

__all__ = [
    "LocalShard",
    "Shard",
    "StateTransferError",
    "as_dtensor",
    "exchange_packed",
    "exchange_state",
    "is_dtensor",
    "local_device",
    "local_shards",
    "map_leaves",
    "pack_state",
    "place_of",
    "read_layout",
    "regraft",
    "shard_of",
    "unpack_state",
]

#: Tensors smaller than this share a buffer (one collective for all of them).
PACK_BELOW = 1 << 20
#: Offsets inside a shared buffer are multiples of this, so that every slice can be
#: viewed as any dtype.
_ALIGN = 64
_LAYOUT_VERSION = 2
#: The device types a transfer can be on, by the code it has in a frame.
_KINDS = ("cpu", "cuda")


class StateTransferError(RuntimeError):
    """The registered state cannot be moved to the peers, or what came is not a
    state this worker can build: says what, and where in the state."""


@dataclass(frozen=True)
class Packed:
    """A state split for the wire: its ``layout`` (JSON bytes), the ``transfers``
    (flat ``uint8`` tensors, in the order the layout lists them) and the device type
    each travels on."""

    layout: bytes
    transfers: list[torch.Tensor]
    kinds: list[str]

    @property
    def nbytes(self) -> int:
        return len(self.layout) + sum(t.numel() for t in self.transfers)


# ----------------------------------------------------------------- packing


def pack_state(
    tree: Any, *, direct_devices: frozenset[str] = frozenset({"cpu"}), copy: bool = False
) -> Packed:
    """Split ``tree`` for the wire (:class:`Packed`). ``direct_devices``: the device
    types with a group of their own; a tensor on any other travels through the CPU.
    ``copy``: the transfers own their memory (a snapshot), instead of large tensors
    being sent from the state's own memory.

    Raises:
        StateTransferError: a leaf that cannot travel, named by its path.
    """
    # (the data, for a DTensor's local shard its global shape and offsets)
    tensors: list[tuple[torch.Tensor, list[list[int]] | bool]] = []

    def encode(value: Any, path: str) -> Any:
        if is_dtensor(value):
            shape, box = place_of(value)
            value = value.to_local()
            _check_plain(value, path)
            tensors.append((value, [list(shape), list(box.offsets)]))
            return {"t": len(tensors) - 1}
        if isinstance(value, LocalShard):
            _check_plain(value.data, path)
            tensors.append((value.data, [list(value.shape), list(value.box.offsets)]))
            return {"t": len(tensors) - 1}
        if isinstance(value, torch.Tensor):
            _check_plain(value, path)
            tensors.append((value, False))
            return {"t": len(tensors) - 1}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            sign = "-" if math.isnan(value) and math.copysign(1, value) < 0 else ""
            return {"f": sign + repr(value)}  # JSON has no inf or nan; keep a nan's sign
        if isinstance(value, torch.Size):
            return {"S": list(value)}
        if isinstance(value, torch.dtype):
            return {"D": _dtype_name(value)}
        if isinstance(value, tuple):
            return {"u": [encode(v, _child(path, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {"l": [encode(v, _child(path, i)) for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            pairs = []
            for key, item in value.items():
                if key is not None and not isinstance(key, (bool, int, float, str)):
                    raise StateTransferError(f"{path} has a key of type {type(key).__name__}")
                pairs.append([key, encode(item, _child(path, key))])
            if isinstance(value, OrderedDict):
                doc: dict[str, Any] = {"o": pairs}
                metadata = getattr(value, "_metadata", None)
                if metadata is not None:  # nn.Module's per-submodule versions
                    doc["m"] = encode(metadata, f"{path}._metadata")
                return doc
            return {"d": pairs}
        raise StateTransferError(
            f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which cannot "
            "travel between ranks: a state holds tensors, numbers, strings, None, and "
            "lists, tuples and dicts of them"
        )

    tree_doc = encode(tree, "state")
    entries: list[list[Any]] = []
    transfers: list[torch.Tensor] = []
    kinds: list[str] = []
    small: dict[str, list[tuple[int, torch.Tensor]]] = {}
    slots: list[list[Any] | None] = [None] * len(tensors)
    for index, (tensor, _) in enumerate(tensors):
        device = tensor.device.type
        wire = device if device in direct_devices else "cpu"
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= PACK_BELOW:
            data = tensor.detach()
            if data.device.type != wire:
                data = data.to(wire)  # a copy already
            elif copy:
                data = data.clone(memory_format=torch.contiguous_format)
            transfers.append(_as_bytes(data.contiguous()))
            kinds.append(wire)
            slots[index] = [len(transfers) - 1, 0]
        else:
            small.setdefault(wire, []).append((index, tensor))
    for wire, members in small.items():
        offsets, total = [], 0
        for _, tensor in members:
            offsets.append(total)
            total += _aligned(tensor.numel() * tensor.element_size())
        buffer = torch.empty(total, dtype=torch.uint8, device=wire)
        for (index, tensor), offset in zip(members, offsets, strict=True):
            _slice(buffer, offset, tensor.dtype, tensor.shape).copy_(tensor.detach())
            slots[index] = [len(transfers), offset]
        transfers.append(buffer)
        kinds.append(wire)
    for index, (tensor, sharded) in enumerate(tensors):
        slot = slots[index]
        assert slot is not None
        entries.append(
            [*slot, _dtype_name(tensor.dtype), list(tensor.shape), tensor.device.type, sharded]
        )
    layout = {
        "v": _LAYOUT_VERSION,
        "transfers": [[kind, t.numel()] for kind, t in zip(kinds, transfers, strict=True)],
        "tensors": entries,
        "tree": tree_doc,
    }
    return Packed(json.dumps(layout, separators=(",", ":")).encode(), transfers, kinds)


def _dtensor_class() -> Any:
    """``DTensor``, once its module is loaded (None before: no state can hold one
    then). Importing it costs a second or more, which a worker that shards nothing
    must not pay before its first round."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(value: Any) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(value, dtensor)


def _check_plain(tensor: torch.Tensor, path: str) -> None:
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise StateTransferError(
            f"{path} is a {type(tensor).__module__}.{type(tensor).__qualname__}, a tensor "
            "subclass live regroup cannot take apart: plain tensors and DTensors travel"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise StateTransferError(f"{path} is a {tensor.layout} tensor: only dense tensors travel")
    if tensor.is_quantized:
        raise StateTransferError(f"{path} is a quantized tensor: only plain dtypes travel")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` tensor (a view, no copy)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _slice(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Any) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` at byte ``offset`` of ``buffer`` (a view)."""
    size = math.prod(shape) * dtype.itemsize
    part = buffer[offset : offset + size]
    return (part.view(dtype) if dtype != torch.uint8 else part).view(tuple(shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- unpacking


def _fail(what: str) -> StateTransferError:
    return StateTransferError(f"the state from the peer is not valid: {what}")


def read_layout(layout: bytes) -> dict[str, Any]:
    """Decode and check a layout's frame (its transfers and tensors; the tree is
    checked while it is built).

    Raises:
        StateTransferError: malformed.
    """
    try:
        doc = json.loads(layout)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _fail(f"the layout is not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("v") != _LAYOUT_VERSION:
        raise _fail(f"the layout is not of version {_LAYOUT_VERSION}")
    transfers, tensors = doc.get("transfers"), doc.get("tensors")
    if not isinstance(transfers, list) or not isinstance(tensors, list) or "tree" not in doc:
        raise _fail("the layout lacks its transfers, tensors or tree")
    for entry in transfers:
        if not (
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
            and _is_count(entry[1])
        ):  # fmt: skip
            raise _fail(f"a transfer is not [device, bytes]: {entry!r}")
    for entry in tensors:
        if not (isinstance(entry, list) and len(entry) == 6):
            raise _fail(
                f"a tensor is not [transfer, offset, dtype, shape, device, sharded]: {entry!r}"
            )
        transfer, offset, dtype, shape, device, sharded = entry
        if not (_is_count(transfer) and transfer < len(transfers) and _is_count(offset)):
            raise _fail(f"a tensor's place is out of range: {entry!r}")
        if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
            raise _fail(f"a tensor's shape is not a list of sizes: {entry!r}")
        if not isinstance(device, str) or not (sharded is False or _is_place(sharded, shape)):
            raise _fail(
                f"a tensor's device is not a name, or its place in a sharded tensor not "
                f"[global shape, offsets] inside it: {entry!r}"
            )
        element = _dtype(dtype).itemsize
        if offset % element or offset + math.prod(shape) * element > transfers[transfer][1]:
            raise _fail(f"a tensor does not fit its transfer: {entry!r}")
    return doc


def _is_place(place: Any, local: list[int]) -> bool:
    """Whether ``place`` is [global shape, offsets] of a box of ``local``'s sizes."""
    if not (isinstance(place, list) and len(place) == 2):
        return False
    shape, offsets = place
    return (
        isinstance(shape, list) and isinstance(offsets, list)
        and len(shape) == len(offsets) == len(local)
        and all(_is_count(n) for n in [*shape, *offsets])
        and all(o + n <= s for o, n, s in zip(offsets, local, shape, strict=True))
    )  # fmt: skip


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dtype(name: Any) -> torch.dtype:
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise _fail(f"{name!r} is not a torch dtype")
    return found


def unpack_state(
    doc: Mapping[str, Any],
    transfers: list[torch.Tensor],
    place: Callable[[str], Any] = str,
    like: Any = None,
    *,
    local_shards: bool = False,
) -> Any:
    """Build the tree of a layout (:func:`read_layout`) over the ``transfers`` it
    came with. The tensors are views into the transfers; ``place`` maps a sender's
    device type to where this worker keeps such tensors. A sharded tensor's local
    shard becomes a ``DTensor`` of the mesh and placements of the tensor at the same
    place in ``like`` (this worker's own state: the same structure), or with
    ``local_shards`` a :class:`LocalShard` (no mesh: to be resharded).

    Raises:
        StateTransferError: the tree is malformed, or a shard has no DTensor of the
            same local shape at its place in ``like``.
    """
    declared = [nbytes for _, nbytes in doc["transfers"]]
    if declared != [t.numel() for t in transfers]:
        raise _fail(f"transfers of {declared} bytes were announced, not what came")
    built: list[tuple[torch.Tensor, Any]] = []
    for transfer, offset, dtype, shape, device, sharded in doc["tensors"]:
        tensor = _slice(transfers[transfer], offset, _dtype(dtype), shape)
        target = place(device)
        if tensor.device != torch.device(target):
            tensor = tensor.to(target)
        built.append((tensor, sharded))

    def build(value: Any, like: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if not (isinstance(value, dict) and (len(value) == 1 or value.keys() == {"o", "m"})):
            raise _fail(f"{value!r} is not a value of the layout")
        kind = "o" if "m" in value else next(iter(value))
        item = value[kind]
        if kind == "t" and _is_count(item) and item < len(built):
            tensor, sharded = built[item]
            if sharded and local_shards:
                whole, offsets = sharded
                return LocalShard(tensor, tuple(whole), Box(tuple(offsets), tuple(tensor.shape)))
            return as_dtensor(tensor, like, path) if sharded else tensor
        if kind == "f" and item in ("inf", "-inf", "nan", "-nan"):
            return float(item)
        if kind == "S" and isinstance(item, list) and all(_is_count(n) for n in item):
            return torch.Size(item)
        if kind == "D":
            return _dtype(item)
        if kind in ("l", "u") and isinstance(item, list):
            peers: Sequence[Any] = like if isinstance(like, (list, tuple)) else ()
            items = [
                build(v, peers[i] if i < len(peers) else None, _child(path, i))
                for i, v in enumerate(item)
            ]
            return items if kind == "l" else tuple(items)
        if kind in ("d", "o") and isinstance(item, list):
            if not all(isinstance(p, list) and len(p) == 2 for p in item):
                raise _fail(f"a dict's items are not [key, value] pairs: {item!r}")
            known: Mapping[Any, Any] = like if isinstance(like, Mapping) else {}
            mapping: dict[Any, Any] = {} if kind == "d" else OrderedDict()
            for key, inner in item:
                if key is not None and not isinstance(key, (bool, int, float, str)):
                    raise _fail(f"{key!r} is not a key")
                mapping[key] = build(inner, known.get(key), _child(path, key))
            if "m" in value:
                mapping._metadata = build(value["m"], None, f"{path}._metadata")  # type: ignore[attr-defined]
            return mapping
        raise _fail(f"{value!r} is not a value of the layout")

    try:
        return build(doc["tree"], like, "state")
    except RecursionError:
        raise _fail("the tree is nested too deeply") from None


def as_dtensor(local: torch.Tensor, like: Any, path: str) -> Any:
    """``local`` as this worker's shard of the DTensor ``like`` stands for."""
    if not is_dtensor(like):
        raise StateTransferError(
            f"{path}: a peer sent a shard of a sharded tensor where this worker's state has "
            f"{type(like).__name__}: build the same model and wrapping on every rank"
        )
    mine = like.to_local()
    if (mine.shape, mine.dtype) != (local.shape, local.dtype):
        raise StateTransferError(
            f"{path}: a peer sent a shard of {tuple(local.shape)} {local.dtype}, but this "
            f"rank's shard is {tuple(mine.shape)} {mine.dtype} (a different mesh or wrapping)"
        )
    return _dtensor_class().from_local(
        local.to(mine.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def regraft(tree: Any, like: Any) -> Any:
    """``tree`` with each ``DTensor``'s local shard in a ``DTensor`` of the mesh of
    the one at the same place in ``like`` (a rank that kept its shard moves it into
    the objects it rebuilt for a new mesh). Large tensors are not copied."""
    packed = pack_state(tree, direct_devices=frozenset(_KINDS))
    return unpack_state(read_layout(packed.layout), packed.transfers, local_device, like)


@dataclass(frozen=True)
class LocalShard:
    """A rank's box of a sharded tensor apart from any mesh (to be resharded): its
    ``data``, the whole tensor's global ``shape``, and where ``data`` lies in it."""

    data: torch.Tensor
    shape: tuple[int, ...]
    box: Box


def place_of(value: Any) -> tuple[tuple[int, ...], Box]:
    """A ``DTensor``'s global shape and the box its local shard holds."""
    (chunk,) = value.__create_chunk_list__()  # one box per rank for a DTensor
    return tuple(value.shape), Box(tuple(chunk.offsets), tuple(chunk.sizes))


def local_shards(tree: Any) -> Any:
    """``tree`` with each ``DTensor`` as its :class:`LocalShard` (no copy)."""

    def apart(_: str, value: Any) -> Any:
        if not is_dtensor(value):
            return value
        shape, box = place_of(value)
        return LocalShard(value.to_local(), shape, box)

    return map_leaves(tree, apart)


def map_leaves(tree: Any, apply: Callable[[str, Any], Any], path: str = "state") -> Any:
    """``tree`` with each leaf (what is not a dict, list or tuple) replaced by
    ``apply(path, leaf)``; ``path`` names the leaf as the transfer's messages do."""
    if isinstance(tree, Mapping):
        mapped = {key: map_leaves(item, apply, _child(path, key)) for key, item in tree.items()}
        if isinstance(tree, OrderedDict):
            ordered = OrderedDict(mapped)
            if hasattr(tree, "_metadata"):
                ordered._metadata = tree._metadata  # type: ignore[attr-defined]
            return ordered
        return mapped
    if isinstance(tree, (list, tuple)):
        items = [map_leaves(item, apply, _child(path, i)) for i, item in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return apply(path, tree)


def _child(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


@dataclass(frozen=True)
class Shard:
    """Which part of a sharded state a rank holds.

    Attributes:
        index: the rank's coordinate along the mesh dimensions that shard the state
            (0 when nothing is sharded: data-parallel training).
        layout: names the sharding (the sizes of the sharded dimensions): two
            ranks' indices compare only under the same layout.
        count: how many shards the layout has.
    """

    index: int
    layout: int
    count: int = 1


def shard_of(tree: Any) -> Shard:
    """Which shard of the state ``tree`` this rank holds: ranks with the same index
    under the same layout hold the same data (the replicas of HSDP). Every mesh
    dimension along which some ``DTensor`` of the tree is sharded counts; a
    replicated dimension does not."""
    dims: dict[tuple[str, int, int], tuple[int, int]] = {}  # mesh dim -> (size, coordinate)

    def visit(value: Any) -> None:
        if is_dtensor(value):
            mesh = value.device_mesh
            coordinate = list(mesh.get_coordinate() or ())
            for dim, placement in enumerate(value.placements):
                if placement.is_shard() and dim < len(coordinate):
                    # Named the same on every rank (a rank's sub-mesh is not).
                    key = (str(mesh.mesh_dim_names), mesh.ndim, dim)
                    dims[key] = (mesh.size(dim), coordinate[dim])
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(tree)
    index, count = 0, 1
    sizes = []
    for key in sorted(dims):
        size, coordinate = dims[key]
        index, count = index * size + coordinate, count * size
        sizes.append([*key, size])  # the layout: each sharded dimension and its size
    return Shard(index, zlib.crc32(json.dumps(sizes).encode()), count)


# ------------------------------------------------------------------- the wire


def exchange_state(
    tree: Any,
    *,
    send_to: Collection[int],
    receive_from: int | None,
    group: Any,
    device_groups: Mapping[str, Any] | None = None,
    like: Any = None,
) -> tuple[Any, int]:
    """Send ``tree`` to the ranks ``send_to`` and receive a tree from
    ``receive_from`` (None: nothing to receive), point to point over ``group``
    (:func:`exchange_packed`); every rank of ``group`` calls it.

    Returns:
        the received tree (None when nothing was received; :func:`unpack_state`'s
        ``like``) and the bytes that came.

    Raises:
        StateTransferError: on every rank when any rank's state could not travel or
            what came is malformed: the reason where it is known, else which rank
            failed.
    """
    groups = {"cpu": group, **(device_groups or {})}
    payload: Packed | StateTransferError | None = None
    if send_to:
        try:
            payload = pack_state(tree, direct_devices=frozenset(groups))
        except StateTransferError as exc:
            payload = exc
    sources = [] if receive_from is None else [receive_from]
    received = exchange_packed(
        dict.fromkeys(send_to, payload), sources, group=group, device_groups=device_groups
    )
    if not received:
        return None, 0
    (packed,) = received
    tree = unpack_state(read_layout(packed.layout), packed.transfers, local_device, like)
    return tree, packed.nbytes


def exchange_packed(
    sends: Mapping[int, Packed | StateTransferError | None],
    sources: Sequence[int],
    *,
    group: Any,
    device_groups: Mapping[str, Any] | None = None,
) -> list[Packed]:
    """Send each rank of ``sends`` its packed state (or the reason it cannot have
    one), and receive one from each rank of ``sources``, point to point over
    ``group``; all at once, so that ranks that send to each other do not wait on
    each other. A device type in ``device_groups`` (``{"cuda": nccl_group}``) sends
    its transfers over that group. Every rank of ``group`` calls it, those with
    nothing to move too: it ends with the ranks' agreement that every transfer
    went well.

    Returns:
        what came from each source, in order (its layout checked by
        :func:`read_layout`).

    Raises:
        StateTransferError: on every rank when any rank could not send or what came
            is malformed: the reason where it is known, else which rank failed.
    """
    groups = {"cpu": group, **(device_groups or {})}
    outgoing = {dst: p for dst, p in sends.items() if isinstance(p, Packed)}
    failures = {
        dst: str(p or "nothing to send").encode()
        for dst, p in sends.items()
        if not isinstance(p, Packed)
    }
    # 1. A header: the layout's length (or minus the reason's, on a failure) and how
    # many transfers follow.
    headers = {
        dst: torch.tensor([len(p.layout), len(p.transfers)]) for dst, p in outgoing.items()
    } | {dst: torch.tensor([-len(why) - 1, 0]) for dst, why in failures.items()}
    heard = {src: torch.zeros(2, dtype=torch.int64) for src in sources}
    _p2p(group, [(headers[dst], dst) for dst in sends], [(h, src) for src, h in heard.items()])
    # 2. The layout (or the reason) and each transfer's device and size.
    texts = {
        src: torch.empty(abs(int(h[0]) + 1) if h[0] < 0 else int(h[0]), dtype=torch.uint8)
        for src, h in heard.items()
    }
    frames = {src: torch.empty(max(int(h[1]), 0), 2, dtype=torch.int64) for src, h in heard.items()}
    posted = []
    for dst, p in outgoing.items():
        frame = torch.tensor(
            [[_KINDS.index(kind), t.numel()] for kind, t in zip(p.kinds, p.transfers, strict=True)],
            dtype=torch.int64,
        ).reshape(-1, 2)
        posted += [(_bytes_tensor(p.layout), dst), (frame, dst)]
    posted += [(_bytes_tensor(why), dst) for dst, why in failures.items()]
    _p2p(group, posted, [(t, src) for part in (texts, frames) for src, t in part.items()])
    # 3. The transfers, each over the group of its device.
    codes = {src: [(int(c), int(n)) for c, n in frames[src].tolist()] for src in sources}
    kinds_in = {
        src: [_KINDS[c] if 0 <= c < len(_KINDS) else "cpu" for c, _ in codes[src]]
        for src in sources
    }
    received = {
        src: [
            torch.empty(max(n, 0), dtype=torch.uint8, device=local_device(kind))
            for (_, n), kind in zip(codes[src], kinds_in[src], strict=True)
        ]
        for src in sources
    }
    for kind in _KINDS:
        out = [
            (t, dst)
            for dst, p in outgoing.items()
            for t, k in zip(p.transfers, p.kinds, strict=True)
            if k == kind
        ]
        into = [
            (t, src)
            for src in sources
            for t, k in zip(received[src], kinds_in[src], strict=True)
            if k == kind
        ]
        if out or into:
            _p2p(groups.get(kind, group), out, into)
    # 4. The outcome, here and everywhere.
    error = next((p for p in sends.values() if isinstance(p, StateTransferError)), None)
    results = []
    for src in sources:
        if error is not None:
            break
        try:
            text = texts[src].numpy().tobytes()
            if heard[src][0] < 0:
                raise StateTransferError(text.decode(errors="replace"))
            if any(not 0 <= c < len(_KINDS) or n < 0 for c, n in codes[src]):
                raise _fail(f"a transfer is not [device, bytes]: {codes[src]!r}")
            read_layout(text)
            results.append(Packed(text, received[src], kinds_in[src]))
        except StateTransferError as exc:
            error = exc
    failed = torch.tensor([dist.get_rank() if error else -1], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(failed.item()) >= 0:
        raise StateTransferError(
            f"rank {int(failed.item())} could not take part in the state's transfer (see its log)"
        )
    return results


def _p2p(
    group: Any,
    sends: Sequence[tuple[torch.Tensor, int]],
    receives: Sequence[tuple[torch.Tensor, int]],
) -> None:
    """Post every send and receive (tensor, peer) at once, then wait for all of them."""
    works = [dist.isend(t, dst=dst, group=group) for t, dst in sends if t.numel()]
    works += [dist.irecv(t, src=src, group=group) for t, src in receives if t.numel()]
    for work in works:
        if work is not None:
            work.wait()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def local_device(device_type: str) -> Any:
    """Where this worker keeps a tensor of ``device_type``: its current device."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device_type in ("cpu", "cuda"):
        return torch.device("cpu")
    return torch.device(device_type)
