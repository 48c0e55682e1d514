"""``--squeeze`` flags: defaults off, bad input named before any rank starts."""
from __future__ import annotations

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import parse_run_config
from megatron_ext.runtime.extension import build_extensions
from tests.hydro.squeezer.squeezer_helpers import tiny_study


def test_off_by_default_and_on_with_a_study(tmp_path):
    assert parse_run_config([]).ext("squeeze").squeeze is None
    assert not [e for e in build_extensions(parse_run_config([])) if e.name == "squeeze"]
    cfg = parse_run_config(["--squeeze", tiny_study(tmp_path), "--pipeline-model-parallel-size", "2"])
    names = [e.name for e in build_extensions(cfg)]
    # the squeezer requires the timeline's events: built although --timeline is off, and first
    assert names.index("timeline") < names.index("squeeze")
    sq = next(e for e in build_extensions(cfg) if e.name == "squeeze")
    assert sq.deps["timeline"].name == "timeline"


@pytest.mark.parametrize("flags, message", [
    (["--squeeze", "nope.yaml"], "--squeeze: nope.yaml is not a file (a Hydro tune YAML"),
    (["--squeeze-control-every", "1"], "--squeeze-control-every must be >= 2, got 1"),
    (["--squeeze-check-every", "6"], "--squeeze-check-every (6) must be at least twice --squeeze-control-every (4)"),
    (["--squeeze-max-slowdown", "1.5"], "--squeeze-max-slowdown must be in [0, 1), got 1.5"),
    (["--squeeze-forecast-quantile", "-0.1"], "--squeeze-forecast-quantile must be in [0, 1], got -0.1"),
    (["--squeeze-margin-ms", "-1"], "--squeeze-margin-ms must be >= 0, got -1.0"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, message):
    if flags[0] != "--squeeze":
        flags = ["--squeeze", tiny_study(tmp_path)] + flags
    with pytest.raises(ConfigError) as exc:
        parse_run_config(flags)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_bad_tune_yaml_is_named_with_its_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("study_name: x\nn_trials: 0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: key 'n_trials' must be >= 1, got 0"):
        parse_run_config(["--squeeze", str(path)])


def test_a_study_in_memory_cannot_be_shared(tmp_path):
    path = tmp_path / "mem.yaml"
    path.write_text(open(tiny_study(tmp_path)).read() + "storage: memory\n")
    with pytest.raises(ConfigError, match="storage 'memory' cannot be shared by the guests"):
        parse_run_config(["--squeeze", str(path)])
