"""Helpers of the reliability and chaos tests: a harness that runs real agents and
finds every process they leave (``cluster``), worker scripts (``peer_worker``,
``train_steps``), a wall-clock shifting LD_PRELOAD shim (``shift_clock.c``) and
network-namespace topologies (``netns``)."""
