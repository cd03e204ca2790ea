"""Offline generation: ``LLM(model, **config).generate(prompts, sampling_params)``.

All prompts of one ``generate`` call run as one continuous batch through ``EngineCore``; text comes from
the incremental detokenizer of ``engine.text`` (stop strings end a request, their text is not returned).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.engine_core import EngineCore, StepOutput
from engine.models.registry import resolve_model
from engine.prompt_logprobs import PromptTokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputError
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import TextTokenizer, load_tokenizer

Prompt = str | list[int]
Detok = IncrementalDetokenizer | None


@dataclass
class RequestOutput:
    """The result of one prompt.

    ``token_ids``: output tokens (a stop string's tokens included, its text not); ``finish_reason``:
    ``"stop"`` (eos, stop token id or stop string), ``"length"``; ``logprobs[i]`` / ``top_logprobs[i]``:
    raw model logprob of output token ``i`` and its top-N ``(token_id, logprob)`` (None unless requested).
    ``num_cached_tokens``: prompt tokens served from the prefix cache. ``prompt_logprobs`` (with
    ``SamplingParams.prompt_logprobs``): one entry per prompt token, None for the first
    (``engine.prompt_logprobs``).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None


def build_engine_config(model: str, **options: Any) -> EngineConfig:
    """Spread keyword options over ``ModelConfig`` / ``CacheConfig`` / ``SchedulerConfig`` by field name.

    Raises:
        ValueError: an option that is no field of those configs, or a bad value (from the configs).
    """
    groups: dict[type, dict[str, Any]] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {},
                                          ParallelConfig: {}}
    for key, value in options.items():
        owner = next((c for c in groups if key in {f.name for f in dataclasses.fields(c)}), None)
        if owner is None or key == "model":
            known = sorted(f.name for c in groups for f in dataclasses.fields(c) if f.name != "model")
            raise ValueError(f"unknown LLM option {key!r}; known options: {known}")
        groups[owner][key] = value
    return EngineConfig(ModelConfig(model, **groups[ModelConfig]), CacheConfig(**groups[CacheConfig]),
                        SchedulerConfig(**groups[SchedulerConfig]), ParallelConfig(**groups[ParallelConfig]))


class LLM:
    """Offline engine over one model (path or alias, default the embedded ``smollm2-135m``).

    Args:
        model: HF directory or alias.
        options: any field of ``ModelConfig`` (dtype, device, attention_backend, load_format,
            max_model_len, seed), ``CacheConfig`` (block_size, num_blocks, ...), ``SchedulerConfig`` or
            ``ParallelConfig`` (``tensor_parallel_size``: rank 0 here, the other ranks in processes of
            their own until ``close``).

    Raises:
        ValueError / FileNotFoundError: unknown options, bad values, or model loading failures.
    """

    def __init__(self, model: str = "smollm2-135m", **options: Any) -> None:
        self.engine_config = build_engine_config(model, **options)
        self.core = EngineCore(self.engine_config)
        path = resolve_model(model)
        self.tokenizer: TextTokenizer | None = (
            load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
        )
        self._ids = itertools.count()

    def close(self) -> None:
        """End the tensor parallel ranks (``tensor_parallel_size > 1``); no-op otherwise."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: give prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs in prompt order.

        Args:
            prompts: a string, a token id list, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default ``SamplingParams()``).

        Raises:
            ValueError: a per-prompt params list of the wrong length, an empty or too long prompt, token
                ids outside the vocabulary, text prompts without a tokenizer (checked for every prompt
                before any is queued), or a ``structured_output`` that does not compile
                (``StructuredOutputError``, also when a grammar rejects a sampled token); on any error all
                of this call's requests are aborted.
        """
        plist = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(plist))
        token_lists = [self._tokenize(p) for p in plist]
        for i, ids in enumerate(token_lists):
            try:
                self.core.validate_prompt(ids)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, Detok] = {}
        seqs = []
        try:
            for prompt, ids, sp in zip(plist, token_lists, params, strict=True):
                rid = f"llm-{next(self._ids)}"
                seqs.append(self.core.add_request(rid, ids, sp))
                outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                             logprobs=[] if sp.logprobs is not None else None,
                                             top_logprobs=[] if sp.logprobs else None)
                detoks[rid] = (IncrementalDetokenizer(self.tokenizer, ids, sp.stop)
                               if self.tokenizer is not None else None)
            self._run(outputs, detoks)
            for seq in seqs:
                outputs[seq.request_id].num_cached_tokens = seq.num_cached_tokens
        finally:
            for rid in outputs:
                self.core.abort_request(rid)  # no-op for finished requests
        return list(outputs.values())

    def _run(self, outputs: dict[str, RequestOutput], detoks: dict[str, Detok]) -> None:
        while self.core.has_unfinished():
            for step in self.core.step():
                self._apply(step, outputs[step.request_id], detoks[step.request_id])
        for out in outputs.values():
            detok = detoks[out.request_id]
            if detok is not None and not detok.stopped:
                out.text += detok.finish()

    def _apply(self, step: StepOutput, out: RequestOutput, detok: IncrementalDetokenizer | None) -> None:
        if out.finish_reason is not None:
            return
        if step.error is not None:
            raise StructuredOutputError(step.error)
        out.token_ids.append(step.token_id)
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = [None, *step.prompt_logprobs]
        if out.logprobs is not None and step.logprob is not None:
            out.logprobs.append(step.logprob)
        if out.top_logprobs is not None:
            out.top_logprobs.append(step.top_logprobs or [])
        out.finish_reason = step.finish_reason
        if detok is not None:
            out.text += detok.add(step.token_id)
            if detok.stopped and step.finish_reason is None:
                self.core.abort_request(out.request_id)
                out.finish_reason = "stop"


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [list(items)]  # type: ignore[arg-type]
    for i, p in enumerate(items):
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
    return items  # type: ignore[return-value]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts; give one, or one per prompt")
    return plist
