"""Tensor parallelism on the CPU (gloo): greedy tokens of two ranks equal one rank's and transformers' for
tiny random Llama (KV heads split, a vocabulary the ranks split unevenly) and Qwen3 (one KV head,
replicated on both ranks) in fp32, logprobs within 1e-4, in one continuous batch and again with prefix-cache
hits, then a dead rank fails the next step; the distributed path forced at one rank equals the plain one;
the shard layout, the refusals and the step message."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.distributed import TensorParallel
from engine.llm import LLM
from engine.model_runner import ModelRunner
from engine.models.tensor_parallel import (
    ShardSpec,
    check_tensor_parallel,
    load_sharded_model,
    local_config,
    shard_spec,
)
from engine.sampling_params import SamplingParams
from engine.step_batch import StepBatch
from tests.engine.test_hf_parity import assert_matches_hf, make_prompts
from tests.engine.test_loader import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
OPTIONS = dict(dtype="float32", device="cpu", attention_backend="torch", block_size=4, num_blocks=256)


def _save(arch: str, path: Path, vocab: int, kv_heads: int) -> torch.nn.Module:
    """A random tiny ``arch`` (4 query heads of 16, ``kv_heads`` KV heads) saved at ``path``; its HF model."""
    cfg = tiny_config(arch, vocab=vocab)
    cfg.num_key_value_heads = kv_heads
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize(("arch", "vocab", "kv_heads"), [("LlamaForCausalLM", 253, 2),
                                                          ("Qwen3ForCausalLM", 256, 1)])
def test_two_ranks_match_one_rank_and_hf(arch, vocab, kv_heads, tmp_path):
    model = _save(arch, tmp_path / "m", vocab, kv_heads)
    prompts = make_prompts(vocab=vocab)[::2]  # 11 prompts, three of them sharing a 13-token prefix
    single = LLM(str(tmp_path / "m"), **OPTIONS).generate(prompts, GREEDY)
    with LLM(str(tmp_path / "m"), tensor_parallel_size=2, timeout_s=120, **OPTIONS) as llm:
        runner = llm.core.runner
        assert runner.tp.size == 2 and runner.kv_cache.num_kv_heads == max(kv_heads // 2, 1)
        assert runner.model.model.embed_tokens.weight.shape[0] == (vocab + 1) // 2
        first = llm.generate(prompts, GREEDY)
        second = llm.generate(prompts[::-1], GREEDY)  # every full block a prefix-cache hit
        llm.core.check_no_leaks()
        _dead_rank_fails_the_next_step(llm)
    for i, (one, two) in enumerate(zip(single, first, strict=True)):
        assert two.token_ids == one.token_ids, f"prompt {i}"
        torch.testing.assert_close(torch.tensor(two.logprobs), torch.tensor(one.logprobs), atol=1e-4, rtol=0)
    assert_matches_hf(model, prompts, first, eos=2, max_tokens=GREEDY.max_tokens)
    assert [o.token_ids for o in second] == [o.token_ids for o in first[::-1]]
    assert sum(o.num_cached_tokens for o in second) >= sum(len(p) // 4 * 4 - 4 for p in prompts if len(p) > 4)


def test_forced_distributed_at_one_rank_equals_plain(tmp_path):
    """The tensor-parallel forward with its collectives (gloo, world size 1) gives the plain path's
    tokens and logprobs (the H200 NCCL check runs the same comparison: bench/tp_world1.py)."""
    _save("LlamaForCausalLM", tmp_path / "m", 256, 2)
    prompts = make_prompts()[::3]
    plain = LLM(str(tmp_path / "m"), **OPTIONS).generate(prompts, GREEDY)
    with LLM(str(tmp_path / "m"), force_distributed=True, timeout_s=60, **OPTIONS) as llm:
        assert llm.core.runner.tp.distributed and llm.core.ranks is not None
        forced = llm.generate(prompts, GREEDY)
        llm.core.check_no_leaks()
    assert [o.token_ids for o in forced] == [o.token_ids for o in plain]
    for a, b in zip(forced, plain, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def _dead_rank_fails_the_next_step(llm: LLM) -> None:
    ranks = llm.core.ranks
    assert ranks is not None
    ranks.followers[0].kill()
    ranks.followers[0].join(10)
    assert ranks.dead_followers()
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (gloo reports a lost peer as RuntimeError or DistError)
        llm.generate([[5, 6, 7, 8]], GREEDY)
    assert time.monotonic() - start < 30


def test_shard_layout_split_replicated_and_padded():
    cfg = tiny_config("LlamaForCausalLM", vocab=253)  # 4 heads, 2 KV heads, head_dim 16, width 128
    r1 = TensorParallel(rank=1, size=2)
    assert shard_spec("model.layers.0.self_attn.q_proj.weight", cfg, r1) == ShardSpec(0, 32, 32, 64)
    assert shard_spec("model.layers.0.self_attn.k_proj.weight", cfg, r1) == ShardSpec(0, 16, 16, 32)
    assert shard_spec("model.layers.0.self_attn.o_proj.weight", cfg, r1) == ShardSpec(1, 32, 32, 64)
    assert shard_spec("model.layers.0.self_attn.o_proj.bias", cfg, r1) is None  # added after the sum
    assert shard_spec("model.layers.0.mlp.up_proj.weight", cfg, r1) == ShardSpec(0, 64, 64, 128)
    assert shard_spec("model.layers.0.mlp.down_proj.weight", cfg, r1) == ShardSpec(1, 64, 64, 128)
    assert shard_spec("lm_head.weight", cfg, r1) == ShardSpec(0, 127, 127, 253)  # 1 padding row
    assert shard_spec("model.norm.weight", cfg, r1) is None
    r3 = TensorParallel(rank=3, size=4)  # 2 KV heads on 4 ranks: ranks 2 and 3 share KV head 1
    assert shard_spec("model.layers.0.self_attn.v_proj.weight", cfg, r3) == ShardSpec(0, 16, 16, 32)
    local = local_config(cfg, 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim, local.intermediate_size,
            local.vocab_size) == (1, 1, 16, 32, 64)


def test_rank_reads_its_slices_tied_embeddings_and_biases(tmp_path):
    """Rank 1 of 2 of a Qwen2 (q/k/v biases) with tied embeddings and an odd vocabulary: every tensor is
    the rank's slice of the checkpoint's, the LM head is the embedding's tensor, the padding row zero."""
    cfg = tiny_config("Qwen2ForCausalLM", vocab=251)
    cfg.tie_word_embeddings = True
    torch.manual_seed(3)
    full = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    full.save_pretrained(tmp_path / "m")
    local, whole = load_sharded_model(ModelConfig(str(tmp_path / "m"), dtype="float32", device="cpu"),
                                      TensorParallel(rank=1, size=2), torch.device("cpu"))
    assert whole.vocab_size == 251 and local.config.vocab_size == 126
    want = full.state_dict()
    attn, mlp = local.model.layers[1].self_attn, local.model.layers[1].mlp
    torch.testing.assert_close(attn.q_proj.bias, want["model.layers.1.self_attn.q_proj.bias"][32:64])
    torch.testing.assert_close(attn.k_proj.weight, want["model.layers.1.self_attn.k_proj.weight"][16:32])
    torch.testing.assert_close(attn.o_proj.weight, want["model.layers.1.self_attn.o_proj.weight"][:, 32:64])
    torch.testing.assert_close(mlp.down_proj.weight, want["model.layers.1.mlp.down_proj.weight"][:, 64:])
    emb = local.model.embed_tokens.weight
    assert local.lm_head.weight is emb
    torch.testing.assert_close(emb[:125], want["model.embed_tokens.weight"][126:])
    assert not emb[125].any()


def test_rank_refuses_a_tensor_with_no_place_and_skips_mtp_layers(tmp_path, caplog):
    """A sharded load refuses a checkpoint tensor the model has no place for (named, before any is read)
    and skips a declared multi-token-prediction layer's tensors with one INFO line."""
    _save("LlamaForCausalLM", tmp_path / "m", vocab=256, kv_heads=2)
    weights, config = tmp_path / "m" / "model.safetensors", tmp_path / "m" / "config.json"
    state = load_file(str(weights))
    n = json.loads(config.read_text())["num_hidden_layers"]
    save_file({**state, "model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}, str(weights),
              metadata={"format": "pt"})
    cfg = ModelConfig(str(tmp_path / "m"), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"1 tensors have no place in the model, e\.g\. "
                                         r"\['model\.layers\.0\.mlp\.extra_proj\.weight'\]"):
        load_sharded_model(cfg, TensorParallel(rank=1, size=2), torch.device("cpu"))
    mtp = {f"model.layers.{n}.enorm.weight": torch.ones(64), f"model.layers.{n}.eh_proj.weight":
           torch.ones(64, 128)}
    save_file({**state, **mtp}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.layers\.{n}\.eh_proj\.weight"):  # not declared
        load_sharded_model(cfg, TensorParallel(rank=1, size=2), torch.device("cpu"))
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_nextn_predict_layers": 1}))
    with caplog.at_level("INFO", logger="engine.models"):
        local, _ = load_sharded_model(cfg, TensorParallel(rank=1, size=2), torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert lines == [f"skipped 2 checkpoint tensors of the multi-token-prediction layers [{n}] "
                     "(not part of the decoder)"]
    torch.testing.assert_close(local.model.norm.weight, state["model.norm.weight"])


def test_refusals_name_the_mismatch():
    with pytest.raises(ValueError, match="mixtures of experts"):
        check_tensor_parallel(tiny_config("MixtralForCausalLM"), 2)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tensor_parallel(tiny_config("LlamaForCausalLM"), 3)
    odd = tiny_config("LlamaForCausalLM")
    odd.num_attention_heads, odd.num_key_value_heads = 6, 3
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_tensor_parallel(odd, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(tensor_parallel_size=0)
    config = EngineConfig(ModelConfig("tiny-llama", device="cpu"), CacheConfig(num_blocks=8),
                          SchedulerConfig(), ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but this process is one of 1 ranks"):
        ModelRunner(config)


def test_step_batch_round_trip():
    batch = StepBatch([[7], [1, 2, 3]], [12, 0], [[4, 5], [9]], [True, False])
    again = StepBatch.decode(batch.encode())
    assert again == batch and not again.stop and not again.is_decode_only
    assert StepBatch.decode(StepBatch.stop_message().encode()).stop


class RecordingRankHook:
    """A RankHook that records, at each layer hook call of a step with a rank note, the sum of every
    layer's K at the step's first sequence's last token slot, then that slot's final sums (at the next
    step or close); written as JSON to `path` at close."""

    def __init__(self, path: str, runner: ModelRunner, tp: TensorParallel) -> None:
        self.path, self.runner, self.rank = path, runner, tp.rank
        self.steps: list[dict] = []
        self._slot: tuple[int, int] | None = None

    def _sums(self) -> list[float]:
        assert self._slot is not None
        block, offset = self._slot
        k = self.runner.kv_cache.kv_buffer[:, 0, block, offset]
        return [float(x) for x in k.reshape(k.shape[0], -1).double().sum(dim=1)]

    def _finish(self) -> None:
        if self._slot is not None:
            self.steps[-1]["final"] = self._sums()
            self._slot = None

    def layer_hook_for(self, batch: StepBatch):
        self._finish()
        if not batch.rank_note:
            return None
        last = batch.starts[0] + len(batch.token_ids[0]) - 1
        bs = self.runner.kv_cache.block_size
        self._slot = (batch.block_tables[0][last // bs], last % bs)
        step: dict = {"note": batch.rank_note.decode(), "calls": []}
        self.steps.append(step)
        return lambda layer: step["calls"].append([layer, self._sums()])

    def close(self) -> None:
        import json

        self._finish()
        Path(self.path).write_text(json.dumps({"rank": self.rank, "steps": self.steps}))


def test_rank_hook_streams_each_layer_on_the_other_rank(tmp_path):
    """Rank 1 builds its RankHook over its own runner; a step with a rank note gets its layer hook, called
    once per layer in order, each right after that layer's K/V landed in rank 1's own kv_buffer (the
    layers up to it hold their final values, the later ones not yet); a step without a note gets none;
    the hook is closed when the engine closes."""
    import functools
    import json

    from engine.engine_core import EngineCore

    _save("LlamaForCausalLM", tmp_path / "m", 253, 2)
    model = ModelConfig(str(tmp_path / "m"), dtype="float32", device="cpu", attention_backend="torch")
    config = EngineConfig(model, CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(),
                          ParallelConfig(tensor_parallel_size=2, timeout_s=120))
    out = tmp_path / "rank1.json"
    core = EngineCore(config, rank_hook=functools.partial(RecordingRankHook, str(out)))
    try:
        core.add_request("a", list(range(3, 9)), SamplingParams(temperature=0.0, max_tokens=2))
        rank0: list[int] = []
        for note in (b"prefill-a", b""):
            output = core.scheduler.schedule()
            results = core.runner.execute(output, rank0.append if note else None, rank_note=note)
            core.commit(output, results)
    finally:
        core.close()
    layers = core.runner.kv_cache.kv_buffer.shape[0]
    assert rank0 == list(range(layers))
    record = json.loads(out.read_text())
    assert record["rank"] == 1 and [s["note"] for s in record["steps"]] == ["prefill-a"]
    (step,) = record["steps"]
    assert [layer for layer, _ in step["calls"]] == list(range(layers))
    final = step["final"]
    for layer, sums in step["calls"]:
        assert sums[:layer + 1] == final[:layer + 1]
        assert all(s != f for s, f in zip(sums[layer + 1:], final[layer + 1:], strict=True))


def test_ranks_are_not_started_for_a_model_they_cannot_split(tmp_path, monkeypatch):
    """A new-user trial: a Qwen3-MoE worker with --tensor-parallel-size 2 started its second rank, which
    died with a multiprocessing traceback. ``TensorParallelRanks`` now refuses the model from its config.json
    before starting any rank (the worker's own flag-named refusal: tests/system/test_up_refusals.py)."""
    from engine import tp_executor

    (tmp_path / "config.json").write_text(tiny_config("Qwen3MoeForCausalLM").to_json_string())
    started: list[object] = []
    monkeypatch.setattr(tp_executor.mp, "get_context", lambda kind: started.append(kind))
    config = EngineConfig(ModelConfig(str(tmp_path), device="cpu", load_format="dummy"), CacheConfig(),
                          SchedulerConfig(), ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2: mixtures of experts "
                                         r"\(Qwen3MoeForCausalLM\) are not supported with tensor "
                                         r"parallelism yet; use tensor_parallel_size=1$"):
        tp_executor.TensorParallelRanks(config)
    assert started == []


def test_a_follower_rank_refusal_is_one_line_without_a_traceback(monkeypatch, caplog):
    """A refusal while a follower builds its shard (one rank 0 meets too, e.g. an explicit max_model_len
    beyond the KV cache) ends the rank with one ERROR line and exit code 1, not a traceback."""
    from engine import tp_executor

    class Group:
        closed = False

        def close(self) -> None:
            Group.closed = True

    def refuse(config, tp):
        raise ValueError("--max-model-len 100 exceeds the KV cache's capacity of 64 tokens")

    monkeypatch.setattr(tp_executor, "init_tensor_parallel", lambda *a: Group())
    monkeypatch.setattr(tp_executor, "ModelRunner", refuse)
    config = EngineConfig(ModelConfig("tiny-llama", device="cpu"), CacheConfig(), SchedulerConfig(),
                          ParallelConfig(tensor_parallel_size=2))
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exit_info:
        tp_executor._follower_main(config, 1, "tcp://127.0.0.1:1", threads)
    assert exit_info.value.code == 1 and exit_info.value.__cause__ is None and Group.closed
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "tensor parallel rank 1: cannot start: --max-model-len 100 exceeds the KV cache's capacity "
                  "of 64 tokens")]


def test_a_follower_rank_runs_its_setup_first(monkeypatch, capsys):
    """``rank_setup`` runs before anything else of the rank: with the worker's ``configure_logging`` for
    JSON, the rank's refusal line is one JSON object on stderr (spawned ranks inherit no log set-up)."""
    import functools
    import json

    from engine import tp_executor
    from protocol.logging import configure_logging

    def refuse(config, tp):
        raise ValueError("no room")

    class Group:
        def close(self) -> None:
            pass

    monkeypatch.setattr(tp_executor, "init_tensor_parallel", lambda *a: Group())
    monkeypatch.setattr(tp_executor, "ModelRunner", refuse)
    config = EngineConfig(ModelConfig("tiny-llama", device="cpu"), CacheConfig(), SchedulerConfig(),
                          ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(SystemExit):
        tp_executor._follower_main(config, 1, "tcp://127.0.0.1:1", torch.get_num_threads(),
                                   rank_setup=functools.partial(configure_logging, "info", "json"))
    (line,) = capsys.readouterr().err.splitlines()
    event = json.loads(line)
    assert (event["level"], event["msg"]) == ("error", "tensor parallel rank 1: cannot start: no room")


def test_a_pad_token_id_past_the_ranks_rows_does_not_stop_the_shard(tmp_path):
    """transformers makes ``pad_token_id`` the embedding's padding_idx, which must lie in the rows it builds:
    a rank holds ceil(V / tp) rows, so a Llama with pad_token_id 200 of 256 failed to build its shards
    (rank 0 holds 128 rows). The ranks' configs carry no pad_token_id (serving needs no padding index)."""
    cfg = tiny_config("LlamaForCausalLM")
    cfg.pad_token_id = 200
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    model_config = ModelConfig(str(tmp_path), dtype="float32", device="cpu", load_format="dummy")
    for rank in (0, 1):
        local, whole = load_sharded_model(model_config, TensorParallel(rank=rank, size=2),
                                          torch.device("cpu"))
        assert whole.pad_token_id == 200 and local.config.pad_token_id is None
        assert local.model.embed_tokens.weight.shape[0] == 128


def test_a_follower_rank_draws_no_progress_bar(monkeypatch):
    """Each tensor parallel rank loads its shard through transformers; only rank 0 draws the worker's
    "Loading weights" bar (followers' bars overwrote it on one line)."""
    import transformers.utils.logging as hf_logging

    from engine.tp_executor import _quiet_progress_bars

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    try:
        _quiet_progress_bars()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
