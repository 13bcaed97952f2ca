"""The registered state travels between ranks as a JSON layout and the tensors'
bytes: every tree ``state_dict()`` can return comes back equal, bit for bit, what
cannot travel is named, and a malformed layout is refused, never executed."""

from __future__ import annotations

import contextlib
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cluster import run_ranks
from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.agent.worker import live_state
from rallypoint.agent.worker.live_state import (
    StateTransferError,
    pack_state,
    read_layout,
    unpack_state,
)

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
]  # fmt: skip


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype.is_floating_point or dtype.is_complex:
        tensor = torch.randn(shape, generator=generator, dtype=dtype)
        if tensor.numel() and draw(st.booleans()):
            tensor.view(-1)[0] = draw(st.sampled_from([math.inf, -math.inf, math.nan, -0.0]))
    elif dtype == torch.bool:
        tensor = torch.randint(0, 2, shape, generator=generator).bool()
    else:
        tensor = torch.randint(0, 100, shape, generator=generator, dtype=dtype)
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1)  # a view that is not contiguous
    return tensor


scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5)
scalars |= st.floats(allow_nan=True, allow_infinity=True)
keys = st.integers(-5, 50) | st.text(max_size=4)


def _ordered(pairs: dict[Any, Any], with_metadata: bool) -> OrderedDict[Any, Any]:
    mapping: OrderedDict[Any, Any] = OrderedDict(pairs)
    if with_metadata:
        mapping._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return mapping


trees = st.recursive(
    scalars | tensors() | st.just(torch.Size([2, 3])) | st.just(torch.float16),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.builds(_ordered, st.dictionaries(keys, inner, max_size=3), st.booleans())
    ),
    max_leaves=20,
)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _same(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same tree: types, keys in order, values bit for bit."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
        assert torch.equal(_bits(a), _bits(b))
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b))
        assert math.copysign(1, a) == math.copysign(1, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
        if hasattr(a, "_metadata"):
            _same(a._metadata, b._metadata)
        else:
            assert not hasattr(b, "_metadata")
    else:
        assert a == b


def _round_trip(tree: Any) -> Any:
    packed = pack_state(tree)
    # What the receiver gets: fresh buffers with the same bytes.
    transfers = [t.clone() for t in packed.transfers]
    return unpack_state(read_layout(packed.layout), transfers)


@examples(300)
@given(trees, st.sampled_from([0, 64, 1 << 20]))
def test_every_state_tree_comes_back_bit_for_bit(tree: Any, pack_below: int) -> None:
    """Whether tensors share a buffer or travel alone (the threshold drawn)."""
    old = live_state.PACK_BELOW
    live_state.PACK_BELOW = pack_below
    try:
        _same(tree, _round_trip(tree))
    finally:
        live_state.PACK_BELOW = old


def test_small_tensors_share_one_transfer_and_large_ones_travel_from_their_memory() -> None:
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
    tree = {"big": big, "small": [torch.tensor(float(i)) for i in range(100)]}
    packed = pack_state(tree)
    assert len(packed.transfers) == 2
    assert packed.transfers[0].data_ptr() == big.data_ptr()  # sent as it is, not copied
    _same(tree, _round_trip(tree))


def test_a_model_and_its_optimizer_resume_exactly_from_a_peers_state() -> None:
    """A module (with its version metadata), Adam's per-parameter state and
    integer-keyed dicts, a scheduler: loaded into fresh objects, the next step is
    the same, bit for bit, as the sender's."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        optimizer.zero_grad()
        model(torch.linspace(-1, 1, 32).reshape(4, 8)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()

    sender = make()
    for _ in range(3):
        step(*sender)
    names = ("model", "optimizer", "scheduler")
    states = {name: obj.state_dict() for name, obj in zip(names, sender, strict=True)}
    doc = _round_trip({"step": 3, "state": states})
    receiver = make()
    for name, obj in zip(names, receiver, strict=True):
        obj.load_state_dict(doc["state"][name])
    step(*sender)
    step(*receiver)
    after = zip(sender[0].state_dict().values(), receiver[0].state_dict().values(), strict=True)
    for a, b in after:
        assert torch.equal(_bits(a), _bits(b))
    assert sender[1].state_dict()["param_groups"] == receiver[1].state_dict()["param_groups"]


class _Custom:
    pass


@pytest.mark.parametrize(
    ("tree", "named"),
    [
        ({"opt": {"hook": _Custom()}}, "state['opt']['hook'] is a"),
        ({"w": torch.zeros(2).to_sparse()}, "state['w'] is a torch.sparse_coo tensor"),
        ({"m": {(1, 2): 3}}, "state['m'] has a key of type tuple"),
        ([torch.zeros(1), lambda: 0], "state[1] is a builtins.function"),
    ],
)
def test_what_cannot_travel_is_named_by_its_place(tree: Any, named: str) -> None:
    with pytest.raises(StateTransferError, match=named.replace("[", r"\[").replace("]", r"\]")):
        pack_state(tree)


def test_a_tensor_subclass_it_cannot_take_apart_is_refused() -> None:
    class Wrapped(torch.Tensor):
        pass

    with pytest.raises(StateTransferError, match="plain tensors and DTensors travel"):
        pack_state({"w": torch.zeros(2).as_subclass(Wrapped)})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=15,
)


@examples(300)
@given(st.data())
def test_a_malformed_layout_is_refused_with_a_transfer_error(data: st.DataObject) -> None:
    """Any JSON in place of a part of a valid layout: the receiver either builds a
    tree or raises StateTransferError, never another error."""
    packed = pack_state({"a": torch.arange(6).reshape(2, 3), "b": [1.5, "x"]})
    doc = json.loads(packed.layout)
    part = data.draw(st.sampled_from(["v", "transfers", "tensors", "tree", "whole"]))
    bad = data.draw(json_values)
    if part == "whole":
        doc = bad
    else:
        doc[part] = bad
    transfers = [t.clone() for t in packed.transfers]
    with contextlib.suppress(StateTransferError):
        unpack_state(read_layout(json.dumps(doc).encode()), transfers)


def test_a_layout_that_points_past_its_transfer_is_refused() -> None:
    packed = pack_state({"a": torch.zeros(4)})
    doc = json.loads(packed.layout)
    doc["tensors"][0][3] = [1000]
    with pytest.raises(StateTransferError, match="does not fit its transfer"):
        read_layout(json.dumps(doc).encode())


#: Three ranks over gloo on 127.0.0.1: rank 0 sends to ranks 1 and 2, and rank 2
#: sends its own state to rank 0 in the same exchange; each prints what came.
_PEERS = """
import datetime, sys, torch, torch.distributed as dist
from rallypoint.agent.worker.live_state import exchange_state, StateTransferError
rank, port, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", int(port), 3, rank == 0, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
torch.manual_seed(1)
state = {"big": torch.randn(300_000), "small": {3: torch.tensor(7), "lr": 0.5}, "s": "x"}
if case == "bad":
    state["small"]["hook"] = object()
send_to = {0: [1, 2], 1: [], 2: [0]}[rank]
receive_from = {0: 2, 1: 0, 2: 0}[rank]
mine = {"from": torch.tensor(rank)} if rank == 2 else state
try:
    tree, size = exchange_state(mine, send_to=send_to, receive_from=receive_from,
                                group=dist.group.WORLD)
except StateTransferError as exc:
    print("refused:", exc)
else:
    if rank == 0:
        print("same" if tree["from"].item() == 2 else "differs", size)
    else:
        same = torch.equal(tree["big"], state["big"]) and tree["small"][3].item() == 7
        same = same and tree["small"]["lr"] == 0.5 and tree["s"] == "x"
        print("same" if same else "differs", size)
dist.destroy_process_group()
"""


@pytest.mark.integration
@pytest.mark.parametrize("case", ["good", "bad"])
def test_three_ranks_over_gloo(tmp_path: Path, case: str) -> None:
    """Each receiver gets its sender's state, in both directions at once; a state
    that cannot travel fails on every rank, the receivers with the sender's reason
    (nobody waits for it)."""
    outputs = run_ranks(tmp_path, _PEERS, 3, case)
    if case == "good":
        assert [o.split()[0] for o in outputs] == ["same"] * 3, outputs
        assert int(outputs[1].split()[1]) > 300_000 * 4, outputs
    else:
        reason = "refused: state['small']['hook'] is a builtins.object"
        assert reason in outputs[1] and reason in outputs[2], outputs
        # Rank 0's own receive went well: it learns that a peer failed.
        assert "refused:" in outputs[0], outputs


def test_a_snapshot_is_a_copy_and_only_the_two_newest_steps_are_kept() -> None:
    """What a rank keeps of its own state: a copy (training on does not change it),
    listed per shard and step for the restore plan, the oldest dropped."""
    from rallypoint.agent.worker.live_snapshots import Snapshots
    from rallypoint.agent.worker.live_state import Shard
    from rallypoint.core.state_sources import Copy

    weights = torch.zeros(300_000)  # above the size that shares a buffer
    snapshots = Snapshots()
    shard = Shard(index=1, layout=7, count=2)
    for step in (10, 20, 30):
        weights.fill_(step)
        snapshots.take({"w": weights}, shard, step, buddy=None, wards={}, group=None)
    weights.fill_(-1)
    assert sorted(snapshots.copies(7, holder=5), key=lambda c: c.step) == [
        Copy(1, 20, 5),
        Copy(1, 30, 5),
    ]
    assert snapshots.copies(8, holder=5) == []
    packed = snapshots.get(7, 1, 20)
    assert packed is not None and snapshots.get(7, 1, 10) is None
    tree = unpack_state(read_layout(packed.layout), packed.transfers)
    assert torch.equal(tree["w"], torch.full((300_000,), 20.0))
    assert snapshots.bytes_kept >= 2 * 300_000 * 4
    # The job went back to step 20: the copy of 30 belongs to a timeline it left.
    snapshots.forget_after(20)
    assert snapshots.copies(7, holder=5) == [Copy(1, 20, 5)]


def test_a_snapshot_copied_in_the_background_holds_the_state_of_its_step() -> None:
    """The copy is made by the snapshot's thread; once :meth:`wait_copied` returned,
    the state may change (the optimizer's next step) without reaching the copy."""
    from rallypoint.agent.worker.live_snapshots import Snapshots
    from rallypoint.agent.worker.live_state import Shard

    weights = torch.full((300_000,), 3.0)
    snapshots = Snapshots()
    shard = Shard(index=0, layout=7, count=1)
    snapshots.take({"w": weights}, shard, 10, buddy=None, wards={}, group=None, in_background=True)
    snapshots.wait_copied()
    weights.fill_(-1)
    assert snapshots.wait(60)
    packed = snapshots.get(7, 0, 10)
    assert packed is not None
    tree = unpack_state(read_layout(packed.layout), packed.transfers)
    assert torch.equal(tree["w"], torch.full((300_000,), 3.0))
    # What cannot be copied is not kept, and nobody waits for it.
    snapshots.take({"w": object()}, shard, 20, buddy=None, wards={}, group=None, in_background=True)
    snapshots.wait_copied()
    assert snapshots.wait(60) and snapshots.get(7, 0, 20) is None


#: Three ranks: rank 0 receives from ranks 1 and 2 at once (a rank that keeps the
#: snapshots of two wards), and sends its own to rank 2 in the same exchange.
_WARDS = """
import datetime, sys, torch, torch.distributed as dist
from rallypoint.agent.worker.live_state import (
    exchange_packed, pack_state, read_layout, unpack_state)
rank, port = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", int(port), 3, rank == 0,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
mine = pack_state({"rank": torch.full((100_000,), float(rank)), "n": rank}, copy=True)
sends = {0: {2: mine}, 1: {0: mine}, 2: {0: mine}}[rank]
sources = {0: [1, 2], 1: [], 2: [0]}[rank]
got = exchange_packed(sends, sources, group=dist.group.WORLD)
trees = [unpack_state(read_layout(p.layout), p.transfers) for p in got]
print(" ".join(f"{t['n']}:{int(t['rank'].sum().item() // 100_000)}" for t in trees), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.integration
def test_a_rank_receives_from_several_senders_in_one_exchange(tmp_path: Path) -> None:
    outputs = run_ranks(tmp_path, _WARDS, 3)
    assert [o.split() for o in outputs] == [["1:1", "2:2"], [], ["0:0"]], outputs
