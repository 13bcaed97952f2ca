"""rallypoint.agent.worker: the code that runs inside a worker's process.

The agent (``rallypoint.agent``, the supervisor) starts processes; what those
processes import lives here, so the folder says which process a line runs in:

* :mod:`.live`: the live-regroup API a training script uses (``live.Job``), with
  the state it moves (:mod:`.live_state`), keeps (:mod:`.live_snapshots`) and
  reshards (:mod:`.live_reshard`), and the worker's end of the local channel to its
  agent (:mod:`.live_channel`, whose wire format the agent's
  :mod:`rallypoint.agent.handover` speaks too);
* :mod:`.warm`: a warm spare (``python -m rallypoint.agent.worker.warm``), which
  imports torch and the live API before a worker is needed, then becomes one;
* :mod:`.function`: the worker of :func:`rallypoint.agent.elastic_launch` for a
  Python function, and of ``--run-path``;
* :mod:`.health`: the process of the pre-flight health check
  (``python -m rallypoint.agent.worker.health``).

The rule (``tests/test_import_graph.py``): nothing here imports the supervisor's
modules (but the leaf :mod:`rallypoint.agent.errors`, for :func:`record`), so a
worker stays cheap to import; the supervisor imports this side only where it
starts a worker or speaks to one. This package's ``__init__`` imports nothing.
"""
