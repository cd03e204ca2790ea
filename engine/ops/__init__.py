"""Triton kernels, each beside its plain-torch reference: ``store_kv``, ``rotary_store_kv`` (RoPE fused with
the store), ``paged_decode_attention``, ``paged_prefill_attention``, and the decoder layer's ``rms_norm``,
``apply_rotary``, ``silu_mul`` and one-row ``gemv`` (import the submodules); ``pdl``: programmatic dependent
launch, which every kernel here supports (``gdc_enter``, ``pdl_kwargs``).

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, the tests on machines without CUDA) this package
first patches one incompatibility between Triton 3.6's interpreter and NumPy >= 2.4: the interpreter
holds scalars as 1-element arrays and converts them with ``int(array)``, which NumPy 2.4 rejects, so any
``for i in range(lo, hi)`` with run-time bounds failed with "only 0-dimensional arrays can be converted
to Python scalars". The patch makes ``tensor.__index__`` read the single element instead. Compiled
(CUDA) Triton is untouched.
"""

from __future__ import annotations

import os


def _patch_interpreter_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pdserve_patched", False):
        return

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pdserve_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_index()
