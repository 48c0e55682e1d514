#!/bin/bash
# plain_error A/B/C: e040057 (before), 99c14dc (count first), a86fca7 (and start_step), 3 rounds, order rotated
P=${PYTHON:-python}
W=$(mktemp -d)  # the clones and the outputs
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
mkdir -p $W/pe_ab
for c in e040057 99c14dc a86fca7; do git clone -q ${REPO:?the repository to clone} $W/pe_$c && git -C $W/pe_$c checkout -q $c; done
arms=(e040057 99c14dc a86fca7)
for r in 0 1 2; do
  for k in 0 1 2; do
    arm=${arms[$(( (r + k) % 3 ))]}
    (cd $W/pe_$arm && PYTHONPATH=$W/pe_$arm $P tools/bench_relayout.py --no-sim --live-parts plain_error > $W/pe_ab/${arm}_$r.txt 2>$W/pe_ab/${arm}_$r.err)
    echo "round $r $arm rc=$? $(grep -o 'plain_error: .*' $W/pe_ab/${arm}_$r.txt | cut -c1-150)" >> $W/pe_ab/summary.txt
  done
done
echo done >> $W/pe_ab/summary.txt
