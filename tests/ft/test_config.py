"""The fault-tolerance core's own config section (``--ft-*``): its former ``--resihp-*`` names, when
the core runs, which launcher starts the ranks, and the core's own layout chooser for a job
without ResiHP."""
from __future__ import annotations

import types

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import config_from_values, parse_run_config
from megatron_ext.ft.choose import keep_shape
from megatron_ext.ft.config import Launcher, enabled, launcher_for, process_group_timeout_s
from megatron_ext.ft.target import KNOBS, LayoutTarget


def test_the_former_flag_names_still_work_and_say_once_what_replaced_them():
    cfg = parse_run_config(["--resihp-on-stop", "continue", "--resihp-heartbeat-timeout-s", "4",
                            "--resihp-continue-timeout-s", "60"])
    ft = cfg.ext("ft")
    assert (ft.ft_on_stop, ft.ft_heartbeat_timeout_s, ft.ft_continue_timeout_s) == ("continue", 4.0, 60.0)
    assert cfg.notes == ["--resihp-on-stop is now --ft-on-stop (the former name still works)",
                         "--resihp-heartbeat-timeout-s is now --ft-heartbeat-timeout-s (the former name still works)",
                         "--resihp-continue-timeout-s is now --ft-continue-timeout-s (the former name still works)"]
    assert parse_run_config(["--ft-on-stop", "continue"]).notes == []
    assert parse_run_config(["--no-resihp-keep-newer-stages"]).ext("ft").ft_keep_newer_stages is False


def test_a_former_yaml_key_is_overridden_by_the_new_flag(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("resihp_on_stop: continue\nresihp_respawn: 1\n")
    cfg = parse_run_config(["--config", str(run), "--ft-on-stop", "report"])
    assert (cfg.ext("ft").ft_on_stop, cfg.ext("ft").ft_respawn) == ("report", 1)
    assert "--resihp-respawn is now --ft-respawn (the former name still works)" in cfg.notes


def test_both_names_at_once_is_one_error():
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--resihp-respawn", "1", "--ft-respawn", "2"])
    assert str(err.value) == ("command line: --resihp-respawn and --ft-respawn are one setting (--resihp-respawn is "
                              "its former name): give --ft-respawn only")


@pytest.mark.parametrize("values,message", [
    ({"ft_heartbeat_timeout_s": 1.0}, "--ft-heartbeat-timeout-s (1.0) must exceed --ft-heartbeat-interval-s (1.0)"),
    ({"ft_continue_timeout_s": 5.0}, "--ft-continue-timeout-s (5.0) must exceed --ft-heartbeat-timeout-s (10.0)"),
    ({"ft_heartbeat_interval_s": 0.0}, "--ft-heartbeat-interval-s must be > 0, got 0.0"),
    ({"ft_respawn": -1}, "--ft-respawn must be >= 0, got -1"),
    ({"ft_hang_timeout_s": -1.0}, "--ft-hang-timeout-s must be >= 0 (0: derived), got -1.0"),
    ({"ft_grace_s": 0.0}, "--ft-grace-s must be > 0, got 0.0"),
    ({"ft_on_stop": "continue", "ft_hang_timeout_s": 120.0},
     "--ft-hang-timeout-s (120) must be below --ft-continue-timeout-s (120): the survivors' collectives with a hung "
     "rank would time out before it is named"),
])
def test_bad_values_are_named(values, message):
    with pytest.raises(ConfigError) as err:
        config_from_values(values)
    assert str(err.value) == message


@pytest.mark.parametrize("values,on,launcher,timeout_s", [
    ({}, False, Launcher(own=False, respawn=0, abort=True), 600.0),
    ({"ft": True}, True, Launcher(own=True, respawn=0, abort=True), 600.0),
    ({"resihp": True}, True, Launcher(own=True, respawn=0, abort=True), 600.0),
    ({"resihp": True, "ft_on_stop": "report"}, True, Launcher(own=False, respawn=0, abort=True), 600.0),
    ({"ft_on_stop": "continue", "ft_respawn": 2}, True, Launcher(own=True, respawn=2, abort=False), 120.0),
])
def test_when_the_core_runs_and_which_launcher_starts_the_ranks(values, on, launcher, timeout_s):
    cfg = config_from_values(values)
    assert (enabled(cfg), launcher_for(cfg), process_group_timeout_s(cfg)) == (on, launcher, timeout_s)


def trainer(world: int, tp: int = 1, pp: int = 2, gbs: int = 8, members=None, launch=None):
    cfg = config_from_values({"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                              "global_batch_size": gbs, "micro_batch_size": 1, "num_layers": 4,
                              "num_attention_heads": 4})
    layout = cfg.parallel.launch_layout(world if members is None else len(members))
    layout = layout if members is None else layout.with_members(members)
    ft = types.SimpleNamespace(launch_target=lambda: launch)
    return types.SimpleNamespace(cfg=cfg, ctx=types.SimpleNamespace(layout=layout, members=layout.members),
                                 relayout_knobs=KNOBS, check_target=lambda target: None, ft=ft)


def test_the_core_chooser_keeps_the_shape_and_drops_a_replica_after_a_loss():
    # PP2 x DP3 on 6 ranks (replicas 0/3, 1/4, 2/5 as stage 0/stage 1), rank 3 lost: the two whole
    # replicas stay as they are; rank 0, whose stage-1 partner is gone, waits as a spare.
    target, line = keep_shape(trainer(6), [0, 1, 2, 4, 5], [3], "loss")
    assert target == LayoutTarget(tp=1, pp=2, members=(1, 2, 4, 5))
    assert line == "the current shape over 4 of 5 device(s) (1 left as spare) (the core's chooser: no --resihp planner)"
    # PP2 x DP2, rank 3 lost: replica 0/2 holds both stages; rank 1 becomes the spare.
    assert keep_shape(trainer(4), [0, 1, 2], [3], "loss")[0].members == (0, 2)


def test_the_core_chooser_takes_only_replica_counts_the_batch_splits_over():
    # 8 micro-batches: 3 replicas cannot share them evenly, so 6 survivors of PP2 form 2 replicas.
    target, _ = keep_shape(trainer(8), [0, 1, 2, 3, 4, 5], [6, 7], "loss")
    assert target.dp == 2 and target.members == (0, 1, 4, 5)


def test_the_core_chooser_brings_the_launch_layout_back_when_replacements_fill_it():
    launch = LayoutTarget(tp=1, pp=2, members=(0, 1, 2, 3))
    target, line = keep_shape(trainer(2, members=(0, 1), launch=launch), [0, 1, 3, 2], [], "grow")
    # The running replica (0 on stage 0, 1 on stage 1) keeps its places; the replacements form the second.
    assert target.members == (0, 2, 1, 3) and line.startswith("the launch layout over 4 of 4 device(s)")


def test_the_core_chooser_says_why_when_no_replica_fits():
    why = keep_shape(trainer(2, tp=2, pp=1), [1], [0], "loss")
    assert why == "no layout of the same shape fits the 1 remaining device(s): 1 device(s) cannot hold one replica of TP x PP"
