# gdn-backport: `make patch` (the main job), `make test`, `make image`, `make gate`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Local mirrors of the upstream repositories (used when present; otherwise the GitHub URLs).
MEGATRON_LM_REPO ?= $(wildcard /work/.mirror/NVIDIA+Megatron-LM/repo)
MEGATRON_BRIDGE_REPO ?= $(wildcard /work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo)
export MEGATRON_LM_REPO MEGATRON_BRIDGE_REPO

.PHONY: venv patch check-patch test test-unit test-image

# ---- backport job -------------------------------------------------------------
# CPU torch for checks and the CPU suite (this machine kind has the 2.13.0 CPU wheel locally).
TORCH_SPEC ?= torch==2.13.0
$(VENV)/.installed: pyproject.toml requirements/verify.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test,image]' -r requirements/verify.txt '$(TORCH_SPEC)'
	touch $@

venv: $(VENV)/.installed

patch: venv  ## Backport 5139086e onto the pinned tree: patch, manifest, trees.
	$(PY) tools/backport --upstream 5139086e --python $(abspath $(PY))

check-patch: venv  ## Regenerate and compare with the files on disk.
	$(PY) tools/backport --check --python $(abspath $(PY))

# ---- tests --------------------------------------------------------------------
test: venv  ## Unit tests, integration test (real mirrors), CPU regression suite.
	$(PY) -m pytest tests -q -rs

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-image: venv
	$(PY) -m pytest tests/image -q -rs

# ---- image (Dockerfile, docker-py) --------------------------------------------
