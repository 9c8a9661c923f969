# Two commands do all the set-up on a fresh machine:
#   make run    the main job (see README)
#   make test   the test suite (what CI runs; `make test-all` adds the slow end-to-end variants)
# Both create .venv (Python >= 3.12), install the dependencies and build the
# native extension first, once.

VENV     ?= .venv
PYBIN    := $(VENV)/bin/python
STAMP    := $(VENV)/.fthsdp-installed
NATIVE   := $(wildcard ffi/*.h ffi/*.cc ffi/*/*.h ffi/*/*.cc ffi/cuda/*.cu fthsdp/proto/*.proto) CMakeLists.txt pyproject.toml
PYTEST_ARGS ?=

.PHONY: install run train test test-all clean study

install: $(STAMP)

$(STAMP): $(NATIVE) scripts/find_python.sh scripts/install_system_deps.sh
	bash scripts/install_system_deps.sh
	@test -x $(PYBIN) || "$$(bash scripts/find_python.sh)" -m venv $(VENV)
	$(PYBIN) -m pip install -q --upgrade pip
	$(PYBIN) -m pip install -q "jax>=0.11.2" "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja "grpcio-tools>=1.60"
	$(PYBIN) -m pip install -q --no-build-isolation -e ".[test,ray]"
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/fthsdp run --config configs/ft_local.py

train: run

test: $(STAMP)
	$(PYBIN) -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	FTHSDP_RUN_SLOW=1 $(PYBIN) -m pytest $(PYTEST_ARGS)

study: $(STAMP)
	$(PYBIN) experiments/lr_intervention.py --quick --out results/lr_quick.json

clean:
	rm -rf build $(VENV) .cache runs
