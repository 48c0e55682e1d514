#!/usr/bin/env python
"""Turn text files or JSONL into a megatron-core indexed dataset (.bin/.idx) for pretrain_gpt.py.

    python tools/preprocess_data.py --input corpus/ data.jsonl --output-prefix data/mycorpus \
        [--tokenizer-file tok.json | --vocab-size 8192] [--json-key text]

Each file (or JSONL line) is one document, ending with the end-of-document token. Without
--tokenizer-file a byte-level BPE is trained on the input. The tokenizer is saved as
<prefix>.tokenizer.json, where pretrain_gpt.py finds it.
"""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="Text files, directories or .jsonl files.")
    parser.add_argument("--output-prefix", required=True, help="Writes <prefix>.bin, .idx and .tokenizer.json.")
    parser.add_argument("--tokenizer-file", default=None, help="Existing tokenizers JSON (else train a BPE).")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size when training.")
    parser.add_argument("--json-key", default="text", help="Field of each JSONL record holding the text.")
    parser.add_argument("--max-bytes", type=int, default=None, help="Stop after this many bytes of text.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_ext.data.preprocess import InputError, preprocess

    try:
        stats = preprocess(args.input, args.output_prefix, tokenizer_file=args.tokenizer_file,
                           vocab_size=args.vocab_size, json_key=args.json_key, max_bytes=args.max_bytes)
    except (InputError, FileNotFoundError, ValueError) as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output_prefix}: {stats['documents']} documents, {stats['tokens']} tokens, "
          f"vocabulary {stats['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
