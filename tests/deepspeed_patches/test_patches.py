"""deepspeed_patches: every patched or relied-on upstream symbol, apply() semantics, the timed
instructions and p2p spans, step -> micro-batch labelling, and --engine deepspeed config errors."""
from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("deepspeed")

import deepspeed  # noqa: E402
from deepspeed.runtime.pipe import p2p, schedule  # noqa: E402
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402

import deepspeed_patches  # noqa: E402
from deepspeed_patches import engine as ds_engine  # noqa: E402
from megatron_ext.pipeline.events import Call, EventRecorder, Phase  # noqa: E402
from megatron_ext.pipeline.schedule_orders import deepspeed_train  # noqa: E402


@pytest.mark.parametrize("module,path,fragment", deepspeed_patches.SYMBOLS,
                         ids=[f"{m}.{p}" for m, p, _ in deepspeed_patches.SYMBOLS])
def test_patched_symbol_is_where_the_patch_expects_it(module, path, fragment):
    obj = deepspeed_patches._resolve(module, path)  # AttributeError / ImportError when it moved
    if fragment is not None:
        import inspect

        assert fragment in inspect.getsource(inspect.unwrap(obj)), f"{module}.{path} no longer uses {fragment!r}"


@pytest.mark.parametrize("name", deepspeed_patches.TIMED)
def test_timed_instruction_is_still_in_the_engine_map(name):
    assert getattr(schedule, name) in PipelineEngine._INSTRUCTION_MAP


def test_supported_version():
    assert deepspeed.__version__ in deepspeed_patches.SUPPORTED_DEEPSPEED
    assert deepspeed_patches.missing_symbols() == []


def test_apply_is_idempotent_and_installs_every_patch():
    deepspeed_patches.apply()
    send_once = p2p.send
    deepspeed_patches.apply()
    assert deepspeed_patches.applied()
    assert deepspeed.PipelineEngine is ds_engine.EventPipelineEngine
    assert p2p.send is send_once and p2p.recv.megatron_ext_patch
    assert not getattr(p2p.send.__wrapped__, "megatron_ext_patch", False)  # wrapped once, not twice
    assert sys.modules["deepspeed.comm.torch"].build_shm_op() is None


def test_apply_refuses_when_a_symbol_moved(monkeypatch):
    monkeypatch.delattr(schedule.TrainSchedule, "_step_to_micro_batch")
    with pytest.raises(RuntimeError, match=r"no longer has .*TrainSchedule\._step_to_micro_batch"):
        deepspeed_patches.apply()


def test_apply_refuses_a_source_fragment_that_moved(monkeypatch):
    def _exec_schedule(self, pipe_schedule):  # an upstream rewrite that no longer looks the map up
        pass

    monkeypatch.setattr(PipelineEngine, "_exec_schedule", _exec_schedule)
    with pytest.raises(RuntimeError, match=r"_exec_schedule \(no longer contains"):
        deepspeed_patches.apply()


def test_apply_refuses_other_versions(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match=r"supports deepspeed \('0.19.8',\), found 0.20.0"):
        deepspeed_patches.apply()


def test_instruction_map_extends_the_base_map():
    mine, base = ds_engine.EventPipelineEngine._INSTRUCTION_MAP, PipelineEngine._INSTRUCTION_MAP
    assert set(mine) == set(base)
    for cls in base:
        timed = cls.__name__ in deepspeed_patches.TIMED
        assert (mine[cls] is not base[cls]) == timed, cls.__name__
    assert base[schedule.ForwardPass] is PipelineEngine._exec_forward_pass  # upstream map untouched


class _FakeEngine:
    """Just what the timed instructions read."""

    def __init__(self, recorder):
        self.event_recorder = recorder
        self._recording = True
        self._step_microbatch = 5
        self._prev_microbatch = 4
        self._span = ds_engine._P2PSpan()
        self.calls = []


def test_send_instruction_is_one_event_over_its_blocking_calls(monkeypatch):
    ticks = iter(range(100))
    rec = EventRecorder(clock=lambda: float(next(ticks)))
    fake_p2p = []
    monkeypatch.setattr(p2p, "send", lambda tensor, stage, async_op=False: fake_p2p.append((tensor, stage)))
    timed_send = ds_engine._timed_p2p("send")  # wraps the module function as apply() does
    monkeypatch.setattr(p2p, "send", timed_send)

    def send_activation(self, buffer_id):  # meta + data, as _exec_send_activations does on first use
        p2p.send("meta", 1)
        p2p.send("data", 1)

    instr = ds_engine._p2p(send_activation, Phase.SEND, Call.SEND_FORWARD, previous_step=True)
    eng = _FakeEngine(rec)
    instr(eng, buffer_id=0)
    ev = rec.events()
    assert fake_p2p == [("meta", 1), ("data", 1)]
    assert len(ev) == 1
    assert (ev[0]["phase"], ev[0]["call"], ev[0]["microbatch"]) == (Phase.SEND, Call.SEND_FORWARD, 4)
    assert (ev[0]["t0"], ev[0]["t1"]) == (0.0, 2.0)  # first call's start to last call's end
    assert ds_engine._open_span is None
    # outside a Send/Recv instruction the patched function only passes through
    timed_send("x", 1)
    assert len(rec.events()) == 1 and fake_p2p[-1] == ("x", 1)


def test_compute_instruction_records_the_step_microbatch_or_nothing():
    rec = EventRecorder()
    eng = _FakeEngine(rec)
    ran = []
    instr = ds_engine._compute(lambda self, buffer_id: ran.append(buffer_id), Phase.BACKWARD)
    instr(eng, buffer_id=1)
    eng._recording = False  # evaluation, or after the train schedule
    instr(eng, buffer_id=2)
    eng._recording, eng.event_recorder = True, None  # no recorder attached
    instr(eng, buffer_id=3)
    ev = rec.events()
    assert ran == [1, 2, 3] and len(ev) == 1
    assert (ev[0]["phase"], ev[0]["microbatch"]) == (Phase.BACKWARD, 5)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_step_tracking_labels_compute_like_deepspeed_train(p, m):
    # Replay each stage's TrainSchedule through the step tracker: the micro-batch it reports for
    # every ForwardPass/BackwardPass is the pure schedule order's.
    for stage in range(p):
        eng = _FakeEngine(None)
        seen = []
        tracked = ds_engine._StepTrackedSchedule(schedule.TrainSchedule(m, p, stage), eng)
        for cmds in tracked:
            assert eng._recording
            for cmd in cmds:
                if isinstance(cmd, (schedule.ForwardPass, schedule.BackwardPass)):
                    seen.append(("F" if isinstance(cmd, schedule.ForwardPass) else "B", eng._step_microbatch, 0))
        assert not eng._recording
        assert seen == [op.key for op in deepspeed_train(p, m).stages[stage]]


def test_engine_subclass_hooks_the_train_schedule_only():
    assert ds_engine.EventPipelineEngine._train_schedule is not PipelineEngine._train_schedule
    assert "_inference_schedule" not in vars(ds_engine.EventPipelineEngine)
    assert issubclass(ds_engine.EventPipelineEngine, PipelineEngine)


def test_comm_torch_module_is_the_deepspeed_one():
    # why _skip_shm_build reads sys.modules: the attribute path resolves to torch itself
    importlib.import_module("deepspeed.comm.torch")
    assert hasattr(sys.modules["deepspeed.comm.torch"], "TorchBackend")


# --- pretrain_gpt.py --engine deepspeed: configuration errors -------------------------------------

def _main(argv, monkeypatch, capsys, world: int = 1):
    import pretrain_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    code = pretrain_gpt.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv,world,message", [
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], 4,
     "--engine deepspeed runs one stage per rank (DeepSpeed's TrainSchedule): drop "
     "--virtual-pipeline-model-parallel-size or use --engine megatron"),
    (["--pipeline-model-parallel-size", "3"], 3,
     "--num-layers (4) is not divisible by --pipeline-model-parallel-size (3)"),
    (["--pipeline-model-parallel-size", "3"], 4,
     "world size 4 is not divisible by --tensor-model-parallel-size (1) x --pipeline-model-parallel-size (3) = 3"),
    (["--num-experts", "2"], 1,
     "--engine deepspeed does not train mixture-of-experts models (--num-experts): DeepSpeed's PipelineModule "
     "here is a dense GPT; use --engine megatron (model flags: --num-experts)"),
    (["--fp16"], 1, "--engine deepspeed trains in fp32 or bf16 (the config's bf16 section, or --bf16): drop --fp16 "
                    "or use --engine megatron"),
    (["--deepspeed_config", '{"train_micro_batch_size_per_gpu": 4}', "--micro-batch-size", "2"], 1,
     "--deepspeed_config (inline JSON): train_micro_batch_size_per_gpu 4 disagrees with --micro-batch-size 2: the "
     "run owns it, so give the same value or drop the key"),
    (["--zero-stage", "2", "--pipeline-model-parallel-size", "2"], 2,
     "ZeRO-2 with --pipeline-model-parallel-size 2: DeepSpeed's pipeline engine runs ZeRO stages 0 and 1 only; use "
     "ZeRO-1, or one pipeline stage (DeepSpeed's plain engine)"),
    (["--doc-length-dist", "fixed:16"], 1,
     "--doc-length-dist (packed documents) is not supported by --engine deepspeed yet: use --engine megatron"),
    (["--pipeline-model-parallel-size", "2", "--inject-slow-link", "0:1:5:1"], 2,
     "--inject-slow-link throttles megatron-core's p2p calls: use it with --engine megatron"),
])
def test_engine_deepspeed_bad_layout_is_a_config_error(argv, world, message, monkeypatch, capsys):
    code, err = _main(["--engine", "deepspeed", *argv], monkeypatch, capsys, world)
    assert code == 2
    assert err.strip() == f"pretrain_gpt.py: error: {message}"
