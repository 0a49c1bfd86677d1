#!/bin/bash
# Guest instructions an aarch64 program executes under QEMU user mode (no ARM hardware needed):
# every translation block holds one instruction (-singlestep) and each execution is logged
# (-d exec,nochain), so the log's lines count the instructions. Slow (~1 µs per instruction).
# A count, not a timing: run a program twice with different repetition counts and take the
# difference to leave its setup out.
#
#   tools/qemu_icount.sh target/aarch64-unknown-linux-gnu/release/examples/... [args]
#
# QEMU_CPU (default max) picks the emulated CPU's features.
set -euo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
QEMU_CPU=${QEMU_CPU:-max} qemu-aarch64-static -L /usr/aarch64-linux-gnu -singlestep -d exec,nochain -D "$log" "$@" >/dev/null
grep -c '^Trace' "$log"
