"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, with its rank
and the top-N alternatives, from the logits a prefill step computes at the prompt's positions.

The logits at position ``p`` predict token ``p + 1``, so a prompt of ``n`` tokens has ``n - 1`` entries
(the first token has no prefix: OpenAI and vLLM report it as null). Values are raw model logprobs
(``log_softmax`` of the logits in float32, before temperature, penalties, ``logit_bias`` or filters:
vLLM's "raw_logprobs" mode, as ``engine.sampler`` reports output logprobs). ``rank`` is the 1-based
rank of the token among the whole vocabulary (1 + the number of tokens with a strictly larger logprob),
as vLLM's ``Logprob.rank``.
"""

from __future__ import annotations

import msgspec
import torch

ROWS_PER_CHUNK = 256  # rows turned into float32 logprobs at once: bounds the [rows, vocab] temporaries


class PromptTokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One prompt token's raw logprob (natural log), its 1-based ``rank`` in the vocabulary and the
    top-N ``(token_id, logprob)`` alternatives, best first (empty when N is 0)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


def prompt_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: int,
                          rows_per_chunk: int = ROWS_PER_CHUNK) -> list[PromptTokenLogprob]:
    """The entry of each row's target token.

    Args:
        logits: ``[P, vocab]`` logits (any float dtype, any device); row ``i`` predicts ``targets[i]``.
        targets: ``[P]`` int64 token ids on the same device.
        num_top: alternatives per entry, 0..vocab.
        rows_per_chunk: rows converted to float32 at once (peak extra memory about
            ``3 * rows_per_chunk * vocab * 4`` bytes).

    Returns:
        ``P`` entries in row order (one device → host copy per chunk and tensor).

    Raises:
        ValueError: ``logits`` and ``targets`` disagree on the number of rows, or ``rows_per_chunk`` < 1.
    """
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"logits has {logits.shape[0]} rows, targets {targets.shape[0]}")
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    out: list[PromptTokenLogprob] = []
    for start in range(0, logits.shape[0], rows_per_chunk):
        chunk = logits[start:start + rows_per_chunk].float().log_softmax(dim=-1)
        wanted = targets[start:start + rows_per_chunk, None]
        chosen = chunk.gather(1, wanted)  # [rows, 1]
        ranks = (chunk > chosen).sum(dim=-1) + 1
        values: list[float] = chosen[:, 0].tolist()
        rank_list: list[int] = ranks.tolist()
        if num_top:
            top_vals, top_ids = chunk.topk(num_top, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), top_vals.tolist(),
                                                                  strict=True)]
        else:
            tops = [[] for _ in values]
        out.extend(PromptTokenLogprob(v, r, t) for v, r, t in zip(values, rank_list, tops, strict=True))
    return out
