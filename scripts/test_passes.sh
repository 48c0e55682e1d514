#!/usr/bin/env bash
# `make test`: the whole suite in two passes, both always run; arguments go to every pytest (e.g.
# tests/ft, --durations=25). PY is the interpreter (the Makefile passes the venv's), XDIST the
# first pass's pytest-xdist workers.
#
# 1. The single-process tests on $XDIST workers.
# 2. The multi-rank and Slurm tests: first those marked `solo`, alone (the Bubble Squeezer's guests
#    run at nice 19 in the main job's bubbles, the CPU the background below would take: beside it
#    no trial finished in 2 of the 3 runs tried), then two pytest sessions side by side:
#    - the foreground, at normal CPU priority, one launch at a time: every other multi-rank test not
#      marked `background` (fail-slow, heartbeat, bubble and link checks read wall-clock times and want the
#      machine to themselves) and the Slurm jobs;
#    - the tests marked `background` (deterministic: parity with a reference, orders, exact errors),
#      one launch at a time at idle CPU priority (SCHED_IDLE, else nice 19), so they run on what
#      the foreground leaves idle -- a four-stage pipeline on two cores leaves much of a core idle
#      in its bubbles -- and at full speed once the foreground is done.
#
# Exit 5 (nothing selected, e.g. a narrowed run with no background test) counts as passed. A failed
# pass is named again at the very end, where a log cut to its tail still shows it. Ctrl-C stops
# both sessions of the second pass.
set -u
PY=${PY:?PY must name the Python interpreter}
XDIST=${XDIST:-2}
tmp=$(mktemp -d -t megatron-ext-test.XXXXXX)
bg=""
stop() {
    [ -n "$bg" ] && kill -INT "$bg" 2>/dev/null && wait "$bg" 2>/dev/null
    rm -rf "$tmp"
    exit 130
}
trap stop INT TERM

passed() { [ "$1" = 0 ] || [ "$1" = 5 ]; }

"$PY" -m pytest -q -n "$XDIST" -m "not multirank and not slurm" "$@" 2>&1 | tee "$tmp/pass1.log"
r1=${PIPESTATUS[0]}

echo "== second pass: the multi-rank tests that want the machine to themselves"
"$PY" -m pytest -q -m "multirank and solo" "$@"
r0=$?

# The background session: SIGINT back to its default (bash gives an asynchronous command SIGINT
# ignored, and Python then never raises KeyboardInterrupt), idle priority, then pytest.
"$PY" - -q -p no:cacheprovider -m "multirank and background" "$@" > "$tmp/background.log" 2>&1 <<'EOF' &
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])
EOF
bg=$!
echo "== the other multi-rank and Slurm tests; those marked background run beside them at idle CPU priority"
"$PY" -m pytest -q -m "(multirank or slurm) and not background and not solo" "$@"
r2=$?
echo "== the background multi-rank tests (idle CPU priority, beside the ones above):"
wait "$bg"
r3=$?
bg=""
cat "$tmp/background.log"

rc=0
if ! passed "$r1"; then
    rc=1
    echo "== the first pass (single-process tests) failed, exit $r1:"
    grep -E '^(FAILED|ERROR) ' "$tmp/pass1.log" || tail -n 30 "$tmp/pass1.log"
fi
if ! passed "$r0"; then rc=1; echo "== the multi-rank tests run alone failed, exit $r0 (above)"; fi
if ! passed "$r2"; then rc=1; echo "== the foreground multi-rank and Slurm tests failed, exit $r2 (above)"; fi
if ! passed "$r3"; then
    rc=1
    echo "== the background multi-rank tests failed, exit $r3:"
    grep -E '^(FAILED|ERROR) ' "$tmp/background.log" || tail -n 30 "$tmp/background.log"
fi
rm -rf "$tmp"
exit $rc
