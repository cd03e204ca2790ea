"""Descriptor-list helpers of the NIXL sender transport (nixl.py); no torch, no NIXL import.

`merge_descs` merges descriptor pairs contiguous on both sides before an initialize_xfer (which, unlike
make_prepped_xfer, does not merge them itself: measured on CPU with nixl_cu13 1.5.1, see
docs/benchmarks/kv_transfer-h200.md step 5). `PreppedRequest` holds the two prep_xfer_dlist handles of one
direct request (NIXL API: prep_xfer_dlist / make_prepped_xfer, nixl_cu13._api.nixl_agent).
"""

from __future__ import annotations

import itertools

Desc = list[tuple[int, int, int]]  # NIXL descriptor tuples (address, bytes, device)
Entry = tuple[str, int, int, str]  # a peer: (remote agent name, kv_buffer base, device, memory type)


def merge_descs(local: Desc, remote: Desc) -> tuple[Desc, Desc]:
    """Pairs of (address, bytes, device) descriptors with each run of consecutive pairs that are
    contiguous on BOTH sides (same devices) merged into one pair: fewer descriptors, same bytes (each
    costs ~7 µs on an H200 over cuda_ipc, facts.md). Raises ValueError if the lists differ in length."""
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
