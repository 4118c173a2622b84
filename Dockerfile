# Training image: the pinned Megatron tree + the verified GDN chunkwise-CP patch,
# with the pinned FLA stack. Build it with `make image` (or `tools/image build`),
# which stages the build context; a plain `docker build .` of the repo root does
# not work, because the tree, the patch and the wheels are generated files.
#
# Build context (staged by image_pipeline/build.py into build/image/context-<flavour>/):
#   Dockerfile
#   deps/requirements.lock   hash-pinned Python packages of the flavour
#                            (docker/requirements-cpu.lock or docker/requirements-cuda.lock,
#                            docker/requirements-cuda-fla052.lock / -fla060.lock with --fla 0.5.2 / 0.6.0)
#   deps/torch-cpu.lock      hash-pinned cpu torch wheel (cpu flavour only)
#   deps/wheels/             the cpu torch wheel (cpu flavour), else empty
#   deps/install-deps.sh     makes /opt/gdn/venv
#   deps/ca-bundle.crt       the host's CA bundle, when pip there needs one (proxy);
#                            used by pip in this stage only, never in the image
#   tree/megatron/           pristine assembled tree (build/tree/base/megatron)
#   app/tests/image/         the image regression suite
#   app/examples/            the walkthrough's examples (docs/examples; docs/train-with-the-image.md)
#   app/bin/                 apply-patch.sh, capability_check.py, run-suite.sh,
#                            tree_digest.py (backport/tree_digest.py, stdlib only)
#   patch/megatron.patch     patches/latest/megatron.patch
#   patch/manifest.json      patches/latest/manifest.json
#   patch/manifest.md        patches/latest/manifest.md (its view for people)
#   patch/decisions.md       docs/decisions.md (the decisions the manifest's reasons cite)
#   patch/trees.json         the tree digests of manifests/lock.json (base_tree_sha256,
#                            patched_tree_sha256, tree_files)
#
# Layer order: dependencies, then the pristine tree and the suite, then the patch,
# so a changed patch rebuilds only `COPY patch/`, the patch step, the final tree
# copy, the capability check and the labels. Nothing is cloned from git.

# cuda flavour (users): an NGC PyTorch image (torch 2.10, CPython 3.12; triton
# 3.6.0 pairs with torch 2.10). cpu flavour (gating): a local Debian bookworm
# base with python3.11, python3-venv and patch; `tools/image base` makes it.
# A base needs python3 (>= 3.10) with venv, and patch.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3

# ---------------------------------------------------------------------------
# deps: /opt/gdn/venv with every Python package hash-checked. The wheels stay
# in this stage; the image copies only the venv.
FROM ${BASE_IMAGE} AS deps
# base: torch comes with BASE_IMAGE. wheel: install deps/torch-cpu.lock.
ARG TORCH_FROM=base
COPY deps/ /opt/gdn/deps/
RUN sh /opt/gdn/deps/install-deps.sh "${TORCH_FROM}"
# Marks this stage's image so `tools/image prune` keeps it: it is the layer cache
# of the slowest step, and untagged.
LABEL io.gdn.stage="deps"

# ---------------------------------------------------------------------------
# src: the pristine tree, the suite and scripts, then the patch. apply-patch.sh
# checks the pristine tree's digest against the lock's (exit 13 names the first
# differing file), the patch against the manifest's sha256, applies it with zero
# fuzz and no offset, checks the patched tree's digest against the lock's, then
# scans for conflict markers and byte-compiles. Uses the base image's python3.
FROM ${BASE_IMAGE} AS src
COPY tree/ /opt/gdn/base/
COPY app/ /opt/gdn/
COPY patch/ /opt/gdn/patch/
RUN sh /opt/gdn/bin/apply-patch.sh

# ---------------------------------------------------------------------------
# image: base + venv + patched tree; the capability check fails the build unless
# the FLA CP API and the patched Megatron modules are usable.
# Every instruction of the classic builder commits a layer, and vfs copies the
# whole root filesystem for each, so the steps that change with the patch are
# kept to three: the tree copy, the capability check and the labels.
FROM ${BASE_IMAGE} AS image
ARG BASE_IMAGE GDN_FLAVOUR=cuda FLA_VERSION=0.4.2 TRITON_VERSION=3.6.0 PATCH_NAME PATCH_SHA256 \
    MANIFEST_SHA256 LOCK_SHA256 TREE_SHA256 PIN_MEGATRON_BRIDGE PIN_MCORE_BASE PIN_UPSTREAM
ENV VIRTUAL_ENV=/opt/gdn/venv \
    PATH=/opt/gdn/venv/bin:${PATH} \
    PYTHONPATH=/opt/gdn/tree${PYTHONPATH:+:${PYTHONPATH}} \
    GDN_TREE=/opt/gdn/tree \
    GDN_BASE_TREE=/opt/gdn/base \
    PYTHONDONTWRITEBYTECODE=1
CMD ["sh", "/opt/gdn/bin/run-suite.sh"]
COPY --from=deps /opt/gdn/venv /opt/gdn/venv
COPY --from=src /opt/gdn/ /opt/gdn/
RUN python /opt/gdn/bin/capability_check.py \
      --fla-version "${FLA_VERSION}" --triton-version "${TRITON_VERSION}" \
      --patch /opt/gdn/patch/megatron.patch --out /opt/gdn/capability.json
LABEL org.opencontainers.image.title="gdn-megatron" \
      org.opencontainers.image.description="Pinned Megatron tree with the GDN chunkwise context-parallel backport" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.version="${PATCH_NAME}" \
      io.gdn.flavour="${GDN_FLAVOUR}" \
      io.gdn.pin.megatron-bridge="${PIN_MEGATRON_BRIDGE}" \
      io.gdn.pin.mcore-base="${PIN_MCORE_BASE}" \
      io.gdn.pin.upstream="${PIN_UPSTREAM}" \
      io.gdn.pin.flash-linear-attention="${FLA_VERSION}" \
      io.gdn.pin.fla-core="${FLA_VERSION}" \
      io.gdn.pin.triton="${TRITON_VERSION}" \
      io.gdn.fla.version="${FLA_VERSION}" \
      io.gdn.patch.sha256="${PATCH_SHA256}" \
      io.gdn.manifest.sha256="${MANIFEST_SHA256}" \
      io.gdn.requirements-lock.sha256="${LOCK_SHA256}" \
      io.gdn.tree.sha256="${TREE_SHA256}"
