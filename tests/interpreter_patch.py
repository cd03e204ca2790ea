"""Triton's interpreter patching ``triton.language`` without a full ``inspect.getmembers`` scan per call.

Under the interpreter every kernel launch, and every call of a ``@triton.jit`` helper from inside a kernel
(once per program and per loop iteration that calls it), runs ``_patch_lang``, which runs
``_patch_builtin`` on ``triton.language``, its ``tensor`` class and ``math`` module (and ``core``'s where
a kernel's module names it): an ``inspect.getmembers`` over each (a ``getattr`` of every name, then a
sort), to patch those members that are Triton builtins. In a kernel whose helpers run per program (the
MoE matrix-vector kernels' weight decoding, the PDL wait) that scan took about 40% of the interpreted
kernel's time. ``cache_builtin_names`` gives ``_patch_builtin`` each of those namespaces' builtin names,
listed once before any kernel runs (in ``getmembers``' order): every call patches the same members as
before, in the same order; a namespace not listed falls back to the scan. Only the pytest processes get
it; a process a test starts keeps Triton's own.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_builtin_names() -> None:
    """Replace the interpreter's ``_patch_builtin`` (call before kernels run, while nothing is patched):
    for ``triton.language``, ``triton.language.core``, ``tensor``, ``math`` and ``tensor_descriptor_base``,
    the names whose member is a builtin are listed now; a call patches each of those whose current
    member is a builtin (a member already patched is not a builtin: the same test as the scan's). Raises
    AttributeError where this Triton has no such function."""
    from triton.runtime import interpreter

    tl = interpreter.tl
    is_builtin = tl.core.is_builtin
    patch_attr = interpreter._patch_attr
    interpreter._patch_builtin  # noqa: B018 - fail loudly if Triton renamed what is replaced
    names: dict[int, tuple[Any, tuple[str, ...]]] = {}
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        names[id(pkg)] = (pkg, tuple(name for name, member in inspect.getmembers(pkg) if is_builtin(member)))
    scan = interpreter._patch_builtin

    def _patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        listed = names.get(id(pkg))
        if listed is None or listed[0] is not pkg:
            scan(pkg, builder, scope)
            return
        for name in listed[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin


def lazy_tuple_type_names() -> None:
    """Make ``triton.language.core.tuple_type.name`` computed when read instead of built in ``__init__``.

    The interpreter makes a ``tuple_type`` for every tensor it creates (a tensor's shape is a Triton
    ``tuple`` of ``constexpr``), and its ``__init__`` formats ``name`` (``"[:constexpr_type[16],...]"``)
    from the types, about a tenth of an interpreted kernel's time; the name is only read by ``__str__``
    (the type's equality compares ``types`` and ``fields``, and it has no hash). Read, it is the same
    string, from the same ``fields`` and ``types``. Raises AttributeError where this Triton has no
    ``tuple_type``."""
    from triton.language import core

    cls = core.tuple_type

    def __init__(self: Any, types: Any, fields: Any = None) -> None:
        self.types = types
        self.fields = fields or [""] * len(types)

    def name(self: Any) -> str:
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types, strict=False)]) + "]"

    cls.__init__ = __init__
    cls.name = property(name)


def np_dtypes_listed_once() -> None:
    """Make the interpreter's ``_get_np_dtype`` (the numpy dtype that holds a Triton dtype's values: every
    op the interpreter runs asks it, often several times) look its answer up in a table made once: it
    built the same 18-entry table, each entry a ``np.dtype(...)`` call, on every call (about 5 % of an
    interpreted kernel's time). Same answers for every input, the same KeyError for a dtype not in the
    table. Raises AttributeError where this Triton has no such function."""
    import numpy as np
    from triton.runtime import interpreter

    scan = interpreter._get_np_dtype
    tl = interpreter.tl
    names = ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
             "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8",
             "float8e4b15")
    table = {getattr(tl, name): scan(getattr(tl, name)) for name in names}
    pointer = np.dtype(np.uint64)
    pointer_type, block_type = tl.pointer_type, tl.block_type

    def _get_np_dtype(tt_dtype: Any) -> Any:
        if isinstance(tt_dtype, pointer_type):
            return pointer
        if isinstance(tt_dtype, block_type):
            if isinstance(tt_dtype.element_ty, pointer_type):
                return pointer
            return table[tt_dtype.element_ty]
        return table[tt_dtype]

    interpreter._get_np_dtype = _get_np_dtype


def tensor_shapes_made_once() -> None:
    """Make ``triton.language.core.tensor.__init__`` take a tensor's ``shape`` (a Triton ``tuple`` of
    ``constexpr``) from parts made once per block shape instead of anew for every tensor the interpreter
    creates (about a tenth of an interpreted kernel's time): each tensor still gets a ``tuple`` and a
    ``values`` list of its own, holding ``constexpr`` objects of that shape's dimensions and that shape's
    ``tuple_type``, equal to what ``tuple([constexpr(s) for s in shape])`` makes (a ``constexpr`` and a
    ``tuple_type`` are not changed after they are made). The other attributes as before. Raises
    AttributeError where this Triton's tensor has none of these."""
    import math

    from triton.language import core

    cls, constexpr, triton_tuple, plain_tuple = core.tensor, core.constexpr, core.tuple, tuple
    made: dict[Any, tuple[list[Any], Any]] = {}

    def __init__(self: Any, handle: Any, type: Any) -> None:
        self.handle = handle
        shape = type.shape if type.is_block() else ()
        self.numel = constexpr(math.prod(shape))
        self.type = type
        self.dtype = type.scalar
        # a block type's shape is a Triton tuple of ints (hashed and compared in Python): keyed by its ints
        key = plain_tuple(shape.values) if isinstance(shape, triton_tuple) else shape
        parts = made.get(key)
        if parts is None:
            values = [constexpr(s) for s in shape]
            parts = made[key] = (values, triton_tuple(values).type)
        dims = triton_tuple.__new__(triton_tuple)
        dims.values = list(parts[0])
        dims.type = parts[1]
        self.shape = dims

    cls.__init__ = __init__
