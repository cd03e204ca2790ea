"""Descriptor-list helpers of the NIXL sender transport (nixl.py); no torch, no NIXL import.

`merge_descs` merges descriptor pairs contiguous on both sides before an initialize_xfer (which, unlike
make_prepped_xfer, does not merge them itself: measured on CPU with nixl_cu13 1.5.1, see
docs/benchmarks/). `PreppedRequest` holds the two prep_xfer_dlist handles of one direct request (NIXL
API: prep_xfer_dlist / make_prepped_xfer, nixl_cu13._api.nixl_agent), released exactly once (`release`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

Desc = list[tuple[int, int, int]]  # NIXL descriptor tuples (address, bytes, device)
Entry = tuple[str, int, int, str]  # a peer: (remote agent name, kv_buffer base, device, memory type)


def merge_descs(local: Desc, remote: Desc) -> tuple[Desc, Desc]:
    """Pairs of (address, bytes, device) descriptors with each run of consecutive pairs that are
    contiguous on BOTH sides (same devices) merged into one pair: fewer descriptors, same bytes (each
    costs ~7 µs on an H200 over cuda_ipc). Raises ValueError if the lists differ in length."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local descriptors for {len(remote)} remote ones")
    out_l: Desc = []
    out_r: Desc = []
    for (la, n, ld), (ra, rn, rd) in zip(local, remote, strict=True):
        if out_l:
            pa, pn, pd = out_l[-1]
            qa, qn, qd = out_r[-1]
            if pa + pn == la and qa + qn == ra and pd == ld and qd == rd:
                out_l[-1], out_r[-1] = (pa, pn + n, pd), (qa, qn + rn, qd)
                continue
        out_l.append((la, n, ld))
        out_r.append((ra, rn, rd))
    return out_l, out_r


def part_descs(parts: list[object], entry: Entry, agent: Any) -> tuple[Desc, Desc]:
    """The local and remote descriptor tuples of a write of `parts` (NixlSendTransport.prepare results
    `(entry, local, remote)` and prepare_layers ones `(PreppedRequest, layer)`), concatenated in order.
    Raises ValueError if a part was prepared for another connection than `entry`."""
    local: Desc = []
    remote: Desc = []
    for part in parts:
        head = part[0]  # type: ignore[index]
        if isinstance(head, PreppedRequest):
            layer: int = part[1]  # type: ignore[index]
            owner, loc, rem = head.entry, head.loc[layer], head.rem[layer]
        else:
            owner, loc, rem = part  # type: ignore[misc]
        if owner is not entry:
            raise ValueError("part prepared for another connection")
        local += loc
        remote += rem
    return local, remote


class PreppedRequest:
    """prep_xfer_dlist handles of one direct request: every layer's pieces, layer by layer, in both
    lists at the same indices (layer l at idx[l]); the tuples too, for a post mixing requests."""

    __slots__ = ("entry", "idx", "loc", "local", "released", "rem", "remote")

    def __init__(self, entry: Entry, local: object, remote: object, loc: list[Desc],
                 rem: list[Desc]) -> None:
        self.entry, self.local, self.remote, self.loc, self.rem = entry, local, remote, loc, rem
        starts = [0]
        for layer in loc:
            starts.append(starts[-1] + len(layer))
        self.idx = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
        self.released = False

    def release(self, agent: Any) -> None:
        """Release both descriptor lists (idempotent)."""
        if self.released:
            return
        self.released = True
        for h in (self.local, self.remote):
            with contextlib.suppress(Exception):
                agent.release_dlist_handle(h)
