"""rallypoint.spec: the formal model and the tools that hold the core to it.

* :mod:`rallypoint.spec.lifecycle` -- the words for a node's lifecycle (phases, states);
* :mod:`rallypoint.spec.model` -- one node's lifecycle as a ``transitions`` machine;
* :mod:`rallypoint.spec.invariants` -- the safety properties of docs/design.md;
* :mod:`rallypoint.spec.check` -- an exhaustive model checker of the real core (its
  parts are the ``check_*`` modules);
* :mod:`rallypoint.spec.simulator` -- a deterministic many-node simulator (its
  parts are the ``sim_*`` modules);
* :mod:`rallypoint.spec.strategies` -- hypothesis strategies for your own properties.

See docs/spec.md.
"""
