"""Static input buffers of the decode CUDA graphs and the one-copy-per-step fill.

A decode step's host work before a graph replay is filling these buffers; it is kept O(batch) numpy work
plus one host-to-device copy (and one ``index_copy_`` when block tables changed), as vLLM's persistent
input batch does (``vllm/v1/worker/gpu_input_batch.py``: host mirrors, one copy per step). PyTorch's
CUDA Graphs notes (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs) explain why the buffers
must be static: a graph reads fixed addresses, so each step writes new inputs into the same tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata

PAD_SLOT = -1  # slot_mapping value of a padding row: store_kv writes nothing for it


class _Stage:
    """numpy views of one host staging buffer (byte layout: see ``StaticDecodeInputs``)."""

    def __init__(self, buf: torch.Tensor, max_batch: int, width: int) -> None:
        b = max_batch
        raw = buf.numpy()
        i64 = raw[: 32 * b].view(np.int64)
        self.buf = buf
        self.ids, self.pos = i64[:b], i64[b : 2 * b]
        self.slots, self.row_index = i64[2 * b : 3 * b], i64[3 * b :]
        self.lens = raw[32 * b : 36 * b].view(np.int32)
        self.rows = raw[36 * b :].view(np.int32).reshape(b, width)


class StaticDecodeInputs:
    """The static device buffers of decode graphs (shared by every bucket: bucket ``B`` uses rows ``[:B]``).

    One step's inputs travel in ONE host-to-device copy: a byte buffer (pinned on CUDA) laid out as int64
    ``input_ids | position_ids | slot_mapping | changed-row index`` (``[max_batch]`` each), int32
    ``seq_lens [max_batch]``, then int32 rows ``[k, max_blocks_per_seq]`` of the block tables that
    changed; its device twin is the same layout, and ``input_ids`` .. ``seq_lens`` are views of it. The
    changed rows then land in ``block_tables`` with one ``index_copy_``. A row is changed when its
    sequence's ``block_table`` is another list, or the same list grown (tables only grow by appending
    while held; ``BlockManager.free`` replaces the list), tracked per row with a host mirror. On CUDA two
    staging buffers alternate, each reused only after the CUDA event of its previous copy completed.

    Args:
        max_batch: rows (the largest bucket).
        max_blocks_per_seq: block-table width, ``ceil(max_model_len / block_size)``.
        block_size: tokens per block.
        max_model_len: tokens per sequence; every graph's ``AttentionMetadata.max_seq_len``.
        device: where the buffers live.
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device) -> None:
        self.max_batch, self.max_blocks_per_seq = max_batch, max_blocks_per_seq
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        b, w, cuda = max_batch, max_blocks_per_seq, device.type == "cuda"
        self._header_bytes = 36 * b
        nbytes = self._header_bytes + 4 * b * w
        self._stages = [_Stage(torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda), b, w)
                        for _ in range(2 if cuda else 1)]
        self._events = [torch.cuda.Event() if cuda else None for _ in self._stages]
        self._recorded = [False for _ in self._stages]
        self._turn = 0
        self._bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        i64 = self._bytes[: 32 * b].view(torch.int64)
        self.input_ids, self.position_ids = i64[:b], i64[b : 2 * b]
        self.slot_mapping, self._row_index = i64[2 * b : 3 * b], i64[3 * b :]
        self.seq_lens = self._bytes[32 * b : 36 * b].view(torch.int32)
        self._rows = self._bytes[36 * b :].view(torch.int32).view(b, w)
        self.slot_mapping.fill_(PAD_SLOT)
        self.seq_lens.fill_(1)
        self.block_tables = torch.zeros((b, w), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._mirror = np.zeros((b, w), dtype=np.int64)  # host copy of block_tables
        self._arange = np.arange(b)
        self._keys: list[tuple[list[int], int] | None] = [None] * b  # per row: (table list, length)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """``AttentionMetadata`` over rows ``[:bucket]`` (views of the static buffers; all decodes)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            num_decodes=bucket,
            num_decode_tokens=bucket,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def fill(self, token_ids: Sequence[int], positions: Sequence[int],
             block_tables: Sequence[list[int]], bucket: int) -> None:
        """Copy one decode step into rows ``[:bucket]``: real rows first, padding rows after them.

        Args:
            token_ids: per sequence, the token to run (``n`` entries, ``n <= bucket``).
            positions: per sequence, that token's position (= its ``num_computed_tokens``).
            block_tables: per sequence, its block ids (the ``Sequence.block_table`` list itself, so an
                unchanged table is recognised and not re-sent); must cover ``position + 1`` tokens.
            bucket: the graph's batch size.

        Padding rows get token 0, position 0, slot ``PAD_SLOT`` and ``seq_len`` 1. Columns of
        ``block_tables`` past a row's length keep stale ids: the kernel never reads past ``seq_lens``.
        On CUDA the copy is asynchronous (pinned memory); the host waits only for the copy made two
        fills ago from the same staging buffer.

        Raises:
            ValueError: mismatched lengths, ``n`` outside ``[1, bucket]``, ``bucket`` over ``max_batch``,
                a position outside ``[0, max_model_len)``, or a block table too short or too wide.
                Nothing is changed then.
        """
        n = len(token_ids)
        pos = self._check(n, positions, block_tables, bucket)
        stage = self._next_stage()
        changed = self._update_mirror(block_tables)
        k = len(changed)
        if k:
            stage.row_index[:k] = changed
            stage.rows[:k] = self._mirror[changed]
        stage.ids[:n] = token_ids
        stage.pos[:n] = pos
        blk, offset = np.divmod(pos, self.block_size)
        slots = stage.slots[:n]
        np.multiply(self._mirror[self._arange[:n], blk], self.block_size, out=slots)
        slots += offset
        stage.lens[:n] = pos + 1
        if n < bucket:
            stage.ids[n:bucket] = stage.pos[n:bucket] = 0
            stage.slots[n:bucket], stage.lens[n:bucket] = PAD_SLOT, 1
        nbytes = self._header_bytes + 4 * k * self.max_blocks_per_seq
        self._bytes[:nbytes].copy_(stage.buf[:nbytes], non_blocking=True)
        if k:
            self.block_tables.index_copy_(0, self._row_index[:k], self._rows[:k])
        event = self._events[self._turn]
        if event is not None:
            event.record()
            self._recorded[self._turn] = True

    def _next_stage(self) -> _Stage:
        """The staging buffer to write next, once its previous copy is done (CUDA event)."""
        self._turn = (self._turn + 1) % len(self._stages)
        event = self._events[self._turn]
        if event is not None and self._recorded[self._turn]:
            event.synchronize()
        return self._stages[self._turn]

    def _update_mirror(self, tables: Sequence[list[int]]) -> list[int]:
        """Bring the host mirror's rows ``[:len(tables)]`` up to date; returns the rows that changed.

        A row whose table moved from another row (a sequence before it finished) is copied from that
        row's mirror, a grown table gets only its new entries: no row is rebuilt from Python ints unless
        its table is new. On an error every touched row is marked unknown (re-sent next time)."""
        keys, mirror = self._keys, self._mirror
        changed: list[int] = []
        src: list[int] = []  # per changed row: the row whose mirror holds a prefix of its table, or -1
        where: dict[int, int] | None = None
        for i, t in enumerate(tables):
            key = keys[i]
            if key is not None and key[0] is t:
                if key[1] != len(t):
                    changed.append(i)
                    src.append(i)
                continue
            if where is None:
                where = {id(k[0]): j for j, k in enumerate(keys) if k is not None}
            changed.append(i)
            src.append(where.get(id(t), -1))
        valid = [keys[j][1] if j >= 0 else 0 for j in src]  # type: ignore[index]
        try:
            moves = [(i, j) for i, j in zip(changed, src, strict=True) if j >= 0 and j != i]
            if moves:
                mirror[[i for i, _ in moves]] = mirror[[j for _, j in moves]]  # RHS gathered first
            for i, have in zip(changed, valid, strict=True):
                t = tables[i]
                if have < len(t):
                    mirror[i, have : len(t)] = t[have:]
                keys[i] = (t, len(t))
        except BaseException:
            for i in changed:
                keys[i] = None
            raise
        return changed

    def _check(self, n: int, positions: Sequence[int], block_tables: Sequence[Sequence[int]],
               bucket: int) -> np.ndarray:
        """Validate (see ``fill``); returns the positions as int64 ``[n]``."""
        if not 1 <= n <= bucket <= self.max_batch:
            raise ValueError(f"need 1 <= sequences ({n}) <= bucket ({bucket}) <= max_batch "
                             f"({self.max_batch})")
        if len(positions) != n or len(block_tables) != n:
            raise ValueError(f"length mismatch: {n} token_ids, {len(positions)} positions, "
                             f"{len(block_tables)} block_tables")
        pos = np.asarray(positions, dtype=np.int64)
        lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
        bs, width = self.block_size, self.max_blocks_per_seq
        if ((pos < 0) | (pos >= self.max_model_len) | (lens * bs <= pos) | (lens > width)).any():
            bad = np.flatnonzero((pos < 0) | (pos >= self.max_model_len))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"sequence {i}: position {pos[i]} outside [0, max_model_len="
                                 f"{self.max_model_len})")
            i = int(np.flatnonzero((lens * bs <= pos) | (lens > width))[0])
            raise ValueError(f"sequence {i}: block_table of {lens[i]} blocks does not fit position {pos[i]} "
                             f"(block_size {bs}, at most {width} blocks)")
        return pos
