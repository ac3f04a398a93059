#!/usr/bin/env bash
# The test command of fencegate: installs what the tests need, then runs every test.
#
#   bash scripts/test.sh              # every test target
#   bash scripts/test.sh config       # extra arguments go to `cargo test`
#
# Needs Debian 12 (or another apt-based system) with Rust. The end-to-end tests run a
# real nginx on loopback as the legacy backend, so nginx is installed with apt if it is
# missing (as root, or through sudo).
set -euo pipefail

cd "$(dirname "$0")/.."

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "scripts/test.sh: nginx is missing and installing it needs root or sudo" >&2
        exit 1
    fi
    echo "==> installing nginx (apt-get)"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends nginx
fi

echo "==> cargo test --all-targets $*"
cargo test --all-targets "$@"
