"""What the connector reads of vLLM's model: its KV-cache groups as the connector moves them,
the KV heads TP ranks pair by, and the model families (or settings) it refuses by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdactors_vllm.errors import ConnectorConfigError
from pdactors_vllm.metadata import KVGroup

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["architecture_of", "kv_groups", "kv_heads_of", "refuse_unserved"]

_STATE_MODES = ("none", "align")


def refuse_unserved(vllm_config: Any) -> None:
    """Raise :class:`ConnectorConfigError` (a ``ValueError``) naming the model's family and
    what is missing when PdActorsConnector cannot serve it in this configuration: a model
    with recurrent state (Mamba, gated delta-net) whose state vLLM keeps in a way the
    connector does not know (it moves the live state pages of ``mamba_cache_mode`` "none",
    one per request, and "align", one per prefix-cache block; vLLM 0.32 has no other)."""
    model_config = vllm_config.model_config
    mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
    if _has_state(model_config) and mode not in _STATE_MODES:
        raise ConnectorConfigError(
            f"PdActorsConnector cannot serve {architecture_of(model_config)} with "
            f"mamba_cache_mode {mode!r}: it moves recurrent state kept as "
            f"{' or '.join(map(repr, _STATE_MODES))} only"
        )


def _has_state(model_config: Any) -> bool:
    """The model keeps recurrent state (Mamba, gated delta-net), alone or in a hybrid."""
    return bool(model_config.has_inner_state or model_config.is_hybrid)


def architecture_of(model_config: Any) -> str:
    return ", ".join(getattr(model_config.hf_config, "architectures", None) or ["?"])


def kv_groups(
    kv_cache_config: KVCacheConfig | None, model: str = "this model"
) -> tuple[KVGroup, ...]:
    """vLLM's KV-cache groups as the connector moves them (none without a config). Full
    attention (MLA's latent cache included) moves every block of the prompt, a sliding window
    the blocks it keeps, recurrent state (Mamba, GDN) its live state pages. Raises
    :class:`ConnectorConfigError` (a ``ValueError``) naming ``model`` and a group of another
    kind (chunked local attention, R-SWA, recurrent state with speculative slots …), which
    the connector does not move."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if kv_cache_config is None:
        return ()
    transferred = set(kv_cache_config.transfer_group_ids)
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        kinds = {type(s) for s in specs}
        state = all(isinstance(s, MambaSpec) for s in specs)
        if state and all(
            s.mamba_cache_mode in _STATE_MODES and not s.num_speculative_blocks  # type: ignore[attr-defined]
            for s in specs
        ):
            window, retained = 0, 0
        elif kinds <= {FullAttentionSpec, MLAAttentionSpec}:
            window, retained = 0, 0
        elif all(isinstance(s, SlidingWindowSpec) for s in specs) and (
            len({(s.sliding_window, s.extra_retained_tokens) for s in specs}) == 1  # type: ignore[attr-defined]
        ):
            window, retained = specs[0].sliding_window, specs[0].extra_retained_tokens  # type: ignore[attr-defined]
        else:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ConnectorConfigError(
                f"PdActorsConnector cannot serve {model}: its KV-cache group {g} "
                f"({len(group.layer_names)} layers, e.g. {group.layer_names[0]}) is {names}; "
                "it moves full-attention, MLA and sliding-window KV, and recurrent state of "
                "mamba_cache_mode 'none' or 'align' without speculative slots"
            )
        groups.append(KVGroup(spec.block_size, window, retained, g in transferred, state))
    return tuple(groups)


def kv_heads_of(model_config: Any) -> int:
    """The KV "heads" the actors pair TP ranks by: the model's KV heads, or 1 for MLA, whose
    one latent cache per layer every TP rank holds whole (replicated): D rank ``j`` then pulls
    it from one P rank (``j`` modulo P's TP size) and the other P ranks only answer. 0 (not
    said) for a model with recurrent state: its state pages do not split by KV head, so P and
    D must have equal TP sizes (rank to rank), and other shapes are refused by the actors."""
    if _has_state(model_config):
        return 0
    return 1 if model_config.use_mla else int(model_config.get_total_num_kv_heads())
