#!/bin/sh
# Dockerfile stage `src`: apply the verified patch to a copy of the pristine tree.
#   apply-patch.sh [EXPECTED_PATCH_SHA256]
# Steps, each named in its error: patch-digest, patch-apply (zero fuzz, a rejected
# hunk fails), leftovers (.rej/.orig), conflict-markers, byte-compile.
# In:  /opt/gdn/base/megatron (pristine), /opt/gdn/stage/{megatron.patch,manifest.json,*.sh,*.py}
# Out: /opt/gdn/tree/megatron (patched), /opt/gdn/patch/, /opt/gdn/bin/
set -eu
STAGE=/opt/gdn/stage
BASE=/opt/gdn/base
TREE=/opt/gdn/tree
PATCH=/opt/gdn/patch/megatron.patch
EXPECTED=${1:-}

die() { echo "error: [$STEP] $*" >&2; exit 1; }
STEP=stage
[ -d "$BASE/megatron" ] || die "no pristine tree at $BASE/megatron in the build context"
mkdir -p /opt/gdn/patch /opt/gdn/bin
mv "$STAGE/megatron.patch" "$STAGE/manifest.json" /opt/gdn/patch/
mv "$STAGE"/* /opt/gdn/bin/
rmdir "$STAGE"

STEP=patch-digest
actual=$(sha256sum "$PATCH" | cut -d' ' -f1)
echo "==> [$STEP] sha256 $actual"
if [ -n "$EXPECTED" ] && [ "$actual" != "$EXPECTED" ]; then
  die "patch sha256 $actual differs from the expected $EXPECTED"
fi

STEP=patch-apply
command -v patch >/dev/null 2>&1 || die "the base image has no 'patch' program (Debian: install patch)"
cp -a "$BASE" "$TREE"
echo "==> [$STEP] patch -p1 --fuzz=0 --batch --forward ($(grep -c '^@@ ' "$PATCH") hunks)"
if ! (cd "$TREE" && patch -p1 --fuzz=0 --batch --forward --no-backup-if-mismatch \
        --reject-file=/tmp/megatron.rej -i "$PATCH"); then
  if [ -s /tmp/megatron.rej ]; then
    echo "--- rejected hunks:" >&2
    head -n 60 /tmp/megatron.rej >&2
  fi
  die "the patch does not apply with zero fuzz to the pristine tree (a hunk was rejected)"
fi

STEP=leftovers
left=$(find "$TREE" \( -name '*.rej' -o -name '*.orig' \) -print | head -n 20)
[ -z "$left" ] || die "patch left these files: $left"

STEP=conflict-markers
# Files the patch touches, plus every Python file of the tree.
grep '^+++ b/' "$PATCH" | sed 's|^+++ b/||; s|[[:space:]].*$||' > /tmp/patched-files
markers=$(cd "$TREE" && { cat /tmp/patched-files; find megatron -name '*.py'; } | sort -u \
          | while read -r f; do [ -f "$f" ] && grep -HnE '^(<<<<<<<|>>>>>>>)( |$)|^=======$|^\|\|\|\|\|\|\|( |$)' "$f" || true; done \
          | head -n 20)
[ -z "$markers" ] || die "conflict markers in the patched tree:
$markers"
echo "==> [$STEP] none in $(wc -l < /tmp/patched-files) patched files and the tree's Python files"

STEP=byte-compile
echo "==> [$STEP] python3 -m compileall $TREE/megatron"
python3 -m compileall -q -j 0 "$TREE/megatron" > /tmp/compileall.log 2>&1 || {
  tail -n 30 /tmp/compileall.log >&2
  die "Python files of the patched tree do not compile"
}
# The image runs with PYTHONDONTWRITEBYTECODE; keep the caches the compile made.
echo "==> [done] patched tree at $TREE"
