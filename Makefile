# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
RIGCTL := $(VENV)/bin/rigctl
# Slow things (lab base image, source archives, wheels, llama.cpp builds) are cached here.
export RIGCTL_CACHE_DIR ?= $(HOME)/.cache/rigctl
export PIP_CACHE_DIR ?= $(RIGCTL_CACHE_DIR)/pip
# The lab rigs need these from the distribution (systemd-nspawn, debootstrap, ip, ssh, zstd).
# Prometheus (and promtool) from Debian: the monitoring tests start the real thing.
HOST_PACKAGES := systemd-container debootstrap iproute2 openssh-client zstd prometheus

.PHONY: demo test check docs lint venv host-deps prepare cuda-check gpu-check upgrade-check wheel-check floor-check \
	lab-down clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

host-deps:
	@missing=""; for p in $(HOST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

lint: venv
	$(VENV)/bin/ruff check rigctl tests perf
	# The roles' modules and plugins run under Ansible, in its style; names that do not resolve are errors anywhere.
	$(VENV)/bin/ruff check --select F,E9 roles
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/ansible-lint --offline -q playbooks/ roles/

# The manual (docs/, mkdocs.yml) as a static site in site/; --strict: a broken link or anchor between pages fails it
# (not --quiet: mkdocs then drops the warnings before --strict counts them, and passes).
docs: venv
	$(VENV)/bin/mkdocs build --strict -d $(CURDIR)/site

# Lint, the manual and the unit tests (no lab rigs, no root): the quick loop while working.
check: lint docs
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/pytest -q -n auto tests/unit

# The lab's slow one-time work (base image, the lab's llama.cpp build) into the cache, as its own step
# with its own progress and timings: seconds when the cache has it, and no test's time limit pays for it.
prepare: venv host-deps
	$(RIGCTL) lab prepare

# Everything: lint, the unit tests, then the lab tests on real rigs (one session, one lab).
test: check prepare
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/pytest --durations=20 tests/lab

# The upgrade and bisect scenarios on the lab (tests/lab/test_upgrade_lab.py): several llama.cpp builds,
# minutes each on two cores even ccache-warm, so outside `make test` and CI's budget. RIGCTL_LAB_SLOT picks
# the lab; the compiles run at nice 10.
upgrade-check: prepare
	RIGCTL_UPGRADE_CHECK=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH nice -n 10 $(VENV)/bin/pytest -v -s \
	  -o timeout=10800 tests/lab/test_upgrade_floor_lab.py tests/lab/test_upgrade_lab.py

# rigctl as a user installs it: the wheel built from this checkout, installed in a fresh venv outside it and run
# there with no RIGCTL_PROJECT (--version, init, inventory check, provision --check on the lab), and the rigctl.fleet
# collection it builds, used by a user's own playbook on the lab (tests/lab/test_install_lab.py, also in `make test`).
wheel-check: prepare
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/pytest -v tests/unit/test_packaging.py tests/lab/test_install_lab.py

# The dependency floors are true: a venv with the lowest version of each dependency pyproject.toml allows
# (tests/dependency_floors.py), pip's own consistency check, then the CLI's unit tests on it.
FLOOR_VENV ?= .venv-floor
floor-check:
	rm -rf $(FLOOR_VENV)
	python3 -m venv $(FLOOR_VENV)
	python3 tests/dependency_floors.py > $(FLOOR_VENV)/floors.txt
	$(FLOOR_VENV)/bin/pip install -q -c $(FLOOR_VENV)/floors.txt -e . pytest pytest-timeout hypothesis
	$(FLOOR_VENV)/bin/pip check
	PATH=$(CURDIR)/$(FLOOR_VENV)/bin:$$PATH $(FLOOR_VENV)/bin/pytest -q -p no:cacheprovider \
	  tests/unit/test_bad_input.py tests/unit/test_packaging.py

# Opt-in, outside `make test`'s budget: the pinned llama.cpp built WITH CUDA (sm_75 and sm_86) on a lab rig
# from NVIDIA's CUDA wheels, then refused there by the smoke test for lack of a GPU (docs/builds.md has the
# compile's cost). It leaves the build in the cache, where `make test` then checks it without compiling.
cuda-check: prepare
	RIGCTL_CUDA_CHECK=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/pytest -v -rA tests/lab/test_cuda_lab.py \
	  tests/lab/test_llama_cpp_lab.py::test_cuda_configure_accepts_the_flags

# On a machine with an NVIDIA GPU, its driver and nvcc (as root; no network, no lab): the pinned llama.cpp built with
# CUDA for that GPU only, the role's smoke test, rigctl's probe, a bench cell with clock readings and a server decode
# against the card's bandwidth bound, on a random-weight model made there (perf/gpu_check.py; docs/benchmarks.md has it).
# Without a GPU it refuses in one line before building. The venv's Python when there is one, else the system's
# (a machine without network has no venv; it needs PyYAML, ruamel.yaml and numpy). GPU_CHECK_ARGS: e.g. --model-mib 1024.
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) perf/gpu_check.py $(GPU_CHECK_ARGS)

demo: prepare
	$(RIGCTL) inventory check
	$(RIGCTL) lab up
	$(RIGCTL) provision
	$(RIGCTL) hosts
	$(RIGCTL) servers
	$(RIGCTL) campaign run campaigns/lab.yml
	$(RIGCTL) report campaigns/lab.yml
	@echo "The lab rigs stay up: '$(RIGCTL) lab ssh desktop' to look around, '$(RIGCTL) lab down' to remove them."

lab-down: venv
	$(RIGCTL) lab down

clean: lab-down
	rm -rf $(VENV)
