"""Preprocessing into megatron's indexed dataset, document boundaries and the micro-batch stream."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.dataset import MicroBatchStream, document_lengths
from megatron_ext.data.preprocess import InputError, iter_documents, preprocess
from megatron_ext.data.tokenizer import BPETokenizer, tokenizer_path_for
from tests.conftest import run_python

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "class Point:\n    x: int = 0\n" * 15, "import os\n" * 30]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    (tmp / "src").mkdir()
    for i, text in enumerate(TEXTS[:2]):
        (tmp / "src" / f"f{i}.py").write_text(text)
    with open(tmp / "more.jsonl", "w") as fh:
        fh.write(json.dumps({"text": TEXTS[2]}) + "\n\n")
    prefix = str(tmp / "out" / "corpus")
    stats = preprocess([str(tmp / "src"), str(tmp / "more.jsonl")], prefix, vocab_size=300)
    return prefix, stats


def test_documents_round_trip_with_eod(dataset):
    prefix, stats = dataset
    tok = BPETokenizer(tokenizer_path_for(prefix))
    ds = IndexedDataset(prefix)
    assert stats["documents"] == len(ds) == 3
    assert stats["tokens"] == int(ds.sequence_lengths.sum())
    for i, text in enumerate(TEXTS):
        ids = ds[i]
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1]) == text


def test_document_lengths_from_eod():
    eod = 0
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4], [1, 2, 3, 4, 5, 6, 7, 8], [0, 3, 3, 0, 0, 2, 2, 2]])
    assert document_lengths(tokens, eod) == [[3, 4, 1], [8], [1, 3, 1, 3]]


def test_bad_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: no 'text' field \(set --json-key\)"):
        list(iter_documents([str(path)]))
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_documents([str(path)]))
    with pytest.raises(InputError, match="input .*missing.txt does not exist"):
        list(iter_documents([str(tmp_path / "missing.txt")]))


def test_interrupted_preprocess_leaves_nothing(tmp_path, dataset):
    prefix = str(tmp_path / "half")

    def docs():
        yield "print(1)\n"
        raise KeyboardInterrupt

    from megatron_ext.data.preprocess import build_indexed_dataset

    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset(docs(), BPETokenizer(tokenizer_path_for(dataset[0])), prefix, batch=1)
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_errors(tmp_path):
    proc = run_python("tools/preprocess_data.py", "--input", str(tmp_path / "none"), "--output-prefix",
                      str(tmp_path / "x"), check=False)
    assert proc.returncode == 2
    assert "preprocess_data.py: error: input" in proc.stderr and "does not exist" in proc.stderr


class FakeDataset:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        t = torch.full((4,), i)
        return {"tokens": t, "labels": t, "loss_mask": torch.ones(4), "position_ids": torch.arange(4)}


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_stream_covers_global_batch_once(dp):
    streams = [MicroBatchStream(FakeDataset(), global_batch=8, micro_batch=2, dp_rank=r, dp_size=dp, eod=-1,
                                consumed_samples=16) for r in range(dp)]
    seen = []
    for s in streams:
        batches = s.next_iteration()
        assert len(batches) == s.num_microbatches == 8 // (2 * dp)
        seen += [int(b["tokens"][j, 0]) for b in batches for j in range(2)]
        assert s.consumed_samples == 24
    assert sorted(seen) == list(range(16, 24))
    assert np.all(np.diff(seen) == 1), "ranks take contiguous shares in rank order"
