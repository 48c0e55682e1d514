"""Token data for tuning: the default corpus, any Megatron indexed dataset, or a synthetic stream.

``data_path`` selects the source: ``""`` is the project's default corpus
(``megatron_ext.data.corpus.default_corpus``), a path prefix is a Megatron indexed dataset
(``prefix.bin`` / ``prefix.idx``), and ``synthetic[:tokens[:vocab[:order]]]`` is a learnable
random Markov stream (for tests and benchmarks that must not depend on a corpus).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from megatron_ext.errors import UserError

logger = logging.getLogger(__name__)


class DataError(UserError, ValueError):
    """The data source named in the config cannot be read; the message says which and why."""


def synthetic_tokens(n_tokens: int, vocab_size: int, seed: int = 0, branching: int = 3, order: int = 1
                     ) -> np.ndarray:
    """A Markov chain of ``order`` where each context has ``branching`` likely successors: its
    entropy (about log(branching) nats) is far below log(vocab), so models of different quality
    differ. ``order=2`` makes the next token depend on the two previous ones, so a model needs
    attention (not just the embedding-to-readout path) to learn it."""
    rng = np.random.default_rng(seed)
    contexts = vocab_size ** order if vocab_size ** order <= 1 << 20 else 1 << 20
    succ = rng.integers(0, vocab_size, size=(contexts, branching))
    out = np.zeros(n_tokens, dtype=np.int64)
    choice = rng.integers(0, branching, size=n_tokens)
    noise = rng.random(n_tokens) < 0.05
    rand_tok = rng.integers(0, vocab_size, size=n_tokens)
    for i in range(order, n_tokens):
        ctx = 0
        for j in range(1, order + 1):
            ctx = ctx * vocab_size + int(out[i - j])
        out[i] = rand_tok[i] if noise[i] else succ[ctx % contexts, choice[i]]
    return out


def read_indexed_dataset(prefix: str, max_tokens: int = 0) -> np.ndarray:
    """All documents of a Megatron indexed dataset, concatenated (end-of-document tokens kept)."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise DataError(f"data_path {prefix!r}: {prefix + ext} does not exist (expected a Megatron "
                            "indexed dataset prefix, '' for the default corpus, or 'synthetic')")
    import warnings
    with warnings.catch_warnings():  # megatron warns about missing GPU extras on import; irrelevant here
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    parts, total = [], 0
    for i in range(len(ds)):
        doc = np.asarray(ds[i], dtype=np.int64)
        parts.append(doc)
        total += doc.size
        if max_tokens and total >= max_tokens:
            break
    if not parts:
        raise DataError(f"data_path {prefix!r}: the dataset has no documents")
    tokens = np.concatenate(parts)
    return tokens[:max_tokens] if max_tokens else tokens


def load_tokens(data_path: str, cache_dir: str | None = None, max_tokens: int = 0, seed: int = 0
                ) -> tuple[np.ndarray, int, str]:
    """(tokens, vocab size, description) for ``data_path``."""
    if data_path.startswith("synthetic"):
        parts = data_path.split(":")
        try:
            n = int(parts[1]) if len(parts) > 1 and parts[1] else 200_000
            vocab = int(parts[2]) if len(parts) > 2 and parts[2] else 256
            order = int(parts[3]) if len(parts) > 3 and parts[3] else 1
        except ValueError:
            raise DataError(f"data_path {data_path!r}: expected synthetic[:tokens[:vocab[:order]]] with integers") from None
        return (synthetic_tokens(n, vocab, seed, order=order), vocab,
                f"synthetic order-{order} Markov stream ({n} tokens, vocab {vocab})")
    prefix = data_path
    vocab = 0
    if not prefix:
        try:
            import warnings
            with warnings.catch_warnings():  # megatron's "no GPU extras" import warnings
                warnings.simplefilter("ignore", UserWarning)
                from megatron_ext.data.corpus import default_corpus, load_tokenizer
        except ImportError as exc:
            raise DataError("data_path is empty (the default corpus) but megatron_ext.data.corpus is not "
                            f"available ({exc}); set data_path to an indexed dataset prefix or 'synthetic'") from None
        prefix = default_corpus(cache_dir)
        try:
            vocab = int(load_tokenizer(prefix).vocab_size)
        except Exception as exc:  # a tokenizer problem should not stop tuning: fall back to max id
            logger.warning("could not read the tokenizer of %s (%s); vocab from the data", prefix, exc)
    tokens = read_indexed_dataset(prefix, max_tokens)
    vocab = max(vocab, int(tokens.max()) + 1)
    return tokens, vocab, f"indexed dataset {os.path.basename(prefix)} ({tokens.size} tokens, vocab {vocab})"


class TokenBatches:
    """Random training windows and a fixed validation set from one token stream.

    The last ``val_fraction`` of the stream is held out; validation batches are fixed windows, so
    every trial (and the transferred target) is scored on exactly the same tokens.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, val_fraction: float = 0.1,
                 seed: int = 0) -> None:
        need = 2 * (seq_len + 1)
        if tokens.size < need / max(val_fraction, 1e-9):
            raise DataError(f"{tokens.size} tokens are too few for seq_len {seq_len} with a "
                            f"{val_fraction:.0%} validation split")
        split = int(tokens.size * (1 - val_fraction))
        self.train = torch.from_numpy(tokens[:split].astype(np.int64))
        self.val = torch.from_numpy(tokens[split:].astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.unsqueeze(1) + torch.arange(self.seq_len + 1).unsqueeze(0)
        w = stream[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def train_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.train.numel() - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        return self._windows(self.train, starts)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        span = self.val.numel() - self.seq_len - 1
        total = n_batches * self.batch_size
        starts = torch.linspace(0, span - 1, total).long()
        return [self._windows(self.val, starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(n_batches)]
