"""tools/resilience_hourly.py: throughput per time bin of the benchmark's policies."""
from __future__ import annotations

import pytest

from megatron_ext.resilience import setting
from tests.conftest import run_python
from tools import resilience_hourly as tool


def test_bins_before_the_fault_run_at_the_healthy_rate_and_a_restart_shows_in_its_bin(capsys):
    ctx = setting.context("llama2-13b")
    it_s = ctx.sim.healthy(ctx.start).time_s
    bin_s = setting.ONSET_S          # bin 0 ends at the fault's onset
    got = tool.hourly("llama2-13b", "gpu_lost", ["recycle", "ckpt_restart"], bin_s=bin_s)
    for name, bins in got.items():
        assert len(bins) == -(-int(setting.ONSET_S + setting.MEASURE_S) // int(bin_s))
        # whole iterations only: at most one iteration's share short of healthy
        assert 1 - it_s / bin_s <= bins[0] <= 1 + 1e-9, (name, bins[0])
    # The restart (heartbeat timeout, 120 s and the shard read, then the rollback's lost work, not
    # subtracted here) is in the bin after the onset; ReCycle's 2 s reroute barely shows.
    assert got["ckpt_restart"][1] < got["recycle"][1] - 0.2
    assert got["recycle"][1] > 0.9
    out = capsys.readouterr().out
    assert "ckpt_restart: " in out and "1 restarts" in out


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; known: gpu_slow_1.5x"):
        tool.hourly("llama2-13b", "nope", ["resihp"])
    with pytest.raises(ValueError, match="--bin-s must be > 0, got 0"):
        tool.hourly("llama2-13b", "gpu_lost", ["resihp"], bin_s=0)


def test_the_command_names_bad_input_in_one_line_and_exits_2():
    proc = run_python("tools/resilience_hourly.py", "--model", "llama2-13b", "--scenario", "nope", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("resilience_hourly: unknown scenario 'nope'; known: gpu_slow_1.5x")
    assert len(proc.stderr.strip().splitlines()) == 1
