"""rallypoint.spec: the formal model and the tools that hold the core to it.

* :mod:`rallypoint.spec.lifecycle` -- the words for a node's lifecycle (phases, states);
* :mod:`rallypoint.spec.model` -- one node's lifecycle as a ``transitions`` machine;
* :mod:`rallypoint.spec.invariants` -- the safety properties of docs/design.md;
* :mod:`rallypoint.spec.check` -- an exhaustive model checker of the real core (its
  parts are the ``check_*`` modules);
* :mod:`rallypoint.spec.simulator` -- a deterministic many-node simulator (its
  parts are the ``sim_*`` modules);
* :mod:`rallypoint.spec.strategies` -- hypothesis strategies for your own properties.

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
