"""GPU nodes of one virtual cluster and the placement rules that allocate gang jobs on them.

Free GPUs are tracked per node plus one bitmask of nodes per free-GPU count, so that "the
lowest-numbered node with exactly k free GPUs" is a bit trick instead of a sort: placement runs
once per scheduling attempt and dominates the event loop on busy VCs.

``consolidate`` follows the Helios artifact's consolidate placer decision for decision (including
its tie-breaks), so that ``--helios-compat`` can reuse it:

* ``g <= gpus_per_node``: best fit — the node with the fewest free GPUs that still holds ``g``,
  lowest index among equals;
* ``g`` a multiple of the node size: that many completely free nodes, lowest indices first;
* otherwise: ``g // n`` completely free nodes, then the next node in descending free-GPU order
  (another free node if one is left) must hold the remainder.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

Alloc = list[tuple[int, int]]  # (node index, GPUs on it)


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class NodePool:
    """Nodes x GPUs of one VC. ``place_*`` only choose; :meth:`take` and :meth:`release` apply."""

    __slots__ = ("nodes", "gpus_per_node", "free", "masks", "free_total", "capacity")

    def __init__(self, nodes: int, gpus_per_node: int):
        if nodes < 1 or gpus_per_node < 1:
            raise ValueError(f"a VC needs >= 1 node and >= 1 GPU per node, got {nodes} x {gpus_per_node}")
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.free = [gpus_per_node] * nodes
        self.masks = [0] * (gpus_per_node + 1)
        self.masks[gpus_per_node] = (1 << nodes) - 1
        self.capacity = nodes * gpus_per_node
        self.free_total = self.capacity

    # -- bookkeeping ---------------------------------------------------------------------------
    def _set(self, node: int, value: int) -> None:
        bit = 1 << node
        self.masks[self.free[node]] ^= bit
        self.masks[value] |= bit
        self.free[node] = value

    def take(self, alloc: Alloc) -> None:
        free = self.free
        for node, n in alloc:
            if n > free[node]:
                raise RuntimeError(f"over-allocation: node {node} has {free[node]} free GPUs, asked {n}")
            self._set(node, free[node] - n)
            self.free_total -= n

    def release(self, alloc: Alloc) -> None:
        free, gpn = self.free, self.gpus_per_node
        for node, n in alloc:
            if free[node] + n > gpn:
                raise RuntimeError(f"double release: node {node} would have {free[node] + n} > {gpn} free GPUs")
            self._set(node, free[node] + n)
            self.free_total += n

    def can_take(self, alloc: Alloc) -> bool:
        free = self.free
        return all(free[node] >= n for node, n in alloc)

    def min_nodes(self, gpus: int) -> int:
        return -(-gpus // self.gpus_per_node)

    # -- placement rules -----------------------------------------------------------------------
    def place(self, gpus: int, rule: str) -> Alloc | None:
        if rule == "consolidate":
            return self.place_consolidate(gpus)
        if rule == "consolidate_first":
            alloc = self.place_consolidate(gpus)
            return alloc if alloc is not None else self.place_pack(gpus)
        if rule == "scatter":
            return self.place_scatter(gpus)
        raise ValueError(f"unknown placement {rule!r}")

    def place_consolidate(self, gpus: int) -> Alloc | None:
        if gpus > self.free_total:
            return None
        gpn, masks = self.gpus_per_node, self.masks
        if gpus <= gpn:
            for k in range(gpus, gpn + 1):
                if masks[k]:
                    return [(_lowest(masks[k]), gpus)]
            return None
        full_nodes, rest = divmod(gpus, gpn)
        full = masks[gpn]
        if full.bit_count() < full_nodes:
            return None
        alloc = []
        for _ in range(full_nodes):
            node = _lowest(full)
            full &= full - 1
            alloc.append((node, gpn))
        if rest:
            if full:  # another completely free node comes next in descending free order
                alloc.append((_lowest(full), rest))
                return alloc
            for k in range(gpn - 1, 0, -1):
                if masks[k]:
                    if k < rest:
                        return None
                    alloc.append((_lowest(masks[k]), rest))
                    return alloc
            return None
        return alloc

    def place_pack(self, gpus: int) -> Alloc | None:
        """Fewest nodes: fill the nodes with the most free GPUs first (lowest index among equals)."""
        if gpus > self.free_total:
            return None
        alloc, need, masks = [], gpus, self.masks
        for k in range(self.gpus_per_node, 0, -1):
            mask = masks[k]
            while mask and need:
                node = _lowest(mask)
                mask &= mask - 1
                take = min(k, need)
                alloc.append((node, take))
                need -= take
            if not need:
                return alloc
        return None

    def place_scatter(self, gpus: int) -> Alloc | None:
        """Spread: one GPU at a time from the node with the most free GPUs (water filling)."""
        if gpus > self.free_total:
            return None
        left = list(self.free)
        got = [0] * self.nodes
        order = sorted(range(self.nodes), key=lambda i: -left[i])
        need = gpus
        while need:
            progressed = False
            for node in order:
                if left[node] and need:
                    left[node] -= 1
                    got[node] += 1
                    need -= 1
                    progressed = True
            if not progressed:  # cannot happen: gpus <= free_total
                return None
        return [(node, n) for node, n in enumerate(got) if n]
