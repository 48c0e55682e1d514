"""Train/valid/test GPTDatasets through megatron.core.datasets and the per-rank micro-batch stream.

The data position is the number of samples consumed globally: iteration ``i`` takes samples
``[consumed, consumed + global_batch)`` and data-parallel rank ``r`` takes its contiguous share, cut
into micro-batches. It is independent of the layout, so a checkpoint resumes (or reshards) exactly.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator

import numpy as np
import torch

from megatron_ext.data.corpus import cache_dir, default_corpus, load_tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Splits:
    train: Any
    valid: Any
    test: Any
    tokenizer: Any
    prefix: str


def split_sizes(train_iters: int, global_batch: int, eval_interval: int | None, eval_iters: int) -> list[int]:
    evals = (train_iters // eval_interval + 1) if eval_interval else 1
    return [train_iters * global_batch, max(evals * eval_iters * global_batch, 1), max(eval_iters * global_batch, 1)]


def build_splits(*, data_path: str | None, tokenizer_file: str | None, split: str, seq_length: int, seed: int,
                 sizes: list[int], cache: str | None, reset_attention_mask: bool = False) -> Splits:
    """Build the three splits on every rank (megatron's builder synchronises ranks itself)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = data_path or default_corpus(cache)
    tokenizer = load_tokenizer(prefix, tokenizer_file)
    # megatron's GPTDataset loops forever when a split with a requested size holds no tokens:
    # count the documents of each split the way its builder does and drop empty splits first.
    n_docs = len(IndexedDataset(prefix).document_indices) - 1
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    docs_per_split = [0 if m is None else int(round(m[1] * n_docs)) - int(round(m[0] * n_docs)) for m in matrix]
    if docs_per_split[0] == 0:
        raise ValueError(f"--split {split} leaves no training documents in {prefix} ({n_docs} documents)")
    sizes = [size if docs else None for size, docs in zip(sizes, docs_per_split)]
    split = ",".join(str(w) if docs else "0" for w, docs in
                     zip(parse_and_normalize_split(split), docs_per_split))

    import os

    index_cache = os.path.join(cache_dir(cache), "index")
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=index_cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    if train is None or len(train) == 0:
        raise ValueError(f"dataset {prefix} has no training samples with --split {split}")
    return Splits(train=train, valid=valid, test=test, tokenizer=tokenizer, prefix=prefix)


def document_lengths(tokens: torch.Tensor, eod: int) -> list[list[int]]:
    """Per-sequence document lengths in a [batch, seq] token tensor (an EOD token ends a document)."""
    out = []
    arr = tokens.cpu().numpy()
    for row in arr:
        ends = np.flatnonzero(row == eod) + 1
        bounds = np.concatenate(([0], ends[ends < len(row)], [len(row)]))
        out.append([int(n) for n in np.diff(bounds) if n > 0])
    return out


class MicroBatchStream:
    """Yields this data-parallel rank's micro-batches of one iteration at a time."""

    def __init__(self, dataset: Any, *, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 eod: int, consumed_samples: int = 0, packing: Any = None, seed: int = 0,
                 replica_microbatches: list[int] | None = None) -> None:
        if replica_microbatches is None and global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} not divisible by micro batch {micro_batch} x dp {dp_size}")
        if replica_microbatches is not None and (len(replica_microbatches) != dp_size
                                                 or sum(replica_microbatches) * micro_batch != global_batch):
            raise ValueError(f"replica micro-batches {replica_microbatches} do not split global batch {global_batch} "
                             f"over {dp_size} replicas of micro batch {micro_batch}")
        # Uneven work split: replica r takes replica_microbatches[r] micro-batches of the global batch,
        # right after those of the replicas before it (the global batch's samples are the same).
        self.replica_microbatches = list(replica_microbatches) if replica_microbatches else None
        self.dataset = dataset
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.eod = eod
        self.consumed_samples = consumed_samples
        self.packing = packing  # a packing.LengthDistribution, or None for the corpus's own documents
        self.seed = seed

    @property
    def num_microbatches(self) -> int:
        if self.replica_microbatches is not None:
            return self.replica_microbatches[self.dp_rank]
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _first_sample(self, start: int) -> int:
        if self.replica_microbatches is not None:
            return start + sum(self.replica_microbatches[:self.dp_rank]) * self.micro_batch
        return start + self.dp_rank * (self.global_batch // self.dp_size)

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        return self.dataset[index % len(self.dataset)]

    def iteration(self, start: int | None = None) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of the global batch starting at ``start`` (default: the data position)."""
        start = self.consumed_samples if start is None else start
        first = self._first_sample(start)
        batches = []
        for m in range(self.num_microbatches):
            samples = [self._sample(first + m * self.micro_batch + j) for j in range(self.micro_batch)]
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
            if self.packing is not None:
                from megatron_ext.data.packing import pack

                pack(batch, self.packing, self.seed, first + m * self.micro_batch)
            else:
                batch["doc_lengths"] = document_lengths(batch["tokens"], self.eod)
            batches.append(batch)
        return batches

    def next_iteration(self) -> list[dict[str, torch.Tensor]]:
        batches = self.iteration()
        self.consumed_samples += self.global_batch
        return batches

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        while True:
            yield self.next_iteration()
