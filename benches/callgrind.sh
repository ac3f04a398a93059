#!/usr/bin/env bash
# Instructions per request of fencegate's W1 (the steady equal-token path), without and
# with token proofs, counted by callgrind: deterministic, so a refactor can be checked
# against today's figure (say, within 2%) on any machine, unlike req/s.
#
#   bash benches/callgrind.sh            # 1,000- and 3,000-request runs of each, 3 times
#   SHORT=500 LONG=1500 REPEAT=1 bash benches/callgrind.sh
#   MODES=plain REPEAT=5 bash benches/callgrind.sh  # plain W1 only, 5 pairs
#   KEEP=/tmp/cg bash benches/callgrind.sh  # keeps the callgrind.out files there, for
#                                           # callgrind_annotate --diff (or one by one)
#
# For each of W1, W1 with proofs required, and (to tell the header's transport from its
# check) W1 carrying the same `Fencing-Proof` header to a route that checks none, it runs
# fencegate (the release binary, `workers = 1`, a fresh store) under
# `valgrind --tool=callgrind` twice against a tiny Python null backend (every request
# answered 204): each run primes 1,000 scopes (token 1; with proofs required, each
# scope's proof verified once) and then sends SHORT, or LONG, W1 PUTs one at a time in
# turn over 4 keep-alive connections (the client: the load bench binary with
# `--callgrind-client`, see benches/load/callgrind.rs). Instructions per request are
# (Ir of the LONG run - Ir of the SHORT run) / (LONG - SHORT): start-up, priming and
# shutdown cancel out. Every count is of all fencegate's threads, so its timers and
# idle threads add a little noise (a few hundred instructions per request between
# pairs): each pair runs REPEAT times (default 3, interleaved) and the median is
# printed. Loopback only; every process it starts is stopped on exit.
set -euo pipefail

cd "$(dirname "$0")/.."

SHORT="${SHORT:-1000}"
LONG="${LONG:-3000}"
KEEP="${KEEP:-}"
REPEAT="${REPEAT:-3}"
# Which W1 variants: plain (always), header, proofed.
MODES="${MODES:-plain header proofed}"
for mode in $MODES; do
    case "$mode" in
    plain | header | proofed) ;;
    *)
        echo "MODES: unknown mode $mode (plain, header, proofed)" >&2
        exit 2
        ;;
    esac
done
if [[ " $MODES " != *" plain "* ]]; then
    echo "MODES must include plain (the other rows are ratios to it)" >&2
    exit 2
fi
if ! [[ "$REPEAT" =~ ^[1-9]$ ]]; then
    echo "REPEAT must be 1 to 9" >&2
    exit 2
fi
if ! [[ "$SHORT" =~ ^[1-9][0-9]*$ && "$LONG" =~ ^[1-9][0-9]*$ ]] || ((LONG <= SHORT || LONG > 1000000)); then
    echo "SHORT and LONG must be request counts with SHORT < LONG <= 1000000" >&2
    exit 2
fi
for tool in valgrind python3; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "needs $tool (apt-get install valgrind python3)" >&2
        exit 2
    fi
done

echo "==> building the release binaries (cargo bench --bench load --no-run)" >&2
client="$(cargo bench --bench load --no-run --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
exe = None
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "load" and m.get("executable"):
        exe = m["executable"]
print(exe or "")
')"
target_dir="$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
fencegate="$target_dir/release/fencegate"
if [ -z "$client" ] || [ ! -x "$client" ] || [ ! -x "$fencegate" ]; then
    echo "the build did not leave the load bench binary and $fencegate" >&2
    exit 1
fi

work="$(mktemp -d -t fencegate-callgrind-XXXXXX)"
pids=()
cleanup() {
    local p n
    for p in "${pids[@]}"; do
        kill -TERM "$p" 2>/dev/null || true
    done
    for p in "${pids[@]}"; do
        # Bounded: SIGKILL after 30 s.
        for n in $(seq 300); do
            kill -0 "$p" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$p" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The null backend: HTTP/1.1 keep-alive, every request answered 204 (the port it bound
# goes to a file). It exits when its stdin (a pipe from this script) closes.
cat >"$work/backend.py" <<'EOF'
import http.server, socketserver, sys, threading

class Null(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        self.send_response(204)
        self.end_headers()
    do_GET = do_PUT = do_POST = do_DELETE = answer

class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

srv = Server(("127.0.0.1", 0), Null)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(srv.server_address[1]))
import os
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
threading.Thread(target=srv.serve_forever, daemon=True).start()
sys.stdin.read()
EOF
mkfifo "$work/backend.stdin"
python3 "$work/backend.py" "$work/backend.port" <"$work/backend.stdin" &
pids+=($!)
exec 9>"$work/backend.stdin"
for n in $(seq 100); do
    [ -s "$work/backend.port" ] && break
    sleep 0.1
done
backend_port="$(cat "$work/backend.port" 2>/dev/null || true)"
if [ -z "$backend_port" ]; then
    echo "the null backend did not start" >&2
    exit 1
fi

"$fencegate" keygen --out "$work/proof-key" >/dev/null

# One fencegate under callgrind: primes, sends $2 requests ($1: plain, header or
# proofed; $3: which pair), stops.
# Sets IR to the instruction count of the whole run. (Not called in a subshell, so that
# the valgrind process is in `pids` for the exit trap.)
IR=""
measure() {
    local mode="$1" count="$2" dir="$work/$1-$2-$3" log line proxy admin pid n
    mkdir -p "$dir"
    cat >"$dir/fencegate.toml" <<EOF
# Written by benches/callgrind.sh.
[server]
listen = "127.0.0.1:0"
workers = 1
shutdown_timeout = "5s"

[admin]
listen = "127.0.0.1:0"

[store]
path = "$dir/marks.redb"

[fencing]
header = "Fencing-Token"
drain_timeout = "5s"
settle = "0s"
proof_keys = ["$work/proof-key.pub"]

[[upstream]]
name = "null"
url = "http://127.0.0.1:$backend_port"
timeout = "60s"

[[route]]
name = "reports"
path = "/reports/{report}/{*rest}"
scope = "report/{report}"
upstream = "null"

[[route]]
name = "proofed"
path = "/proofed/{report}/{*rest}"
scope = "proofed/{report}"
upstream = "null"
proof = "required"
EOF
    log="$dir/fencegate.log"
    RUST_LOG=info valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out" \
        "$fencegate" serve --config "$dir/fencegate.toml" </dev/null >/dev/null 2>"$log" &
    pid=$!
    pids+=("$pid")
    proxy=""
    for n in $(seq 1200); do
        line="$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -m1 'fencegate listening' || true)"
        if [ -n "$line" ]; then
            proxy="$(grep -o 'proxy_addr=[0-9.:]*' <<<"$line" | cut -d= -f2)"
            admin="$(grep -o 'admin_addr=[0-9.:]*' <<<"$line" | cut -d= -f2)"
            break
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$proxy" ] || [ -z "$admin" ]; then
        echo "fencegate did not start under valgrind; log:" >&2
        tail -20 "$log" >&2
        return 1
    fi
    local args=("$proxy" "$admin" "$count")
    case "$mode" in
        proofed) args+=(--proof-key "$work/proof-key.key") ;;
        header) args+=(--proof-key "$work/proof-key.key" --unchecked) ;;
    esac
    if ! "$client" --callgrind-client "${args[@]}" >&2; then
        echo "the client failed; fencegate's log:" >&2
        tail -20 "$log" >&2
        return 1
    fi
    kill -TERM "$pid"
    for n in $(seq 600); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "fencegate did not stop within 60 s of SIGTERM" >&2
        return 1
    fi
    wait "$pid" || true
    unset 'pids[-1]'
    if [ -n "$KEEP" ]; then
        mkdir -p "$KEEP"
        cp "$dir/callgrind.out" "$KEEP/callgrind.$mode-$count-$3.out"
    fi
    IR="$(grep -m1 -E '^(summary|totals):' "$dir/callgrind.out" | awk '{print $2}')"
    if ! [[ "$IR" =~ ^[0-9]+$ ]]; then
        echo "no instruction total in $dir/callgrind.out" >&2
        return 1
    fi
    rm -rf "$dir"
}

read -r -a modes <<<"$MODES"
declare -A each
for r in $(seq "$REPEAT"); do
    for mode in "${modes[@]}"; do
        echo "==> pair $r of $REPEAT, W1 ($mode): $SHORT and $LONG requests under callgrind" >&2
        measure "$mode" "$SHORT" "$r"
        short_ir="$IR"
        measure "$mode" "$LONG" "$r"
        long_ir="$IR"
        per=$(((long_ir - short_ir) / (LONG - SHORT)))
        each[$mode]="${each[$mode]:-} $per"
        echo "    Ir: $short_ir ($SHORT requests), $long_ir ($LONG requests): $per per request" >&2
    done
done

median() {
    tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'
}
plain="$(median "${each[plain]}")"
echo
echo "fencegate instructions per request (callgrind, workers = 1, 4 keep-alive connections,"
echo "1,000 scopes; ($LONG-request run - $SHORT-request run) / $((LONG - SHORT)), all threads;"
echo "median of $REPEAT pair(s)):"
row() {
    local name="$1" mode="$2" v
    v="$(median "${each[$mode]}")"
    printf '  %-52s %7s  %6s× W1   (pairs:%s)\n' "$name" "$v" \
        "$(python3 -c "print(f'{$v / $plain:.3f}')")" "${each[$mode]}"
}
row "W1 (equal token)" plain
if [ -n "${each[header]:-}" ]; then
    row "W1 + the same Fencing-Proof, on a proof = off route" header
fi
if [ -n "${each[proofed]:-}" ]; then
    row "W1 with proofs required" proofed
fi
