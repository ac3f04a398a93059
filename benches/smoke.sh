#!/usr/bin/env bash
# A seconds-long run of the load bench so that it cannot rot (CI runs this). It asserts
# no speed, only correctness: it fails if a workload got answers it should not have.
# Needs nginx (installed with apt if missing); PostgreSQL is used if installed.
set -euo pipefail

cd "$(dirname "$0")/.."

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
    echo "==> installing nginx (apt-get)"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends nginx >/dev/null
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cargo bench --bench load -- --smoke --out "$out" "$@"
