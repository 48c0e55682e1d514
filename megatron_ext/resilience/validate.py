"""How far the simulator is from recorded runs, predicting before any fitting.

Three sets of recorded CPU runs, the first two recorded for other purposes:

* the live ResiHP traces ``tests/resihp/data/{megatron,moe}-*.trace.jsonl.gz`` (4 CPU ranks, PP4 or
  PP2 x DP2, packed documents; healthy, or one rank throttled 1.3x-3x from a known iteration).
  Calibrate on the healthy iterations before the onset (every rank's median forward and backward
  seconds per micro-batch, and the median of the recorded iteration time minus the simulated
  pipeline: the optimizer, the gradient reduce, the loop's overhead); then predict the iteration
  time after the onset from the *nominal* factor alone (the slow rank's compute times the factor;
  an MoE op's time in the token dispatcher's collectives, which the trace keeps apart, is not
  stretched: the injection does not stretch it, nor does the simulator for a slow device), and
  compare with the median recorded one from two iterations after the onset to the end. A healthy
  trace predicts its second half from its first.
* the three timelines of the live re-layout in ``docs/figures/resihp_relayout/`` (PP2 on 2 CPU
  ranks, 12 layers, 8 micro-batches; iteration 25 healthy, 35 with launch rank 1 throttled 2x on
  stage 1, 75 after the planner moved that device to stage 0 with 5 layers and 7 on stage 1).
  Calibrate per-layer and output-layer seconds and each stage's tail (gradient reduce and
  optimizer events) on iteration 25; predict 35 and 75 from the layer counts and the nominal 2x.
* the traces ``tests/resilience/data/megatron-pp2-*.trace.jsonl.gz``, recorded for this validation:
  the first set's megatron model on PP2 over 2 ranks, one per core, healthy or stage 1 throttled
  1.3x-3x; predicted as the first set.

* the wide traces ``tests/resilience/data/megatron-w256-*`` (issue #47 item 5): a model whose
  matrix products take an op's time, TP2 x PP2 (sequence parallel) and PP2 x DP2 on 4 ranks, the
  distributed optimizer; healthy, or one rank slowed 2x (sleeping or burning its extra time). These
  are also predicted by **the whole simulator** (``whole_case``): every op, TP collective, pipeline
  send, the DP gradient reduce and the optimizer step priced by ``sim.Simulator`` from this host's
  figures measured once apart from every predicted run (``cpu-device.json``: FLOP/s, a link's
  bandwidth and latency, the optimizer's bytes per second), no calibration on the trace at all.
  That is the headline error (``whole_simulator``), named as such.

A third figure, beside the prediction and never instead of it, is the simulator's composition alone
(``rel_error_composition``): the predicted window's own recorded op times (every rank's, median over
its iterations of the composed time) through the same pipeline, plus the calibrated tail. Nothing
about device speeds is predicted there; it separates the simulator's error from that of its
inputs (a throttle that costs more than its nominal factor, the host's load).

Each case says its set and whether its ranks had a core each (``one_rank_per_core``). The simulator
assumes they do: on 4 ranks over 2 cores, a throttled rank held idle hands its core to the others,
which then run faster than the simulator's devices would. The figures are given over every case and
per set, never one instead of the other.

Nothing is fitted to the iterations being predicted. The host (2 cores shared with other jobs)
changes its load between the two windows; a second figure scales the prediction by the healthy
ranks' own op-time ratio between the windows (the detector's common-mode factor: what the whole
host did, not what the slow rank did), reported beside the plain one, never instead of it. The DeepSpeed traces are left out: the
simulator runs megatron's 1F1B only (DeepSpeed defers its sends).
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import re

import numpy as np

from megatron_ext.resihp.trace import TraceLayout
from megatron_ext.resilience.faults import ClusterState
from megatron_ext.resilience.hardware import Hardware
from megatron_ext.resilience.job import Job, Pipeline
from megatron_ext.resilience.shapes import BWD_ATTENTION, BWD_LINEAR, ModelShape
from megatron_ext.resilience.sim import Data, Simulator, compiled, run_pipelines, stage_flops

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE_GLOB = os.path.join(ROOT, "tests", "resihp", "data", "*.trace.jsonl.gz")
CORE_TRACE_GLOB = os.path.join(ROOT, "tests", "resilience", "data", "*.trace.jsonl.gz")
SETS = {"resihp-traces": "4 ranks on 2 cores (tests/resihp/data)",
        "relayout-timelines": "2 ranks on 2 cores (docs/figures/resihp_relayout)",
        "pp2-traces": "2 ranks on 2 cores (tests/resilience/data)",
        "wide-traces": "TP2 x PP2 and PP2 x DP2, 4 ranks on 2 cores (tests/resilience/data, megatron-w256-*)"}
WIDE_TAG = "-w256-"
"""The traces of the whole-simulator validation carry this in their name."""
DEVICE_JSON = os.path.join(ROOT, "tests", "resilience", "data", "cpu-device.json")
"""This host's device, link and optimizer figures, measured once (``tools/collect_resihp_traces.py
--measure-device``) apart from every predicted run."""
TIMELINES = os.path.join(ROOT, "docs", "figures", "resihp_relayout", "timeline_iter{:07d}.json")
_NAME = re.compile(r"^(?P<engine>megatron|moe)-.*?(?:slow(?P<rank>\d+)x(?P<factor>[\d.]+)@(?P<onset>\d+)|healthy|"
                   r"link(?P<a>\d+)-(?P<b>\d+)at(?P<mbps>[\d.]+)@(?P<link_onset>\d+))")
ACTIVATION_BYTES = 4
"""Bytes per activation value of the recorded runs (fp32: ``collect_resihp_traces.py``'s model)."""


def _pipeline_s(fwd: np.ndarray, bwd: np.ndarray, send: np.ndarray | None = None) -> float:
    """Makespan of 1F1B pipelines with these (replicas, stages, micro-batches) op seconds; ``send``
    (replicas, stages - 1): each message's transfer across a stage boundary, both ways (none by
    default). Megatron's sends hold the sending stage (``blocking``)."""
    dp, pp, m = fwd.shape
    c = compiled(pp, m)
    s = np.zeros((dp, pp - 1)) if send is None else send
    ms, _ = run_pipelines(c, fwd, bwd, s, s, blocking=True)
    return float(ms.max())


def _records(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _ops(rec: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(ranks, m) forward and backward compute seconds of chunk 0, then the seconds the same ops
    spent in the MoE token dispatcher's collectives (zeros for a dense model), which the trace keeps
    apart (docs/resihp_trace_format.md): compute plus dispatcher is an op's full span."""
    fwd = np.asarray(rec["fwd_s"], dtype=float)[:, 0, :]
    bwd = np.asarray(rec["bwd_s"], dtype=float)[:, 0, :]
    comm = []
    for key, arr in (("moe_comm_fwd_s", fwd), ("moe_comm_bwd_s", bwd)):
        extra = np.zeros_like(arr)
        if rec.get(key) is not None:
            got = np.asarray(rec[key], dtype=float)
            if got.ndim == 3:
                got = got[:, 0, :]
            if got.shape == arr.shape:
                extra = got
        comm.append(extra)
    where = [(int(s), int(d)) for s, d, _ in rec["layout"]["ranks"]]
    return fwd, bwd, comm[0], comm[1], where


def _grid(fwd: np.ndarray, where: list[tuple[int, int]], pp: int, dp: int) -> np.ndarray:
    out = np.zeros((dp, pp, fwd.shape[1]))
    for r, (s, d) in enumerate(where):
        out[d, s] = np.maximum(out[d, s], fwd[r])
    return out


def trace_case(path: str) -> dict | None:
    m = _NAME.match(os.path.basename(path))
    if m is None:
        return None
    recs = _records(path)
    lay = recs[0]["layout"]
    if lay["schedule"] != "1f1b" or lay["vp"] != 1:
        return None
    pp, dp = lay["pp"], lay["dp"]
    warm = 5
    send = None
    if m.group("a") is not None:
        # A slow pipeline link (--inject-slow-link A:B:ITER:MBPS): from ITER on, each message
        # between A and B is held bytes / bandwidth before it leaves; the bandwidth is the one the
        # run was given, the bytes a micro-batch's activations (tokens x hidden, fp32). Nothing
        # computes slower. The simulator's communication model prices it: a transfer on the link,
        # the sending stage held for it.
        onset, factor, rank = int(m.group("link_onset")), 1.0, None
        where0 = [(int(s), int(d)) for s, d, _ in lay["ranks"]]
        a, b = (where0[int(m.group(k))] for k in ("a", "b"))
        tokens = sum(recs[0]["documents"][0][0])
        hold = tokens * recs[0]["model"]["hidden_size"] * ACTIVATION_BYTES / (float(m.group("mbps")) * 1e6)
        send = np.zeros((dp, pp - 1))
        if a[1] == b[1] and abs(a[0] - b[0]) == 1:
            send[a[1], min(a[0], b[0])] = hold
        calib = [r for r in recs if warm <= r["iteration"] < onset]
        target = [r for r in recs if r["iteration"] >= onset + 2]
    elif m.group("rank") is not None:
        onset, factor, rank = int(m.group("onset")), float(m.group("factor")), int(m.group("rank"))
        calib = [r for r in recs if warm <= r["iteration"] < onset]
        target = [r for r in recs if r["iteration"] >= onset + 2]
    else:
        onset, factor, rank = None, 1.0, None
        half = recs[len(recs) // 2]["iteration"]
        calib = [r for r in recs if warm <= r["iteration"] < half]
        target = [r for r in recs if r["iteration"] >= half]
    if len(calib) < 3 or len(target) < 3:
        return None
    ops = [_ops(r) for r in calib]
    # Per rank and micro-batch: the median full span (compute plus dispatcher) and median compute.
    f_med, b_med = (np.median([o[i] + o[i + 2] for o in ops], axis=0) for i in (0, 1))
    fc_med, bc_med = (np.median([o[i] for o in ops], axis=0) for i in (0, 1))
    where = ops[0][4]

    def span(f: np.ndarray, b: np.ndarray, sends: np.ndarray | None = None) -> float:
        return _pipeline_s(_grid(f, where, pp, dp), _grid(b, where, pp, dp), sends)

    # The part of an iteration outside the pipeline (optimizer, gradient reduce, the loop): the
    # recorded time minus the simulation of that iteration's own recorded op times.
    tail = float(np.median([r["iteration_s"] - span(o[0] + o[2], o[1] + o[3]) for r, o in zip(calib, ops)]))
    # A slow device computes slower; its time in the MoE dispatcher's collectives is not stretched
    # (as the injection does, Throttle.exclude_s, and as the simulator prices a slow device).
    f_pred, b_pred = f_med.copy(), b_med.copy()
    if rank is not None:
        f_pred[rank] += (factor - 1) * fc_med[rank]
        b_pred[rank] += (factor - 1) * bc_med[rank]
    predicted = span(f_pred, b_pred, send) + tail
    observed = float(np.median([r["iteration_s"] for r in target]))
    # The host's load in the predicted window against the calibration window, from the healthy
    # ranks' own compute times (the detector's common-mode factor; without the dispatcher time,
    # where a healthy EP peer waits for the slow rank): it scales every op and the tail.
    later = [_ops(r) for r in target]
    healthy = [i for i in range(f_med.shape[0]) if i != rank]
    common = float(np.median(np.median([o[0][healthy] + o[1][healthy] for o in later], axis=0)
                             / (fc_med[healthy] + bc_med[healthy])))
    wide = WIDE_TAG in os.path.basename(path)
    own_core = os.path.dirname(os.path.abspath(path)) == os.path.dirname(CORE_TRACE_GLOB) and not wide
    # The simulator's composition alone: each predicted iteration's own recorded op times (every
    # rank's, the slow one's included) through the pipeline, plus the calibrated tail. No device
    # speed is predicted here: it tells the simulator's error from the error of its inputs.
    composed = float(np.median([span(o[0] + o[2], o[1] + o[3], send) for o in later])) + tail
    return {"case": os.path.basename(path).split(".trace")[0], "predicted_s": predicted, "observed_s": observed,
            "composed_s": composed, "rel_error_composition": (composed - observed) / observed,
            "set": "wide-traces" if wide else "pp2-traces" if own_core else "resihp-traces",
            "one_rank_per_core": own_core,
            "slow_link": send is not None,
            "rel_error": (predicted - observed) / observed, "host_load_factor": common,
            "rel_error_load_normalised": (predicted * common - observed) / observed}


# ---- the whole simulator: every op, collective and the optimizer priced from figures measured once ----

def shape_of(model: dict) -> ModelShape:
    """The simulator's ``ModelShape`` of a trace's ``model`` record. The simulator counts a SwiGLU
    MLP (three matrices) and no experts: another model is refused, not mispriced."""
    if not model.get("gated_linear_unit") or model.get("num_experts"):
        raise ValueError("the whole-simulator validation prices a dense SwiGLU model (the simulator's FLOPs "
                         f"count); this trace's model has gated_linear_unit={model.get('gated_linear_unit')}, "
                         f"num_experts={model.get('num_experts')}")
    heads = int(model["num_attention_heads"])
    return ModelShape(name="recorded", source="the trace's model record", num_layers=int(model["num_layers"]),
                      hidden_size=int(model["hidden_size"]), num_attention_heads=heads,
                      num_query_groups=int(model.get("num_query_groups") or heads),
                      ffn_hidden_size=int(model["ffn_hidden_size"]), vocab_size=int(model["vocab_size"]))


def data_of(rec: dict) -> Data:
    """The iteration's packed micro-batches, replica by replica (the simulator's pipeline ``q`` takes
    the ``q``-th run of ``m`` micro-batches)."""
    docs = rec["documents"]
    sq = np.array([float(sum(x * x for x in mb)) for replica in docs for mb in replica])
    return Data(seq_length=int(sum(docs[0][0])), micro_batch_size=1, sum_sq=sq)


def job_of(rec: dict) -> Job:
    """The recorded layout as the simulator's job: device = rank; each stage's TP group in TP order."""
    lay = TraceLayout(**rec["layout"])
    rank_of = {lay.coords(r): r for r in range(lay.world_size)}
    layers = [sum(x) for x in rec["layers"]] if rec.get("layers") else [rec["model"]["num_layers"] // lay.pp] * lay.pp
    return Job(pipelines=tuple(
        Pipeline(stages=tuple(tuple(rank_of[(k, d, t)] for t in range(lay.tp)) for k in range(lay.pp)),
                 layers=tuple(layers), microbatches=lay.num_microbatches)
        for d in range(lay.dp)))


def op_flops(shape: ModelShape, tokens: int, sum_sq: float, layers: int, head: bool) -> float:
    """Forward plus backward FLOPs of one micro-batch through ``layers`` layers (and the output layer),
    the simulator's count (``sim.stage_flops``)."""
    lin, att = stage_flops(shape, tokens, sum_sq, layers, head)
    return (1 + BWD_LINEAR) * lin + (1 + BWD_ATTENTION) * att


def device_flops(paths: list[str], warm: int = 3) -> dict:
    """FLOP/s of one device from single-rank runs of the model (no parallelism): per iteration after
    ``warm``, the simulator's FLOPs of its ops over their recorded seconds; the median over every
    iteration of every run (and each run's), so that the runs' ragged ends -- one finishing
    first hands its core to the others -- do not count."""
    per_run, rates = [], []
    for path in paths:
        recs = [r for r in _records(path) if r["iteration"] > warm]
        if not recs or recs[0]["layout"]["tp"] * recs[0]["layout"]["pp"] * recs[0]["layout"]["dp"] != 1:
            raise ValueError(f"{path}: device_flops needs a single-rank run with iterations after {warm}")
        shape = shape_of(recs[0]["model"])
        mine = []
        for r in recs:
            data = data_of(r)
            fl = sum(op_flops(shape, data.tokens, q, shape.num_layers, True) for q in data.sum_sq)
            mine.append(fl / float(np.sum(r["fwd_s"][0]) + np.sum(r["bwd_s"][0])))
        per_run.append(float(np.median(mine)))
        rates += mine
    return {"flops": float(np.median(rates)), "per_run": per_run}


def hardware_of(device: dict, world: int) -> Hardware:
    """The simulator's ``Hardware`` for the measured host: every rank a device of one node (each link
    a collective over gloo on the host), the measured FLOP/s at efficiency 1."""
    return Hardware(gpus_per_node=world, peak_flops=device["flops"], efficiency=1.0,
                    hbm_bytes_per_s=device["optimizer_bytes_per_s"], nvlink_bytes_per_s=device["link_bytes_per_s"],
                    nvlink_latency_s=device["link_latency_s"], memory_bytes=24e9)


def load_device(path: str = DEVICE_JSON) -> dict:
    with open(path, encoding="utf-8") as f:
        device = json.load(f)
    missing = {"flops", "link_bytes_per_s", "link_latency_s", "optimizer_bytes_per_s"} - set(device)
    if missing:
        raise ValueError(f"{path}: missing {', '.join(sorted(missing))} (written by tools/collect_resihp_traces.py "
                         "--measure-device)")
    return device


WIDE_VALUE_BYTES = 4
"""The wide runs train in fp32: 4 bytes per value on the wire."""


def whole_case(path: str, device: dict, warm: int = 5) -> dict | None:
    """A wide trace predicted by the whole simulator from ``device`` alone (figures measured once,
    apart from every predicted run): compute from the simulator's FLOPs count, the TP collectives,
    the pipeline sends, the DP gradient reduce and the optimizer step from its communication and
    memory models. Nothing of the trace is used but its model, layout, documents and injected fault;
    the recorded iteration times are only compared with."""
    name = os.path.basename(path)
    m = _NAME.match(name)
    if m is None or WIDE_TAG not in name:
        return None
    recs = _records(path)
    shape, job = shape_of(recs[0]["model"]), job_of(recs[0])
    world = len(job.devices)
    hw = hardware_of(device, world)
    speed = np.ones(world)
    first = warm
    if m.group("rank") is not None:
        speed[int(m.group("rank"))] = 1.0 / float(m.group("factor"))
        first = int(m.group("onset")) + 2
    state = ClusterState(speed, np.ones(world), {})
    target = [r for r in recs if r["iteration"] >= first]
    if len(target) < 3:
        return None
    sims = [Simulator(shape, hw, data_of(r), value_bytes=WIDE_VALUE_BYTES) for r in target]
    res = [s.iteration(job, state) for s in sims]
    predicted = float(np.median([x.time_s for x in res]))
    observed = float(np.median([r["iteration_s"] for r in target]))
    lay = recs[0]["layout"]
    # Per stage of the first replica, an op's seconds (median over the window's micro-batches and the
    # stage's TP ranks, TP collectives included): the simulator's against the recorded, to say which
    # term missed.
    stages = []
    ops = [s.op_seconds(job, state, 0) for s in sims]
    for k in range(job.pipelines[0].pp):
        mine = list(job.pipelines[0].stages[k])
        rec = {ph: float(np.median([np.asarray(r[key], dtype=float)[mine, 0, :] for r in target]))
               for ph, key in (("fwd", "fwd_s"), ("bwd", "bwd_s"))}
        pred = {"fwd": float(np.median([o[0][k] for o in ops])), "bwd": float(np.median([o[1][k] for o in ops]))}
        stages.append({"stage": k, "recorded_fwd_s": rec["fwd"], "recorded_bwd_s": rec["bwd"],
                       "predicted_fwd_s": pred["fwd"], "predicted_bwd_s": pred["bwd"]})
    return {"case": name.split(".trace")[0], "layout": f"tp{lay['tp']}pp{lay['pp']}dp{lay['dp']}", "stages": stages,
            "predicted_s": predicted, "observed_s": observed, "rel_error": (predicted - observed) / observed,
            "compute_s": float(np.median([x.compute_s for x in res])),
            "grad_sync_s": float(np.median([x.grad_sync_s for x in res])),
            "optimizer_s": float(np.median([x.optimizer_s for x in res])), "iterations": len(target)}


def whole_error(paths: list[str] | None = None, device: dict | None = None) -> dict | None:
    """The whole simulator's error over the wide traces (None where none is given or recorded)."""
    if paths is None:
        paths = [p for p in glob.glob(CORE_TRACE_GLOB) if WIDE_TAG in os.path.basename(p)]
    if not paths:
        return None
    device = load_device() if device is None else device
    cases = [c for c in (whole_case(p, device) for p in sorted(paths)) if c is not None]
    if not cases:
        return None
    err = np.abs([c["rel_error"] for c in cases])
    return {"median": round(float(np.median(err)), 4), "p95": round(float(np.percentile(err, 95)), 4),
            "cases": len(cases), "detail": cases, "device": device}


def _timeline(it: int) -> dict:
    with open(TIMELINES.format(it), encoding="utf-8") as f:
        data = json.load(f)
    out: dict = {"span_s": data["metadata"]["megatron_ext"]["span_s"], "fwd": {}, "bwd": {}, "tail": {}}
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        s = e["pid"]
        if e["cat"] == "forward":
            out["fwd"].setdefault(s, {})[e["args"]["microbatch"]] = e["dur"] * 1e-6
        elif e["cat"] == "backward":
            out["bwd"].setdefault(s, {})[e["args"]["microbatch"]] = e["dur"] * 1e-6
        elif e["cat"] in ("optimizer", "grad-reduce"):
            out["tail"][s] = out["tail"].get(s, 0.0) + e["dur"] * 1e-6
    return out


def relayout_cases() -> list[dict]:
    """Iterations 35 (stage 1 on the 2x device, 6/6 layers) and 75 (stage 0 on it, 5/7 layers)
    predicted from iteration 25 (healthy, 6/6)."""
    if not os.path.exists(TIMELINES.format(25)):
        return []
    h = _timeline(25)
    m = len(h["fwd"][0])
    med = {ph: [float(np.median(list(h[ph][s].values()))) for s in (0, 1)] for ph in ("fwd", "bwd")}
    per_layer = {ph: med[ph][0] / 6 for ph in med}          # stage 0: 6 layers (+ the embedding lookup)
    head = {ph: med[ph][1] - 6 * per_layer[ph] for ph in med}  # stage 1: 6 layers + the output layer
    out = []
    for it, layers, slow_stage in ((35, (6, 6), 1), (75, (5, 7), 0)):
        obs = _timeline(it)
        f = np.zeros((1, 2, m))
        b = np.zeros((1, 2, m))
        tail = []
        for s in (0, 1):
            speed = 0.5 if s == slow_stage else 1.0
            f[0, s] = (layers[s] * per_layer["fwd"] + (head["fwd"] if s == 1 else 0.0)) / speed
            b[0, s] = (layers[s] * per_layer["bwd"] + (head["bwd"] if s == 1 else 0.0)) / speed
            tail.append(h["tail"].get(s, 0.0) / speed)
        c = compiled(2, m)
        ms, _ = run_pipelines(c, f, b, np.zeros((1, 1)), np.zeros((1, 1)), blocking=True)
        # Each stage's tail after its own last op; the iteration ends with the later one.
        predicted = float(ms[0] + max(tail))
        # The composition alone: this iteration's own recorded op times, iteration 25's tails.
        fo = np.array([[[obs["fwd"][s][k] for k in sorted(obs["fwd"][s])] for s in (0, 1)]])
        bo = np.array([[[obs["bwd"][s][k] for k in sorted(obs["bwd"][s])] for s in (0, 1)]])
        mo, _ = run_pipelines(c, fo, bo, np.zeros((1, 1)), np.zeros((1, 1)), blocking=True)
        composed = float(mo[0] + max(h["tail"].get(s, 0.0) for s in (0, 1)))
        out.append({"case": f"relayout-pp2-iter{it}", "predicted_s": predicted, "observed_s": obs["span_s"],
                    "composed_s": composed, "rel_error_composition": (composed - obs["span_s"]) / obs["span_s"],
                    "set": "relayout-timelines", "one_rank_per_core": True,
                    "rel_error": (predicted - obs["span_s"]) / obs["span_s"]})
    return out


def _summary(cases: list[dict]) -> dict:
    err = np.abs([c["rel_error"] for c in cases])
    norm = np.abs([c.get("rel_error_load_normalised", c["rel_error"]) for c in cases])
    comp = np.abs([c["rel_error_composition"] for c in cases])
    return {"median": round(float(np.median(err)), 4), "p95": round(float(np.percentile(err, 95)), 4),
            "load_normalised": {"median": round(float(np.median(norm)), 4), "p95": round(float(np.percentile(norm, 95)), 4)},
            "composition": {"median": round(float(np.median(comp)), 4), "p95": round(float(np.percentile(comp, 95)), 4)},
            "cases": len(cases)}


def sim_error(paths: list[str] | None = None) -> dict:
    """Every case's prediction and the median and 95th percentile of |relative error|, over every
    case, per set (``by_set``) and over the cases whose ranks had a core each (``one_rank_per_core``)."""
    if paths is None:
        paths = glob.glob(TRACE_GLOB) + glob.glob(CORE_TRACE_GLOB)
    cases = [c for c in (trace_case(p) for p in sorted(paths)) if c is not None]
    cases += relayout_cases()
    if not cases:
        raise FileNotFoundError(f"no recorded runs found ({TRACE_GLOB}, {CORE_TRACE_GLOB}, {TIMELINES.format(25)})")
    own = [c for c in cases if c["one_rank_per_core"]]
    wide = [p for p in paths if WIDE_TAG in os.path.basename(p)]
    return {**_summary(cases), "detail": cases, "whole_simulator": whole_error(wide) if wide else None,
            "by_set": {name: _summary(sub) for name in SETS if (sub := [c for c in cases if c["set"] == name])},
            "one_rank_per_core": _summary(own) if own else None}
