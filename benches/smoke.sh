#!/usr/bin/env bash
# A seconds-long run of the load bench so that it cannot rot (CI runs this). It asserts
# no speed, only correctness: it fails if a workload got answers it should not have.
# PostgreSQL is used if installed.
set -euo pipefail

cd "$(dirname "$0")/.."

# Needs nginx; wrk and openssl for the one TLS comparison it runs (full handshakes, a
# second each): installed with apt if missing.
missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
    echo "==> installing ${missing[*]} (apt-get)"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cargo bench --bench load -- --smoke --out "$out" "$@"
