#!/bin/bash
# Compile time of a Helix graph whose tiling is declined: e5c3a04 (a third, untiled trace) against
# the commit after it (the first untiled trace returned). Two checkouts, the arms in rotated order.
set -e
repo=$(git rev-parse --show-toplevel); here=$(cd "$(dirname "$0")" && pwd); tmp=$(mktemp -d)
git clone -q "$repo" "$tmp/old" && git -C "$tmp/old" checkout -q e5c3a04
git clone -q "$repo" "$tmp/new" && git -C "$tmp/new" checkout -q "${NEW:-HEAD}"
for r in 1 2 3; do
  if [ $r = 2 ]; then order="new old"; else order="old new"; fi
  for arm in $order; do
    echo -n "round $r $arm "
    ROOT=$tmp/$arm OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore python "$here/ab_compile.py" 2>/dev/null | tail -1
  done
done
