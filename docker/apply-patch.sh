#!/bin/sh
# Dockerfile stage `src`: apply the verified patch to a copy of the pristine tree.
#   apply-patch.sh
# Steps, each named in its error: base-tree (the pristine tree's digest is the lock's),
# patch-digest (the sha256 the manifest records), patch-apply (zero fuzz and no offset:
# a rejected or moved hunk fails), patched-tree (the patched tree's digest is the lock's),
# leftovers (.rej/.orig), conflict-markers, byte-compile.
# A tree that is not the lock's exits 13 and names the first differing file; other
# failures exit 1.
# In:  /opt/gdn/base/megatron (pristine), /opt/gdn/patch/{megatron.patch,manifest.json,
#      trees.json (the tree fields of manifests/lock.json)}, /opt/gdn/bin/tree_digest.py
# Out: /opt/gdn/tree/megatron (patched)
set -eu
ROOT=${GDN_ROOT:-/opt/gdn}   # tests run this script on a scratch root
BASE=$ROOT/base
TREE=$ROOT/tree
PATCH=$ROOT/patch/megatron.patch
TREES=$ROOT/patch/trees.json
DIGEST=$ROOT/bin/tree_digest.py
REJ=${TMPDIR:-/tmp}/megatron.rej
LOG=${TMPDIR:-/tmp}/megatron.patch.log

die() { echo "error: [$STEP] $*" >&2; exit 1; }
# A tree that is not the one the lock records: exit 13 (InputError), like tools/image's preflight.
drift() { echo "error: [$STEP] $*" >&2; exit 13; }
STEP=stage
[ -d "$BASE/megatron" ] || die "no pristine tree at $BASE/megatron in the build context"
[ -f "$PATCH" ] || die "no patch at $PATCH in the build context"
[ -f "$TREES" ] || drift "no $TREES: the lock (manifests/lock.json) has no tree digests"
[ -f "$DIGEST" ] || die "no $DIGEST in the build context"

# tree_digest.py prints its own 'error: ... first differing file: ...' line on a drift.
check_tree() {  # check_tree PARENT base|patched
  out=$(python3 "$DIGEST" "$1" --lock "$TREES" --which "$2" 2>&1) || {
    echo "$out" | sed "s/^error: /error: [$STEP] /" >&2
    exit 13
  }
  echo "==> [$STEP] $out"
}

STEP=base-tree
check_tree "$BASE" base

STEP=patch-digest
actual=$(sha256sum "$PATCH" | cut -d' ' -f1)
EXPECTED=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("patch", {}).get("sha256", ""))' \
           "$ROOT/patch/manifest.json") || die "cannot read $ROOT/patch/manifest.json"
echo "==> [$STEP] sha256 $actual"
if [ -n "$EXPECTED" ] && [ "$actual" != "$EXPECTED" ]; then
  die "patch sha256 $actual differs from the sha256 in manifest.json ($EXPECTED)"
fi

STEP=patch-apply
command -v patch >/dev/null 2>&1 || die "the base image has no 'patch' program (Debian: install patch)"
cp -a "$BASE" "$TREE"
echo "==> [$STEP] patch -p1 --fuzz=0 --batch --forward ($(grep -c '^@@ ' "$PATCH") hunks)"
if ! (cd "$TREE" && patch -p1 --fuzz=0 --batch --forward --no-backup-if-mismatch \
        --reject-file="$REJ" -i "$PATCH") > "$LOG" 2>&1; then
  cat "$LOG"
  if [ -s "$REJ" ]; then
    echo "--- rejected hunks:" >&2
    head -n 60 "$REJ" >&2
  fi
  die "the patch does not apply with zero fuzz to the pristine tree (a hunk was rejected)"
fi
cat "$LOG"
# GNU patch has no flag that refuses a hunk found at another line: read its report.
moved=$(grep -iE '(offset|fuzz) [0-9]+' "$LOG" | head -n 10 || true)
[ -z "$moved" ] || die "the patch applies only with an offset or fuzz; the tree is not the one it was made against:
$moved"
rm -f "$LOG"

STEP=patched-tree
check_tree "$ROOT/tree" patched

STEP=leftovers
left=$(find "$TREE" \( -name '*.rej' -o -name '*.orig' \) -print | head -n 20)
[ -z "$left" ] || die "patch left these files: $left"

STEP=conflict-markers
# Files the patch touches, plus every Python file of the tree.
grep '^+++ b/' "$PATCH" | sed 's|^+++ b/||; s|[[:space:]].*$||' > "$ROOT/patched-files"
markers=$(cd "$TREE" && { cat "$ROOT/patched-files"; find megatron -name '*.py'; } | sort -u \
          | while read -r f; do [ -f "$f" ] && grep -HnE '^(<<<<<<<|>>>>>>>)( |$)|^=======$|^\|\|\|\|\|\|\|( |$)' "$f" || true; done \
          | head -n 20)
[ -z "$markers" ] || die "conflict markers in the patched tree:
$markers"
echo "==> [$STEP] none in $(wc -l < "$ROOT/patched-files") patched files and the tree's Python files"

STEP=byte-compile
echo "==> [$STEP] python3 -m compileall $TREE/megatron"
python3 -m compileall -q -j 0 "$TREE/megatron" > "$ROOT/compileall.log" 2>&1 || {
  tail -n 30 "$ROOT/compileall.log" >&2
  die "Python files of the patched tree do not compile"
}
rm -f "$ROOT/patched-files" "$ROOT/compileall.log"
echo "==> [done] patched tree at $TREE"
