"""Moving a worker's registered state to its peers as tensors, never through pickle.

Runs in the worker's process (:mod:`rallypoint.agent.live`). A state tree (the
nested dicts, lists and tuples that ``state_dict()`` returns, with tensors and
plain values at the leaves) is split in two:

* a **layout**: the tree with every tensor replaced by its place in the transfers,
  encoded as JSON (plain data only: decoding it runs no code, and anything
  malformed is refused with :class:`StateTransferError`);
* the **transfers**: each large tensor on its own, sent from its memory as it is
  (no copy on the sender), and the small ones packed into one buffer per device,
  so that an optimizer's many scalar tensors cost one collective, not hundreds.

Every transfer is a broadcast of bytes (``uint8``), so any dtype travels on any
backend. A CUDA tensor goes over the round's own group when that is NCCL, and over
the CPU group otherwise; a receiver builds it on its own current device.

What cannot travel (a sharded ``DTensor``, an object of a class of the script's)
is reported by the sender to every rank of the broadcast, so that all of them fail
with the same message instead of waiting for a state that never comes.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StateTransferError", "broadcast_state", "pack_state", "unpack_state"]

#: Tensors smaller than this share a buffer (one collective for all of them).
PACK_BELOW = 1 << 20
#: Offsets inside a shared buffer are multiples of this, so that every slice can be
#: viewed as any dtype.
_ALIGN = 64
_LAYOUT_VERSION = 1


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


def pack_state(tree: Any, *, direct_devices: frozenset[str] = frozenset({"cpu"})) -> Packed:
    """Split ``tree`` for the wire (:class:`Packed`). ``direct_devices``: the device
    types with a group of their own; a tensor on any other travels through the CPU.

    Raises:
        StateTransferError: a leaf that cannot travel, named by its path.
    """
    tensors: list[tuple[torch.Tensor, str]] = []

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            _check_plain(value, path)
            tensors.append((value, path))
            return {"t": len(tensors) - 1}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"f": repr(value)}
        if isinstance(value, torch.Size):
            return {"S": list(value)}
        if isinstance(value, torch.dtype):
            return {"D": _dtype_name(value)}
        if isinstance(value, tuple):
            return {"u": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {"l": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            pairs = []
            for key, item in value.items():
                if key is not None and not isinstance(key, (bool, int, float, str)):
                    raise StateTransferError(f"{path} has a key of type {type(key).__name__}")
                pairs.append([key, encode(item, f"{path}[{key!r}]")])
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
                data = data.to(wire)
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
    for index, (tensor, _) in enumerate(tensors):
        slot = slots[index]
        assert slot is not None
        entries.append([*slot, _dtype_name(tensor.dtype), list(tensor.shape), tensor.device.type])
    layout = {
        "v": _LAYOUT_VERSION,
        "transfers": [[kind, t.numel()] for kind, t in zip(kinds, transfers, strict=True)],
        "tensors": entries,
        "tree": tree_doc,
    }
    return Packed(json.dumps(layout, separators=(",", ":")).encode(), transfers, kinds)


def _check_plain(tensor: torch.Tensor, path: str) -> None:
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise StateTransferError(
            f"{path} is a {type(tensor).__name__} (a sharded or wrapped tensor): live "
            "regroup copies one rank's whole state to the others, which suits data-parallel "
            "training only; restore sharded state from a checkpoint"
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
        raise _fail("the layout is not of version 1")
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
        if not (isinstance(entry, list) and len(entry) == 5):
            raise _fail(f"a tensor is not [transfer, offset, dtype, shape, device]: {entry!r}")
        transfer, offset, dtype, shape, device = entry
        if not (_is_count(transfer) and transfer < len(transfers) and _is_count(offset)):
            raise _fail(f"a tensor's place is out of range: {entry!r}")
        if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
            raise _fail(f"a tensor's shape is not a list of sizes: {entry!r}")
        if not isinstance(device, str):
            raise _fail(f"a tensor's device is not a name: {entry!r}")
        element = _dtype(dtype).itemsize
        if offset % element or offset + math.prod(shape) * element > transfers[transfer][1]:
            raise _fail(f"a tensor does not fit its transfer: {entry!r}")
    return doc


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dtype(name: Any) -> torch.dtype:
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise _fail(f"{name!r} is not a torch dtype")
    return found


def unpack_state(
    doc: Mapping[str, Any], transfers: list[torch.Tensor], place: Callable[[str], Any] = str
) -> Any:
    """Build the tree of a layout (:func:`read_layout`) over the ``transfers`` it
    came with. The tensors are views into the transfers; ``place`` maps a sender's
    device type to where this worker keeps such tensors.

    Raises:
        StateTransferError: the tree is malformed.
    """
    declared = [nbytes for _, nbytes in doc["transfers"]]
    if declared != [t.numel() for t in transfers]:
        raise _fail(f"transfers of {declared} bytes were announced, not what came")
    built: list[torch.Tensor] = []
    for transfer, offset, dtype, shape, device in doc["tensors"]:
        tensor = _slice(transfers[transfer], offset, _dtype(dtype), shape)
        target = place(device)
        if tensor.device != torch.device(target):
            tensor = tensor.to(target)
        built.append(tensor)

    def build(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if not (isinstance(value, dict) and (len(value) == 1 or value.keys() == {"o", "m"})):
            raise _fail(f"{value!r} is not a value of the layout")
        kind = "o" if "m" in value else next(iter(value))
        item = value[kind]
        if kind == "t" and _is_count(item) and item < len(built):
            return built[item]
        if kind == "f" and item in ("inf", "-inf", "nan"):
            return float(item)
        if kind == "S" and isinstance(item, list) and all(_is_count(n) for n in item):
            return torch.Size(item)
        if kind == "D":
            return _dtype(item)
        if kind in ("l", "u") and isinstance(item, list):
            items = [build(v) for v in item]
            return items if kind == "l" else tuple(items)
        if kind in ("d", "o") and isinstance(item, list):
            if not all(isinstance(p, list) and len(p) == 2 for p in item):
                raise _fail(f"a dict's items are not [key, value] pairs: {item!r}")
            mapping: dict[Any, Any] = {} if kind == "d" else OrderedDict()
            for key, inner in item:
                if key is not None and not isinstance(key, (bool, int, float, str)):
                    raise _fail(f"{key!r} is not a key")
                mapping[key] = build(inner)
            if "m" in value:
                mapping._metadata = build(value["m"])  # type: ignore[attr-defined]
            return mapping
        raise _fail(f"{value!r} is not a value of the layout")

    try:
        return build(doc["tree"])
    except RecursionError:
        raise _fail("the tree is nested too deeply") from None


# ------------------------------------------------------------------- the wire


def broadcast_state(
    tree: Any, source: int, group: Any, *, device_groups: Mapping[str, Any] | None = None
) -> tuple[Any, int]:
    """Give every rank of ``group`` the ``source`` rank's ``tree`` (ignored on the
    others): (the tree, bytes that came). The layout and the CPU transfers go over
    ``group``; a device type in ``device_groups`` (``{"cuda": nccl_group}``) sends
    its tensors over that group instead. On the source the tree itself is returned.

    Raises:
        StateTransferError: the source's state cannot travel (on every rank, with the
            source's reason) or what came is malformed.
    """
    groups = {"cpu": group, **(device_groups or {})}
    me = dist.get_rank()
    packed: Packed | None = None
    header = torch.zeros(1, dtype=torch.int64)
    message = b""
    if me == source:
        try:
            packed = pack_state(tree, direct_devices=frozenset(groups))
            message = packed.layout
            header[0] = len(message)
        except StateTransferError as exc:
            message = str(exc).encode()
            header[0] = -len(message) - 1  # a failure, with its reason
    dist.broadcast(header, src=source, group=group)
    size = int(header.item())
    text = _broadcast_bytes(message, abs(size + 1) if size < 0 else size, source, group)
    if size < 0:
        raise StateTransferError(text.decode(errors="replace"))
    if packed is not None:
        for transfer, kind in zip(packed.transfers, packed.kinds, strict=True):
            dist.broadcast(transfer, src=source, group=groups[kind])
        return tree, 0
    doc = read_layout(text)
    received = []
    for kind, nbytes in doc["transfers"]:
        if kind not in groups:
            raise _fail(f"a transfer on {kind!r}, which this worker has no group for")
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=_local(kind))
        dist.broadcast(buffer, src=source, group=groups[kind])
        received.append(buffer)
    return unpack_state(doc, received, _local), len(text) + sum(t.numel() for t in received)


def _broadcast_bytes(data: bytes, size: int, source: int, group: Any) -> bytes:
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(size, dtype=torch.uint8)
    )
    if size:
        dist.broadcast(buffer, src=source, group=group)
    return buffer.numpy().tobytes()


def _local(device_type: str) -> Any:
    """Where this worker keeps a tensor of ``device_type``: its current device."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device_type in ("cpu", "cuda"):
        return torch.device("cpu")
    return torch.device(device_type)
