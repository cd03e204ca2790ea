"""Routing: choose workers for one request (no torch).

Policy:
* a prompt shorter than ``disagg_threshold`` tokens goes to a live colocated worker when one exists;
* otherwise disaggregated: the prefill worker with the longest cached prefix (``PrefixIndex``: the blocks
  its KV events report first, then those this gateway routed to it and not yet reported) among the least
  loaded (load within ``prefill_slack`` of the minimum), and for it the decode worker chosen the same
  way (its prefix cache holds the blocks whose KV need not be sent; load within ``decode_slack`` of the
  minimum among the decode workers it pairs with; ties: less load, more free blocks), restricted to
  pairs that are compatible (``pairing_mismatch``) and not blocked (``blocked``: a pair whose KV data
  path failed its canary, gateway/canary.py). Gateways fed the same KV events and loads choose the same
  workers for a prefix the workers reported;
* ``max_tokens == 1``: prefill only, no decode worker;
* a deployment with no prefill and no decode workers serves everything colocated;
* prefill or decode missing while colocated workers exist: colocated only with ``allow_local_prefill``
  (counted as a fallback), else ``NoWorkerError`` (→ 503);
* ``exclude``: workers that already failed this request are left out (the orchestrator's retries);
* a colocated worker is chosen as a prefill worker is: the longest cached prefix among the least loaded
  (within ``prefill_slack``), the prompt's blocks then pending on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from gateway.prefix_index import PrefixIndex, PrefixMatch, block_hashes
from gateway.registry import WorkerEntry, WorkerRegistry, pairing_mismatch
from protocol.messages import Role

RouteKind = Literal["disaggregated", "prefill_only", "colocated"]


class NoWorkerError(RuntimeError):
    """No live (compatible) worker can take the request; the message says what is missing."""


@dataclass(frozen=True)
class Route:
    """Where one request goes. ``fallback`` marks colocated serving because prefill/decode were missing.
    ``prefix_blocks``: leading blocks of the prompt the chosen prefill (or colocated) worker reported
    cached (its KV events), of ``prompt_blocks`` full blocks; ``decode_prefix_blocks``:
    those the chosen decode worker reported cached, as many as it can reuse (0 but for disaggregated
    routes)."""

    kind: RouteKind
    prefill: WorkerEntry | None = None
    decode: WorkerEntry | None = None
    colocated: WorkerEntry | None = None
    fallback: bool = False
    prefix_blocks: int = 0
    prompt_blocks: int = 0
    decode_prefix_blocks: int = 0

    def prefix_tokens(self) -> int:
        """``prefix_blocks`` in tokens (the first-token worker's block size; 0 without one)."""
        first = self.prefill if self.kind != "colocated" else self.colocated
        return self.prefix_blocks * first.info.compat.block_size if first is not None else 0


class Router:
    """Chooses workers from ``registry`` and the prefix-cache state in ``prefix_index`` (where it also
    records the blocks of each prompt it sends to a prefill or decode worker as pending). ``blocked(prefill
    id, decode id)`` says why a compatible pair may not be used ("" when it may). ``prefill_slack`` /
    ``decode_slack``: how much more load (``WorkerEntry.load_score``) than the least loaded worker of its
    role a worker may carry and still be chosen for a longer cached prefix."""

    def __init__(self, registry: WorkerRegistry, prefix_index: PrefixIndex, disagg_threshold: int = 0,
                 allow_local_prefill: bool = False, prefill_slack: int = 2,
                 blocked: Callable[[str, str], str] = lambda p, d: "", decode_slack: int = 2) -> None:
        self.registry, self.prefix_index = registry, prefix_index
        self.disagg_threshold, self.allow_local_prefill = disagg_threshold, allow_local_prefill
        self.prefill_slack, self.blocked = prefill_slack, blocked
        self.decode_slack = decode_slack

    def pair_problem(self, prefill: WorkerEntry, decode: WorkerEntry) -> str | None:
        """Why this pair cannot serve (incompatible KV, or a failed data path), or None if it can."""
        mismatch = pairing_mismatch(prefill.info, decode.info)
        if mismatch is not None:
            return mismatch
        blocked = self.blocked(prefill.worker_id, decode.worker_id)
        return f"{prefill.worker_id} / {decode.worker_id}: {blocked}" if blocked else None

    def route(self, prompt_token_ids: list[int], max_tokens: int,
              exclude: frozenset[str] = frozenset()) -> Route:
        """Pick the workers for a prompt (token ids) producing up to ``max_tokens`` tokens, leaving out
        the worker ids in ``exclude``.

        Raises:
            NoWorkerError: nothing can serve it (message names the missing role or the mismatch).
        """
        coloc = [w for w in self.registry.routable("colocated") if w.worker_id not in exclude]
        prefills = [w for w in self.registry.routable("prefill") if w.worker_id not in exclude]
        decodes = [w for w in self.registry.routable("decode") if w.worker_id not in exclude]
        if not coloc and not prefills and not decodes:
            besides = f" besides {', '.join(sorted(exclude))}" if exclude else ""
            raise NoWorkerError(f"no live worker{besides}{self._draining()}")
        if coloc and (len(prompt_token_ids) < self.disagg_threshold or (not prefills and not decodes)):
            return self._colocated(prompt_token_ids, coloc, fallback=False)
        try:
            return self._disaggregated(prompt_token_ids, max_tokens, prefills, decodes)
        except NoWorkerError:
            if coloc and self.allow_local_prefill:
                return self._colocated(prompt_token_ids, coloc, fallback=True)
            raise

    def _draining(self, role: Role | None = None) -> str:
        """`` (<ids> draining: stopping)`` naming the workers (of ``role``) that drain, "" when none does."""
        draining = sorted(w.worker_id for w in self.registry.live(role) if w.load.draining)
        return f" ({', '.join(draining)} draining: stopping)" if draining else ""

    def _colocated(self, prompt: list[int], coloc: list[WorkerEntry], fallback: bool) -> Route:
        chains: dict[int, list[int]] = {}
        best, hit = self._rank(prompt, coloc, chains, self.prefill_slack)[0]
        chain = chains[best.info.compat.block_size]
        self.prefix_index.expect(best.worker_id, chain)
        return Route("colocated", colocated=best, fallback=fallback, prefix_blocks=hit.cached,
                     prompt_blocks=len(chain))

    def _disaggregated(self, prompt: list[int], max_tokens: int, prefills: list[WorkerEntry],
                       decodes: list[WorkerEntry]) -> Route:
        if not prefills:
            raise NoWorkerError(f"no live prefill worker{self._draining('prefill')} (start one, or run the "
                                "gateway with --allow-local-prefill and a colocated worker)")
        chains: dict[int, list[int]] = {}  # block size → the prompt's block hashes
        ranked = self._rank(prompt, prefills, chains, self.prefill_slack)
        if max_tokens <= 1:
            best, hit = ranked[0]
            return self._chosen(Route("prefill_only", prefill=best), hit, chains)
        if not decodes:
            raise NoWorkerError(f"no live decode worker{self._draining('decode')}")
        reasons = []
        for prefill, hit in ranked:
            ok = [d for d in decodes if self.pair_problem(prefill, d) is None]
            if ok:
                decode, decode_hit = self._rank(prompt, ok, chains, self.decode_slack)[0]
                self.prefix_index.expect(decode.worker_id, chains[decode.info.compat.block_size])
                return self._chosen(Route("disaggregated", prefill=prefill, decode=decode,
                                          decode_prefix_blocks=decode_hit.cached), hit, chains)
            reasons += [m for d in decodes if (m := self.pair_problem(prefill, d))]
        raise NoWorkerError("no compatible prefill/decode pair: " + "; ".join(reasons))

    def _rank(self, prompt: list[int], workers: list[WorkerEntry], chains: dict[int, list[int]], slack: int
              ) -> list[tuple[WorkerEntry, PrefixMatch]]:
        """``workers`` (one role) with their usable prefix hits: those within ``slack`` of the least load
        first, then by reported cached prefix, then pending prefix, then load, then more free blocks, then
        worker id (not registration order, which differs between gateways)."""
        floor = min(p.load_score() for p in workers)
        scored = []
        for p in workers:
            size = p.info.compat.block_size
            chain = chains.get(size)
            if chain is None:
                chain = chains[size] = block_hashes(prompt, size)
            hit = _usable(self.prefix_index.match(p.worker_id, chain), len(prompt), size,
                          p.info.compat.prefill_grid)
            near = p.load_score() <= floor + slack
            scored.append((p, hit, near))
        scored.sort(key=lambda s: (not s[2], -s[1].cached, -s[1].pending, s[0].load_score(),
                                   -s[0].load.num_free_blocks, s[0].worker_id))
        return [(p, hit) for p, hit, _ in scored]

    def _chosen(self, route: Route, hit: PrefixMatch, chains: dict[int, list[int]]) -> Route:
        """``route`` with its prefix counts; the prompt's blocks become pending on its prefill worker."""
        assert route.prefill is not None
        chain = chains[route.prefill.info.compat.block_size]
        self.prefix_index.expect(route.prefill.worker_id, chain)
        return replace(route, prefix_blocks=hit.cached, prompt_blocks=len(chain))


def _usable(hit: PrefixMatch, prompt_len: int, block_size: int, prefill_grid: int) -> PrefixMatch:
    """The part of ``hit`` a worker's prefix cache can serve: never the block holding the prompt's last
    token (one token is always computed, for its logits: BlockManager.allocate_prefix), and whole grid
    chunks only on a worker with ``--prefill-grid`` (``prefill_grid`` tokens, a multiple of
    ``block_size``)."""
    limit = max(prompt_len - 1, 0) // block_size
    step = max(prefill_grid // block_size, 1)
    cached, pending = min(hit.cached, limit), min(hit.pending, limit)
    return PrefixMatch(cached - cached % step, pending - pending % step)

