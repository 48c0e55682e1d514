"""Train/valid/test GPTDatasets through megatron.core.datasets and the per-rank micro-batch stream.

The data position is the number of samples consumed globally: iteration ``i`` takes samples
``[consumed, consumed + global_batch)`` and data-parallel rank ``r`` takes its contiguous share, cut
into micro-batches. It is independent of the layout, so a checkpoint resumes (or reshards) exactly.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Iterator

import numpy as np
import torch

from megatron_ext.data.blend import SPLIT_NAMES, Blend, parse_blend, parse_split
from megatron_ext.data.corpus import cache_dir, default_corpus
from megatron_ext.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Splits:
    train: Any
    valid: Any
    test: Any
    tokenizer: Any
    source: str
    """What the data is, for the start-up line (a prefix, a blend, the per-split paths or mock data)."""


def split_sizes(train_iters: int, global_batch: int, eval_interval: int | None, eval_iters: int) -> list[int]:
    evals = (train_iters // eval_interval + 1) if eval_interval else 1
    return [train_iters * global_batch, max(evals * eval_iters * global_batch, 1), max(eval_iters * global_batch, 1)]


def build_splits(data: Any, tok: Any, *, seq_length: int, seed: int, sizes: list[int]) -> Splits:
    """Build the three splits on every rank (megatron's builder synchronises ranks itself), as
    Megatron-LM's pretrain_gpt.py does: GPTDataset (MockGPTDataset with --mock-data) splits through
    BlendedMegatronDatasetBuilder, from --data-path and --split, or from the per-split paths.
    ``data``, ``tok``: the run's data and tokenizer sections."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    from megatron_ext.data.check import bpe_file_of, sequences, split_without_empty
    from megatron_ext.data.tokenizer import tokenizer_path_for
    from megatron_ext.data.tokenizer_types import build_tokenizer

    cache = data.data_cache_path
    per_split = None
    if data.train_data_path:
        per_split = [parse_blend(items, f"--{name}-data-path") if items else None
                     for name, items in zip(SPLIT_NAMES, (data.train_data_path, data.valid_data_path,
                                                          data.test_data_path))]
        for blend in filter(None, per_split):
            for p in blend.prefixes:
                if sequences(p) == 0:
                    raise ConfigError(f"{p} holds no documents")
        source = "; ".join(f"{name} {b.describe()}" for name, b in zip(SPLIT_NAMES, per_split) if b)
    elif data.mock_data:
        source = "mock data (megatron-core's MockGPTDataset)"
    else:
        blend = parse_blend(data.data_path, "--data-path") if data.data_path else Blend((default_corpus(cache),), None)
        source = blend.describe()
    bpe_file = bpe_file_of(data, tok)
    if bpe_file is None and tok.tokenizer_type is None:
        bpe_file = tokenizer_path_for(default_corpus(cache))
    tokenizer = build_tokenizer(tok, bpe_file)

    split = None
    if per_split is None and not data.mock_data:
        split, dropped = split_without_empty(data.split, list(blend.prefixes))
        for what in dropped:
            logger.info("%s", what)
        sizes = [size if w > 0 else 0 for size, w in zip(sizes, parse_split(split))]
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None if per_split is not None or data.mock_data else blend.as_megatron(),
        blend_per_split=None if per_split is None else [b.as_megatron() if b else None for b in per_split],
        split=split,
        path_to_cache=cache or os.path.join(cache_dir(None), "index"),
        mmap_bin_files=data.mmap_bin_files,
        num_dataset_builder_threads=data.num_dataset_builder_threads,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=data.eod_mask_loss,
        # The attention applies the causal mask itself (Megatron-LM's --no-create-attention-mask-in-dataloader).
        create_attention_mask=False,
    )
    cls = MockGPTDataset if data.mock_data else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    if train is None or len(train) == 0:
        raise ConfigError(f"{source}: no training samples")
    return Splits(train=train, valid=valid, test=test, tokenizer=tokenizer, source=source)


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
            # A blend's samples also name their corpus (BlendedDataset's "dataset_id"): not model input.
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0] if torch.is_tensor(samples[0][k])}
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
