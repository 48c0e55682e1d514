#!/bin/bash
# Compile time of a Helix graph whose tiling is declined: e5c3a04 (a third, untiled trace) against
# 2ae49dc (the first untiled trace returned). Two checkouts, the arms in rotated order. The kept
# output (out_20261203.txt) came from the same loop before 2ae49dc was committed: its "new" arm was
# e5c3a04 with 2ae49dc's megatron_ext/helix/compiler.py copied in, the only code 2ae49dc changes.
set -e
repo=$(git rev-parse --show-toplevel); here=$(cd "$(dirname "$0")" && pwd); tmp=$(mktemp -d)
git clone -q "$repo" "$tmp/old" && git -C "$tmp/old" checkout -q e5c3a04
git clone -q "$repo" "$tmp/new" && git -C "$tmp/new" checkout -q "${NEW:-2ae49dc}"
for r in 1 2 3; do
  if [ $r = 2 ]; then order="new old"; else order="old new"; fi
  for arm in $order; do
    echo -n "round $r $arm "
    ROOT=$tmp/$arm OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore ${PYTHON:-python} "$here/ab_compile.py" 2>/dev/null | tail -1
  done
done
