# The two fresh-machine commands of the README:
#   make run    create .venv, install, run the main job (label-skewed FedAvg on the embedded digits)
#   make test   create .venv, install with test extras, run the test suite
VENV ?= .venv
PYTHON ?= python3
# The CPU build of PyTorch; a bare `torch` requirement would pull the newest CUDA build (GBs).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install run test bench docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/fedistill run --config configs/digits_fedavg.yaml

# Two test processes with one torch thread each (tests/conftest.py): the small models of the tests use two
# cores poorly inside one process; on two idle cores the suite takes about 8 minutes (1,304 tests; tests/test_cuda.py skips without CUDA).
test: install
	$(PY) -m pytest -n 2

# The documentation site into site/ (open site/index.html; no network needed to build or read it).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) benchmarks/bench_fedavg_mnist.py

clean:
	rm -rf $(VENV) runs .pytest_cache site
