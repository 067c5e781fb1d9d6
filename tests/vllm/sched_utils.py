"""Drive vLLM's real v1 `Scheduler` and its KV connector's scheduler side, with no model at all.

`make_scheduler` builds the scheduler the way vLLM's engine core does (model config from the
tiny model, KV cache layout, one full-attention KV cache group, block sizes, structured output
manager), except that nothing measures memory and no worker starts: the KV cache is simply
``num_blocks`` blocks. `step` plays the worker: it schedules, samples one token for every
request whose prefill is complete (as the model runner does), reports the KV connector's
finished and failed transfers, and feeds that back through ``update_from_output``.

Facts about vLLM 0.32 these helpers rely on (and tests can lean on):

- ``kv_transfer_params`` reach the `Request` through ``SamplingParams.extra_args`` under the
  key ``"kv_transfer_params"``, as the OpenAI server passes them; connectors mutate the dict.
- A request that loads its whole prompt remotely (``WAITING_FOR_REMOTE_KVS``) becomes
  schedulable in the ``schedule()`` *after* the step that reports it in ``finished_recving``;
  the scheduler then sets ``num_computed_tokens = num_tokens - 1`` so the last prompt token is
  recomputed to sample the first output token.
- A failed receive is reported in both ``failed_recving`` and ``finished_recving`` (vLLM's
  ``KVOutputAggregator`` only forwards failures that have also finished); `step` adds the
  failed ids to ``finished_recving`` for the same reason.
- The block pool keeps one "null" block that is never handed out, so `total_blocks` is
  ``num_blocks - 1``.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

with warnings.catch_warnings():
    # Importing the scheduler imports torch._inductor, whose import of torch.utils.mkldnn
    # decorates methods with the deprecated torch.jit.script_method (torch's own code).
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.jit\.script_method` is deprecated",
        category=DeprecationWarning,
    )
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

from pdactors_vllm.tiny_model import ensure_tiny_model

DEFAULT_TOKEN_ID = 100
"""The token `step` samples unless told otherwise: an ordinary (non-special) tiny-model token."""

PDACTORS_CONNECTOR = "PdActorsConnector"

_DEFAULT_LAYOUT = "LBNHC"
_HASH_ALGO = "sha256"  # vLLM's default prefix_caching_hash_algo
_FIRST_ORDINARY_TOKEN = 4  # ids 0..3 are unk, bos, eos, pad in the tiny model


class StepResult(NamedTuple):
    """What one `step` produced: the scheduler's plan and the engine outputs, by request id."""

    scheduled: SchedulerOutput
    outputs: dict[str, EngineCoreOutput]


@cache
def tiny_model_dir() -> Path:
    """The tiny model's directory (built once by `ensure_tiny_model`)."""
    return ensure_tiny_model()


@cache
def _hf_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads((tiny_model_dir() / "config.json").read_text())
    return config


def eos_token_id() -> int:
    """The tiny model's EOS token id; sampling it finishes a request with FINISHED_STOPPED."""
    return int(_hf_config()["eos_token_id"])


def layer_names() -> list[str]:
    """The tiny model's attention layer names, as vLLM names them in the KV cache config."""
    return [
        f"model.layers.{i}.self_attn.attn" for i in range(int(_hf_config()["num_hidden_layers"]))
    ]


def make_scheduler(
    *,
    kv_role: str,
    connector: str = PDACTORS_CONNECTOR,
    module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 512,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    kv_load_failure_policy: str = "fail",
    engine_id: str | None = None,
    async_scheduling: bool = False,
    log_stats: bool = True,
    sliding_window: int = 0,
    recurrent_state: bool = False,
) -> Scheduler:
    """Build vLLM's `Scheduler` for the tiny model with KV connector ``connector`` in ``kv_role``.

    The connector's scheduler side is created by the scheduler itself (``scheduler.connector``,
    see `connector_of`). ``"PdActorsConnector"`` without a ``module_path`` is registered first
    through ``pdactors_vllm.plugin.register()``. ``max_num_batched_tokens`` defaults to
    ``max_model_len`` (any prompt is prefilled in one step); set it lower to get chunked
    prefills. ``engine_id`` None lets vLLM pick a random one. ``sliding_window`` > 0 makes the
    first layer a sliding-window layer of that many tokens (vLLM's hybrid KV cache manager:
    a sliding-window group and a full-attention group, one layer each); ``recurrent_state``
    makes it a Mamba-style state layer instead (one state page per request, vLLM's
    ``mamba_cache_mode`` "none"; needs ``enable_prefix_caching=False``). No model weights are
    loaded.
    Raises whatever vLLM raises for an unknown connector or an invalid configuration.
    """
    if connector == PDACTORS_CONNECTOR and module_path is None:
        _register_pdactors_connector()
    model = str(tiny_model_dir())
    model_config = ModelConfig(
        model=model,
        tokenizer=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        seed=0,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens or max_model_len,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module_path,
            kv_role=kv_role,  # type: ignore[arg-type]  # vLLM validates the literal
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
            engine_id=engine_id,
        ),
        device_config=DeviceConfig("cpu"),
    )
    kv_cache_config = _kv_cache_config(vllm_config, num_blocks, sliding_window, recurrent_state)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )


def make_request(
    request_id: str,
    prompt_len: int,
    *,
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    prompt_token_ids: list[int] | None = None,
    block_size: int = 16,
) -> Request:
    """A `Request` as the engine core builds it, ready for ``scheduler.add_request``.

    The prompt is ``prompt_token_ids`` or else ``prompt_len`` ordinary tokens drawn from a
    generator seeded by ``request_id`` (distinct requests share no prefix-cache blocks; the
    same id gives the same prompt). ``kv_transfer_params`` is deep-copied into
    ``SamplingParams.extra_args``. EOS is the tiny model's, as vLLM sets it from the
    generation config. ``block_size`` must match the scheduler's (it sizes the block hashes
    that prefix caching and connectors read). Raises `ValueError` if ``prompt_token_ids``
    does not have ``prompt_len`` tokens.
    """
    if prompt_token_ids is None:
        rng = random.Random(request_id)
        vocab_size = int(_hf_config()["vocab_size"])
        prompt_token_ids = [
            rng.randrange(_FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(prompt_len)
        ]
    elif len(prompt_token_ids) != prompt_len:
        raise ValueError(f"prompt_len={prompt_len} but {len(prompt_token_ids)} prompt tokens")
    extra_args = (
        {"kv_transfer_params": copy.deepcopy(kv_transfer_params)}
        if kv_transfer_params is not None
        else None
    )
    sampling_params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    sampling_params.update_from_generation_config({}, eos_token_id())
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=_block_hasher(block_size),
    )


def step(
    scheduler: Scheduler,
    *,
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
    sampled_token: int | Callable[[Request], int] | None = None,
    eos: bool = False,
) -> StepResult:
    """Run one engine step: ``schedule()``, a fake model run, ``update_from_output``.

    Every scheduled request whose prefill is complete after this step samples one token (a
    partial prefill chunk samples nothing, as in vLLM's model runner): ``sampled_token`` (an
    id, or a function of the request; default `DEFAULT_TOKEN_ID`), or EOS when ``eos`` is
    true. The KV connector output carries the given sets as the workers would report them;
    ``failed_recving`` ids are also reported as finished. Returns the scheduler output and
    the engine outputs keyed by request id (finish reasons, ``kv_transfer_params``).
    Raises `ValueError` if both ``eos`` and ``sampled_token`` are given, or if transfers are
    reported to a scheduler without a connector.
    """
    if eos and sampled_token is not None:
        raise ValueError("give either eos=True or sampled_token, not both")
    if eos:
        sampled_token = eos_token_id()
    return finish_step(
        scheduler,
        scheduler.schedule(),
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=failed_recving,
        invalid_block_ids=invalid_block_ids,
        sampled_token=sampled_token,
    )


def finish_step(
    scheduler: Scheduler,
    scheduled: SchedulerOutput,
    *,
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
    sampled_token: int | Callable[[Request], int] | None = None,
) -> StepResult:
    """The rest of `step` for a ``scheduled`` step: the fake model run and
    ``update_from_output``. With async scheduling the next ``schedule()`` may come first."""
    if sampled_token is None:
        sampled_token = DEFAULT_TOKEN_ID
    sending = set(finished_sending)
    failed = set(failed_recving)
    recving = set(finished_recving) | failed
    invalid = set(invalid_block_ids)
    req_ids = list(scheduled.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.is_prefill_chunk:
            sampled.append([])
        elif callable(sampled_token):
            sampled.append([sampled_token(request)])
        else:
            sampled.append([sampled_token])

    kv_output: KVConnectorOutput | None = None
    if scheduler.connector is not None:
        kv_output = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid,
            failed_recving=failed,
        )
    elif sending or recving or invalid:
        raise ValueError("KV transfers reported to a scheduler without a KV connector")
    model_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )
    engine_outputs = scheduler.update_from_output(scheduled, model_output)
    outputs: dict[str, EngineCoreOutput] = {}
    for client_outputs in engine_outputs.values():
        for output in client_outputs.outputs:
            assert output.request_id not in outputs, f"two outputs for {output.request_id}"
            outputs[output.request_id] = output
    return StepResult(scheduled, outputs)


def free_blocks(scheduler: Scheduler) -> int:
    """Blocks free in the scheduler's block pool (cached-but-unreferenced blocks count as free)."""
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def total_blocks(scheduler: Scheduler) -> int:
    """Blocks the pool can hand out: all but vLLM's null block; `free_blocks` when idle."""
    return scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1


def block_ids(scheduler: Scheduler, request_id: str) -> list[int]:
    """The KV block ids the scheduler holds for ``request_id`` (empty once they are freed)."""
    (ids,) = scheduler.kv_cache_manager.get_block_ids(request_id)
    return list(ids)


def block_tables(scheduler: Scheduler, request_id: str) -> tuple[list[int], ...]:
    """The request's block table per KV-cache group (0: vLLM's null block)."""
    return tuple(list(t) for t in scheduler.kv_cache_manager.get_block_ids(request_id))


def request_status(scheduler: Scheduler, request_id: str) -> RequestStatus | None:
    """The request's status, or None once the scheduler has forgotten it (blocks freed)."""
    request = scheduler.requests.get(request_id)
    return None if request is None else request.status


def connector_of(scheduler: Scheduler) -> KVConnectorBase_V1:
    """The scheduler-role KV connector the scheduler created. Raises `LookupError` if none."""
    connector = scheduler.connector
    if connector is None:
        raise LookupError("the scheduler has no KV connector")
    return connector


def _register_pdactors_connector() -> None:
    # Imported here so that upstream connectors work without our plugin; register() is
    # idempotent.
    from pdactors_vllm import plugin

    plugin.register()


def _kv_cache_config(
    vllm_config: VllmConfig, num_blocks: int, window: int, state: bool
) -> KVCacheConfig:
    """One full-attention group over every layer (or, with a ``window``, a sliding-window
    group of the first layer and a full-attention group of the others; with ``state``, a
    recurrent-state group of the first), sized to exactly ``num_blocks`` blocks."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    # The engine core resolves the layout before the connector exists; a connector's
    # preference wins, as it does there when the attention backend supports it.
    cache_config.kv_cache_layout = get_kv_connector_cache_layout(vllm_config) or _DEFAULT_LAYOUT
    spec = FullAttentionSpec(
        block_size=cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=torch.float32,
    )
    names = layer_names()
    groups = [KVCacheGroupSpec(names, spec)]
    if window:
        sliding = SlidingWindowSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            sliding_window=window,
        )
        groups = [KVCacheGroupSpec(names[:1], sliding), KVCacheGroupSpec(names[1:], spec)]
    if state:
        pages = MambaSpec(
            block_size=model_config.max_model_len,
            shapes=((3, 64), (2, 8, 8)),  # a conv state and a recurrent one
            dtypes=(torch.float32, torch.float32),
            page_size_padded=spec.page_size_bytes,  # vLLM pads state pages to KV pages
            mamba_cache_mode="none",
        )
        groups = [KVCacheGroupSpec(names[:1], pages), KVCacheGroupSpec(names[1:], spec)]
    per_block = spec.page_size_bytes * max(len(g.layer_names) for g in groups)
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, available_memory=num_blocks * per_block
    )
    assert kv_cache_config.num_blocks == num_blocks, kv_cache_config
    kv_cache_config.kv_cache_layout = cache_config.kv_cache_layout
    return kv_cache_config


@cache
def _block_hasher(block_size: int) -> Callable[[Request], list[Any]]:
    hash_fn = get_hash_fn_by_name(_HASH_ALGO)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


__all__ = [
    "DEFAULT_TOKEN_ID",
    "PDACTORS_CONNECTOR",
    "StepResult",
    "block_ids",
    "block_tables",
    "connector_of",
    "eos_token_id",
    "finish_step",
    "free_blocks",
    "layer_names",
    "make_request",
    "make_scheduler",
    "request_status",
    "step",
    "tiny_model_dir",
    "total_blocks",
]
