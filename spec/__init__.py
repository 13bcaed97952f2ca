"""rallypoint.spec: the formal model and the tools that hold the core to it.

Its parts, in the order a newcomer reads them (three sub-packages, then a module):

1. :mod:`rallypoint.spec.model` -- what must hold: the words for a node's lifecycle
   (:mod:`~rallypoint.spec.model.lifecycle`: phases, states), one node's lifecycle
   as a ``transitions`` machine (:mod:`~rallypoint.spec.model.machine`), and the
   safety properties of docs/design.md (:mod:`~rallypoint.spec.model.invariants`);
2. :mod:`rallypoint.spec.check` -- an exhaustive model checker of the real core for
   a few nodes (the package puts it together; its modules: ``state``, ``steps``
   with ``core_steps``, ``conformance`` and ``properties``, ``symmetry``,
   ``search``, ``wire``, ``trace``);
3. :mod:`rallypoint.spec.simulator` -- a deterministic many-node simulator (the
   package wires its parts together: ``config``, ``report``, ``node``, then
   ``events``, ``checks``, ``backend``, ``agent``, ``faults``);
4. :mod:`rallypoint.spec.strategies` -- hypothesis strategies for your own
   properties.

Beside them: :mod:`rallypoint.spec.options` (the range checks the checker's and the
simulator's configs share) and :mod:`rallypoint.spec.cli` (``rallypoint spec
check|diagram``, ``rallypoint simulate``, ``python -m rallypoint.spec``).

Simulations in your own hypothesis tests take the names below from here::

    from rallypoint.spec import sim_configs, simulate

    @given(sim_configs(nodes=8))
    def test_mine(config):
        report = simulate(config)
        assert report.ok, report.format()
        for round, returned in report.by_round().items():
            ...  # returned: slot -> JoinReturn (.joined: its rank, the members)

See docs/spec.md, "Simulations in your own tests".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .simulator import (
        JoinReturn,
        SimConfig,
        SimConfigError,
        SimReport,
        Simulator,
        SimViolation,
        simulate,
    )
    from .strategies import node_descs, rendezvous_settings, rendezvous_states, sim_configs

__all__ = [
    "JoinReturn",
    "SimConfig",
    "SimConfigError",
    "SimReport",
    "SimViolation",
    "Simulator",
    "node_descs",
    "rendezvous_settings",
    "rendezvous_states",
    "sim_configs",
    "simulate",
]

#: Where each exported name lives. They load on first use, so that the checker's
#: processes and ``rallypoint spec`` import neither hypothesis nor the simulator.
_HOMES = {name: "strategies" for name in __all__ if name[0].islower() and name != "simulate"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = importlib.import_module(f".{_HOMES.get(name, 'simulator')}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rallypoint.spec' has no attribute {name!r}")
