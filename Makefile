# The two fresh-machine commands of the README:
#   make run    create .venv, install the package and what the main job needs (no test extras), run the main job
#               (label-skewed FedAvg on the embedded digits)
#   make test   the same install, plus the test extras (pytest, Flower, Ray, TensorBoard, mkdocs), run the suite
VENV ?= .venv
PYTHON ?= python3
# The CPU build of PyTorch; a bare `torch` requirement would pull the newest CUDA build (GBs).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install install-test run test bench docs clean

# The main job's install: torch's CPU build, then the package with its core dependencies only.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

# The test extras on top: pip finds torch and the core dependencies installed and leaves them as they are.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/fedistill run --config configs/digits_fedavg.yaml

# Two test processes with one torch thread each (tests/conftest.py): the small models of the tests use two
# cores poorly inside one process (three were slower). On two idle cores: 4 min 10 s to 5 min 10 s on AVX-512 AMD
# EPYC hosts (1,647 tests at 06:33 on 2026-12-07, 1,657 at 14:12 on another, 1,658 at 18:02 and 1,660 at 20:44 and 21:30
# on that one); on an AVX2-only AMD EPYC (its rounds are 3-3.6x slower) 14 min 22 s for 1,666 (00:08 on 2026-12-08),
# then 13:00, 10:13 and 12:07 for 1,670-1,671 with worker processes forked from a fork server (02:12, 02:51, 03:09); CI's host took 332 s
# for 1,658, and 1,072 s with the install at stop 82; tests/test_cuda.py skips without CUDA. benchmarks/RESULTS.md, "The suite's time". --durations=20
# prints the slowest tests, so a CI log shows where its host spends the time.
test: install-test
	$(PY) -m pytest -n 2 --durations=20

# The documentation site into site/ (open site/index.html; no network needed to build or read it).
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) benchmarks/bench_fedavg_mnist.py

clean:
	rm -rf $(VENV) runs .pytest_cache site
