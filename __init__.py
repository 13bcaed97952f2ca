"""rallypoint: elastic distributed training with a model-checked rendezvous.

Subpackages:

* :mod:`rallypoint.core` -- the pure rendezvous state machine (no IO, no clock reads).
* :mod:`rallypoint.adapters` -- backends (memory, c10d, etcd) and the rendezvous handler.
* :mod:`rallypoint.agent` -- the elastic agent and the torchrun-compatible launcher.
* :mod:`rallypoint.spec` -- the formal model, invariants, model checker and simulator.
"""

__version__ = "0.1.0"
