#!/bin/sh
# Dockerfile stage `deps`: make /opt/gdn/venv and install the hash-locked packages.
#   install-deps.sh base    torch comes with the base image (cuda flavour)
#   install-deps.sh wheel   install deps/torch-cpu.lock first (cpu flavour)
# The venv sees the base image's site-packages (--system-site-packages), so the
# NGC torch stays in use; the pinned packages shadow any other version there.
set -eu
DEPS=/opt/gdn/deps
VENV=/opt/gdn/venv
TORCH_FROM=${1:-base}

say() { echo "==> [deps] $*"; }
die() { echo "error: [deps] $*" >&2; exit 1; }

command -v python3 >/dev/null 2>&1 || die "the base image has no python3; use a base with CPython >= 3.10 and its venv module"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "python3 of the base image is older than 3.10"
python3 -c 'import ensurepip, venv' 2>/dev/null || die "python3 of the base image lacks ensurepip (Debian: install python3-venv)"

say "python: $(python3 -c 'import sys; print(sys.version.split()[0])'), torch from: ${TORCH_FROM}"
python3 -m venv --system-site-packages "$VENV"

# NGC images set PIP_CONSTRAINT to their own pins; the lock is ours, not theirs.
export PIP_CONSTRAINT="" PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
       PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off
# Behind a TLS-inspecting proxy the build context carries the host's CA bundle.
if [ -s "$DEPS/ca-bundle.crt" ]; then
  export PIP_CERT="$DEPS/ca-bundle.crt"
  say "pip trusts the host's CA bundle (deps/ca-bundle.crt)"
fi
set --
case "$TORCH_FROM" in
  wheel)
    ls "$DEPS"/wheels/torch-*.whl >/dev/null 2>&1 || die "TORCH_FROM=wheel but no torch wheel in the build context (deps/wheels/)"
    set -- -r "$DEPS/torch-cpu.lock" ;;
  base)
    "$VENV/bin/python" -c 'import torch' 2>/dev/null || die "TORCH_FROM=base but the base image has no torch; build the cpu flavour (--flavour cpu) or use a PyTorch base"
    ;;
  *) die "TORCH_FROM must be 'base' or 'wheel', not '$TORCH_FROM'" ;;
esac

# --no-deps: the lock is the whole closure (`tools/image check-lock` proves it; pip check below
# re-checks what was installed), so pip installs exactly it and resolves nothing, and a
# requirement on what the base provides (or on torchvision, absent from the cpu flavour) does
# not make pip fetch an unpinned copy.
say "pip install --require-hashes --no-deps $* -r requirements.lock"
"$VENV/bin/python" -m pip install --require-hashes --no-deps "$@" -r "$DEPS/requirements.lock"

if [ "$TORCH_FROM" = wheel ]; then
  # The cpu flavour cannot hold torchvision (PyPI's is built against CUDA torch and breaks
  # `import transformers` next to the cpu torch; backport/image_lock.py UNAVAILABLE): the one
  # unmet requirement pip check may report here is on it (timm, open-clip-torch).
  say "pip check (torchvision is absent on purpose in the cpu flavour)"
  "$VENV/bin/python" -m pip check > "$DEPS/pip-check.txt" 2>&1 || true
  cat "$DEPS/pip-check.txt"
  if grep -v -e '^No broken requirements found' -e 'requires torchvision, which is not installed' \
       "$DEPS/pip-check.txt" | grep -q .; then
    die "pip check found broken requirements (above)"
  fi
fi
"$VENV/bin/python" -m pip freeze --all > "$VENV/gdn-freeze.txt"
say "installed $(wc -l < "$VENV/gdn-freeze.txt") distributions"
