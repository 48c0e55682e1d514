"""A Megatron-LM user's logs: TensorBoard tags and series under Megatron-LM's names (read back with
TensorBoard's EventAccumulator), Weights & Biases in offline mode (its run file read back),
``--log-throughput`` against the FLOPs model worked by hand, the ``--log-format megatron`` line parsed
with the regular expression a Megatron-LM log parser uses, and Megatron-LM's logging defaults.

One in-process single-rank run (``run``) of 6 iterations, a line every 3 and a validation every 3,
writes everything the tests read."""
from __future__ import annotations

import contextlib
import glob
import io
import json
import math
import re
import struct

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import LoggingConfig, config_from_values, parse_run_config
from megatron_ext.runtime.extension import IterationMetrics
from megatron_ext.runtime.runlog import RunLog

VALUES = {"train_iters": 6, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32,
          "global_batch_size": 4, "micro_batch_size": 2, "lr_warmup_iters": 0,
          "log_interval": 3, "eval_interval": 3, "eval_iters": 2, "log_format": "megatron", "log_throughput": True,
          "log_timers_to_tensorboard": True, "timing_log_level": 1, "log_validation_ppl_to_tensorboard": True,
          "wandb_project": "megatron-ext-test", "wandb_exp_name": "tiny", "log_params_norm": True,
          "log_num_zeros_in_grad": True}

# What a Megatron-LM log parser matches in training_log's line (each field as core_v0.16.1 prints it).
MEGATRON_LINE = re.compile(
    r" \[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\] iteration\s+(?P<it>\d+)/\s*(?P<iters>\d+) \|"
    r" consumed samples:\s+(?P<samples>\d+) \|"
    r" elapsed time per iteration \(ms\):\s+(?P<ms>[\d.]+) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\):\s+(?P<tflops>[\d.]+) \|)?"
    r" learning rate:\s+(?P<lr>[\d.E+-]+) \|"
    r" global batch size:\s+(?P<batch>\d+) \|"
    r" lm loss:\s+(?P<loss>[\d.E+-]+) \|"
    r"(?P<other_losses>(?: \w+: [\d.E+-]+ \|)*)"      # MoE's load_balancing_loss, ...
    r" loss scale:\s+(?P<scale>[\d.]+) \|"
    r"(?: grad norm:\s+(?P<grad_norm>[\d.]+) \|)?"
    r"(?: num zeros:\s+(?P<num_zeros>\d+) \|)?"
    r"(?: params norm:\s+(?P<params_norm>[\d.]+) \|)?"
    r" number of skipped iterations:\s+(?P<skipped>\d+) \|"
    r" number of nan iterations:\s+(?P<nan>\d+) \|")
MEGATRON_VALID = re.compile(r" validation loss at iteration (?P<it>\d+)(?P<end> on validation set)? \|"
                            r" lm loss value: (?P<loss>[\d.E+-]+) \| lm loss PPL: (?P<ppl>[\d.E+-]+) \| $")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.loop import Trainer

    out = tmp_path_factory.mktemp("logs")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    cfg = config_from_values({**VALUES, "tensorboard_dir": str(out / "tb"), "metrics_file": str(out / "m.jsonl"),
                              "wandb_save_dir": str(out / "wandb")})
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    printed = io.StringIO()
    try:
        trainer = Trainer(cfg, ctx).setup()
        with contextlib.redirect_stdout(printed):
            trainer.run()
        padded_vocab = trainer.model.vocab_size
        # every parameter once (one rank, the tied output head is the embedding)
        norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in trainer.model.parameters()))
    finally:
        distributed.teardown()
        mp.undo()
    rows = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    return {"out": out, "stdout": printed.getvalue(), "rows": rows, "vocab": padded_vocab, "params_norm": norm}


def train_rows(run):
    return [r for r in run["rows"] if r["kind"] == "train"]


def scalars(run) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["out"] / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_megatrons_tags_and_series(run):
    got = scalars(run)
    rows = train_rows(run)
    samples = [r["consumed_samples"] for r in rows]
    assert samples == [4, 8, 12, 16, 20, 24]
    for tag, key in (("lm loss", "loss"), ("learning-rate", "lr"), ("grad-norm", "grad_norm")):
        assert [s for s, _ in got[tag]] == [1, 2, 3, 4, 5, 6], tag
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in rows], rel=1e-6), tag
        # the "vs samples" series: the same values over the consumed samples
        assert got[f"{tag} vs samples"] == [(n, v) for n, (_, v) in zip(samples, got[tag])], tag
    assert got["batch-size"] == [(i, 4.0) for i in range(1, 7)]
    assert got["loss-scale"] == [(i, 1.0) for i in range(1, 7)]   # bf16 / fp32: no loss scaling
    valid = [r for r in run["rows"] if r["kind"] == "valid"]
    assert [s for s, _ in got["lm loss validation"]] == [3, 6]
    assert [v for _, v in got["lm loss validation"]] == pytest.approx([r["loss"] for r in valid], rel=1e-6)
    assert [s for s, _ in got["lm loss validation vs samples"]] == [12, 24]
    assert [v for _, v in got["lm loss validation ppl"]] == pytest.approx([math.exp(r["loss"]) for r in valid],
                                                                         rel=1e-5)
    # --log-timers-to-tensorboard: at each log interval but the first line's, the interval's mean
    # iteration time (s) and with --timing-log-level 1 its phases, and the throughput.
    times = [r["iter_time_s"] for r in rows]
    assert [s for s, _ in got["iteration-time"]] == [3, 6]
    assert [v for _, v in got["iteration-time"]] == pytest.approx([sum(times[:3]) / 3, sum(times[3:]) / 3],
                                                                  rel=1e-5)
    for tag in ("forward-backward-time", "optimizer-time", "throughput"):
        assert [s for s, _ in got[tag]] == [3, 6], tag
    fb, opt = dict(got["forward-backward-time"]), dict(got["optimizer-time"])
    assert all(0 < fb[i] + opt[i] <= v for i, v in got["iteration-time"])
    # ours only where Megatron-LM has no name; none of our former train/ and valid/ names
    assert [t for t in got if t.startswith(("train/", "valid/"))] == ["train/tokens_per_s"]


def test_throughput_is_the_flops_model_worked_by_hand(run):
    # A GPT layer per token, forward: QKV 2h x 3h, output 2h x h, MLP 2 x 2h x 4h = 24 h^2; the
    # vocabulary head 2hV; attention 4 h s^2 per sequence and layer (the whole score matrix).
    # Backward twice the forward; one rank, so per device = the whole iteration.
    L, h, s, B, V = 2, 32, 32, 4, run["vocab"]
    flops = 3 * B * ((L * 24 * h * h + 2 * h * V) * s + L * 4 * h * s * s)
    rows = train_rows(run)
    assert [r["tflops_per_device"] for r in rows] == pytest.approx(
        [flops / (r["iter_time_s"] * 1e12) for r in rows], rel=1e-9)
    got = dict(scalars(run)["throughput"])
    times = [r["iter_time_s"] for r in rows]
    assert got[6] == pytest.approx(flops / (sum(times[3:]) / 3 * 1e12), rel=1e-5)


def test_the_megatron_line_parses_as_megatrons(run):
    lines = [m for m in map(MEGATRON_LINE.match, run["stdout"].splitlines()) if m]
    assert [int(m["it"]) for m in lines] == [1, 3, 6]        # the first iteration and every --log-interval
    rows = train_rows(run)
    # The interval's mean loss and time: after the first line the sums go on (it only shows the
    # start-up), so the line at 3 averages 1-3 and the one at 6 averages 4-6.
    for m, window in zip(lines, (rows[:1], rows[:3], rows[3:])):
        last = window[-1]
        assert (int(m["iters"]), int(m["samples"]), int(m["batch"])) == (6, last["consumed_samples"], 4)
        assert float(m["loss"]) == pytest.approx(sum(r["loss"] for r in window) / len(window), rel=1e-6)
        assert float(m["ms"]) == pytest.approx(1e3 * sum(r["iter_time_s"] for r in window) / len(window), abs=0.06)
        assert float(m["lr"]) == pytest.approx(last["lr"], rel=1e-6)
        assert float(m["grad_norm"]) == pytest.approx(last["grad_norm"], abs=5e-4)
        assert (m["scale"], m["skipped"], m["nan"], m["tflops"]) == ("1.0", "0", "0", "0.0")
    text = run["stdout"].splitlines()
    valid = [(i, m) for i, m in enumerate(map(MEGATRON_VALID.match, text)) if m]
    assert [(int(m["it"]), bool(m["end"])) for _, m in valid] == [(3, False), (6, True)]
    for i, m in valid:   # Megatron-LM's rule of dashes above and below, one longer than the line
        assert text[i - 1] == text[i + 1] == "-" * (len(text[i]) + 1)
        assert float(m["ppl"]) == pytest.approx(math.exp(float(m["loss"])), rel=1e-5)


def wandb_records(path: str):
    """The records of a wandb run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log blocks of 32 KiB whose records have a 7-byte header (CRC, length,
    type: full, first, middle, last) and carry one protobuf ``Record`` each."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, part = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:     # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:
            pos += 32768 - pos % 32768 if pos % 32768 else 0
            continue
        part += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def test_wandb_offline_run_holds_the_scalars(run):
    (path,) = glob.glob(str(run["out"] / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history: dict[int, dict[str, float]] = {}
    config: dict[str, object] = {}
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731 - wandb nests some names
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = history.setdefault(record.history.step.num, {})
            step.update({key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "run":
            assert (record.run.project, record.run.display_name) == ("megatron-ext-test", "tiny")
            config.update({key(i): json.loads(i.value_json) for i in record.run.config.update})
    rows = train_rows(run)
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    assert [history[i]["lm loss"] for i in range(1, 7)] == pytest.approx([r["loss"] for r in rows])
    assert [history[i]["learning-rate"] for i in range(1, 7)] == pytest.approx([r["lr"] for r in rows])
    assert [history[i]["samples vs steps"] for i in range(1, 7)] == [4, 8, 12, 16, 20, 24]
    valid = [r["loss"] for r in run["rows"] if r["kind"] == "valid"]
    assert [history[i]["lm loss validation"] for i in (3, 6)] == pytest.approx(valid)
    assert all("iteration-time" in history[i] and "throughput" in history[i] for i in (3, 6))
    assert not any(k.endswith(" vs samples") for h in history.values() for k in h)   # TensorBoard's only
    assert config["train_iters"] == 6 and config["wandb_project"] == "megatron-ext-test"   # the run's flags


def _metrics(it: int, loss: float = 2.0, *, skipped: bool = False, **extra) -> IterationMetrics:
    return IterationMetrics(iteration=it, loss=loss, lr=1e-3, grad_norm=0.5, iter_time_s=0.1, tokens_per_s=1.0,
                            consumed_samples=4 * it, skipped=skipped, extra=dict(extra), global_batch_size=4)


@pytest.mark.parametrize("fmt, lines", [("megatron-ext", [1, 4, 8, 10]), ("megatron", [1, 4, 8])])
def test_lines_come_at_the_first_iteration_every_interval_and_ours_at_the_last(capsys, fmt, lines):
    log = RunLog(LoggingConfig(log_interval=4, log_format=fmt), train_iters=10)
    for it in range(1, 11):
        log.train(_metrics(it), avg_time=0.1)
    printed = capsys.readouterr().out.splitlines()
    assert [int(re.search(r"iteration\s+(\d+)/", line)[1]) for line in printed] == lines


def test_the_megatron_line_counts_skipped_and_nan_iterations_and_names_moe_losses(capsys, tmp_path):
    log = RunLog(LoggingConfig(log_interval=4, log_format="megatron", tensorboard_dir=str(tmp_path)), train_iters=8)
    log.first_iteration = 5   # a resumed run: its first line comes at 5
    log.open()
    for it, loss, skipped in ((5, 2.0, False), (6, float("nan"), True), (7, 4.0, False), (8, 6.0, True)):
        log.train(_metrics(it, loss, skipped=skipped, moe_load_balancing_loss=1.25, bubble_s0=0.5), avg_time=0.1)
    log.close()
    first, line = capsys.readouterr().out.splitlines()
    m = MEGATRON_LINE.match(line)
    # 5-8: 5 and 7 updated the model (mean loss 3.0), 6 and 8 were skipped, 6 with a nan loss
    assert (int(m["it"]), float(m["loss"]), m["skipped"], m["nan"]) == (8, 3.0, "2", "1")
    assert " load_balancing_loss: 1.250000E+00 |" in line and line.endswith(" bubble_s0: 0.5 |")
    assert "moe_load_balancing_loss" not in line and MEGATRON_LINE.match(first)["it"] == "5"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "load_balancing_loss" in tags and "load_balancing_loss vs samples" in tags   # megatron's tracker name
    assert "train/bubble_s0" in tags and "train/moe_load_balancing_loss" not in tags


def test_megatrons_logging_defaults():
    lg = parse_run_config([]).logging
    assert (lg.log_interval, lg.eval_iters, lg.eval_interval) == (100, 100, None)   # core_v0.16.1's
    assert (lg.tensorboard_log_interval, lg.tensorboard_queue_size, lg.timing_log_level) == (1, 1000, 0)
    assert lg.log_loss_scale_to_tensorboard and not (lg.log_throughput or lg.log_timers_to_tensorboard
                                                     or lg.log_validation_ppl_to_tensorboard)
    assert lg.log_format == "megatron-ext"
    assert parse_run_config(["--no-log-loss-scale-to-tensorboard"]).logging.log_loss_scale_to_tensorboard is False
    # Megatron-LM's rule: only a project switches Weights & Biases on
    assert parse_run_config(["--wandb-exp-name", "x"]).logging.wandb_project is None


def test_wandb_without_the_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--wandb-project", "p"])
    assert str(err.value) == ("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                              "(or leave --wandb-project unset)")


def test_throughput_divides_by_the_world():
    log = RunLog(LoggingConfig(), train_iters=1)
    assert log.tflops_per_device(0.5, 8) is None            # without --log-throughput
    log.flops_per_sample, log.world_size = 3e12, 4
    assert log.tflops_per_device(0.5, 8) == pytest.approx(3 * 8 / (0.5 * 4))


def test_log_params_norm_is_the_norm_of_every_parameter(run):
    rows = train_rows(run)
    assert rows[-1]["params_norm"] == pytest.approx(run["params_norm"], rel=1e-9)
    assert [v for _, v in scalars(run)["params-norm"]] == pytest.approx([r["params_norm"] for r in rows], rel=1e-6)
    lines = [m for m in map(MEGATRON_LINE.match, run["stdout"].splitlines()) if m]
    assert [float(m["params_norm"]) for m in lines] == pytest.approx(
        [rows[int(m["it"]) - 1]["params_norm"] for m in lines], abs=1e-3)


def test_log_num_zeros_in_grad_is_logged_as_megatrons(run):
    rows = train_rows(run)
    zeros = [r["num_zeros_in_grad"] for r in rows]
    assert all(isinstance(z, int) and z >= 0 for z in zeros), zeros
    assert [v for _, v in scalars(run)["num-zeros"]] == pytest.approx(zeros)
    lines = [m for m in map(MEGATRON_LINE.match, run["stdout"].splitlines()) if m]
    assert [int(m["num_zeros"]) for m in lines] == [zeros[int(m["it"]) - 1] for m in lines]


def test_num_zeros_counts_the_embedding_rows_of_unseen_tokens():
    # Untied embeddings: the input embedding's rows of tokens absent from the batch get no gradient
    # (tied, the output head gives every row one). fp32 on CPU: the plain AdamW path counts over the
    # parameters the gradient norm counts.
    import torch

    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.loop import Trainer

    values = {k: v for k, v in VALUES.items() if not k.startswith("wandb")}
    cfg = config_from_values({**values, "untie_embeddings_and_output_weights": True, "train_iters": 1,
                              "eval_iters": 0, "progress": False})
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    try:
        trainer = Trainer(cfg, ctx).setup()
        m = trainer.train_step()
        seen = len(set(torch.cat([b["tokens"].flatten() for b in trainer.last_batches]).tolist()))
        unseen = trainer.model.vocab_size - seen
    finally:
        distributed.teardown()
    assert unseen * 32 <= m.num_zeros_in_grad < unseen * 32 + 1000   # hidden size 32
