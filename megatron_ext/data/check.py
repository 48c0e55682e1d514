"""What the data and its tokenizer are checked for before any rank starts (``RunConfig.validate_launch``),
and the checks ``dataset.build_splits`` repeats on every rank.

* The tokenizer is built, so a file of the wrong kind is one line (``tokenizer_types.check_files``).
* Every dataset prefix's token ids lie inside its vocabulary: data written with another tokenizer
  (a larger vocabulary) would otherwise reach the embedding as an index error on some rank,
  mid-run. The largest id is read from the ``.bin`` through a memory map: all of it up to
  ``WHOLE_BELOW_BYTES``, else ``WINDOWS`` evenly spaced windows (a sample: a few ids out of range in
  a large file can pass, a file written with another tokenizer does not).
* A prefix whose share of a split holds no sequence: megatron-core's GPTDataset never finishes
  building such a split, so an empty training share is refused, and empty validation and test
  shares are dropped (``split_without_empty``).
* Without --tokenizer-type the prefixes share one BPE file (``bpe_file_of``).
"""
from __future__ import annotations

import dataclasses
import filecmp
import os
import re
from typing import Any

import numpy as np

from megatron_ext.data.blend import SPLIT_NAMES, empty_splits
from megatron_ext.errors import ConfigError

WHOLE_BELOW_BYTES = 1 << 28
WINDOWS = 256
WINDOW_TOKENS = 1 << 16


@dataclasses.dataclass(frozen=True)
class TokenRange:
    max_id: int
    read_tokens: int
    total_tokens: int


def token_range(prefix: str) -> TokenRange:
    """The largest token id of ``prefix``'s ``.bin`` (whole if small, else sampled)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path

    dtype = IndexedDataset(prefix, mmap=True).index.dtype
    data = np.memmap(get_bin_path(prefix), dtype=dtype, mode="r")
    total = int(data.size)
    if total == 0:
        return TokenRange(-1, 0, 0)
    if data.nbytes <= WHOLE_BELOW_BYTES:
        return TokenRange(int(data.max()), total, total)
    starts = np.linspace(0, total - WINDOW_TOKENS, WINDOWS).astype(np.int64)
    return TokenRange(max(int(data[s:s + WINDOW_TOKENS].max()) for s in starts), WINDOWS * WINDOW_TOKENS, total)


def sequences(prefix: str) -> int:
    """The sequences of an indexed dataset: what megatron-core's GPTDataset splits and samples."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return int(IndexedDataset(prefix, mmap=True).sequence_lengths.shape[0])


def split_without_empty(split: str, prefixes: list[str]) -> tuple[str, list[str]]:
    """``split`` with valid and test set to 0 where a prefix's share of them is empty (megatron-core
    would never finish building them), and what was dropped; ConfigError when a prefix's training
    share is empty. Unchanged (the same text) when nothing is empty."""
    counts = {p: sequences(p) for p in prefixes}
    empty = empty_splits(split, counts)
    if empty[0]:
        p = empty[0][0]
        raise ConfigError(f"--split {split} leaves no training documents in {p} ({counts[p]} documents)")
    numbers = re.findall(r"[.0-9]+", split) + ["0"] * 2
    dropped = []
    for i, name in enumerate(SPLIT_NAMES[1:], 1):
        if float(numbers[i]) > 0 and empty[i]:
            numbers[i] = "0"
            dropped.append(f"no {name} split: --split {split} gives it none of the {counts[empty[i][0]]} documents "
                           f"of {empty[i][0]}")
    return (",".join(numbers[:3]) if dropped else split), dropped


def bpe_file_of(data: Any, tok: Any) -> str | None:
    """The project's BPE file a run without --tokenizer-type reads: --tokenizer-file, else the one
    its prefixes were preprocessed with (they must share it). None: the default corpus's."""
    from megatron_ext.data.tokenizer import tokenizer_path_for
    from megatron_ext.data.tokenizer_types import resolved_type

    if resolved_type(tok) is not None or tok.tokenizer_file:
        return tok.tokenizer_file

    prefixes = data.prefixes()
    if not prefixes:
        return None
    for prefix in prefixes:
        if not os.path.isfile(tokenizer_path_for(prefix)):
            raise ConfigError(f"{prefix} has no {os.path.basename(tokenizer_path_for(prefix))} beside it (it was "
                              "not preprocessed with this project's BPE): pass the --tokenizer-type and files it was "
                              "preprocessed with, or --tokenizer-file")
    first = tokenizer_path_for(prefixes[0])
    for prefix in prefixes[1:]:
        if not filecmp.cmp(first, tokenizer_path_for(prefix), shallow=False):
            raise ConfigError(f"{prefixes[0]} and {prefix} were preprocessed with different tokenizers "
                              f"({first} and {tokenizer_path_for(prefix)} differ): a run reads one tokenizer; "
                              "preprocess both with the same --tokenizer-file")
    return first


def check_data(data: Any, tok: Any) -> None:
    """Build the tokenizer and check every prefix's token ids against it (see the module doc)."""
    from megatron_ext.data.tokenizer_types import build_tokenizer, describe, resolved_type

    prefixes = data.prefixes()
    if not prefixes and resolved_type(tok) is None and not tok.tokenizer_file:
        return   # the default corpus (or mock data) with its own BPE
    if data.data_path:
        split_without_empty(data.split, prefixes)   # a prefix with no training share is refused
    bpe_file = bpe_file_of(data, tok)
    tokenizer = build_tokenizer(tok, bpe_file)
    vocab = int(tokenizer.vocab_size)
    for prefix in prefixes:
        found = token_range(prefix)
        if found.max_id >= vocab:
            sampled = ("" if found.read_tokens == found.total_tokens
                       else f" (in a sample of {found.read_tokens} of its {found.total_tokens} tokens)")
            raise ConfigError(f"{prefix}: token id {found.max_id}{sampled} is out of range of the tokenizer's "
                              f"{vocab} tokens ({describe(tok, bpe_file)}): the data was written with another tokenizer; "
                              "pass the --tokenizer-type and files it was preprocessed with")
