"""pretrain_gpt.py on Megatron-LM users' data: a blend of two corpora tokenized with a SentencePiece
model trains and logs its validation loss; bad data and tokenizer input is one line, exit 2, before
any rank starts."""
from __future__ import annotations

import json
import math

import pytest

from megatron_ext.data.preprocess import megatron_preprocess
from tests.conftest import run_python, run_torchrun
from tests.data.tokenizer_files import documents, gpt2_files, section, sentencepiece_model

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--no-progress"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """Corpora a and b written by Megatron-LM's preprocessing with one SentencePiece model."""
    root = tmp_path_factory.mktemp("sp_blend")
    sp = sentencepiece_model(str(root / "sp"))
    prefixes = []
    for name, n, seed in (("a", 150, 11), ("b", 250, 12)):
        with open(root / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": d}) + "\n" for d in documents(n, seed, words=60))
        prefixes += megatron_preprocess([str(root / f"{name}.jsonl")], str(root / name),
                                        section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp),
                                        append_eod=True)
    return root, sp, prefixes


@pytest.mark.multirank
def test_a_sentencepiece_blend_trains_and_logs_its_validation_loss(blend):
    root, sp, (a, b) = blend
    metrics = root / "metrics.jsonl"
    out = run_torchrun("pretrain_gpt.py", *MODEL, "--data-path", "0.4", a, "0.6", b, "--split", "90,8,2",
                       "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp,
                       "--data-cache-path", str(root / "cache"), "--train-iters", "6", "--eval-interval", "3",
                       "--eval-iters", "2", "--metrics-file", str(metrics), nproc=2, timeout=600).stdout
    assert f"data 0.4 {a} 0.6 {b}" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r["loss"] for r in rows if r["kind"] == "train"]
    valid = [r for r in rows if r["kind"] == "valid"]
    assert len(train) == 6 and all(math.isfinite(x) for x in train)
    # The SentencePiece model's 320 ids, padded: an untrained model's loss is about ln(vocabulary).
    assert abs(train[0] - math.log(384)) < 0.5
    assert [r["iteration"] for r in valid] == [3, 6] and all(math.isfinite(r["loss"]) for r in valid)


def refused(*argv: str) -> list[str]:
    proc = run_python("pretrain_gpt.py", "--nproc-per-node", "2", *MODEL, *argv, check=False)
    assert (proc.returncode, proc.stdout) == (2, "")
    return proc.stderr.splitlines()


def test_a_tokenizer_file_of_the_wrong_kind_is_one_line_before_any_rank_starts(blend, tmp_path):
    root, sp, (a, _) = blend
    vocab, _merges = gpt2_files(str(tmp_path / "gpt2"))
    assert refused("--data-path", a, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", vocab) == [
        f"pretrain_gpt.py: error: --tokenizer-model {vocab} is a token -> id vocabulary (GPT-2's vocab.json), not a "
        "SentencePiece model (--tokenizer-type SentencePieceTokenizer)"]


def test_a_blend_whose_weights_do_not_parse_is_one_line_before_any_rank_starts(blend):
    _, sp, (a, b) = blend
    assert refused("--data-path", "0.3", a, "0,7", b, "--tokenizer-type", "Llama2Tokenizer",
                   "--tokenizer-model", sp) == [
        f"pretrain_gpt.py: error: --data-path 0.3 {a} 0,7 {b}: weight '0,7' (item 3) is not a number; a blend is "
        "WEIGHT PREFIX pairs, e.g. 0.3 corpusA 0.7 corpusB"]


def test_data_written_with_another_vocabulary_is_one_line_before_any_rank_starts(blend):
    _, _, (a, _) = blend
    (line,) = refused("--data-path", a, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert line.startswith(f"pretrain_gpt.py: error: {a}: token id ") and line.endswith(
        "is out of range of the tokenizer's 101 tokens (NullTokenizer 100): the data was written with another "
        "tokenizer; pass the --tokenizer-type and files it was preprocessed with")
