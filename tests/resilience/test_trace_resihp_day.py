"""tools/trace_resihp_day.py refuses a perturbation it cannot draw, by name, before any day runs."""
import pytest

from tools import trace_resihp_day


@pytest.mark.parametrize("argv, named", [
    (["llama2-7b", "1", "--perturb", "1.0"], "--perturb must be a fraction in [0, 1), got 1.0"),
    (["llama2-7b", "1", "--perturb", "-0.1"], "--perturb must be a fraction in [0, 1), got -0.1"),
    (["llama2-7b", "1", "--perturb", "0.2", "--perturb-seed", "-1"], "--perturb-seed must be >= 0, got -1"),
])
def test_a_bad_perturbation_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        trace_resihp_day.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
