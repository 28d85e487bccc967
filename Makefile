# hpctrain — the commands a newcomer runs. Everything installs itself: CI runs `make test` on a clean clone.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PYTHON ?= python3
# torch is pinned; which build comes depends on the index: PyPI's Linux wheel is the CUDA build (multi-GB, what
# GPU nodes want), TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU build (a login node, a test box).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
DEEPSPEED_SPEC ?= deepspeed==0.19.8
CLUSTER := tests/cluster/slurm.sh

.PHONY: help install install-base install-node install-system cluster-up cluster-down test test-fast demo bench lint clean

help:
	@echo "make demo      install, then train a small model on the local executor (2 ranks, ZeRO-3)"
	@echo "make test      install everything (apt included), start the 4-node SLURM cluster, run the tests"
	@echo "make install   base CLI + node extra into $(VENV)"

$(VENV)/bin/python:
	@echo "== install: a virtual environment in $(VENV) (seconds)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

# Login-node install: the CLI only (click, jinja2, submitit, rich, tomli-w). No torch.
install-base: $(VENV)/bin/python
	@echo "== install: the hpctrain CLI (base profile, no torch)"
	$(PIP) install -e .

# Compute-side install. Order matters: torch first (pinned), then deepspeed from source against it
# (--no-build-isolation, so its build sees this torch), then the rest of the node extra.
install-node: install-base
	@echo "== install: $(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX),) (the largest download: minutes on a cold cache)"
	$(PIP) install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)",)
	$(PIP) install ninja setuptools wheel
	@echo "== install: $(DEEPSPEED_SPEC), built from source against that torch"
	$(PIP) install --no-build-isolation "$(DEEPSPEED_SPEC)"
	@echo "== install: the node extra (transformers, datasets, ...), test and plot tools, trackers (wandb, mlflow), bitsandbytes (QLoRA)"
	$(PIP) install -e ".[node,test,plot,wandb,mlflow,qlora]"

install: install-node
	@echo "== installed. Put hpctrain on PATH in your shell: source $(VENV)/bin/activate"

# Debian packages the tests need: SLURM + accounting (slurmdbd, MariaDB), munge, and tools for the cluster
# namespaces; podman, runc, debootstrap and Charliecloud for the container tests (as root; each skips apt
# when every program is present). Before pytest starts: tests that need podman check for it at collection,
# so a fixture installing it later would leave them skipped on a fresh machine. shellcheck: the test extra.
install-system:
	bash $(CLUSTER) install
	bash tests/cluster/login_sshd.sh install  # openssh-server + rsync: the login node of tests/test_remote_slurm.py
	bash containers/build.sh deps

# The local 4-node cluster (tests/cluster/slurm.sh; LAB=/tmp/hpctrain-slurm, nodes node1..node4, partition debug).
.PHONY: cluster-status cluster-wipe
cluster-up: install-system
	bash $(CLUSTER) up --keep

cluster-down:
	bash $(CLUSTER) down

cluster-status:
	bash $(CLUSTER) status

cluster-wipe:
	bash $(CLUSTER) wipe

# pytest-xdist (tests/conftest.py groups the tests): one worker runs every SLURM/container test in turn while the
# others run the rest, file by file: the cluster's waits (signals, time limits, requeues) overlap CPU work.
# HPCTRAIN_TEST_CLUSTER_LANES=2: the cluster modules that do not kill or slow nodes go to any idle worker once the
# others are done (slower on 2 cores: the jobs are CPU-bound; see tests/conftest.py).
TEST_WORKERS ?= 2
test: install install-system
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadgroup tests

test-fast: install-base
	$(PY) -m pytest -q -m "not slurm and not deepspeed and not container" tests

demo: install
	@echo "== demo: train, preempt, resume, summarise (about a minute on an idle machine)"
	bash examples/demo.sh

bench: install
	$(PY) bench/cli_startup.py

# The linters need no torch: a light venv (the base install and the pinned linters, pyproject's lint extra; about
# 15 s to build from a warm pip cache) that mypy sees exactly as the full one (it skips the node extra's modules).
# `make lint LINT_VENV=.venv` lints in the full install instead, with the same verdict.
LINT_VENV ?= .venv-lint
$(LINT_VENV)/.lint-installed: pyproject.toml
	@echo "== lint: the linters in $(LINT_VENV) (no torch)"
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip --disable-pip-version-check -q install -e ".[lint]"
	touch $@

lint: $(LINT_VENV)/.lint-installed
	$(LINT_VENV)/bin/ruff check toolkit tests bench
	$(LINT_VENV)/bin/mypy --cache-dir $(LINT_VENV)/.mypy_cache
	$(LINT_VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(LINT_VENV) build dist *.egg-info toolkit/*.egg-info

# The node container image (containers/README.md): apt deps (podman, runc, debootstrap, charliecloud-runtime),
# a debootstrap Debian base, localhost/hpctrain:cpu from ./Dockerfile and a Charliecloud directory copy.
# Cached by podman: seconds when nothing changed. A GPU image for a cluster: `hpctrain image build`.
.PHONY: image
image:
	bash containers/build.sh ci
