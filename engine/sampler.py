"""Batched token sampling on the model's device, with per-request seeds that reproduce anywhere.

Order of operations per row (all rows at once, no per-request loop over the vocabulary):
0. ``logit_bias``: each listed token's bias added to its raw logit (ids beyond the vocabulary ignored).
1. Penalties on the (biased) logits: ``repetition_penalty`` with Hugging Face semantics over prompt + output
   tokens (``RepetitionPenaltyLogitsProcessor``: a seen token's logit is divided by the penalty when
   positive, multiplied when negative); ``presence_penalty`` / ``frequency_penalty`` with OpenAI semantics
   over output tokens (``logit -= frequency * count + presence * (count > 0)``); ``min_tokens``: eos and
   ``stop_token_ids`` masked while fewer output tokens exist.
   Then the grammar: rows with a ``structured_output`` get ``-inf`` on every token their grammar's bitmask
   (``GrammarMask``, filled on the host by ``engine.structured_output``) does not allow, on the logits'
   device (xgrammar's ``apply_token_bitmask_inplace``: a CUDA/Triton kernel on the GPU, a CPU loop on the
   host; the plain-torch reference is ``masked_by_bitmask``). The grammar wins over ``min_tokens``: a row
   whose grammar allows only the banned eos/stop tokens (its output is complete) is sampled without the ban.
2. Greedy rows (``temperature == 0``) take the argmax. Other rows: divide by temperature, then top-k,
   top-p (smallest set of tokens whose probability mass reaches ``top_p``; the most probable token
   always stays, the only one at ``top_p`` 0), then min-p (drop tokens with
   probability below ``min_p`` × the largest), as in transformers' warpers.
3. Sampling by the Gumbel-max trick (equivalently an exponential race): ``argmax(logit + g)`` with
   ``g = -log(-log(u))``, where ``u`` in (0, 1) comes from a counter-based integer hash of
   ``(seed, output position, token id)``. No RNG state: the same seed gives the same token on any worker,
   CPU or GPU, batched or alone (up to float rounding of the logits themselves).
Every argmax is ``engine.ops.argmax.argmax_rows``: ``torch.argmax``'s answer (lowest index among equal
maxima, NaN first), by a two-pass Triton kernel on a GPU (torch's reduces a row on one thread block).

Logprobs are those of the model's raw distribution: ``log_softmax`` of the logits before penalties,
temperature and filters (vLLM's "raw_logprobs" mode), in float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from engine.host_copy import host_to_device
from engine.ops.argmax import argmax_rows
from engine.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1 (exact in float32)


@dataclass(frozen=True)
class GrammarMask:
    """Token bitmask of one batch: ``bitmask`` int32 ``[B, ceil(V / 32)]`` on the host or already on the
    logits' device (bit ``j % 32`` of word ``j // 32`` set = token ``j`` allowed; rows not in ``rows`` are
    unused), ``rows``: the batch rows that have a grammar (ascending)."""

    bitmask: torch.Tensor
    rows: list[int]


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """In place: ``logits [B, V]`` float32 of ``mask.rows`` get ``-inf`` where ``mask.bitmask`` has a 0
    bit. A host bitmask goes to the logits' device first (pinned memory, asynchronous copy on CUDA); one
    already there (``engine.structured_output.BitmaskBuffers``) is used as is. Token ids at or beyond
    ``32 * bitmask.shape[1]`` are left alone (the bitmask covers the whole logit width).

    Raises:
        ValueError: the bitmask's row count differs from the logits' or it covers fewer than ``V`` ids.
    """
    import xgrammar  # the grammar engine; loaded only by batches with a grammar

    if mask.bitmask.shape[0] != logits.shape[0] or mask.bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask {tuple(mask.bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    bitmask = mask.bitmask
    if bitmask.device != logits.device:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    indices = None if len(mask.rows) == logits.shape[0] else mask.rows  # every row: no index list to copy
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=indices)


def masked_by_bitmask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """Plain-torch reference of ``apply_grammar_mask`` (a new tensor): unpack the bits of each row of
    ``mask.rows`` and fill ``-inf`` where a bit is 0."""
    out = logits.clone()
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32)
    for row in mask.rows:
        words = mask.bitmask[row].to(torch.int32)
        allowed = ((words[:, None] >> bits[None, :]) & 1).reshape(-1)[:vocab].bool()
        out[row] = out[row].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out


class SampleResult(msgspec.Struct, frozen=True):
    """One sampled token: id, its raw logprob (None unless requested) and the raw top-N
    ``(token_id, logprob)`` pairs, best first (None unless ``logprobs >= 1``)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one sampling sequence (one row of the logits).

    ``seed``: the request's seed (a random one is drawn at admission when the request has none);
    ``output_position``: index of the output token being sampled (0 for the first);
    ``eos_token_ids``: the model's eos ids (banned with ``stop_token_ids`` below ``min_tokens``).
    """

    params: SamplingParams
    seed: int
    output_position: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, after Wellons' "hash prospector" lowbias32) on
    int64 tensors. Inputs are masked to 32 bits; both multipliers are < 2**31 so no product overflows
    int64, which keeps the result bit-identical on every device. Returns int64 in [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise ``u [B, V]`` float32 in (0, 1) from ``hash(seed, position, token id)``: the top 24
    bits of the hash, centred in their cell. The open interval matters: the Gumbel noise
    ``-log(-log(u))`` is ``+inf`` at ``u == 1``, and ``-inf + inf`` is NaN, which ``argmax`` picks, so a
    token masked to ``-inf`` (grammar, top-k/top-p, ``min_tokens``) would win. ``2**24 - 0.5`` is not a
    float32 (it rounds to ``2**24``), so the top cell is clamped to the largest float32 below 1.

    Args:
        seeds: int64 ``[B]``, any 64-bit value (taken modulo 2**64 by the caller).
        positions: int64 ``[B]``, output positions.
        vocab_size: V.
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    row = mix32(mix32(lo ^ mix32(hi + 0x9E3779B9)) ^ positions)
    tok = mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x632BE5AB)
    h = mix32(row[:, None] ^ tok[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return u.clamp_(max=_BELOW_ONE)


def _token_counts(ids: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float32 counts of each token id per row (one flat index tensor, no per-row tensor)."""
    flat = host_to_device(list(itertools.chain.from_iterable(ids)), torch.int64, device)
    row = torch.repeat_interleave(torch.arange(len(ids), device=device),
                                  host_to_device([len(r) for r in ids], torch.int64, device),
                                  output_size=int(flat.shape[0]))
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((row, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def _as_int64(seed: int) -> int:
    """``seed`` modulo 2**64 as a two's-complement int64 (so any Python int is a valid seed)."""
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return host_to_device(values, torch.float32, device)[:, None]


def _bias(ps: Sequence[SamplingParams], vocab: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float32: each row's ``logit_bias`` scattered over the vocabulary (0 elsewhere)."""
    pairs = [(i, t, b) for i, p in enumerate(ps) for t, b in p.logit_bias if t < vocab]
    bias = torch.zeros(len(ps), vocab, dtype=torch.float32, device=device)
    if pairs:
        rows, ids, values = zip(*pairs, strict=True)
        index = (host_to_device(list(rows), torch.int64, device),
                 host_to_device(list(ids), torch.int64, device))
        bias.index_put_(index, host_to_device(list(values), torch.float32, device))
    return bias


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits [B, V]`` (float32) with ``logit_bias``, repetition/presence/frequency penalties and
    the ``min_tokens`` eos/stop mask applied (see module docstring). Rows without penalties are unchanged."""
    return ban_stop_tokens(penalized(logits, rows), rows)


def penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits [B, V]`` (float32) with ``logit_bias`` and repetition/presence/frequency penalties applied;
    ``logits`` itself (unmodified) when no row has any."""
    dev, vocab = logits.device, logits.shape[1]
    ps = [r.params for r in rows]
    if any(p.logit_bias for p in ps):
        logits = logits + _bias(ps, vocab, dev)
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = _token_counts([[*r.prompt_token_ids, *r.output_token_ids] for r in rows], vocab, dev) > 0
        pen = _column([p.repetition_penalty for p in ps], dev).expand_as(logits)
        scaled = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(seen, scaled, logits)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in ps):
        counts = _token_counts([r.output_token_ids for r in rows], vocab, dev)
        logits = logits - _column([p.frequency_penalty for p in ps], dev) * counts
        logits = logits - _column([p.presence_penalty for p in ps], dev) * (counts > 0).float()
    return logits


def ban_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits [B, V]`` with the eos ids and ``stop_token_ids`` at ``-inf`` in the rows with fewer than
    ``min_tokens`` outputs (a new tensor); ``logits`` itself when no row has such a ban."""
    dev, vocab = logits.device, logits.shape[1]
    banned = [
        [*r.params.stop_token_ids, *r.eos_token_ids]
        if len(r.output_token_ids) < r.params.min_tokens else []
        for r in rows
    ]
    if any(banned):
        mask = _token_counts([[t for t in b if t < vocab] for b in banned], vocab, dev) > 0
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def apply_filters(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on ``logits [B, V]`` (non-greedy rows); filtered tokens get
    ``-inf``. Returns a new float32 tensor."""
    dev, vocab = logits.device, logits.shape[1]
    ps = [r.params for r in rows]
    logits = logits / _column([p.temperature if p.temperature > 0 else 1.0 for p in ps], dev)
    if any(p.top_k != -1 or p.top_p < 1.0 for p in ps):
        # stable: among equal logits the lowest id ranks first, as the greedy argmax picks it
        srt, idx = logits.sort(dim=-1, descending=True, stable=True)
        top_k = host_to_device([p.top_k if p.top_k > 0 else vocab for p in ps], torch.int64, dev)
        ranks = torch.arange(vocab, device=dev)[None, :]
        srt = srt.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = srt.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # the most probable token always stays: with top_p 0 (the limit of an ever smaller nucleus, which
        # OpenAI's range [0, 1] allows) it is the only one
        outside = (mass_before >= _column([p.top_p for p in ps], dev)) & (ranks > 0)
        srt = srt.masked_fill(outside, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, srt)
    if any(p.min_p > 0.0 for p in ps):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * _column([p.min_p for p in ps], dev)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def is_plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row's token is the plain argmax of its raw logits: greedy, no logprobs, no penalties,
    no ``logit_bias``, no ``structured_output``, and ``min_tokens`` reached (nothing masked). Such rows
    need no ``SamplingRow`` (see ``Sampler.greedy``)."""
    return (params.temperature == 0.0 and params.logprobs is None and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and not params.logit_bias
            and params.structured_output is None and num_output_tokens >= params.min_tokens)


def samples_on_device(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row's token needs nothing the host learns later but its grammar's bitmask: no
    logprobs, no penalties (they read the output so far), no ``logit_bias`` (kept on the plain path) and
    ``min_tokens`` reached, greedy or seeded sampling (the Gumbel noise hashes seed and output position).
    ``Sampler.sample_tokens`` of such rows can run for a step launched before the previous step's token is
    on the host (asynchronous scheduling, engine/async_step.py). A row with a ``structured_output`` is
    such a row too: its bitmask is filled from the previous step's token after the step's forward is
    enqueued and before its sampling (``ModelRunner.launch``)."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.logit_bias
            and num_output_tokens >= params.min_tokens)


class Sampler:
    """Samples one token per row of a logits batch; stateless (the seed lives in each row)."""

    @staticmethod
    def greedy(logits: torch.Tensor) -> list[int]:
        """Argmax token id of each row of ``logits [B, V]`` (any float dtype: the argmax of bf16 logits is
        that of their float32 values): one argmax on the device and one device-to-host copy of ``B``
        int64. For batches whose rows are all ``is_plain_greedy``; equals ``__call__``'s token ids there.

        Raises:
            ValueError: ``logits`` is not 2-D.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits {tuple(logits.shape)} must be [batch, vocab]")
        tokens: list[int] = argmax_rows(logits).tolist()
        return tokens

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 grammar_mask: GrammarMask | None = None) -> list[SampleResult]:
        """Sample ``len(rows)`` tokens.

        Args:
            logits: ``[B, V]`` any float dtype, on the model's device; row ``i`` belongs to ``rows[i]``.
            rows: per-row parameters, seeds, output positions and token histories.
            grammar_mask: the allowed tokens of the rows with a grammar (None: no row has one).

        Returns:
            ``B`` results in row order.

        Raises:
            ValueError: ``logits`` is not 2-D or its row count differs from ``len(rows)``.
        """
        raw = logits.float()
        return self._results(raw, self.sample_tokens(logits, rows, raw, grammar_mask), rows)

    @staticmethod
    def sample_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], raw: torch.Tensor | None = None,
                      grammar_mask: GrammarMask | None = None) -> torch.Tensor:
        """The sampled token ids, int64 ``[B]`` on the device, without waiting for the device (no host
        synchronisation: per-row values go through pinned memory). ``raw``: ``logits.float()`` if the
        caller has it (never modified). Raises ``ValueError`` as ``__call__``."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} must be [len(rows)={len(rows)}, vocab]")
        raw = logits.float() if raw is None else raw
        free = penalized(raw, rows)
        processed = ban_stop_tokens(free, rows)
        if grammar_mask is not None:
            banned = processed is not free  # a new tensor: some row is below its min_tokens
            if processed is raw or processed is logits:
                processed = raw.clone()
            apply_grammar_mask(processed, grammar_mask)
            if banned:
                # The grammar wins over min_tokens: a row left with no allowed token (its grammar allows
                # only the banned eos/stop tokens) takes its grammar-masked logits without the ban.
                free = raw.clone() if free is raw or free is logits else free
                apply_grammar_mask(free, grammar_mask)
                processed = torch.where(torch.isneginf(processed).all(dim=-1, keepdim=True), free, processed)
        tokens = argmax_rows(processed)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            sub = [rows[i] for i in random_rows]
            dev = raw.device
            index = host_to_device(random_rows, torch.int64, dev)
            filtered = apply_filters(processed.index_select(0, index), sub)
            seeds = host_to_device([_as_int64(r.seed) for r in sub], torch.int64, dev)
            pos = host_to_device([r.output_position for r in sub], torch.int64, dev)
            u = seeded_uniform(seeds, pos, raw.shape[1])
            gumbel = -torch.log(-torch.log(u))
            tokens.index_copy_(0, index, argmax_rows(filtered + gumbel))
        return tokens

    @staticmethod
    def _results(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """Attach raw logprobs where requested; one device → host copy per tensor."""
        want = [r.params.logprobs for r in rows]
        token_list: list[int] = tokens.tolist()
        if all(w is None for w in want):
            return [SampleResult(token_id=t) for t in token_list]
        logprobs = raw.log_softmax(dim=-1)
        chosen: list[float] = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_n = max(w or 0 for w in want)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if top_n > 0:
            vals, ids = logprobs.topk(top_n, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out = []
        for i, (t, w) in enumerate(zip(token_list, want, strict=True)):
            if w is None:
                out.append(SampleResult(token_id=t))
                continue
            top = list(zip(top_ids[i][:w], top_vals[i][:w], strict=True)) if w > 0 else None
            out.append(SampleResult(token_id=t, logprob=chosen[i], top_logprobs=top))
        return out
