# make demo: the shipped checkpoint solves test problems with PD + MTP; make test: the CPU test suite.
# Both create the venv .venv at the checkout root on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch lies on disk; install it before anything that could pull a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,train]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m jaxgdn.generate

# Two workers (pytest-xdist): the suite is mostly XLA compiles, one at a time per process; tests that share
# servers carry an xdist_group and run on one worker.
test: venv
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV)
