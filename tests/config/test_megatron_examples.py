"""The two example scripts issue 44 names, as Megatron-LM core_v0.16.1 ships them
(examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh, the
LLaMA one on its default mock-data branch): every flag as written, the sizes shrunk to a CPU (layers,
hidden, heads, sequence, batch, iterations, layout) and the paths made here. Both parse, say once what
they ignore and why, pass the checks before launch (megatron-core's TransformerConfig included), and
train on one CPU rank."""
from __future__ import annotations

import json
import os

import pytest

from megatron_ext.config.run import parse_run_config
from tests.conftest import run_python

GPT3 = [
    # GPT_MODEL_ARGS (sizes shrunk)
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--attention-backend", "auto",
    # TRAINING_ARGS (batch and iterations shrunk; the ramp as written needs a batch of at least 16)
    "--micro-batch-size", "1", "--global-batch-size", "32", "--rampup-batch-size", "16", "16", "5859375",
    "--train-iters", "3", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    # MODEL_PARALLEL_ARGS (8 x 16 shrunk to one rank)
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    # DATA_ARGS and EVAL_AND_LOGGING_ARGS: the paths are the fixture's
    "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
    "--eval-iters", "10",
]

LLAMA = [
    # MODEL_ARGS (sizes shrunk; kv-channels, rotary, norm and the rest as written)
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "128",
    "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    # TRAINING_ARGS (samples shrunk)
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "24", "--lr-decay-samples", "23",
    "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    # DTYPE_ARGS
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
    # MODEL_PARALLEL_ARGS and DDP_ARGS
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    # DATA_ARGS_LIST, the mock branch (the cache path is the fixture's)
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--tiktoken-pattern", "v2",
    "--split", "99,1,0", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    # EVAL_AND_LOGGING_ARGS (the paths are the fixture's)
    "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
    "torch_dist", "--distributed-timeout-minutes", "60",
]

_FP8 = (" without Transformer Engine's layers: fp8 and fp4 compute inside Transformer Engine's layers; this run's "
        "layers are megatron-core's local ones, so it computes in the model's precision (--bf16 / --fp16, else fp32)")
_PROFILE = ": no profiler range is opened here (per-operation timings: --timeline)"
LLAMA_IGNORED = [
    "ignored --sequence-parallel: with --tensor-model-parallel-size 1 there is no tensor-parallel region to split "
    "(Megatron-LM turns it off too)",
    "ignored --empty-unused-memory-level 1 on the CPU: there is no CUDA caching allocator to empty",
    "ignored --attention-backend fused without Transformer Engine's layers: Transformer Engine's attention kernels; "
    "megatron-core's local attention (DotProductAttention) runs",
    "ignored --fp8-format hybrid" + _FP8,
    "ignored --fp8-amax-history-len 1024" + _FP8,
    "ignored --fp8-amax-compute-algo max" + _FP8,
    "ignored --use-mcore-models: megatron-core's GPTModel is the only model here (Megatron-LM's legacy models are not)",
    "ignored --profile" + _PROFILE,
    "ignored --profile-step-start 4" + _PROFILE,
    "ignored --profile-step-end 6" + _PROFILE,
    "ignored --overlap-param-gather: the distributed optimizer all-gathers the updated parameters right after its "
    "step here (megatron's overlap with the next forward is not wired)",
    "ignored --fp8-param-gather" + _FP8,
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """GPT-2-style vocab.json and merges.txt made here, a corpus preprocessed with them by
    tools/preprocess_data.py (Megatron-LM's flags), and the output directories."""
    from tests.data.tokenizer_files import documents, gpt2_files

    root = tmp_path_factory.mktemp("examples")
    vocab, merges = gpt2_files(str(root / "gpt2"))
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for text in documents(300, words=80):
            fh.write(json.dumps({"text": text}) + "\n")
    run_python("tools/preprocess_data.py", "--input", str(root / "corpus.jsonl"), "--output-prefix",
               str(root / "corpus"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
               merges, "--append-eod", "--workers", "1")
    gpt3 = ["--data-path", str(root / "corpus_text_document"), "--vocab-file", vocab, "--merge-file", merges,
            "--save", str(root / "gpt3"), "--load", str(root / "gpt3"), "--tensorboard-dir", str(root / "gpt3_tb")]
    llama = ["--data-cache-path", str(root / "cache"), "--save", str(root / "llama"), "--load", str(root / "llama"),
             "--tensorboard-dir", str(root / "llama_tb")]
    return {"gpt3": GPT3 + gpt3, "llama": LLAMA + llama}


@pytest.mark.parametrize("name, ignored", [("gpt3", []), ("llama", LLAMA_IGNORED)])
def test_the_example_parses_and_passes_the_checks_before_launch(paths, name, ignored):
    from megatron_ext.runtime.model import check_config

    cfg = parse_run_config(["--device", "cpu"] + paths[name])
    assert cfg.notes == ignored
    cfg.validate(1)
    check_config(cfg)   # megatron-core's TransformerConfig of the run
    if name == "gpt3":
        assert (cfg.training.fp16, cfg.training.rampup_batch_size, cfg.training.lr_warmup_fraction) == (
            True, [16, 16, 5859375], 0.001)
    else:
        assert (cfg.training.train_iters, cfg.model.rotary_percent, cfg.model.make_vocab_size_divisible_by) == (
            3, 1.0, 128)


@pytest.mark.parametrize("name, iterations", [("gpt3", 3), ("llama", 3)])
def test_the_example_trains_on_one_cpu_rank(paths, name, iterations):
    proc = run_python("pretrain_gpt.py", "--device", "cpu", *paths[name], timeout=600)
    lines = (proc.stdout + proc.stderr).splitlines()
    progress = [ln for ln in lines if ln.lstrip().startswith("iteration")]
    assert progress and progress[-1].split()[1] == f"{iterations}/", "\n".join(lines[-30:])
    # Megatron-LM's format (--ckpt-format torch_dist, the default): its tracker names the iteration saved
    saved = os.path.join(paths[name][paths[name].index("--save") + 1], "latest_checkpointed_iteration.txt")
    assert open(saved).read() == str(iterations)


@pytest.mark.multirank
@pytest.mark.parametrize("name, layout, ignored", [
    ("gpt3", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "5"], []),
    ("llama", ["--train-samples", "40"], LLAMA_IGNORED),   # TP1 as written: four data-parallel ranks
])
def test_the_example_trains_five_iterations_on_four_cpu_ranks(paths, name, layout, ignored):
    proc = run_python("pretrain_gpt.py", "--nproc-per-node", "4", "--device", "cpu", *paths[name], *layout,
                      timeout=600)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert [ln for ln in lines if ln.startswith("pretrain_gpt.py: note:")] == [
        "pretrain_gpt.py: note: " + note for note in ignored]   # once, from rank 0
    progress = [ln for ln in lines if ln.lstrip().startswith("iteration")]
    assert progress and progress[-1].split()[1] == "5/", "\n".join(lines[-30:])
