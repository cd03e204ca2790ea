"""``tl.dot`` under Triton's interpreter with the same bits for a row whatever the tile's row count.

The interpreter computes ``tl.dot`` with ``np.matmul``, and numpy's BLAS (OpenBLAS, which picks its
kernels by CPU) may give one row of a product other bits depending on how many rows the product has: on
an AMD EPYC with OpenBLAS's Haswell kernels, rows 0..M-1 of a ``[64, K] x [K, N]`` float32 product differ
from the same rows computed alone for 20 of 24 (K, N, M) cases tried. A GPU's MMA sums each output's K
products in an order set by the tile's K loop, not by its row count; the tests that compare kernel
variants bit for bit on the CPU (tiles of other row counts, packed GQA heads, a prefix-cache hit's chunks
against a fresh prompt's) rely on that. ``use_einsum_dot`` makes the interpreter's ``tl.dot`` an
``np.einsum`` over C-contiguous copies of its operands, which sums each output over K in one order
whatever the row count (the order can depend on the operands' memory layout, hence the copies): no BLAS.
Only the pytest processes get it; a process a test starts that runs Triton's interpreter keeps
``np.matmul``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def use_einsum_dot() -> None:
    """Replace ``InterpreterBuilder.create_dot`` (Triton's interpreter; call before kernels run): the same
    operands and accumulator dtype as Triton's own (8-bit float operands converted to float16 first), the
    product by ``np.einsum``. Raises ImportError / AttributeError where this Triton has no such builder."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    fp16 = interpreter.tl.float16
    builder = interpreter.InterpreterBuilder
    builder.create_dot  # noqa: B018 - fail loudly if Triton renamed what is replaced

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any,
                   max_num_imprecise_acc: Any) -> Any:
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = convert(a_data, a.dtype, fp16, None).view(np.float16)
            b_data = convert(b_data, b.dtype, fp16, None).view(np.float16)
        product = np.einsum("...mk,...kn->...mn", np.ascontiguousarray(a_data), np.ascontiguousarray(b_data),
                            dtype=d.data.dtype, casting="same_kind")
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
