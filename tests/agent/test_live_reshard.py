"""Resharding in memory: four ranks over gloo on 127.0.0.1 train an FSDP2 model on a
mesh of 4, then rebuild it on another mesh and reshard the state they hold into it.
What each rank loads, gathered whole, is bit for bit what the old mesh held; a
box nobody sends, or a tensor built in another dtype, fails on every rank before
anything moves."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cluster import run_ranks

pytestmark = pytest.mark.integration

#: argv: RANK PORT CASE NEW_MESH. Trains 2 steps on FSDP over 4 ranks, keeps the
#: whole state (gathered) to compare, reshards into the new mesh and prints
#: "same BYTES SOURCES" or "refused: why".
_RESHARD = """
import datetime, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from rallypoint.agent.worker.live import Sharded
from rallypoint.agent.worker.live_reshard import reshard
from rallypoint.agent.worker.live_state import StateTransferError, local_shards, map_leaves
rank, port, case, new_mesh = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", int(port), 4, rank == 0,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
side = dist.new_group(backend="gloo")

def build(shape, names, dtype=torch.float32):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return Sharded(model, torch.optim.Adam(model.parameters(), lr=0.01))

def whole(tree):
    out = {}
    def keep(path, v):
        out[path] = v.full_tensor() if isinstance(v, DTensor) else v
        return v
    map_leaves(tree, keep)
    return out

old = build((4,), ("shard",))
for step in range(2):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    old.model(x).pow(2).mean().backward()
    old.optimizer.step()
    old.optimizer.zero_grad()
state = old.state_dict()
before = whole(state)
held = local_shards(state)
shape, names = {"fsdp2": ((2, 2), ("dp", "shard")), "fsdp3": ((4,), ("shard",))}[new_mesh]
new = build(shape, names, torch.float64 if case == "dtype" and rank == 2 else torch.float32)
wanted = new.state_dict()
sources = [] if case == "hole" and rank == 3 else [held]
try:
    tree, size, came = reshard(sources, wanted, reference=0, group=side)
except StateTransferError as exc:
    print("refused:", exc, flush=True)
else:
    new.load_state_dict(tree)
    after = whole(new.state_dict())
    same = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor)
        else before[k] == after[k] for k in before)
    print("same" if same else "differs", size, sorted(came), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp_over_four_ranks_reshards_into_two_replicas_of_two_shards(tmp_path: Path) -> None:
    """FSDP on 4 -> HSDP 2 x 2: every rank needs half of each tensor, two old
    shards; it keeps what it held and gets the rest from the ranks that hold it."""
    outputs = run_ranks(tmp_path, _RESHARD, 4, "good", "fsdp2")
    words = [o.split() for o in outputs]
    assert [w[0] for w in words] == ["same"] * 4, outputs
    assert all(int(w[1]) > 0 for w in words), outputs


def test_a_rank_keeping_its_place_reshards_from_itself_alone(tmp_path: Path) -> None:
    """The same mesh again: each rank's boxes are the ones it holds; only the plain
    values (step counts, hyperparameters) come from rank 0."""
    outputs = run_ranks(tmp_path, _RESHARD, 4, "good", "fsdp3")
    assert outputs[0].split()[:3] == ["same", "0", "[]"], outputs
    for output in outputs[1:]:
        assert output.split()[0] == "same" and output.split()[2:] == ["[0]"], outputs


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("hole", "the boxes held cover"),
        ("dtype", "is float64 on rank 2 but float32 elsewhere"),
    ],
)
def test_what_cannot_be_resharded_fails_on_every_rank(
    tmp_path: Path, case: str, reason: str
) -> None:
    outputs = run_ranks(tmp_path, _RESHARD, 4, case, "fsdp2")
    assert all("refused:" in o and reason in o for o in outputs), outputs
