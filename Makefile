# Two commands set everything up on a fresh machine:
#   make demo   - train, preempt with a real SIGTERM, resume, verify bit-identical weights
#   make test   - install what the tests need (venv, etcd, control-plane binaries) and run every tier
SHELL := /bin/bash
export PREEMPTIBLE_CACHE ?= $(HOME)/.cache/preemptible
# this checkout's environment (scripts/bootstrap.sh) and the shared one with the dependencies
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
export PATH := $(VENV)/bin:$(PREEMPTIBLE_CACHE)/venv/bin:$(PATH)

.PHONY: setup demo test test-unit lint cluster-binaries cluster-up bench manifests

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) -m trainer_runtime.demo

lint: setup
	ruff check .
	ruff format --check .

cluster-binaries: setup
	bash tests/cluster/build.sh

test: setup lint cluster-binaries
	$(PY) -m pytest tests --durations=30  # the slowest 30: where a fresh machine's time goes

test-unit: setup
	$(PY) -m pytest tests/unit

cluster-up: setup cluster-binaries
	$(PY) -m tests.cluster.up

bench: setup
	$(PY) benchmarks/resume_time.py
	$(PY) benchmarks/agreement_overhead.py
	$(PY) benchmarks/sampling_balance.py
	$(PY) -P benchmarks/checkpoint_io.py
	$(PY) -P benchmarks/cpu_malloc_tuning.py

# Regenerate the CRD from the operator's models, the chart's admission policy and user roles from
# operator/rbac.py, and the plain install YAML from the chart.
manifests: setup cluster-binaries
	$(PY) -m preemptible_operator.crd --write
	$(PY) -m preemptible_operator.rbac --write
	$(PY) scripts/render_manifests.py
