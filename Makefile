# gdn-backport: `make patch` (the main job), `make test`, `make image`, `make gate`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Upstream sources: only from the environment (MEGATRON_LM_REPO / MEGATRON_BRIDGE_REPO, a URL or
# a local mirror); unset, tools/backport uses the GitHub URLs. No machine-specific default here.
export MEGATRON_LM_REPO MEGATRON_BRIDGE_REPO

# $(call tool,CMD): run one of our tools. make itself exits 2 for any failed recipe, which hides
# the tool's documented exit code (README "Exit codes"); so a failure prints that code, and with
# TOOL_RC_FILE set (.ci/run sets it) also writes it there, for a caller to exit with.
TOOL_RC_FILE ?=
define tool
echo '$(strip $(1))'; rc=0; $(1) || rc=$$?; if [ $$rc -ne 0 ]; then \
  echo "make $@: the tool exited $$rc (README \"Exit codes\"); make itself exits 2. Command: $(strip $(1))" >&2; \
  $(if $(TOOL_RC_FILE),echo $$rc > $(TOOL_RC_FILE);) exit $$rc; fi
endef

.PHONY: venv patch release check-patch test test-unit test-image

# ---- backport job -------------------------------------------------------------
# CPU torch for checks and the CPU suite (this machine kind has the 2.13.0 CPU wheel locally).
TORCH_SPEC ?= torch==2.13.0
$(VENV)/.installed: pyproject.toml requirements/verify.txt
	@if [ -L $(VENV) ] || { [ -e $(VENV) ] && [ ! -d $(VENV) ]; }; then \
	  echo "error: $(VENV) is a link or a file, and $(VENV)/.installed is older than pyproject.toml or requirements/verify.txt (or missing): make would rebuild it" >&2; \
	  echo "hint: keep the shared venv: run \`make -o $(VENV)/.installed <target>\`, or remove the link and run make again to build a venv here" >&2; exit 2; fi
	python3 -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test,image,bench]' -r requirements/verify.txt '$(TORCH_SPEC)'
	touch $@

venv: $(VENV)/.installed

patch: venv  ## Backport 5139086e onto the pinned tree: patch, manifest, trees, dated as manifests/lock.json (the committed bytes).
	@$(call tool,$(PY) tools/backport --upstream 5139086e --python $(abspath $(PY)))

# A new dated release: DATE=YYYY-MM-DD (default today, UTC). Re-dates manifests/lock.json and
# says what changed; commit the lock to publish it.
DATE ?=
release: venv  ## New dated patch + lock (DATE=YYYY-MM-DD, default today UTC); says what changed in manifests/lock.json.
	@$(call tool,$(PY) tools/backport --upstream 5139086e --python $(abspath $(PY)) --release $(if $(DATE),--date $(DATE)))

# The cuda images cannot be built here (their NGC base cannot be pulled): prove each cuda lock
# installs for Python 3.12 manylinux x86_64 (pip resolver dry run, hashes required) and covers
# Bridge's declared deps: the default FLA 0.4.2 set and the FLA 0.5.2 and 0.6.0 sets, in one command.
.PHONY: check-locks
check-locks: venv  ## Every cuda lock (FLA 0.4.2 default, 0.5.2, 0.6.0) resolves (pip dry run; needs PyPI).
	@$(call tool,$(PY) tools/image check-lock --flavour cuda --fla all)

check-patch: venv  ## Regenerate with the lock's date and compare with the files on disk (the lock alone in a fresh clone).
	@$(call tool,$(PY) tools/backport --check --python $(abspath $(PY)))

# ---- tests --------------------------------------------------------------------
# The Docker tests (tests/unit/test_image_docker.py) are opt-in, GDN_DOCKER_TESTS=1: `make test`
# runs them (holding the engine's lock that tools/image takes); the quick check does not.
PYTEST := $(PY) -m pytest
# JUNIT_DIR=DIR (.ci/run sets it): each pytest run also writes DIR/junit-<name>.xml (per-test seconds).
JUNIT_DIR ?=
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/junit-$(1).xml)
.PHONY: test-host test-gated check

test: venv  ## Everything: unit tests (Docker tests included), integration (real mirrors), CPU image suite.
	GDN_GATE_CASES= GDN_DOCKER_TESTS=1 $(PYTEST) tests -q -rs $(call junit,test)

test-unit: venv  ## Quick check: unit tests without Docker, mirrors or network; prints skip reasons.
	$(PYTEST) tests/unit -q -rs $(call junit,unit)

test-image: venv
	$(PYTEST) tests/image -q -rs $(call junit,image)

check: venv  ## While editing (a few minutes): unit tests up to the first failure, then what `make check-patch` runs.
	$(PYTEST) tests/unit -q -x
	@$(call tool,$(PY) tools/backport --check --python $(abspath $(PY)))

# .ci/run splits `make test` in two around the image gate, so that nothing runs twice:
# test-host runs while the image builds: unit (no Docker) + integration, and the real-FLA CPU
# tier (never run in the image: run-suite.sh leaves it out); test-gated runs after the gate: the
# Docker tests and the rest of tests/image, less every test the gate passed (GATE_CASES, read by
# tests/conftest.py). Together they run what `make test` runs.
GATE_CASES ?= $(CI_REPORTS)/gate-report-cases.json
test-host: venv  ## CI, part 1: unit tests but the Docker ones, integration tests, the real-FLA CPU tier.
	GDN_GATE_CASES= $(PYTEST) tests/unit tests/integration -q -rs --ignore=tests/unit/test_image_docker.py $(call junit,host)
	GDN_GATE_CASES= $(PYTEST) tests/image -q -rs -m fla_interpret $(call junit,fla)

test-gated: venv  ## CI, part 2 (after `make gate`): the Docker tests, tests/image less what passed in the gate.
	GDN_DOCKER_TESTS=1 GDN_GATE_CASES=$(abspath $(GATE_CASES)) $(PYTEST) tests/unit/test_image_docker.py tests/image \
	  -q -rs -m "not fla_interpret" $(call junit,gated)

# ---- the real-FLA CPU tier on each FLA set (docs/fla-versions.md "What is tested where") ----
# `make test-fla-interpret FLA=0.5.2` builds build/fla-tier/venv-0.5.2 (never the shared .venv):
# requirements/verify.txt with its FLA axis replaced by the set's pins, the project's CPU torch,
# then runs `tests/image -m fla_interpret` there and records versions, counts and seconds in
# results/fla-tiers/fla<digits>.json (tests/image/fla_tier_record.py). Not in CI: the 0.4.2 tier
# already runs there (test-host), and each other set takes as long again (results/fla-tiers/README.md).
FLA_TIER_SETS := 0.4.2 0.5.2 0.6.0
FLA_TIER_DIR ?= build/fla-tier
FLA_TIER_PYTHON ?= python3.11
fla_tier_triton = $(if $(filter 0.4.2,$(1)),3.6.0,3.7.1)
# FLA 0.6.0's set is fla-core alone, as in its image lock (image_pipeline/lock.py FLA_SETS).
fla_tier_packages = $(if $(filter 0.6.0,$(1)),fla-core==$(1),flash-linear-attention==$(1) fla-core==$(1))
FLA_TIER_VENV = $(FLA_TIER_DIR)/venv-$(FLA)

.PHONY: test-fla-interpret fla-tier-venv
$(FLA_TIER_DIR)/venv-%/.installed: pyproject.toml requirements/verify.txt
	@case " $(FLA_TIER_SETS) " in *" $* "*) ;; *) echo "error: no CPU tier for FLA $*; sets: $(FLA_TIER_SETS)" >&2; \
	  echo "hint: make test-fla-interpret FLA=<one of $(FLA_TIER_SETS)>" >&2; exit 2;; esac
	rm -rf $(@D)
	$(FLA_TIER_PYTHON) -m venv $(@D)
	grep -v -E '^(triton|flash-linear-attention|fla-core)==' requirements/verify.txt > $(@D)/requirements.txt
	printf '%s\n' triton==$(call fla_tier_triton,$*) $(call fla_tier_packages,$*) >> $(@D)/requirements.txt
	$(@D)/bin/python -m pip install -q '$(TORCH_SPEC)'
	$(@D)/bin/python -m pip install -q -e '.[test]' -r $(@D)/requirements.txt '$(TORCH_SPEC)'
	touch $@

fla-tier-venv: $(FLA_TIER_VENV)/.installed  ## The CPU tier's venv of FLA set FLA= (build/fla-tier/venv-<set>).

test-fla-interpret: $(FLA_TIER_VENV)/.installed  ## The real-FLA CPU tier on FLA set FLA= (0.4.2, 0.5.2, 0.6.0) in its own venv -> results/fla-tiers/.
	@mkdir -p $(FLA_TIER_DIR)/run-$(FLA)
	rc=0; GDN_GATE_CASES= GDN_FLA_TIER_RECORD=$(FLA_TIER_DIR)/run-$(FLA)/tier.json $(FLA_TIER_VENV)/bin/python -m pytest \
	  tests/image -q -rs -m fla_interpret -p no:cacheprovider --junitxml=$(FLA_TIER_DIR)/run-$(FLA)/junit.xml || rc=$$?; \
	$(FLA_TIER_VENV)/bin/python tests/image/fla_tier_record.py $(FLA_TIER_DIR)/run-$(FLA) results/fla-tiers || { [ $$rc -ne 0 ] || rc=1; }; \
	exit $$rc

# ---- GPU host (tools/gpu-suite, tools/bench-gdn; docs/gpu.md) ---------------------
# FLA wheels for the GPU host's Python (3.12 on the device tool's H200 hosts).
GPU_PYTHON_VERSION ?= 3.12
WHEEL_DL = $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION)

.PHONY: wheels gpu-bundle gpu-suite gpu-training

.whl/fla042/.ok: | venv
	$(WHEEL_DL) -d .whl/fla042 flash-linear-attention==0.4.2 fla-core==0.4.2
	touch $@

.whl/fla041/.ok: | venv
	$(WHEEL_DL) -d .whl/fla041 flash-linear-attention==0.4.1 fla-core==0.4.1
	touch $@

wheels: .whl/fla042/.ok .whl/fla041/.ok  ## FLA 0.4.2 (patched tree) and 0.4.1 (base tree) wheels for the GPU host.

# The other FLA sets for GDN_FLA_SET=0.5.2 / 0.6.0 (tools/gpu-suite, tools/gpu-fla-sweep); 0.6.0 is
# fla-core alone, as in its image lock. Their triton 3.7.1 is carried apart (docs/gpu.md).
.whl/fla052/.ok: | venv
	$(WHEEL_DL) -d .whl/fla052 flash-linear-attention==0.5.2 fla-core==0.5.2
	touch $@

.whl/fla060/.ok: | venv
	$(WHEEL_DL) -d .whl/fla060 fla-core==0.6.0
	touch $@

.PHONY: wheels-fla-sets
wheels-fla-sets: .whl/fla052/.ok .whl/fla060/.ok  ## FLA 0.5.2 and 0.6.0 wheels for the GPU host (GDN_FLA_SET).

gpu-bundle: wheels  ## dist/gdn-gpu-bundle.tgz: repo, both trees, patch, wheels, Triton caches.
	tools/gpu-bundle

gpu-suite:  ## On a host with one GPU or more (4 ranks share them): the GPU part of the regression suite -> results/raw/gpu-suite.
	tools/gpu-suite

gpu-training:  ## On a GPU host: the training tier's full matrix -> results/raw/training (docs/training-tier-tests.md).
	tools/gpu-training

# ---- image (Dockerfile, docker-py) --------------------------------------------
# Owned by the image pipeline (Dockerfile, docker/, image_pipeline/, tools/image).
# Both targets need a Docker Engine; on a machine without one: `sudo tools/dockerd-up`
# (or `make dockerd`). `make image` builds the users' cuda flavour by default, which
# needs the NGC base image present locally (no registry is reachable here); the
# gate builds the cpu flavour (local Debian base + CPU torch), which runs anywhere.
IMAGE_FLAVOUR ?= cuda
GATE_FLAVOUR ?= cpu
# FLA set of `make image`: 0.4.2 (default), 0.5.2 or 0.6.0 (cuda only; README "Choosing an FLA version").
FLA ?= 0.4.2
IMAGE_ARGS ?=
# Where `make gate` writes its report: build/ci/ (ignored by git), so a gate run by hand changes
# no tracked file; `make record-gate` copies it over the committed gate on record
# (results/pipeline/gate-report.json), on purpose.
CI_REPORTS ?= build/ci
GATE_REPORT ?= $(CI_REPORTS)/gate-report.json

.PHONY: image gate record-gate image-measure dockerd

dockerd:  ## Start a Docker Engine (Debian docker.io, overlay2 else vfs, no bridge) and wait for it.
	@$(call tool,tools/dockerd-up)

image: venv  ## Build the training image from build/tree/base + patches/latest (docker-py).
	@$(call tool,$(PY) tools/image build --flavour $(IMAGE_FLAVOUR) --fla $(FLA) $(IMAGE_ARGS))

gate: venv  ## Build the cpu image, run its regression suite inside it, write $(GATE_REPORT).
	@$(call tool,$(PY) tools/image gate --flavour $(GATE_FLAVOUR) --report $(GATE_REPORT) $(IMAGE_ARGS))

record-gate:  ## Copy CI's gate report ($(CI_REPORTS)/gate-report.json) over the committed results/pipeline/gate-report.json.
	@test -f $(CI_REPORTS)/gate-report.json || { echo "error: no $(CI_REPORTS)/gate-report.json"; echo "hint: run make gate (or bash .ci/run) first"; exit 1; } >&2
	cp $(CI_REPORTS)/gate-report.json results/pipeline/gate-report.json
	@echo "copied $(CI_REPORTS)/gate-report.json -> results/pipeline/gate-report.json; commit it to record this gate"

image-measure: venv  ## Cold build and one-line-patch rebuild times -> results/pipeline/image-timings.json.
	@$(call tool,$(PY) tools/image measure --flavour $(GATE_FLAVOUR) $(IMAGE_ARGS))
