"""What the tests share, in one place; the tests themselves sit in folders that
mirror the packages (``tests/core``, ``tests/adapters``, ``tests/agent``,
``tests/spec``) plus ``tests/e2e`` and ``tests/chaos`` for scenarios on real agents.

* ``core_scenarios``, ``core_strategies``: states built by the core's own actions,
  and hypothesis strategies of views, sightings and runs;
* ``checker_plants``: protocol bugs planted for the checker and simulator to find;
* ``waiting``: bounded waits (``eventually``, ``join_all``);
* ``cluster``: runs real agents and finds every process they leave; ``etcd_jobs``:
  the same on etcd; ``netns``: network-namespace topologies;
* worker scripts run by real agents: ``peer_worker``, ``train_steps``,
  ``live_steps``, ``torchrun_parity_worker`` (and its ``torchrun.logs_specs`` plugin,
  ``torchrun_parity_logs_specs``); ``shift_clock.c``, an LD_PRELOAD shim that moves
  the wall clock;
* ``gpu_check``: the GPU checks in one command (``python tests/helpers/gpu_check.py``).
"""
