# FLA sets on a GPU host (sourced by tools/gpu-suite and tools/gpu-fla-sweep; docs/gpu.md).
#
# fla_set_triton SET: the triton the set runs with (0.4.2: 3.6.0; 0.5.2 and 0.6.0: 3.7.1, the
#   sets of image_pipeline/lock.py FLA_SETS).
# fla_set_install SET WHEELS WORK PY: pip-install the set's wheels ($WHEELS/fla<digits>/*.whl,
#   e.g. .whl/fla052) into $WORK/fla<digits> and print that folder. A triton other than the
#   host's comes from GDN_TRITON_SITE (a --target folder, e.g. the one split_wheel.py's install
#   writes for triton 3.7.1), which then goes first on PYTHONPATH (fla_set_pythonpath).
# fla_set_check SET SITE PY: with SITE first on PYTHONPATH, the FLA version, the triton version
#   and tests/image/fla_gloo.py's check against that release's fla.ops.cp.comm; prints one JSON
#   line; returns 1 (naming what differs) when a version is not the set's.
fla_set_triton() {
  case $1 in 0.4.2) echo 3.6.0 ;; 0.5.2|0.6.0) echo 3.7.1 ;; *) return 1 ;; esac
}

fla_set_pythonpath() {  # fla_set_pythonpath SITE: SITE, then GDN_TRITON_SITE when set
  echo "$1${GDN_TRITON_SITE:+:$GDN_TRITON_SITE}"
}

fla_set_install() {
  local set=$1 wheels=$2 work=$3 py=$4 digits=${1//./}
  fla_set_triton "$set" >/dev/null || { echo "fla-set: unknown FLA set $set; hint: one of 0.4.2 0.5.2 0.6.0" >&2; return 2; }
  ls "$wheels/fla$digits"/*.whl >/dev/null 2>&1 || {
    echo "fla-set: no wheels in $wheels/fla$digits; hint: make wheels FLA_WHEELS=$set (or pip download --no-deps the set's flash-linear-attention/fla-core wheels there)" >&2; return 2; }
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/fla$digits" \
    "$wheels/fla$digits"/*.whl >&2 || { echo "fla-set: installing $wheels/fla$digits/*.whl failed" >&2; return 2; }
  echo "$work/fla$digits"
}

fla_set_check() {
  local set=$1 site=$2 py=$3 repo
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  PYTHONPATH="$(fla_set_pythonpath "$site"):$repo/tests/image" $py - "$set" "$(fla_set_triton "$set")" <<'PY'
import json, sys
import triton, fla
import fla_gloo
want_fla, want_triton = sys.argv[1], sys.argv[2]
found = {"fla": fla.__version__, "triton": triton.__version__, "fla_path": fla.__path__[0], "triton_path": triton.__path__[0]}
bad = [f"{k} {found[k]} (the set wants {w})" for k, w in (("fla", want_fla), ("triton", want_triton)) if found[k] != w]
if bad:
    print("fla-set: " + "; ".join(bad) + ". hint: carry the set's wheels (.whl/fla<digits>) and, for triton 3.7.1, "
          "install it with split_wheel.py and set GDN_TRITON_SITE", file=sys.stderr)
    sys.exit(1)
try:
    found["gloo_shim"] = fla_gloo.check()
except RuntimeError as exc:
    print(f"fla-set: {exc}", file=sys.stderr)
    sys.exit(1)
print(json.dumps(found))
PY
}
