"""tools/gpu_check.py on CPU: argument checks, the skip path, the report's JSON shape and the pure
pieces of its sections (FLOPs-model fit, MFU inputs), and one --cpu-smoke run of every section."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.conftest import run_python
from tools import gpu_check


def test_defaults_run_every_section():
    args = gpu_check.parse_args([])
    assert args.sections == list(gpu_check.SECTIONS) and args.iters == 30
    assert not args.record and not args.cpu_smoke and args.peak_tflops is None


@pytest.mark.parametrize("argv, message", [
    (["--sections", "gpt,warp"], "--sections: unknown section(s) warp; choose from env, gpt, llama, packed, "
                                 "flops_model, hydro, helix"),
    (["--sections", ","], "--sections: unknown section(s) (none given)"),
    (["--iters", "7"], "--iters must be an even number >= 4 (the resume check restarts at half), got 7"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0, got 0.0"),
    (["--budget-s", "-1"], "--budget-s must be > 0, got -1.0"),
    (["--hard-limit-s", "0"], "--hard-limit-s must be > 0, got 0.0"),
    (["--record", "--cpu-smoke"], "--record keeps GPU figures only: drop --cpu-smoke"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_skips_cleanly_without_cuda(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--record"]) == gpu_check.SKIP_EXIT == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("gpu-check skipped: no CUDA device")
    report = json.loads(out[-1])
    assert report["skipped"].startswith("no CUDA device") and report["env"]["torch"] == torch.__version__
    assert report["env"]["device"] == "cpu"


def test_an_nvidia_device_torch_cannot_use_fails_instead_of_skipping(monkeypatch, capsys):
    # A CPU build of torch (or a driver older than its CUDA) on a GPU machine: the window must not
    # pass as a skip.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "gpu_visible", lambda: True)
    assert gpu_check.main([]) == gpu_check.UNUSABLE_GPU_EXIT == 1
    out, err = capsys.readouterr()
    assert err.startswith("gpu-check failed: an NVIDIA device is present but torch cannot use it (torch ")
    report = json.loads(out.strip().splitlines()[-1])
    assert report["error"].startswith("NVIDIA device present, CUDA unusable (torch ")


def test_a_failed_distributed_setup_is_each_sections_error_and_the_others_run(monkeypatch, capsys):
    # Nothing is lost when megatron's parallel state cannot be set up (an NCCL or entry-point
    # error): the sections needing it report why, the others run, and every section's figures reach
    # stderr as it ends.
    import torch

    def no_dist(seed):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "_dist_context", no_dist)
    monkeypatch.setitem(gpu_check.SECTION_FUNCS, "hydro", lambda ctx: {"fused_b8_speedup": 3.0})
    assert gpu_check.main(["--cpu-smoke", "--sections", "env,gpt,hydro,helix"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    why = "distributed setup failed: RuntimeError: NCCL error: unhandled system error"
    assert report["gpt"]["error"] == report["helix"]["error"] == why
    assert report["hydro"]["fused_b8_speedup"] == 3.0
    done = [line for line in err.splitlines() if line.startswith("gpu-check: ")]
    assert [line.split()[1] for line in done] == ["env", "gpt", "hydro", "helix"]
    assert json.loads(done[1].split(": ", 2)[2]) == {"error": why}


def _with_hydro_stuck(monkeypatch, capsys, hydro, sections: str) -> dict:
    """The report of ``--cpu-smoke --sections SECTIONS --hard-limit-s 0.5`` with ``hydro`` as the
    hydro section."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(gpu_check.SECTION_FUNCS, "hydro", hydro)
    assert gpu_check.main(["--cpu-smoke", "--sections", sections, "--hard-limit-s", "0.5"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_section_past_the_hard_limit_is_interrupted_and_the_report_still_printed(monkeypatch, capsys):
    import time

    finished = []

    def stuck(ctx):
        time.sleep(30)
        finished.append(True)  # reached only if nothing interrupted the sleep
        return {"fused_b8_speedup": 1.0}

    report = _with_hydro_stuck(monkeypatch, capsys, stuck, "env,hydro,ft_nccl")
    assert not finished
    assert report["hydro"]["error"] == "SectionTimeout: interrupted at --hard-limit-s"
    assert report["hydro"]["fused_b8_speedup"] is None
    assert report["ft_nccl"]["skipped"].startswith("hard limit reached (")


def test_report_has_the_issue_shape_even_when_sections_fail():
    def boom(ctx):
        raise ValueError("no kernel image for this device")

    results = {"env": {"torch": "x"}, "gpt": gpu_check.run_section("gpt", boom, {}),
               "hydro": {"fused_b8_speedup": 5.0, "section_s": 1.0}}
    assert results["gpt"]["error"] == "ValueError: no kernel image for this device"
    full = gpu_check.complete(results)
    for section, keys in gpu_check.REQUIRED.items():
        assert set(keys) <= set(full[section]), section
    assert full["gpt"]["mfu"] is None and full["hydro"]["fused_b8_speedup"] == 5.0
    assert full["helix"]["skipped"] == "not run (--sections)"
    line = json.dumps(full)
    assert json.loads(line)["gpt"]["error"].startswith("ValueError")
    text = gpu_check.table(full)
    assert text.splitlines()[0].split() == ["section", "figure", "value"]
    assert any(r.split()[:2] == ["hydro", "fused_b8_speedup"] and r.split()[2] == "5" for r in text.splitlines())


def test_record_writes_table_and_json(tmp_path, monkeypatch):
    import datetime

    monkeypatch.setattr(gpu_check, "RECORD_DIR", str(tmp_path / "gpu"))
    when = datetime.datetime(2026, 12, 1, 7, 0, 0)
    txt, js = gpu_check.record("table", '{"a": 1}', "NVIDIA H200", when)
    assert os.path.basename(js) == "gpu_check_20261201_070000_nvidia-h200.json"
    assert open(js).read() == '{"a": 1}\n' and open(txt).read() == "table\n"


def test_flops_model_fit_recovers_a_linear_device():
    rng = np.random.default_rng(0)
    lin, att = rng.uniform(1e9, 4e9, 20), rng.uniform(0, 3e9, 20)
    seconds = 2e-13 * lin + 7e-13 * att + 1e-4
    calib = np.arange(20) % 2 == 0
    assert gpu_check.fit_flops_model(lin, att, seconds, calib).max() < 1e-6
    # A device that is 30 % slower on the held-out half is 30 % off the calibrated prediction.
    slow = np.where(calib, seconds, seconds * 1.3)
    err = gpu_check.fit_flops_model(lin, att, slow, calib)
    assert np.allclose(err, 1 - 1 / 1.3, atol=1e-6)
    summary = gpu_check.error_summary(err)
    assert summary["points"] == 10 and summary["median_abs_err"] == pytest.approx(1 - 1 / 1.3)
    with pytest.raises(ValueError, match="need >= 3 calibration points and >= 1 held-out point, got 2 and 18"):
        gpu_check.fit_flops_model(lin, att, seconds, np.arange(20) < 2)


def test_doc_mixes_fill_their_token_counts():
    mixes = gpu_check._doc_mixes((64, 128), 12, seed=1)
    assert [sum(m) for m in mixes] == [64, 128] * 6
    assert all(min(m) >= 1 for m in mixes)
    shares = [sum(d * d for d in m) / sum(m) ** 2 for m in mixes]
    assert max(shares) > 4 * min(shares), "batches must differ in attention work"


def test_peak_flops_and_iteration_flops():
    assert gpu_check.peak_flops("NVIDIA H200", None) == 989e12
    assert gpu_check.peak_flops("NVIDIA GH200 480GB", None) == 989e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB", None) == 312e12
    assert gpu_check.peak_flops("Some New GPU", None) is None
    assert gpu_check.peak_flops("NVIDIA H200", 500.0) == 500e12
    # Backward is twice the forward (no flash recomputation): 3x one forward of 6*12*h^2... per token.
    h, s, v, layers, b = 64, 32, 128, 2, 4
    per_token_fwd = layers * 24 * h * h + 2 * h * v
    attention_fwd = layers * 4 * h * s * s
    assert gpu_check.gpt_iteration_flops(layers, h, 2, v, s, b) == pytest.approx(
        3 * b * (per_token_fwd * s + attention_fwd))


@pytest.mark.multirank  # one subprocess that imports megatron (~20 s) and runs every section tiny
def test_cpu_smoke_runs_every_section(tmp_path):
    # No time budget: on a slow machine a section past the default one would be skipped, and this
    # test is about every section's code, not the machine's speed.
    proc = run_python("tools/gpu_check.py", "--cpu-smoke", "--budget-s", "100000", timeout=600,
                      env={"OMP_NUM_THREADS": "1"})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    # Every section runs on the CPU smoke path: the skips the tool has are CUDA-only (a GPU without
    # TE, fewer than 2 GPUs), so any skipped section here is a failure, whatever its reason.
    assert set(gpu_check.SECTIONS) <= set(report)
    skipped = {k: v["skipped"] for k, v in report.items() if isinstance(v, dict) and "skipped" in v}
    assert not skipped, skipped
    assert report["meta"]["cpu_smoke"] is True and report["env"]["device"] == "cpu"
    gpt = report["gpt"]
    assert gpt["family"] == "gpt" and gpt["dtype"] == "bfloat16" and gpt["optimizer"] == "ChainedOptimizer"
    assert gpt["resume_max_rel_diff"] == 0.0 and gpt["resume_loss_max_rel_diff"] == 0.0
    assert report["packed"]["documents_isolated"] is True
    assert report["hydro"]["param_max_rel_diff"] < 1e-4
    assert report["helix"]["compiled"] is True and report["helix"]["loss_max_rel_diff"] < 1e-4
    # The DeepSpeed engine (with --timeline) trains the megatron engine's curve: the same model,
    # data and seed; on CPU the two engines' losses agree.
    ds = report["deepspeed"]
    assert (ds["backend"], ds["ranks"], ds["trained"]) == ("gloo", 1, True)
    assert ds["megatron_exit_codes"] == ds["deepspeed_exit_codes"] == [0]
    assert ds["loss_max_rel_diff"] < 1e-5 and ds["loss_first"] > ds["loss_last"] > 0
    # The NCCL section's job on gloo: the survivor of a SIGKILLed rank trains to the end.
    ft = report["ft_nccl"]
    assert (ft["backend"], ft["continued"], ft["exit_codes"], ft["job_exit_code"]) == ("gloo", True, [0, -9], 0)
    # The LLaMA section trains the runtime's llama family (not the GPT again) and resumes exactly.
    llama = report["llama"]
    assert llama["family"] == "llama" and llama["dtype"] == "bfloat16" and llama["optimizer"] == "ChainedOptimizer"
    assert llama["resume_max_rel_diff"] == 0.0 and llama["resume_loss_max_rel_diff"] == 0.0
    assert llama["params"] != gpt["params"]
    # The FLOPs-model fit ran on its measured micro-batches (half calibrate, half are predicted).
    fm = report["flops_model"]
    sizes = gpu_check.Sizes.cpu_smoke(30)
    assert fm["micro_batches"] == sizes.flops_batches and fm["points"] == sizes.flops_batches
    assert isinstance(fm["median_abs_err"], float) and fm["median_abs_err"] <= fm["p95_abs_err"]


def test_sections_past_the_budget_are_skipped(monkeypatch, capsys):
    # Only env and hydro (no megatron model): the hydro section starts after the budget is spent.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--cpu-smoke", "--sections", "env,hydro", "--budget-s", "1e-9"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["hydro"]["skipped"].startswith("time budget spent (")
    assert report["hydro"]["fused_b8_speedup"] is None and report["env"]["device"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_check_correctness_on_cuda():
    # Correctness only (speed figures are the check's report, not assertions).
    proc = run_python("tools/gpu_check.py", timeout=900)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = {k: v["error"] for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    gpt = report["gpt"]
    assert gpt["loss_falls"] and gpt["layer_impl"].startswith("TE") and gpt["dtype"] == "bfloat16"
    assert gpt["resume_max_rel_diff"] < 1e-6
    assert report["packed"]["documents_isolated"]
    assert report["helix"]["compiled"] and report["helix"]["loss_max_rel_diff"] < 1e-3


def test_a_section_that_catches_exception_itself_is_still_interrupted(monkeypatch, capsys):
    # A section's own broad handler (a preflight, a retried step) must not swallow the hard limit.
    import time

    finished = []

    def guarded(ctx):
        try:
            time.sleep(30)
        except Exception:  # noqa: BLE001 - what a section may do around a step
            pass
        finished.append(True)
        return {"fused_b8_speedup": 1.0}

    report = _with_hydro_stuck(monkeypatch, capsys, guarded, "env,hydro")
    assert not finished
    assert report["hydro"]["error"] == "SectionTimeout: interrupted at --hard-limit-s"


def test_an_engine_that_fails_on_the_gpu_path_is_the_sections_error(monkeypatch):
    # What a GPU window must bring back when the DeepSpeed engine fails there (a CPU tensor handed
    # to an NCCL collective, say): the rank's last line and how far it trained, not a traceback;
    # and the megatron engine's arm still ran.
    from megatron_ext.ft import launch

    def fake_launch(argv, nproc, **kw):
        engine = argv[argv.index("--engine") + 1]
        if engine == "megatron":   # trains its four iterations
            with open(argv[argv.index("--metrics-file") + 1], "w") as fh:
                for i in range(1, 5):
                    fh.write(json.dumps({"kind": "train", "iteration": i, "loss": 8.0 - i / 10,
                                         "tokens_per_s": 100.0 * i}) + "\n")
            return [launch.RankResult(rank=0, returncode=0, output="")]
        return [launch.RankResult(rank=0, returncode=1,
                                  output="Traceback ...\nRuntimeError: No backend type associated with device type cpu\n")]

    monkeypatch.setattr(launch, "launch_ranks", fake_launch)
    ctx = {"cuda": False, "sizes": gpu_check.Sizes.cpu_smoke(30)}
    out = gpu_check.run_section("deepspeed", gpu_check.section_deepspeed, ctx)
    assert out["trained"] is False and out["megatron_exit_codes"] == [0] and out["deepspeed_exit_codes"] == [1]
    assert out["megatron_tokens_per_s"] == 300.0       # the median after the first iteration
    assert out["error"] == ("--engine deepspeed trained 0 of 4 iterations: "
                            "RuntimeError: No backend type associated with device type cpu")
    assert "loss_max_rel_diff" not in out              # complete() fills it with None in the report
