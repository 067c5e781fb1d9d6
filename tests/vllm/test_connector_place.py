"""Where a worker sits (its DP/TP/PP ranks, whether it runs the bootstrap), from vLLM's own
config objects set the way vLLM's engine core sets them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, ParallelConfig

from pdactors_vllm.connector import worker_place

pytestmark = pytest.mark.vllm


def dense_dp_engine(index: int, size: int = 2, **lb: bool) -> ParallelConfig:
    """The parallel config of DP engine ``index`` of a dense model: vLLM's engine core sets
    ``data_parallel_index`` to the engine's rank and leaves ``data_parallel_rank`` at 0
    (dense DP engines are independent; ``v1/engine/core.py``)."""
    parallel = ParallelConfig(data_parallel_size=size, **lb)
    parallel.data_parallel_rank = 0
    parallel.data_parallel_index = index
    return parallel


def producer(**extra: object) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="PdActorsConnector", kv_role="kv_producer", kv_connector_extra_config=extra
    )


def place(parallel: ParallelConfig, transfer: KVTransferConfig, *, tp_rank: int = 0):  # type: ignore[no-untyped-def]
    return worker_place(
        parallel, transfer, f"p_dp{parallel.data_parallel_index}",
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1,
    )  # fmt: skip


def test_each_dense_dp_engine_registers_its_own_rank_and_one_runs_the_bootstrap() -> None:
    """The regression: every DP engine registered as DP rank 0 and ran a bootstrap on one port."""
    places = [place(dense_dp_engine(i), producer()) for i in range(2)]
    assert [p.ranks.dp_rank for p in places] == [0, 1]
    assert [p.runs_bootstrap for p in places] == [True, False]
    assert [p.engine_id for p in places] == ["p_dp0", "p_dp1"]


def test_only_tp_rank_0_of_dp_index_0_runs_the_bootstrap() -> None:
    assert not place(dense_dp_engine(0), producer(), tp_rank=1).runs_bootstrap
    assert place(dense_dp_engine(0), producer(), tp_rank=1).ranks.tp_rank == 1


def test_with_local_load_balancing_the_local_rank_counts() -> None:
    """Hybrid / external load balancing: each node's engines are on their own; the local rank
    is what they register (upstream's rule)."""
    parallel = dense_dp_engine(3, size=4, data_parallel_external_lb=True)
    parallel.data_parallel_rank_local = 1
    assert parallel.local_engines_only
    assert place(parallel, producer()).ranks.dp_rank == 1


def test_no_bootstrap_with_an_external_one_and_none_on_d() -> None:
    assert not place(dense_dp_engine(0), producer(bootstrap_server_address="h:1")).runs_bootstrap
    consumer = KVTransferConfig(kv_connector="PdActorsConnector", kv_role="kv_consumer")
    d = place(dense_dp_engine(1), consumer)
    assert (d.runs_bootstrap, d.is_consumer, d.ranks.dp_rank) == (False, True, 1)
