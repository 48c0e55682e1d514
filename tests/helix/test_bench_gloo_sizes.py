"""tools/bench_gloo_sizes.py: how the runs of one payload are summarised, and its bad arguments."""
import pytest

from tools import bench_gloo_sizes as bg


def test_stalls_are_counted_against_the_fastest_tenth_and_the_statistics_are_in_ms():
    fast, stalled = [0.0003] * 8, [0.0033] * 2
    s = bg.summarise({"idle": fast + stalled, "after compute": [0.0004] * 10}, stall_s=0.0015)
    assert s["idle"]["stalled"] == pytest.approx(0.2) and s["after compute"]["stalled"] == 0.0
    assert s["idle"]["mean_ms"] == pytest.approx(0.9)
    assert s["idle"]["trimmed_mean_ms"] == pytest.approx((0.3 * 7 + 3.3) / 8)   # one stall and one fast run dropped
    assert s["idle"]["median_ms"] == pytest.approx(0.3)
    assert s["after compute"]["q1_ms"] == pytest.approx(0.4) == s["after compute"]["q3_ms"]
    with pytest.raises(ValueError, match="no runs"):
        bg.summarise({"idle": []}, 0.0015)


@pytest.mark.parametrize("argv, message", [(["--payloads", "12"], "multiples of 8 bytes"),
                                           (["--rounds", "1"], "at least 2")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bg.main(argv)
    assert message in capsys.readouterr().err
