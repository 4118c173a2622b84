# Triton cache carried between device calls (sourced by tools/bench-gdn and tools/gpu-suite).
#
# triton_cache_seed NAME ARCHIVE: unless TRITON_CACHE_DIR is already set, use
#   /tmp/gdn-triton/NAME as Triton's cache and, when ARCHIVE (a .tgz of a cache folder) exists,
#   unpack it there first. Each tool keeps its own cache: the suite's autotune policy ("first")
#   must never feed the benchmark's tuned configs, nor the reverse.
# triton_cache_save NAME: when $OUT is set, pack the cache to $OUT/triton-cache/NAME.tgz so that
#   it comes back from the device tool; store it as .triton-cache/NAME.tgz (git-ignored: it
#   holds kernels compiled from FLA, never committed) for the next call to carry.
triton_cache_seed() {
  local name=$1 archive=$2
  [ -n "${TRITON_CACHE_DIR:-}" ] && return 0
  export TRITON_CACHE_DIR=/tmp/gdn-triton/$name
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -f "$archive" ]; then
    tar xzf "$archive" -C "$TRITON_CACHE_DIR" --strip-components=1 \
      && echo "triton cache: seeded $TRITON_CACHE_DIR from $archive" >&2 \
      || echo "triton cache: could not unpack $archive; compiling from scratch" >&2
  fi
}

triton_cache_save() {
  local name=$1
  [ -n "${OUT:-}" ] && [ -d "${TRITON_CACHE_DIR:-}" ] || return 0
  mkdir -p "$OUT/triton-cache"
  tar czf "$OUT/triton-cache/$name.tgz.part" -C "$(dirname "$TRITON_CACHE_DIR")" \
    --transform "s|^$(basename "$TRITON_CACHE_DIR")|cache|" "$(basename "$TRITON_CACHE_DIR")" \
    && mv "$OUT/triton-cache/$name.tgz.part" "$OUT/triton-cache/$name.tgz" \
    && echo "triton cache: saved to $OUT/triton-cache/$name.tgz" >&2
}
