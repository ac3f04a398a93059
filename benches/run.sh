#!/usr/bin/env bash
# Reproduces benches/results/: installs what the load bench needs (nginx, wrk, h2load,
# openssl, PostgreSQL) if missing, then runs it (several minutes). Everything stays on loopback; every process
# it starts is stopped when it ends.
#
#   bash benches/run.sh                       # full run, results in benches/results/
#   bash benches/run.sh --duration 20         # longer measurements
#   bash benches/run.sh --out /tmp/results    # somewhere else
#
# Extra arguments go to the bench (see the top of benches/load.rs).
set -euo pipefail

cd "$(dirname "$0")/.."

missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
# The TLS rows (benches/load/tls.rs): HTTP/2 over TLS, and the run's certificates.
command -v h2load >/dev/null 2>&1 || missing+=(nghttp2-client)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
ls /usr/lib/postgresql/*/bin/pgbench >/dev/null 2>&1 || missing+=(postgresql)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "benches/run.sh: ${missing[*]} missing and installing needs root or sudo" >&2
        exit 1
    fi
    echo "==> installing ${missing[*]} (apt-get)"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

exec cargo bench --bench load -- "$@"
