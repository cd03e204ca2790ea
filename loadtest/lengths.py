"""Length distributions for synthetic prompts and outputs (in tokens, or words for text prompts)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

DistKind = Literal["fixed", "uniform", "normal"]


@dataclass(frozen=True)
class LengthDist:
    """A distribution of lengths (tokens), always sampled as an int >= 1.

    Spec strings (``LengthDist.parse``): ``"fixed:128"`` or ``"128"``; ``"uniform:64,256"`` (inclusive
    bounds); ``"normal:128,32"`` (mean, standard deviation; rounded, clipped to >= 1).
    """

    kind: DistKind
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"length distribution kind must be fixed|uniform|normal, got {self.kind!r}")
        if self.kind == "fixed" and (self.a < 1 or self.a != int(self.a)):
            raise ValueError(f"fixed length must be an integer >= 1, got {self.a:g}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform length bounds need 1 <= low <= high, got {self.a:g}, {self.b:g}")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"normal length needs mean >= 1 and std >= 0, got {self.a:g}, {self.b:g}")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """Parse ``kind:args`` (see class doc). Raises ValueError naming the bad spec."""
        kind, _, args = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        try:
            values = [float(x) for x in args.split(",")]
        except ValueError:
            raise ValueError(f"bad length spec {spec!r}: arguments must be numbers") from None
        wanted = {"fixed": 1, "uniform": 2, "normal": 2}.get(kind)
        if wanted is None or len(values) != wanted:
            raise ValueError(
                f"bad length spec {spec!r}: use fixed:N, uniform:LOW,HIGH or normal:MEAN,STD"
            )
        return cls(kind, values[0], values[1] if wanted == 2 else 0.0)  # type: ignore[arg-type]

    @classmethod
    def parse_flag(cls, flag: str, spec: str) -> LengthDist:
        """``parse(spec)`` for ``flag``: the error names the flag (``--input-len: fixed length must be an
        integer >= 1, got 0``). Raises ValueError."""
        try:
            return cls.parse(spec)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None

    def sample(self, rng: random.Random) -> int:
        """Draw one length (int >= 1) from ``rng``."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))
