# Two commands on a fresh machine (see README):
#   make demo   run the main job: a real elastic launch with the embedded c10d store,
#               a worker crash mid-run and a live regroup
#   make test   install everything into .venv and run the whole suite
#   (make test-fast: the pure parts only, in about a minute and a half)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rallypoint-installed
# Processes that share the suite (pytest-xdist) on 2 cores: with one, a core idles
# while tests wait on real agents, servers and timeouts; with two, about a quarter
# of the cores' time is still idle (most of the suite's CPU is processes starting:
# each agent and worker imports torch). Three were 5% faster on a host that
# imports torch in 1.5 s, and 5% slower on one that takes 3 s (load average 9,
# and a timing test failed), four no faster. Every test must pass with the other
# process's load beside it. A module's tests stay in one process (--dist
# loadfile): some share an expensive run (a module fixture).
TEST_PROCESSES ?= 2
# The project's bytecode, written before a run: each agent and worker process the
# suite starts imports the project again, and where the environment forbids
# writing bytecode (PYTHONDONTWRITEBYTECODE) compiles every module it imports each
# time: about a sixth of the suite's CPU time. Only changed files are recompiled.
BYTECODE := $(PY) -m compileall -q -j 0 *.py core adapters agent spec tests bench examples

.PHONY: install demo test test-fast chaos lint bench

$(STAMP): pyproject.toml Makefile
	# The state diagram (rallypoint spec diagram) renders with graphviz's dot.
	command -v dot >/dev/null || (apt-get update -q && apt-get install -y -q graphviz) \
		|| echo "graphviz not installed: the diagram PNG test will be skipped"
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: this version's CPU build is on local disk; a bare
	# "torch" requirement would download a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# dev brings the extras run (the launcher, the c10d/etcd adapters) and plot.
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rallypoint run --standalone --nproc-per-node 2 --live --max-restarts 1 \
		examples/train.py --steps 400 --crash-at-step 155

# The type check runs beside the suite, not before it: the suite leaves a quarter
# of the cores' time idle (its tests wait on agents, servers and timeouts), and
# mypy's 20-30 s of one core fit there. Its report is printed when the suite ends;
# either failing fails the target.
MYPY_REPORT := $(VENV)/mypy-report.txt
SUITE := $(PY) -m pytest -q -p no:cacheprovider --durations=10 -n $(TEST_PROCESSES) --dist loadfile

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(BYTECODE)
	@echo "$(VENV)/bin/mypy (beside the suite; its report follows the suite's)"
	@$(VENV)/bin/mypy > $(MYPY_REPORT) 2>&1 & typecheck=$$!; \
	echo "$(SUITE)"; $(SUITE); \
	suite=$$?; wait $$typecheck; types=$$?; \
	echo "$(VENV)/bin/mypy:"; cat $(MYPY_REPORT); \
	[ $$suite -eq 0 ] && [ $$types -eq 0 ]

# The pure parts (core, spec, the driver's executor on the memory backend), without
# real processes, servers or the long checker searches, and a tenth of each property
# test's examples (tests/helpers/examples.py): about 40 s, for the edit loop.
test-fast: $(STAMP)
	$(BYTECODE)
	RALLYPOINT_FAST_EXAMPLES=1 $(PY) -m pytest -q -p no:cacheprovider -m "not integration and not slow"

# The fault-injection scenarios (etcd failover, SIGKILL loops, partitions, clock
# shifts) at full length; make test runs the same scenarios in reduced form.
chaos: $(STAMP)
	$(BYTECODE)
	RALLYPOINT_CHAOS_FULL=1 $(PY) -m pytest -q -p no:cacheprovider -m chaos

bench: $(STAMP)
	$(PY) bench/core_throughput.py
	$(PY) bench/simulator_throughput.py
	$(PY) bench/rendezvous_latency.py
	$(PY) bench/recovery.py
