"""sched_utils drives vLLM's real Scheduler: checked here against upstream's MooncakeConnector.

These tests exercise vLLM (its scheduler and the scheduler side of its Mooncake connector, which
starts no transfer engine), not pdactors: they pin down the behaviour our connector's tests rely
on.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from sched_utils import (
    DEFAULT_TOKEN_ID,
    block_ids,
    connector_of,
    eos_token_id,
    free_blocks,
    make_request,
    make_scheduler,
    request_status,
    step,
    total_blocks,
)
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.vllm

MOONCAKE = "MooncakeConnector"
PROMPT_LEN = 40  # three 16-token blocks, the last one partial
D_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "e",
    "remote_bootstrap_addr": "http://127.0.0.1:1",
    "transfer_id": "x",
}


def test_producer_holds_blocks_until_finished_sending() -> None:
    sched = make_scheduler(kv_role="kv_producer", connector=MOONCAKE)
    assert type(connector_of(sched)).__name__ == MOONCAKE
    assert free_blocks(sched) == total_blocks(sched) == 63
    sched.add_request(
        make_request(
            "p",
            PROMPT_LEN,
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": "x"},
        )
    )

    scheduled, outputs = step(sched)
    assert scheduled.num_scheduled_tokens == {"p": PROMPT_LEN}
    assert outputs["p"].new_token_ids == [DEFAULT_TOKEN_ID]
    assert outputs["p"].finish_reason == FinishReason.LENGTH
    assert request_status(sched, "p") == RequestStatus.FINISHED_LENGTH_CAPPED
    held = block_ids(sched, "p")
    assert len(held) == 3
    assert free_blocks(sched) == total_blocks(sched) - 3

    # Nothing to schedule, and without a send report the blocks stay with the request.
    scheduled, outputs = step(sched)
    assert scheduled.total_num_scheduled_tokens == 0
    assert outputs == {}
    assert block_ids(sched, "p") == held
    assert free_blocks(sched) == total_blocks(sched) - 3

    step(sched, finished_sending={"p"})
    assert request_status(sched, "p") is None
    assert block_ids(sched, "p") == []
    assert free_blocks(sched) == total_blocks(sched)


def test_consumer_waits_for_remote_kvs_then_decodes() -> None:
    sched = make_scheduler(kv_role="kv_consumer", connector=MOONCAKE)
    request = make_request("d", PROMPT_LEN, max_tokens=3, kv_transfer_params=D_PARAMS)
    sched.add_request(request)

    # The whole prompt is to be loaded: blocks are allocated, nothing runs.
    scheduled, outputs = step(sched)
    assert scheduled.total_num_scheduled_tokens == 0
    assert outputs == {}
    assert request_status(sched, "d") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(block_ids(sched, "d")) == 3
    assert request.num_computed_tokens == PROMPT_LEN

    # Reported this step, the load makes the request schedulable at the next schedule().
    scheduled, outputs = step(sched, finished_recving={"d"})
    assert scheduled.total_num_scheduled_tokens == 0
    assert request_status(sched, "d") == RequestStatus.WAITING_FOR_REMOTE_KVS

    # The last prompt token is recomputed to sample the first output token.
    tokens = iter([7, 8, 9])
    scheduled, outputs = step(sched, sampled_token=lambda _request: next(tokens))
    assert scheduled.num_scheduled_tokens == {"d": 1}
    assert outputs["d"].new_token_ids == [7]
    assert request_status(sched, "d") == RequestStatus.RUNNING

    step(sched, sampled_token=lambda _request: next(tokens))
    scheduled, outputs = step(sched, sampled_token=lambda _request: next(tokens))
    assert scheduled.num_scheduled_tokens == {"d": 1}
    assert outputs["d"].finish_reason == FinishReason.LENGTH
    assert list(request.output_token_ids) == [7, 8, 9]
    assert request_status(sched, "d") is None
    assert free_blocks(sched) == total_blocks(sched)


def test_consumer_failed_load_finishes_with_error_and_frees_blocks() -> None:
    sched = make_scheduler(kv_role="kv_consumer", connector=MOONCAKE)
    sched.add_request(make_request("d", PROMPT_LEN, kv_transfer_params=D_PARAMS))
    step(sched)
    assert free_blocks(sched) == total_blocks(sched) - 3

    _, outputs = step(sched, failed_recving={"d"})
    assert outputs["d"].finish_reason == FinishReason.ERROR
    assert request_status(sched, "d") is None
    assert free_blocks(sched) == total_blocks(sched)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_plain_requests_run_normally(kv_role: str) -> None:
    sched = make_scheduler(kv_role=kv_role, connector=MOONCAKE)
    sched.add_request(make_request("long", PROMPT_LEN, max_tokens=2))
    sched.add_request(make_request("eos", PROMPT_LEN))

    scheduled, outputs = step(sched)
    assert scheduled.num_scheduled_tokens == {"long": PROMPT_LEN, "eos": PROMPT_LEN}
    assert outputs["long"].finish_reason is None

    _, outputs = step(
        sched,
        sampled_token=lambda r: eos_token_id() if r.request_id == "eos" else DEFAULT_TOKEN_ID,
    )
    assert outputs["long"].finish_reason == FinishReason.LENGTH
    assert outputs["eos"].finish_reason == FinishReason.STOP
    assert outputs["eos"].new_token_ids == [eos_token_id()]
    assert not sched.requests
    assert free_blocks(sched) == total_blocks(sched)


def test_partial_prefill_chunks_sample_nothing() -> None:
    sched = make_scheduler(kv_role="kv_producer", connector=MOONCAKE, max_num_batched_tokens=16)
    sched.add_request(make_request("c", PROMPT_LEN, max_tokens=1))

    chunks = [step(sched) for _ in range(3)]
    assert [s.num_scheduled_tokens["c"] for s, _ in chunks] == [16, 16, 8]
    assert [outputs for _, outputs in chunks[:2]] == [{}, {}]
    assert chunks[2].outputs["c"].finish_reason == FinishReason.LENGTH
    assert free_blocks(sched) == total_blocks(sched)


def test_eos_flag_finishes_stopped() -> None:
    sched = make_scheduler(kv_role="kv_producer", connector=MOONCAKE)
    sched.add_request(make_request("s", 8))
    _, outputs = step(sched, eos=True)
    assert outputs["s"].finish_reason == FinishReason.STOP
    with pytest.raises(ValueError, match="not both"):
        step(sched, eos=True, sampled_token=5)
