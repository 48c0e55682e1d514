"""tools/bench_helix.py refuses arguments it cannot run, with one line naming them (before any rank
starts)."""
import pytest

from tools import bench_helix


@pytest.mark.parametrize("argv, named", [
    (["--select-rounds", "0"], "got 0, 100 and 2"),
    (["--peak-attempts", "0"], "got 8, 0 and 2"),
    (["--tiles", "1"], "got 8, 100 and 1"),
    (["--interference", "1.0"], "--interference is a share of compute throughput in [0, 1), got 1.0"),
])
def test_bad_arguments_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_helix.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in err and named in err, err
