"""Text / JSONL -> megatron-core indexed dataset (.bin/.idx), one document per file or JSON line.

Two ways in, one format out (megatron-core's ``IndexedDatasetBuilder``):

* the project's own (``preprocess``): files, directories or JSONL, tokenized with the BPE trained on
  them (or ``--tokenizer-file``); every document ends with the end-of-document token, so
  per-document lengths can be recovered from any training sequence (ResiHP prices attention by
  them); written as ``<prefix>.bin/.idx`` with the tokenizer beside it, ``<prefix>.tokenizer.json``.
* Megatron-LM's (``megatron_preprocess``, its ``tools/preprocess_data.py``): JSONL, one document a
  line for each of ``--json-keys`` (a list value is a document of sentences), tokenized by a
  ``--tokenizer-type``, the end-of-document token appended only with ``--append-eod``, by
  ``--workers`` processes in input order; written as ``<prefix>_<key>_document.bin/.idx`` with the
  dtype megatron-core picks for the vocabulary (``DType.optimal_dtype``), byte for byte what
  Megatron-LM's tool writes for the same input and tokenizer (an empty document included). Unlike
  Megatron-LM's tool, every key's ``.idx`` is written (its single-partition path finalises the last
  key's only) and a line that is not JSON, or lacks a key, is an error naming the file and line.

Outputs are written under temporary names and renamed at the end: an interrupted run never leaves
a half-written dataset behind.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

from megatron_ext.data.tokenizer import BPETokenizer, tokenizer_path_for, train_bpe

logger = logging.getLogger(__name__)


class InputError(ValueError):
    """Unreadable or malformed input; the message names the file (and line)."""


def json_lines(path: str) -> Iterator[tuple[int, str, Any]]:
    """(line number, line, its JSON value) of each non-blank line of a JSONL file (``.gz`` read
    through gzip); a line that is not JSON is an InputError naming file and line."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, line, json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None


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
            for lineno, _line, record in json_lines(path):
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


# --- Megatron-LM's tools/preprocess_data.py ---------------------------------------------------------

_WORKER_TOKENIZER: Any = None


def _start_worker(tokenizer_section: Any) -> None:
    global _WORKER_TOKENIZER
    from megatron_ext.data.tokenizer_types import build_tokenizer

    _WORKER_TOKENIZER = build_tokenizer(tokenizer_section)


def encode_record(record: dict[str, Any], keys: tuple[str, ...], tokenizer: Any, append_eod: bool
                  ) -> dict[str, tuple[list[int], list[int]]]:
    """(token ids, sentence lengths) of each key's document, as Megatron-LM's ``Encoder.encode``:
    a list value is the document's sentences, an empty sentence adds nothing, the end-of-document
    token closes a non-empty document (and lengthens its last sentence)."""
    out = {}
    for key in keys:
        text = record[key]
        ids: list[int] = []
        lengths: list[int] = []
        for sentence in text if isinstance(text, list) else [text]:
            sentence_ids = tokenizer.tokenize(sentence)
            if len(sentence_ids) > 0:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        out[key] = (ids, lengths)
    return out


def _encode_line(job: tuple[str, tuple[str, ...], bool]) -> dict[str, tuple[list[int], list[int]]]:
    line, keys, append_eod = job
    return encode_record(json.loads(line), keys, _WORKER_TOKENIZER, append_eod)


def _jsonl_records(paths: list[str], keys: tuple[str, ...]) -> Iterator[str]:
    """The lines of the JSONL inputs (``.gz`` read through gzip), each checked to be a JSON object
    holding every key with a string or a list of strings; blank lines are skipped."""
    for path in paths:
        if not os.path.isfile(path):
            raise InputError(f"input {path} does not exist")
        for lineno, line, record in json_lines(path):
            missing = [k for k in keys if not isinstance(record, dict) or k not in record]
            if missing:
                raise InputError(f"{path}:{lineno}: no '{missing[0]}' field (set --json-keys)")
            for k in keys:
                value = record[k]
                if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
                    raise InputError(f"{path}:{lineno}: field '{k}' is neither a string nor a list of strings")
            yield line


def megatron_output_prefix(output_prefix: str, key: str) -> str:
    """Where Megatron-LM's tool writes ``key``'s documents: ``<prefix>_<key>_document``."""
    return f"{output_prefix}_{key}_document"


def megatron_preprocess(inputs: list[str], output_prefix: str, tokenizer_section: Any, *,
                        json_keys: tuple[str, ...] = ("text",), append_eod: bool = False, workers: int = 1,
                        log_interval: int = 1000) -> dict[str, dict[str, int]]:
    """Megatron-LM's preprocessing (module doc); returns per key its output prefix's counts."""
    from megatron.core.datasets.indexed_dataset import DType

    from megatron_ext.data.tokenizer_types import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_section)
    keys = tuple(json_keys)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {k: megatron_output_prefix(output_prefix, k) for k in keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = {k: IndexedDatasetBuilder(get_bin_path(p + ".tmp"), dtype=dtype) for k, p in prefixes.items()}
    counts = {k: {"documents": 0, "tokens": 0, "vocab_size": tokenizer.vocab_size} for k in keys}
    jobs = ((line, keys, append_eod) for line in _jsonl_records(inputs, keys))
    pool = None
    try:
        if workers > 1:
            import multiprocessing

            pool = multiprocessing.Pool(workers, initializer=_start_worker, initargs=(tokenizer_section,))
            encoded = pool.imap(_encode_line, jobs, 32)
        else:
            encoded = (encode_record(json.loads(line), k, tokenizer, eod) for line, k, eod in jobs)
        for n, doc in enumerate(encoded, 1):
            for key, (ids, lengths) in doc.items():
                builders[key].add_document(ids, lengths)
                counts[key]["documents"] += 1
                counts[key]["tokens"] += len(ids)
            if n % log_interval == 0:
                logger.info("processed %d documents", n)
        for key, builder in builders.items():
            builder.finalize(get_idx_path(prefixes[key] + ".tmp"))
    except BaseException:
        for key, p in prefixes.items():
            builders[key].data_file.close()
            for path in (get_bin_path(p + ".tmp"), get_idx_path(p + ".tmp")):
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    if not any(c["documents"] for c in counts.values()):
        for p in prefixes.values():
            os.remove(get_bin_path(p + ".tmp"))
            os.remove(get_idx_path(p + ".tmp"))
        raise InputError("no documents found in the input")
    for p in prefixes.values():   # the .idx last: a reader checks for it
        os.replace(get_bin_path(p + ".tmp"), get_bin_path(p))
        os.replace(get_idx_path(p + ".tmp"), get_idx_path(p))
        logger.info("wrote %s.{bin,idx}", p)
    return {prefixes[k]: counts[k] for k in keys}
