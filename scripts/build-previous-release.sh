#!/usr/bin/env bash
# Builds the previous release's `sandboxd` (the commit in PREVIOUS_RELEASE
# below) for tests/it/cluster/versions.rs, which runs it beside this
# checkout's server on one bucket, as Cloud Run runs the old and the new
# revision side by side during a deploy. Prints the binary's path.
#
# The binary of a commit never changes, so it is kept outside the clone, in
# $SANDBOXD_PREVIOUS_CACHE (default /var/cache/sandboxd/previous-release, or
# ~/.cache/sandboxd/previous-release when that is not writable): a run that
# built it once builds nothing. The source comes from this clone's history
# (git archive), the build goes to a target directory of its own (its
# `target/debug/sandboxd` must not replace this checkout's).
#
# When a change alters what is written to the bucket, set PREVIOUS_RELEASE
# to the commit that is deployed (the last one that landed) before it.
set -euo pipefail
cd "$(dirname "$0")/.."

PREVIOUS_RELEASE=1a23218d67a8642f9490fb8d09f44b16dd84af91

default_cache=/var/cache/sandboxd/previous-release
if ! mkdir -p "$default_cache" 2>/dev/null || [ ! -w "$default_cache" ]; then
  default_cache=${XDG_CACHE_HOME:-$HOME/.cache}/sandboxd/previous-release
fi
cache=${SANDBOXD_PREVIOUS_CACHE:-$default_cache}/$PREVIOUS_RELEASE
binary=$cache/sandboxd
if [ -x "$binary" ]; then
  echo "$binary"
  exit 0
fi

if ! git cat-file -e "${PREVIOUS_RELEASE}^{commit}" 2>/dev/null; then
  echo "error: commit $PREVIOUS_RELEASE (the previous release) is not in this clone's history;" \
       "fetch it, or clone without --depth" >&2
  exit 1
fi
mkdir -p "$cache"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
git archive "$PREVIOUS_RELEASE" | tar -x -C "$work"
# Not linted: CI lints this checkout through RUSTC_WORKSPACE_WRAPPER.
( cd "$work" && env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS CARGO_TARGET_DIR="$work/target" \
    cargo build --locked --bin sandboxd >&2 )
cp "$work/target/debug/sandboxd" "$binary.partial"
mv "$binary.partial" "$binary"
echo "$binary"
