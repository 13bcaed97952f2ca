"""Resharding in memory: four ranks over gloo on 127.0.0.1 train an FSDP2 model on a
mesh of 4, then rebuild it on another mesh and reshard the state they hold into it.
What each rank loads, gathered whole, is bit for bit what the old mesh held; a
box nobody sends, or a tensor built in another dtype, fails on every rank before
anything moves.

The four cases run one after the other in one set of four ranks (the module's
fixture): a refused plan fails on every rank after one exchange, before anything
moves, so the group is in step for the next case, and each case reshards from the
same trained state (one process start and torch import per rank for all four cases,
not one per case).
"""

from __future__ import annotations

import pytest
from helpers.cluster import run_ranks

pytestmark = pytest.mark.integration

#: (case, new mesh) the script runs, in order
CASES = [("good", "fsdp2"), ("good", "fsdp3"), ("hole", "fsdp2"), ("dtype", "fsdp2")]

#: argv: RANK PORT CASE:NEW_MESH... Trains 2 steps on FSDP over 4 ranks, keeps the
#: whole state (gathered) to compare, and for each case reshards into the new mesh
#: and prints "CASE:NEW_MESH same BYTES SOURCES" or "CASE:NEW_MESH refused: why".
_RESHARD = """
import datetime, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from rallypoint.agent.worker.live import Sharded
from rallypoint.agent.worker.live_reshard import reshard
from rallypoint.agent.worker.live_state import StateTransferError, local_shards, map_leaves
rank, port, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
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
before = whole(old.state_dict())
for name in cases:
    case, new_mesh = name.split(":")
    held = local_shards(old.state_dict())
    shape, names = {"fsdp2": ((2, 2), ("dp", "shard")), "fsdp3": ((4,), ("shard",))}[new_mesh]
    new = build(shape, names, torch.float64 if case == "dtype" and rank == 2 else torch.float32)
    wanted = new.state_dict()
    sources = [] if case == "hole" and rank == 3 else [held]
    try:
        tree, size, came = reshard(sources, wanted, reference=0, group=side)
    except StateTransferError as exc:
        print(name, "refused:", str(exc).replace("\\n", " "), flush=True)
    else:
        new.load_state_dict(tree)
        after = whole(new.state_dict())
        same = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor)
            else before[k] == after[k] for k in before)
        print(name, "same" if same else "differs", size, sorted(came), flush=True)
    dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[str]]:
    """(case, new mesh) -> what each rank printed for it, by rank."""
    ranks = run_ranks(
        tmp_path_factory.mktemp("reshard"), _RESHARD, 4, *(f"{c}:{m}" for c, m in CASES)
    )
    found: dict[tuple[str, str], list[str]] = {}
    for output in ranks:
        lines = {line.split(" ", 1)[0]: line for line in output.splitlines()}
        for case, mesh in CASES:
            found.setdefault((case, mesh), []).append(
                lines.get(f"{case}:{mesh}", f"(no line: {output})").split(" ", 1)[-1]
            )
    return found


def test_fsdp_over_four_ranks_reshards_into_two_replicas_of_two_shards(
    outputs: dict[tuple[str, str], list[str]],
) -> None:
    """FSDP on 4 -> HSDP 2 x 2: every rank needs half of each tensor, two old
    shards; it keeps what it held and gets the rest from the ranks that hold it."""
    found = outputs[("good", "fsdp2")]
    words = [o.split() for o in found]
    assert [w[0] for w in words] == ["same"] * 4, found
    assert all(int(w[1]) > 0 for w in words), found


def test_a_rank_keeping_its_place_reshards_from_itself_alone(
    outputs: dict[tuple[str, str], list[str]],
) -> None:
    """The same mesh again: each rank's boxes are the ones it holds; only the plain
    values (step counts, hyperparameters) come from rank 0."""
    found = outputs[("good", "fsdp3")]
    assert found[0].split()[:3] == ["same", "0", "[]"], found
    for output in found[1:]:
        assert output.split()[0] == "same" and output.split()[2:] == ["[0]"], found


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("hole", "the boxes held cover"),
        ("dtype", "is float64 on rank 2 but float32 elsewhere"),
    ],
)
def test_what_cannot_be_resharded_fails_on_every_rank(
    outputs: dict[tuple[str, str], list[str]], case: str, reason: str
) -> None:
    found = outputs[(case, "fsdp2")]
    assert len(found) == 4 and all(o.startswith("refused:") and reason in o for o in found), found
