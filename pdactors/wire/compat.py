"""What must match between a P and a D for KV bytes to mean the same thing: the
:class:`Compat` description P registers with its bootstrap entry and D sends with each pull
(compared by :mod:`pdactors.core.compat`)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pdactors.wire.limits import MAX_BLOCK_SIZE, MAX_COMPAT_FIELD

__all__ = ["COMPAT_INFO", "Compat"]

#: The info gauge on a vLLM server's ``/metrics`` (our connector's, from start-up) whose
#: labels are the engine's identity fields (:data:`pdactors.core.compat.IDENTITY_FIELDS`),
#: ``role`` (vLLM's ``kv_role``) and ``relax`` (its ``compat_relax``, comma-separated); value 1.
COMPAT_INFO = "vllm:pdactors_compat_info"

_Field = Annotated[str, Meta(max_length=MAX_COMPAT_FIELD)]


class Compat(msgspec.Struct, frozen=True, omit_defaults=True):
    """An engine's description, field by field, in the order they are compared (the first
    that differs is the one a refusal names). An empty field (``""`` or 0) is not known and
    is not compared; a newer peer's extra fields are ignored.

    * ``wire``: the pdactors wire version (:data:`~pdactors.wire.PROTOCOL_VERSION`).
    * ``model``: the model's config (its architecture and a hash of the rest).
    * ``weights``: a fingerprint of the weights, or the operator's ``model_fingerprint``.
    * ``dtype`` / ``kv_dtype``: the model's dtype and its KV cache's.
    * ``block_size``: tokens per KV block.
    * ``layout``: the KV layout and head geometry (layers, KV heads, head size, memory order).

    A map (not ``array_like``): it travels in JSON in the bootstrap's answers too.
    """

    wire: Annotated[int, Meta(ge=0, le=255)] = 0
    model: _Field = ""
    weights: _Field = ""
    dtype: _Field = ""
    kv_dtype: _Field = ""
    block_size: Annotated[int, Meta(ge=0, le=MAX_BLOCK_SIZE)] = 0
    layout: _Field = ""
