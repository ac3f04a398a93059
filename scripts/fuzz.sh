#!/usr/bin/env bash
# The fuzz targets (fuzz/, cargo-fuzz and libFuzzer on a nightly toolchain), each run for
# FUZZ_SECONDS (default 30) from its committed seed corpus. Fails on a crash, a hang or a
# differential mismatch (each target panics on one), leaving the input that found it
# under fuzz/artifacts/<target>/.
#
#   FUZZ_SECONDS=1800 scripts/fuzz.sh            # every target, 30 minutes each
#   FUZZ_SECONDS=60 scripts/fuzz.sh head_scan    # one target
#
# Built without a sanitizer (the crate forbids unsafe code; libFuzzer's coverage and
# comparison tracing stay), optimized, with debug assertions and overflow checks, so that
# the build stays a few minutes. New inputs found go to a scratch directory, not to the
# committed corpus: `cargo fuzz cmin` and a commit add the ones worth keeping.
set -euo pipefail

cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-30}"
toolchain="${FUZZ_TOOLCHAIN:-nightly}"
target_dir="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
flags=(-s none -O -a --codegen-units 16 --target-dir "$target_dir")

if ! cargo "+$toolchain" fuzz --version >/dev/null 2>&1; then
    echo "==> cargo install cargo-fuzz --locked"
    cargo "+$toolchain" install cargo-fuzz --locked
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo "+$toolchain" fuzz list --fuzz-dir fuzz)
fi

echo "==> cargo fuzz build (${targets[*]})"
cargo "+$toolchain" fuzz build "${flags[@]}" --fuzz-dir fuzz

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
    echo "==> fuzz $t for ${seconds}s"
    mkdir -p "$scratch/$t"
    # One job on one core; an input taking over 10 s is a hang. Output goes to a log, of
    # which the summary (and a failure's report) is shown.
    if ! cargo "+$toolchain" fuzz run "${flags[@]}" --fuzz-dir fuzz "$t" \
        "$scratch/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$scratch/$t.log" 2>&1; then
        tail -n 60 "$scratch/$t.log"
        echo "fuzz: $t failed; the input is under fuzz/artifacts/$t/" >&2
        exit 1
    fi
    grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)' \
        "$scratch/$t.log" || tail -n 5 "$scratch/$t.log"
done
