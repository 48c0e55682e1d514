"""Text / JSONL -> megatron-core indexed dataset (.bin/.idx), one document per file or JSON line.

Every document ends with the end-of-document token, so per-document lengths can be recovered from
any training sequence (ResiHP prices attention by them). Outputs are written under temporary names
and renamed at the end: an interrupted run never leaves a half-written dataset behind.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Iterable, Iterator

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

from megatron_ext.data.tokenizer import BPETokenizer, tokenizer_path_for, train_bpe

logger = logging.getLogger(__name__)


class InputError(ValueError):
    """Unreadable or malformed input; the message names the file (and line)."""


def iter_documents(paths: Iterable[str], *, json_key: str = "text") -> Iterator[str]:
    """Yield documents: a ``.jsonl``/``.json`` file gives one per line (``json_key``), any other file
    is one document. Directories are walked in sorted order."""
    for path in paths:
        if os.path.isdir(path):
            files = sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
            yield from iter_documents(files, json_key=json_key)
            continue
        if not os.path.isfile(path):
            raise InputError(f"input {path} does not exist")
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                    if not isinstance(record, dict) or json_key not in record:
                        raise InputError(f"{path}:{lineno}: no '{json_key}' field (set --json-key)")
                    text = record[json_key]
                    if not isinstance(text, str):
                        raise InputError(f"{path}:{lineno}: field '{json_key}' is not a string")
                    if text:
                        yield text
        else:
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except UnicodeDecodeError:
                logger.warning("skipping %s: not UTF-8 text", path)
                continue
            if text:
                yield text


def build_indexed_dataset(documents: Iterable[str], tokenizer: BPETokenizer, output_prefix: str,
                          *, batch: int = 256) -> dict[str, int]:
    """Tokenize ``documents`` into ``output_prefix``.bin/.idx (+ tokenizer JSON); returns counts."""
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp_prefix = output_prefix + ".tmp"
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=dtype)
    n_docs = n_tokens = 0
    pending: list[str] = []

    def flush() -> None:
        nonlocal n_docs, n_tokens
        for ids in tokenizer.encode_batch(pending):
            ids = np.append(ids, tokenizer.eod).astype(dtype)
            builder.add_document(torch.from_numpy(ids.astype(np.int64)), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)
        pending.clear()

    try:
        for doc in documents:
            pending.append(doc)
            if len(pending) >= batch:
                flush()
        flush()
        builder.finalize(get_idx_path(tmp_prefix))
    except BaseException:
        builder.data_file.close()
        for p in (get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)):
            if os.path.exists(p):
                os.remove(p)
        raise
    if n_docs == 0:
        raise InputError("no documents found in the input")
    import shutil

    shutil.copyfile(tokenizer.path, tokenizer_path_for(tmp_prefix))
    # Rename the tokenizer and .bin first and the .idx last: a reader checks for the .idx.
    os.replace(tokenizer_path_for(tmp_prefix), tokenizer_path_for(output_prefix))
    os.replace(get_bin_path(tmp_prefix), get_bin_path(output_prefix))
    os.replace(get_idx_path(tmp_prefix), get_idx_path(output_prefix))
    logger.info("wrote %s.{bin,idx}: %d documents, %d tokens", output_prefix, n_docs, n_tokens)
    return {"documents": n_docs, "tokens": n_tokens, "vocab_size": tokenizer.vocab_size}


def preprocess(inputs: list[str], output_prefix: str, *, tokenizer_file: str | None = None,
               vocab_size: int = 4096, json_key: str = "text", max_bytes: int | None = None) -> dict[str, int]:
    """Train a BPE tokenizer (unless ``tokenizer_file``) and build the indexed dataset."""
    def docs() -> Iterator[str]:
        total = 0
        for doc in iter_documents(inputs, json_key=json_key):
            if max_bytes is not None and total >= max_bytes:
                return
            total += len(doc.encode("utf-8"))
            yield doc

    if tokenizer_file is None:
        tok_path = output_prefix + ".trained-tokenizer.json"
        os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
        train_bpe(docs(), vocab_size).save(tok_path)
        tokenizer = BPETokenizer(tok_path)
    else:
        tokenizer = BPETokenizer(tokenizer_file)
        tok_path = None
    try:
        return build_indexed_dataset(docs(), tokenizer, output_prefix)
    finally:
        if tok_path and os.path.exists(tok_path):
            os.remove(tok_path)
