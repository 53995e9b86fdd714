#!/usr/bin/env bash
# Builds a sandbox image: a root filesystem of Debian packages (mmdebstrap,
# from the Debian archive; no Docker engine), stored content-addressed in the
# image directory and given a name. See docs/runtime.md, "Images".
#
#   scripts/build-image.sh                       # the default image, named "default"
#   scripts/build-image.sh --name python-data --packages "python3-numpy python3-pandas"
#   scripts/build-image.sh --name t --from-tar files.tar.gz   # default image + these files
#
# Layout of the image directory ($SANDBOXD_IMAGES, default /var/lib/sandboxd/images):
#   sha256-<hex>/rootfs/    the image (read-only, shared by every sandbox on it)
#   sha256-<hex>/image.json name, digest, packages, base, created_at
#   <name> -> sha256-<hex>  the name (a symlink, replaced atomically)
#   .inputs/<hex>           build cache: what these inputs built last time
# The digest is the SHA-256 of the rootfs as a canonical tar (sorted names,
# numeric owners, GNU format), so the same content has the same digest
# wherever it was built. Inputs already built are not rebuilt (CI caches the
# directory outside the clone); --rebuild forces a build.
set -euo pipefail

# Everything the default image holds: what people and agents type first, and
# python3 for the agent (src/runtime/agent/sandbox_agent/, PID 1).
BASE_PACKAGES="bash coreutils python3 python3-pip python3-venv git curl procps ca-certificates less findutils grep sed tar gzip xz-utils file"
SUITE=bookworm
MIRROR=${SANDBOXD_IMAGE_MIRROR:-http://deb.debian.org/debian}
IMAGES=${SANDBOXD_IMAGES:-/var/lib/sandboxd/images}
NAME=default
PACKAGES=""
FROM_TAR=""
BASE=default
REBUILD=0
# Bump when this script changes what it builds from the same inputs.
RECIPE=6
# Reproducible builds: generated files get this time, so the same packages
# give the same digest on every host (and in the deploy Dockerfile).
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1735689600}
# Extra mmdebstrap arguments (the Dockerfile skips mounts it cannot make).
MMDEBSTRAP_ARGS=${SANDBOXD_MMDEBSTRAP_ARGS:-}

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --name) NAME=$2; shift 2 ;;
    --packages) PACKAGES=$2; shift 2 ;;
    --from-tar) FROM_TAR=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --images) IMAGES=$2; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
if ! [[ "$NAME" =~ ^[a-z0-9]([a-z0-9._-]{0,62})$ ]] || [[ "$NAME" == sha256-* ]]; then
  echo "error: invalid image name '$NAME': lower-case letters, digits, '.', '_', '-'; at most 63; not sha256-..." >&2
  exit 2
fi
[ "$(id -u)" = 0 ] || { echo "error: building an image needs root (file ownership in the image)" >&2; exit 1; }
mkdir -p "$IMAGES/.inputs"

digest_of_tree() { tar --sort=name --numeric-owner --format=gnu -C "$1" -cf - . | sha256sum | cut -d' ' -f1; }

if [ -n "$FROM_TAR" ]; then
  [ -f "$FROM_TAR" ] || { echo "error: $FROM_TAR does not exist" >&2; exit 1; }
  [ -d "$IMAGES/$BASE/rootfs" ] || { echo "error: base image '$BASE' is not in $IMAGES; build it first: scripts/build-image.sh --name $BASE" >&2; exit 1; }
  base_digest=$(basename "$(readlink "$IMAGES/$BASE")")
  inputs=$( { echo "recipe=$RECIPE from-tar base=$base_digest"; sha256sum < "$FROM_TAR"; } | sha256sum | cut -d' ' -f1)
else
  base_digest=""
  packages=$(echo "$BASE_PACKAGES $PACKAGES" | tr ' ' '\n' | sed '/^$/d' | sort -u | tr '\n' ' ')
  inputs=$(printf 'recipe=%s suite=%s mirror=%s epoch=%s packages=%s\n' "$RECIPE" "$SUITE" "$MIRROR" "$SOURCE_DATE_EPOCH" "$packages" | sha256sum | cut -d' ' -f1)
fi

link_name() {
  ln -sfn "$1" "$IMAGES/.$NAME.new"
  mv -T "$IMAGES/.$NAME.new" "$IMAGES/$NAME"
  echo "image $NAME = $1 ($IMAGES/$1)"
}

if [ "$REBUILD" = 0 ] && [ -f "$IMAGES/.inputs/$inputs" ]; then
  cached=$(cat "$IMAGES/.inputs/$inputs")
  if [ -d "$IMAGES/$cached/rootfs" ]; then
    echo "image $NAME: inputs already built (cached), not rebuilding"
    link_name "$cached"
    exit 0
  fi
fi

work=$(mktemp -d "$IMAGES/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/rootfs"
started=$(date +%s)
if [ -n "$FROM_TAR" ]; then
  echo "== image $NAME: $BASE ($base_digest) + $FROM_TAR"
  cp -a --reflink=auto "$IMAGES/$BASE/rootfs/." "$work/rootfs/"
  tar --numeric-owner -xzf "$FROM_TAR" -C "$work/rootfs"
  packages=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("packages",""))' "$IMAGES/$BASE/image.json")
else
  command -v mmdebstrap >/dev/null || {
    echo "error: mmdebstrap is missing: apt-get install -y mmdebstrap" >&2; exit 1; }
  echo "== image $NAME: mmdebstrap $SUITE from $MIRROR with: $packages"
  # minbase: Essential packages and apt; the user sandbox (uid 1000, the uid
  # user code runs as) gets an entry so ls -l, whoami and pip --user know it;
  # pip installs (--user, into a venv) without --break-system-packages: the
  # sandbox is the user's own system.
  # mmdebstrap copies the build host's /etc/hostname and /etc/resolv.conf:
  # nothing of the host goes into an image (and the digest stays the same
  # wherever it is built).
  # shellcheck disable=SC2086
  mmdebstrap --variant=minbase --mode=root --quiet $MMDEBSTRAP_ARGS \
    --include="$(echo "$packages" | tr ' ' ',' | sed 's/,$//')" \
    --customize-hook='chroot "$1" useradd --uid 1000 --user-group --create-home --home-dir /home/sandbox --shell /bin/bash sandbox' \
    --customize-hook='mkdir -p "$1/workspace" && chown 1000:1000 "$1/workspace"' \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
    --customize-hook='echo sandbox > "$1/etc/hostname"' \
    --customize-hook='printf "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tsandbox\n" > "$1/etc/hosts"' \
    --customize-hook='echo "# egress sandboxes get the server'"'"'s nameservers here (a bind mount)" > "$1/etc/resolv.conf"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*.log "$1"/var/cache/ldconfig/aux-cache' \
    "$SUITE" "$work/rootfs" "$MIRROR"
  # ls -l, stat and du on this machine's runsc: see scripts/image/statx-shim.c.
  command -v cc >/dev/null || { echo "error: a C compiler is missing: apt-get install -y gcc" >&2; exit 1; }
  mkdir -p "$work/rootfs/usr/local/lib/sandboxd"
  cc -shared -fPIC -O2 -Wall -Werror -o "$work/rootfs/usr/local/lib/sandboxd/statx-shim.so" \
    "$(dirname "$0")/image/statx-shim.c"
  echo /usr/local/lib/sandboxd/statx-shim.so > "$work/rootfs/etc/ld.so.preload"
  # mmdebstrap clamps times only in tarballs; a directory keeps the build's
  # times. Clamp them, so the same packages give the same digest everywhere.
  find "$work/rootfs" -newermt "@$SOURCE_DATE_EPOCH" -print0 \
    | xargs -0r touch --no-dereference --date="@$SOURCE_DATE_EPOCH"
fi
digest=$(digest_of_tree "$work/rootfs")
id="sha256-$digest"
python3 - "$work/image.json" "$NAME" "$id" "$packages" "$base_digest" <<'PY'
import datetime, json, sys
path, name, digest, packages, base = sys.argv[1:]
doc = {"built_as": name, "digest": digest, "packages": packages.split(),
       "base": base or None, "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
open(path, "w").write(json.dumps(doc, indent=2) + "\n")
PY
if [ -d "$IMAGES/$id/rootfs" ]; then
  echo "image $NAME: same content as the existing $id"
else
  chmod 755 "$work"
  mv "$work" "$IMAGES/$id"
  trap - EXIT
fi
echo "$id" > "$IMAGES/.inputs/$inputs"
echo "image $NAME built in $(( $(date +%s) - started )) s, $(du -sh "$IMAGES/$id/rootfs" | cut -f1)"
link_name "$id"
