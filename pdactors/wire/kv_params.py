"""``kv_transfer_params``: the dictionary vLLM carries per request between the proxy, P and D."""

from __future__ import annotations

import msgspec

from pdactors.errors import BadTransferParams

__all__ = ["KVTransferParams"]


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The per-request ``kv_transfer_params``, as upstream's MooncakeConnector and the routers
    built for it (its example proxy, vllm-router, llm-d) write them: the one definition of
    those keys, for the proxy and for the vLLM adapter's scheduler side.

    P's request carries ``do_remote_decode=True`` and a ``transfer_id``; D's request carries
    ``do_remote_prefill=True``, ``remote_engine_id``, ``remote_bootstrap_addr`` and the same
    ``transfer_id``; P's answer (for routers that call P first) carries all five, with
    ``do_remote_decode=False``. A key left unset (None) is not written; unknown keys are
    ignored on reading, so other tools can add their own.

    ``first_token_from_p`` (ours; `pdactors proxy` sends it): the client's first token is P's
    answer, and D continues after it. On P: the whole prompt is computed (a model with
    recurrent state holds no token back) and a request that stops at that token (EOS, a stop
    string) frees its KV at once, as no D will pull it. On D: the prompt's last token is P's
    token, so D pulls the KV of the tokens before it and computes that one itself.
    """

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    remote_engine_id: str | None = None
    remote_bootstrap_addr: str | None = None
    transfer_id: str | None = None
    first_token_from_p: bool | None = None
    #: (ours; `pdactors proxy` sends it to P on a one-token request of its own): P frees the
    #: KV it keeps for these transfers, as no D will pull them (D's leg was given up); one it
    #: does not know is remembered as given up. The request itself is served as any other.
    release_transfer_ids: list[str] | None = None

    @classmethod
    def from_dict(cls, params: dict[str, object]) -> KVTransferParams:
        """Read a request's ``kv_transfer_params``. Raises :class:`BadTransferParams` naming
        the key whose value has the wrong type."""
        try:
            return msgspec.convert(params, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise BadTransferParams(f"kv_transfer_params {params!r}: {exc}") from None

    def to_dict(self) -> dict[str, object]:
        """The JSON object the wire carries (keys left unset are not written)."""
        out: dict[str, object] = msgspec.to_builtins(self)
        return out

    @property
    def remote_complete(self) -> bool:
        """Whether D's params name everything a pull needs."""
        return bool(self.remote_engine_id and self.remote_bootstrap_addr and self.transfer_id)
