#!/usr/bin/env bash
# Builds the production container image (deploy/Dockerfile) without a Docker
# engine or a registry: buildah, a Debian base made by mmdebstrap, Debian's
# runsc, and the sandboxd binaries cargo built on this machine. The image is
# the Dockerfile's, line for line; only its base images, its runsc and where
# its binaries come from are build arguments (deploy/README.md, "Without
# Docker"; docs/decisions/0011-container-image-without-docker.md).
#
#   scripts/build-container.sh                         # binaries from target/debug
#   scripts/build-container.sh --binaries target/release --tag localhost/sandboxd:rel
#   scripts/build-container.sh --binaries cargo --rust-image rust:1-bookworm   # cargo inside
#
# (Not scripts/build-image.sh: that name builds the *sandbox* images,
# the root filesystems sandboxes run on; this image carries one of them.)
#
# Options:
#   --tag NAME         image name (default localhost/sandboxd:local)
#   --binaries DIR     directory holding sandboxd and sandboxctl (default
#                      target/debug), or "cargo": cargo build --release inside
#                      the build, on --rust-image
#   --rust-image IMG   the cargo stage's toolchain image (default rust:1-bookworm);
#                      "host": this machine's rustup toolchain on the Debian
#                      base, with gcc (no registry needed; crates.io is)
#   --runsc SOURCE     debian (default: Debian's package, platform ptrace) or
#                      release (gVisor's releases, platform systrap; needs
#                      storage.googleapis.com)
#   --refresh-base     rebuild the mmdebstrap base (new Debian packages; every
#                      cached layer is rebuilt after it)
#
# Cached between runs, outside the clone: the base tarball in
# $SANDBOXD_CONTAINER_CACHE (default /var/cache/sandboxd-container), the
# imported base and every layer (buildah --layers) in the containers storage
# (/var/lib/containers). A run whose Dockerfile lines and inputs are unchanged
# rebuilds only the layer holding the binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

TAG=localhost/sandboxd:local
BINARIES=target/debug
RUST_IMAGE=rust:1-bookworm
RUNSC_SOURCE=debian
REFRESH_BASE=0
CACHE=${SANDBOXD_CONTAINER_CACHE:-/var/cache/sandboxd-container}
# The same archive the sandbox images come from (scripts/build-image.sh).
MIRROR=${SANDBOXD_IMAGE_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
# Bump when the base's recipe changes.
BASE_RECIPE=1

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG=$2; shift 2 ;;
    --binaries) BINARIES=$2; shift 2 ;;
    --rust-image) RUST_IMAGE=$2; shift 2 ;;
    --runsc) RUNSC_SOURCE=$2; shift 2 ;;
    --refresh-base) REFRESH_BASE=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
case "$RUNSC_SOURCE" in
  debian) RUNSC_PLATFORM=ptrace ;;
  release) RUNSC_PLATFORM=systrap ;;
  *) echo "error: --runsc must be debian or release, not '$RUNSC_SOURCE'" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || { echo "error: building the image needs root (buildah's storage, mmdebstrap)" >&2; exit 1; }
missing=""
command -v buildah >/dev/null || missing+=" buildah"
command -v podman >/dev/null || missing+=" podman"
command -v runc >/dev/null || missing+=" runc"
command -v mmdebstrap >/dev/null || missing+=" mmdebstrap"
if [ -n "$missing" ]; then
  echo "== installing$missing"
  apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null \
    || { echo "error: cannot install$missing: apt-get install -y$missing" >&2; exit 1; }
fi

started=$(date +%s)
mkdir -p "$CACHE/base"
# buildah 1.28 leaves a working container behind for each stage that only
# renames another (FROM stage AS alias), holding its image: remove the ones
# this run leaves, also when it fails; and the run's context.
containers_before=$(buildah containers -q | sort)
context=""
cleanup() {
  if [ -n "$context" ]; then rm -rf "$context" "$context.iid"; fi
  comm -13 <(echo "$containers_before") <(buildah containers -q | sort) | xargs -r buildah rm >/dev/null || true
}
trap cleanup EXIT

# ---- the base: Debian from the archive, as the registry's debian images are
# (minbase: Essential packages and apt; the same suites and PATH).
base_inputs=$(printf 'recipe=%s suite=%s mirror=%s\n' "$BASE_RECIPE" "$SUITE" "$MIRROR" | sha256sum | cut -c1-16)
base_tar="$CACHE/base/$SUITE-$base_inputs.tar"
base_image="localhost/sandboxd-base:$SUITE-$base_inputs"
# A refresh imports a new base under the same name: every layer is rebuilt on
# it (the old ones stay in the storage until `podman image prune`).
if [ "$REFRESH_BASE" = 1 ] || ! podman image exists "$base_image"; then
  if [ "$REFRESH_BASE" = 1 ] || [ ! -f "$base_tar" ]; then
    echo "== base image: mmdebstrap $SUITE (minbase) from $MIRROR"
    t=$(date +%s)
    mmdebstrap --variant=minbase --mode=root --format=tar --quiet \
      --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
      "$SUITE" "$base_tar.part" \
      "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
      "deb ${MIRROR%/debian}/debian-security $SUITE-security main"
    mv "$base_tar.part" "$base_tar"
    echo "   base tarball built in $(( $(date +%s) - t )) s"
  fi
  echo "== importing $base_tar as $base_image"
  podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    "$base_tar" "$base_image" >/dev/null
fi

# ---- the build context: what the Dockerfile copies, and the binaries.
# (One per run: CI and a developer may build at the same time.)
context=$(mktemp -d "$CACHE/context.XXXXXX")
mkdir -p "$context/scripts"
cp -a Cargo.toml Cargo.lock controllers src "$context/"
cp -a scripts/build-image.sh scripts/image "$context/scripts/"
build_args=(--build-arg "RUNSC_SOURCE=$RUNSC_SOURCE" --build-arg "RUNSC_PLATFORM=$RUNSC_PLATFORM"
            --build-arg "DEBIAN_IMAGE=$base_image" --build-arg "RUNTIME_IMAGE=$base_image")
if [ "$BINARIES" = cargo ] && [ "$RUST_IMAGE" = host ]; then
  # A stand-in for rust:1-bookworm: the toolchain cargo uses here, relocated
  # (rustc finds its sysroot next to itself), the C toolchain that
  # buildpack-deps has (aws-lc-sys and ring compile C), and the host's CAs.
  sysroot=$(rustc --print sysroot) || { echo "error: --rust-image host needs rustc on this machine" >&2; exit 1; }
  RUST_IMAGE="localhost/sandboxd-rust:$(rustc --version | cut -d' ' -f2)-$base_inputs"
  if ! podman image exists "$RUST_IMAGE"; then
    echo "== toolchain image $RUST_IMAGE from $sysroot"
    ctr=$(buildah from --pull=false "$base_image")
    buildah run "$ctr" -- sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc g++ libc6-dev make perl pkg-config ca-certificates >/dev/null && rm -rf /var/lib/apt/lists/*'
    buildah copy "$ctr" "$sysroot" /usr/local/rust >/dev/null
    # This machine's trust store: cargo reaches crates.io the way the host
    # does (through whatever TLS proxy the host trusts).
    buildah copy "$ctr" /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt >/dev/null
    buildah config --env PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit --rm "$ctr" "$RUST_IMAGE" >/dev/null
  fi
fi
if [ "$BINARIES" = cargo ]; then
  build_args+=(--build-arg SANDBOXD_BINARIES=cargo --build-arg "RUST_IMAGE=$RUST_IMAGE")
  echo "== binaries: cargo build --release inside the build, on $RUST_IMAGE"
else
  for binary in sandboxd sandboxctl; do
    [ -x "$BINARIES/$binary" ] || {
      echo "error: $BINARIES/$binary is missing: build it first (cargo build --bins, or --release with --binaries target/release)" >&2
      exit 1; }
  done
  mkdir -p "$context/prebuilt"
  cp "$BINARIES/sandboxd" "$BINARIES/sandboxctl" "$context/prebuilt/"
  build_args+=(--build-arg SANDBOXD_BINARIES=prebuilt)
  echo "== binaries: $BINARIES ($("$BINARIES/sandboxd" --version), built $(date -u -r "$BINARIES/sandboxd" +%FT%TZ))"
fi

# ---- the build: deploy/Dockerfile as it is, every layer cached.
previous=$(podman image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)
echo "== buildah bud -f deploy/Dockerfile -t $TAG (runsc: $RUNSC_SOURCE, platform $RUNSC_PLATFORM)"
t=$(date +%s)
# The sandbox image first, for its id: buildah keys the step that unpacks it
# into the runtime stage on the step's text alone (see the Dockerfile).
iidfile="$context.iid"
buildah bud --layers --pull=false -f "$repo/deploy/Dockerfile" --target sandbox-images \
  --iidfile "$iidfile" "${build_args[@]}" "$context"
build_args+=(--build-arg "SANDBOX_IMAGES_ID=$(cat "$iidfile")")
buildah bud --layers --pull=false -f "$repo/deploy/Dockerfile" -t "$TAG" "${build_args[@]}" "$context"
built=$(podman image inspect --format '{{.Id}}' "$TAG")
echo "   buildah bud took $(( $(date +%s) - t )) s"
# The image this tag named before is garbage now (its cached layers are
# shared with the new one or with the cache; those stay).
if [ -n "$previous" ] && [ "$previous" != "$built" ]; then
  podman image rm "$previous" >/dev/null 2>&1 || true
fi
echo "image $TAG = ${built:0:12}, $(podman image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec) (built in $(( $(date +%s) - started )) s)"
