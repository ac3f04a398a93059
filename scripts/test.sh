#!/usr/bin/env bash
# The test command of fencegate: installs what the tests need, then runs every test.
#
#   bash scripts/test.sh              # every test target, etcd backend included
#   bash scripts/test.sh config       # extra arguments go to `cargo test`
#
# Needs Debian 12 (or another apt-based system) with Rust. The end-to-end tests run real
# servers on loopback: nginx as the legacy backend, a 3-member etcd cluster for the lease
# authority's etcd backend (whose client needs protoc to build), and promtool (Debian's
# `prometheus` package) checks and unit-tests the alert rules in deploy/prometheus before
# any test runs. Whatever is missing is installed with apt (as root, or through sudo).
# The Kubernetes manifests in deploy/kubernetes are validated offline by
# kubernetes-validate (pip, into a virtualenv under target/), and the fencegate configs
# they embed are checked with `fencegate check-config` (openssl makes stand-ins for the
# files they name on Secrets). The S3 dialect's tests need s3s-fs (cargo install, into
# target/s3s-fs), boto3 and, for the S3 compatibility suite, pytest (pip, into another
# virtualenv under target/). The WebDAV tests run wsgidav (pip, into target/dav-venv)
# beside nginx, and the litmus suite and rclone (apt) through an api = "webdav" route.
set -euo pipefail

cd "$(dirname "$0")/.."

missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || missing+=(etcd-server)
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
command -v litmus >/dev/null 2>&1 || missing+=(litmus)
command -v rclone >/dev/null 2>&1 || missing+=(rclone)

if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "scripts/test.sh: ${missing[*]} missing and installing needs root or sudo" >&2
        exit 1
    fi
    echo "==> installing ${missing[*]} (apt-get)"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"
fi

# The alert rules: valid, and each alert fires on the series its unit tests say and on no
# other (tests/it/ops/deploy.rs checks that every metric they use is one fencegate exports).
echo "==> promtool check rules, promtool test rules (deploy/prometheus)"
promtool check rules deploy/prometheus/fencegate.rules.yml
(cd deploy/prometheus && promtool test rules fencegate.rules.test.yml)

# The Kubernetes manifests: every object valid against the API's OpenAPI schemas, which
# kubernetes-validate bundles (no cluster, no network once installed), strictly (a
# misspelt or unknown field is an error), for the oldest Kubernetes they support (1.29:
# the sidecar's backend is a native sidecar container) and the newest the validator knows.
venv=target/deploy-venv
if ! "$venv/bin/kubernetes-validate" --version >/dev/null 2>&1; then
    echo "==> installing kubernetes-validate (pip, into $venv)"
    mkdir -p target
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'kubernetes-validate==1.37.0'
fi
echo "==> kubernetes-validate --strict deploy/kubernetes/*.yaml (Kubernetes 1.29 and 1.37)"
"$venv/bin/kubernetes-validate" --strict --quiet -k 1.29.0 deploy/kubernetes/*.yaml
"$venv/bin/kubernetes-validate" --strict --quiet -k 1.37.0 deploy/kubernetes/*.yaml

# The fencegate.toml of each ConfigMap there: accepted by `fencegate check-config`, and
# consistent with its pod (mounts, probes, Service ports, grace period). This builds the
# binary, with the features the tests below build it with, so they reuse it.
echo "==> fencegate check-config on the configs in deploy/kubernetes"
FENCEGATE="cargo run -q --features etcd --" "$venv/bin/python" deploy/kubernetes/check_configs.py

# The S3 dialect's end-to-end test (tests/it/s3.rs): boto3 against fencegate in front of
# s3s-fs, an S3 server that verifies SigV4. Both installed once under target/ and reused.
s3s=target/s3s-fs/bin/s3s-fs
if ! [ -x "$s3s" ]; then
    echo "==> installing s3s-fs 0.14.1 (cargo install, into target/s3s-fs)"
    cargo install s3s-fs --version 0.14.1 --features binary --locked --root target/s3s-fs
fi
s3venv=target/s3-venv
if ! "$s3venv/bin/python" -c 'import boto3' >/dev/null 2>&1; then
    echo "==> installing boto3 (pip, into $s3venv)"
    mkdir -p target
    python3 -m venv "$s3venv"
    "$s3venv/bin/python" -m pip install --quiet --disable-pip-version-check 'boto3==1.43.11'
fi
# The S3 compatibility suite (tests/it/s3_compat.rs runs the s3-tests subset in
# tests/s3-compat with pytest, in the same virtualenv).
if ! "$s3venv/bin/python" -c 'import pytest, munch, isodate, pytz, requests' >/dev/null 2>&1; then
    echo "==> installing pytest and what s3-tests imports (pip, into $s3venv)"
    "$s3venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -r tests/s3-compat/requirements.txt
fi

# The WebDAV tests' second server (tests/it/webdav.rs), beside nginx's WebDAV module.
davvenv=target/dav-venv
if ! "$davvenv/bin/wsgidav" --version >/dev/null 2>&1; then
    echo "==> installing wsgidav (pip, into $davvenv)"
    mkdir -p target
    python3 -m venv "$davvenv"
    "$davvenv/bin/python" -m pip install --quiet --disable-pip-version-check \
        'wsgidav==4.4.0' 'cheroot==11.1.2'
fi

echo "==> cargo test --all-targets --features etcd $*"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
cargo test --all-targets --features etcd "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line over every test binary (cargo prints one summary per binary, and the
# last ones are the examples', which hold no tests).
mkdir -p target
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;/) p += $i; if ($(i+1) ~ /^failed;/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log" | tee target/test-summary.txt
exit "$status"
