"""The embedded default corpus: the Python standard library's own source files on this machine.

No download: the files ship with every Python. On first use they are tokenized with a BPE trained on
them and cached as an indexed dataset; the cache key covers the file list, sizes and settings, so a
different Python gets its own cache. A file lock makes concurrent ranks (or test processes) build it
once.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sysconfig
from typing import Iterator

from megatron.core.datasets.indexed_dataset import get_idx_path

from megatron_ext.data.preprocess import preprocess
from megatron_ext.data.tokenizer import BPETokenizer, tokenizer_path_for

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_BYTES = 6 * 2**20
_FORMAT = 1
# Generated, vendored or test-only trees: skipped so the corpus is ordinary library code.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
              "ensurepip", "turtledemo", "pydoc_data", "encodings"}


def cache_dir(explicit: str | None = None) -> str:
    path = explicit or os.environ.get("MEGATRON_EXT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_ext")
    os.makedirs(path, exist_ok=True)
    return path


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Sorted stdlib ``.py`` files (relative order is stable across machines with one Python)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                found.append(os.path.join(dirpath, name))
    found.sort(key=lambda p: os.path.relpath(p, root))
    out, total = [], 0
    for path in found:
        size = os.path.getsize(path)
        if size == 0:
            continue
        if total + size > max_bytes:
            break
        out.append(path)
        total += size
    return out


def _key(files: list[str], vocab_size: int) -> str:
    root = sysconfig.get_paths()["stdlib"]
    h = hashlib.sha256(f"v{_FORMAT}:{vocab_size}".encode())
    for path in files:
        h.update(f"{os.path.relpath(path, root)}:{os.path.getsize(path)}\n".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def default_corpus(cache_dir_path: str | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                   max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Prefix of the default corpus's indexed dataset, building it on first use."""
    files = stdlib_files(max_bytes)
    if not files:
        raise RuntimeError("no Python standard-library sources found for the default corpus; "
                           "pass --data-path to a dataset built with tools/preprocess_data.py")
    root = os.path.join(cache_dir(cache_dir_path), "corpus")
    os.makedirs(root, exist_ok=True)
    prefix = os.path.join(root, f"stdlib-{_key(files, vocab_size)}")
    if os.path.exists(get_idx_path(prefix)):
        return prefix
    with _locked(prefix + ".lock"):
        if not os.path.exists(get_idx_path(prefix)):
            logger.info("building the default corpus from %d standard-library files into %s (first use only)",
                        len(files), prefix)
            preprocess(files, prefix, vocab_size=vocab_size)
    return prefix


def load_tokenizer(prefix: str, tokenizer_file: str | None = None) -> BPETokenizer:
    return BPETokenizer(tokenizer_file or tokenizer_path_for(prefix))
