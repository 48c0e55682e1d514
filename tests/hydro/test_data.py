"""Token sources: a Megatron indexed dataset (the default corpus's format) and the synthetic stream."""
import numpy as np
import pytest
import torch

from megatron_ext.hydro.data import DataError, TokenBatches, load_tokens, synthetic_tokens


def test_indexed_dataset_is_read_in_document_order(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "toy")
    docs = [np.arange(5) + 10 * i for i in range(4)]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.from_numpy(d), [len(d)])
    builder.finalize(prefix + ".idx")
    tokens, vocab, desc = load_tokens(prefix)
    assert tokens.tolist() == np.concatenate(docs).tolist()
    assert vocab == 35 and "toy" in desc
    assert load_tokens(prefix, max_tokens=7)[0].tolist() == np.concatenate(docs)[:7].tolist()


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"data_path '.*nope': .*nope.bin does not exist"):
        load_tokens(str(tmp_path / "nope"))
    with pytest.raises(DataError, match=r"expected synthetic\[:tokens\[:vocab\[:order\]\]\]"):
        load_tokens("synthetic:lots")


def test_batches_are_shifted_windows_and_validation_is_fixed():
    toks = synthetic_tokens(5000, 50, seed=0)
    data = TokenBatches(toks, seq_len=16, batch_size=4, seed=0)
    x, y = data.train_batch()
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    v1, v2 = data.val_batches(3), data.val_batches(3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))
    held_out = set(data.val.tolist()[:20])
    assert data.val.numel() == 500 and toks[4500:4520].tolist() == data.val[:20].tolist() and held_out
    # the synthetic stream is learnable: far fewer distinct bigrams than vocab^2
    pairs = {(int(a), int(b)) for a, b in zip(toks[:-1], toks[1:])}
    assert len(pairs) < 0.3 * 50 * 50
