# Triton cache carried between device calls (sourced by tools/bench-gdn and tools/gpu-suite).
#
# triton_cache_seed NAME ARCHIVE: unless TRITON_CACHE_DIR is already set, use
#   /tmp/gdn-triton/NAME as Triton's cache and, when ARCHIVE (a .tgz of a cache folder) exists,
#   unpack it there first. Each tool keeps its own cache: the suite's autotune policy ("first")
#   must never feed the benchmark's tuned configs, nor the reverse.
#   An archive split in parts (ARCHIVE.part00, .part01, ...) is joined first.
# triton_cache_save NAME: when $OUT is set, pack the cache to $OUT/triton-cache/NAME.tgz so that
#   it comes back from the device tool; store it as .triton-cache/NAME.tgz (git-ignored: it
#   holds kernels compiled from FLA, never committed) for the next call to carry. An archive
#   over TRITON_CACHE_PART_MB (default 15; the device tool returns files of at most 16 MiB)
#   is split into NAME.tgz.part00, .part01, ...: carry them as they are (seeding joins them).
triton_cache_seed() {
  local name=$1 archive=$2
  [ -n "${TRITON_CACHE_DIR:-}" ] && return 0
  export TRITON_CACHE_DIR=/tmp/gdn-triton/$name
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -f "$archive" ]; then
    tar xzf "$archive" -C "$TRITON_CACHE_DIR" --strip-components=1 \
      && echo "triton cache: seeded $TRITON_CACHE_DIR from $archive" >&2 \
      || echo "triton cache: could not unpack $archive; compiling from scratch" >&2
  elif compgen -G "$archive.part*" >/dev/null; then
    cat "$archive".part* | tar xzf - -C "$TRITON_CACHE_DIR" --strip-components=1 \
      && echo "triton cache: seeded $TRITON_CACHE_DIR from $archive.part*" >&2 \
      || echo "triton cache: could not unpack $archive.part*; compiling from scratch" >&2
  fi
}

triton_cache_save() {
  local name=$1
  [ -n "${OUT:-}" ] && [ -d "${TRITON_CACHE_DIR:-}" ] || return 0
  mkdir -p "$OUT/triton-cache"
  tar czf "$OUT/triton-cache/$name.tgz.tmp" -C "$(dirname "$TRITON_CACHE_DIR")" \
    --transform "s|^$(basename "$TRITON_CACHE_DIR")|cache|" "$(basename "$TRITON_CACHE_DIR")" \
    && mv "$OUT/triton-cache/$name.tgz.tmp" "$OUT/triton-cache/$name.tgz" || return 1
  local limit=$(( ${TRITON_CACHE_PART_MB:-15} * 1024 * 1024 ))
  if [ "$(stat -c %s "$OUT/triton-cache/$name.tgz")" -gt "$limit" ]; then
    split -b "$limit" -d -a 2 "$OUT/triton-cache/$name.tgz" "$OUT/triton-cache/$name.tgz.part" \
      && rm "$OUT/triton-cache/$name.tgz" || return 1
  fi
  echo "triton cache: saved to $(ls "$OUT/triton-cache/$name.tgz"* | tr '\n' ' ')($(du -sh "$TRITON_CACHE_DIR" | cut -f1) unpacked)" >&2
}
