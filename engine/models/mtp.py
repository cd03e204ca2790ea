"""Multi-token-prediction (MTP) layers of a checkpoint: recognised so loaders skip their tensors.

GLM-4.5 and DeepSeek-V3 declare ``num_nextn_predict_layers`` extra layers stored after the
``num_hidden_layers`` decoder layers (``model.layers.{num_hidden_layers + i}.*``). They draft tokens for
speculative decoding, which pdserve does not run, so no loader builds them; the FP8 loader
(``engine.models.fp8``), the bf16/fp32 loader (``engine.models.loader``) and the tensor-parallel loader
(``engine.models.tensor_parallel``) skip their tensors with one INFO line (``log_skipped``). No torch.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layers(hf_config: Any) -> range:
    """Layer indices of the checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``, as
    GLM-4.5 and DeepSeek-V3 declare them): the ones stored after the ``num_hidden_layers`` decoder layers.
    Empty when the config declares none."""
    nextn = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    first = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    return range(first, first + nextn)


def layer_index(key: str) -> int | None:
    """The decoder layer index of a checkpoint tensor name ``model.layers.{i}.*``; None for other names."""
    match = _LAYER_KEY.match(key)
    return None if match is None else int(match.group(1))


def is_mtp_key(key: str, mtp: range) -> bool:
    """Whether the checkpoint tensor ``key`` belongs to one of the layers ``mtp`` (``mtp_layers``)."""
    index = layer_index(key)
    return index is not None and index in mtp


def log_skipped(count: int, mtp: range) -> None:
    """The one INFO line of a load that skipped ``count`` (> 0) tensors of the MTP layers ``mtp``."""
    logger.info("skipped %d checkpoint tensors of the multi-token-prediction layers %s (not part of "
                "the decoder)", count, list(mtp))
