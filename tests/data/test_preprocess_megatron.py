"""tools/preprocess_data.py with Megatron-LM's flags writes what Megatron-LM's tool writes: one
<prefix>_<key>_document dataset a key, the end-of-document token only with --append-eod, the
dtype megatron-core picks, input order whatever --workers; the project's own interface still works.

(Measured once by hand against Megatron-LM core_v0.16.1's own tools/preprocess_data.py on 200 JSONL
records with empty and list-valued texts: byte-identical .bin and .idx for SentencePieceTokenizer with
and without --append-eod, Llama2Tokenizer, HuggingFaceTokenizer, TikTokenizer, NullTokenizer, two
--json-keys, and GPT2BPETokenizer against its --legacy-tokenizer GPT-2 BPE.)"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

from megatron_ext.data.tokenizer_types import build_tokenizer
from tests.conftest import run_python
from tests.data.tokenizer_files import documents, section, sentencepiece_model

RECORDS = [{"text": d, "title": d[:20]} for d in documents(12, seed=5)]
RECORDS[3]["text"] = ""                                   # an empty document: written, with no sequence
RECORDS[7]["text"] = ["first sentence", "", "third one"]  # a list: the document's sentences


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    with open(root / "in.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in RECORDS)
    return root, sentencepiece_model(str(root / "sp"))


def cli(*args: str, check: bool = True):
    return run_python("tools/preprocess_data.py", *args, check=check)


def expected(tok, text, append_eod: bool) -> tuple[list[int], list[int]]:
    sentences = [tok.tokenize(s) for s in (text if isinstance(text, list) else [text])]
    sentences = [s for s in sentences if s]
    if sentences and append_eod:
        sentences[-1] = sentences[-1] + [tok.eod]
    return [i for s in sentences for i in s], [len(s) for s in sentences]


@pytest.mark.parametrize("append_eod", [False, True])
def test_megatron_flags_write_megatrons_files(inputs, append_eod):
    root, sp = inputs
    out = root / f"eod{int(append_eod)}" / "my"
    proc = cli("--input", str(root / "in.jsonl"), "--output-prefix", str(out), "--json-keys", "text", "title",
               "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp, "--workers", "2",
               *(["--append-eod"] if append_eod else []))
    tok = build_tokenizer(section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp))
    assert sorted(os.listdir(out.parent)) == ["my_text_document.bin", "my_text_document.idx",
                                              "my_title_document.bin", "my_title_document.idx"]
    for key in ("text", "title"):
        ds = IndexedDataset(f"{out}_{key}_document")
        assert ds.index.dtype == DType.optimal_dtype(tok.vocab_size) == np.uint16
        assert len(ds.document_indices) == len(RECORDS) + 1, "one document a record, empty ones too"
        for r, record in enumerate(RECORDS):
            ids, lengths = expected(tok, record[key], append_eod)
            first, last = ds.document_indices[r], ds.document_indices[r + 1]
            assert list(ds.sequence_lengths[first:last]) == lengths
            got = [int(t) for s in range(first, last) for t in ds[int(s)]]
            assert got == ids
        assert f"{out}_{key}_document: {len(RECORDS)} documents" in proc.stdout


def test_workers_write_the_same_bytes_in_input_order(inputs):
    root, sp = inputs
    flags = ["--input", str(root / "in.jsonl"), "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp,
             "--append-eod"]
    cli(*flags, "--output-prefix", str(root / "w1" / "x"), "--workers", "1")
    cli(*flags, "--output-prefix", str(root / "w3" / "x"), "--workers", "3")
    for ext in (".bin", ".idx"):
        assert (root / "w1" / f"x_text_document{ext}").read_bytes() == (root / "w3" / f"x_text_document{ext}").read_bytes()


def test_bad_input_is_one_line_naming_file_and_line(inputs, tmp_path):
    root, sp = inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    flags = ["--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", sp]
    proc = cli("--input", str(bad), *flags, check=False)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [
        f"preprocess_data.py: error: {bad}:2: no 'text' field (set --json-keys)"])
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir()), "nothing half-written"
    proc = cli("--input", str(root / "in.jsonl"), *flags[:2], "--tokenizer-type", "SentencePieceTokenizer",
               "--tokenizer-model", str(root / "in.jsonl"), check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"preprocess_data.py: error: --tokenizer-model {root / 'in.jsonl'} is a text file, not a SentencePiece model "
        "(--tokenizer-type SentencePieceTokenizer)"]
    proc = cli("--input", str(root / "in.jsonl"), *flags, "--split-sentences", check=False)
    assert proc.stderr.splitlines() == [
        "preprocess_data.py: error: --split-sentences (NLTK sentence splitting, for BERT-style data) is not "
        "supported: GPT pretraining reads whole documents"]


def test_the_project_interface_still_writes_prefix_bin_idx_and_tokenizer(inputs, tmp_path):
    root, _ = inputs
    proc = cli("--input", str(root / "in.jsonl"), "--output-prefix", str(tmp_path / "c"), "--json-key", "title",
               "--vocab-size", "300")
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx", "c.tokenizer.json"]
    assert f"{tmp_path / 'c'}: {len(RECORDS)} documents" in proc.stdout
