"""Megatron-LM's ``--data-path`` and ``--split``, read as Megatron-LM reads them.

A data path is one prefix, ``WEIGHT PREFIX WEIGHT PREFIX ...`` (a blend: each prefix is drawn in
proportion to its weight) or ``PREFIX PREFIX ...`` (weighted by their sizes). Megatron-LM hands
the list to megatron-core's ``get_blend_from_list``, which silently reads a list whose weights do
not all parse as a list of prefixes (``0.3 a 0,7 b`` becomes four prefixes) and then fails on a
missing file, or asserts; here such a list is refused naming the item, before anything is built.
The prefixes and weights handed to megatron-core are ``get_blend_from_list``'s own.

``--split`` is read with megatron-core's ``parse_and_normalize_split``: the numbers in the text,
whatever separates them (``969,30,1``, ``99/1/0``, and ``'99,1,0'`` with the quotes a shell script
leaves in when it expands a quoted array element).

Pure: no torch, no process groups.
"""
from __future__ import annotations

import dataclasses
import math
import re

DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's split when ``--data-path`` is given without ``--split``."""

SPLIT_NAMES = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True)
class Blend:
    """A blend as megatron-core's ``BlendedMegatronDatasetConfig`` takes it: prefixes and, unless
    they are weighted by their sizes, one weight per prefix (not normalised)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None

    def as_megatron(self) -> tuple[list[str], list[float] | None]:
        return list(self.prefixes), None if self.weights is None else list(self.weights)

    def describe(self) -> str:
        if self.weights is None:
            return " ".join(self.prefixes)
        return " ".join(f"{w:g} {p}" for w, p in zip(self.weights, self.prefixes))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(items: list[str] | tuple[str, ...], flag: str = "--data-path") -> Blend:
    """The blend of ``items`` (a flag's values); ValueError naming the item when it is neither a
    list of prefixes nor WEIGHT PREFIX pairs whose weights all parse as non-negative numbers."""
    items = [str(i) for i in items]
    if not items or any(not i.strip() for i in items):
        raise ValueError(f"{flag} needs a prefix, or WEIGHT PREFIX pairs")
    from megatron.core.datasets.utils import get_blend_from_list

    numbers = [_number(i) for i in items]
    if len(items) % 2 == 0 and len(items) > 1:
        weights = numbers[0::2]
        if all(w is not None for w in weights):
            bad = [(i, items[2 * i + 1]) for i in range(len(weights)) if numbers[2 * i + 1] is not None]
            if bad:
                raise ValueError(f"{flag} {' '.join(items)}: '{bad[0][1]}' stands where a prefix belongs "
                                 "(a blend is WEIGHT PREFIX pairs)")
            negative = [items[2 * i] for i, w in enumerate(weights) if not (math.isfinite(w) and w >= 0)]
            if negative:
                raise ValueError(f"{flag} {' '.join(items)}: weight {negative[0]} is not a finite number >= 0")
            if sum(weights) <= 0:
                raise ValueError(f"{flag} {' '.join(items)}: the weights sum to 0")
        elif any(w is not None for w in weights) or any(n is not None for n in numbers[1::2]):
            # Some weight places hold numbers and some do not: a weight that does not parse.
            at = next(k for k, w in enumerate(weights) if w is None)
            raise ValueError(f"{flag} {' '.join(items)}: weight '{items[2 * at]}' (item {2 * at + 1}) is not "
                             "a number; a blend is WEIGHT PREFIX pairs, e.g. 0.3 corpusA 0.7 corpusB")
    elif any(n is not None for n in numbers) and len(items) > 1:
        first = next(i for i, n in zip(items, numbers) if n is not None)
        raise ValueError(f"{flag} {' '.join(items)}: an odd number of items with a number among them "
                         f"('{first}'): a blend is WEIGHT PREFIX pairs, a list of prefixes holds no weights")
    prefixes, weights = get_blend_from_list(items)
    return Blend(tuple(prefixes), None if weights is None else tuple(float(w) for w in weights))


def parse_split(text: str) -> list[float]:
    """``--split`` normalised to three fractions, as megatron-core reads it; ValueError when the
    text holds no number, more than three, or only zeros."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    found = re.findall(r"[.0-9]+", str(text))
    if not found or len(found) > 3:
        raise ValueError(f"--split {text!r}: give up to three proportions train,valid,test such as 969,30,1")
    try:
        values = [float(v) for v in found]
    except ValueError:
        raise ValueError(f"--split {text!r}: {', '.join(found)} are not all numbers") from None
    if sum(values) <= 0:
        raise ValueError(f"--split {text!r}: the proportions sum to 0")
    return parse_and_normalize_split(str(text))


def empty_splits(split: str, sequences: dict[str, int]) -> list[list[str]]:
    """For each of train, valid and test, the prefixes whose share of it under ``split`` holds no
    sequence, counted as megatron-core's builder cuts a prefix (``round(bound x sequences)``); a
    split ``split`` gives no share is empty of nothing. megatron-core's GPTDataset never finishes
    building a split that was asked for samples and holds no tokens, so such a split is dropped
    (valid, test) or refused (train) before it is built."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    out: list[list[str]] = []
    for bounds in convert_split_vector_to_split_matrix(parse_split(split)):
        out.append([] if bounds is None else
                   [p for p, n in sequences.items() if int(round(bounds[1] * n)) - int(round(bounds[0] * n)) == 0])
    return out
