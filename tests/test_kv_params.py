"""``KVTransferParams``: upstream's ``kv_transfer_params`` keys, read and written in one place."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdactors import BadTransferParams, KVTransferParams

FLAGS = ("do_remote_decode", "do_remote_prefill")
TEXTS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")

valid = st.fixed_dictionaries(
    {},
    optional={
        **{k: st.booleans() for k in FLAGS},
        **{k: st.text(min_size=1) for k in TEXTS},
    },
)
# What routers and vLLM add beside upstream's keys (vLLM: remote_prefill_cached_tokens).
others = st.dictionaries(
    st.text(min_size=1).filter(lambda k: k not in FLAGS + TEXTS),
    st.integers() | st.text() | st.none(),
    max_size=3,
)


@given(valid, others)
def test_a_valid_dict_reads_and_writes_back_its_own_keys(
    params: dict[str, Any], extra: dict[str, Any]
) -> None:
    read = KVTransferParams.from_dict({**params, **extra})
    assert read.to_dict() == params  # unknown keys ignored, known ones kept exactly
    assert msgspec.json.decode(msgspec.json.encode(read)) == params


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("transfer_id", 5),
        ("transfer_id", ["t"]),
        ("remote_engine_id", 1.5),
        ("remote_bootstrap_addr", {"host": "p"}),
        ("do_remote_prefill", "yes"),
        ("do_remote_decode", 1),
    ],
)
def test_a_wrong_type_is_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(BadTransferParams, match=rf"\$\.{key}"):
        KVTransferParams.from_dict({"do_remote_decode": True, key: value})


def test_what_p_answers_routers_is_upstreams_five_keys() -> None:
    answer = KVTransferParams(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="prefill-0",
        remote_bootstrap_addr="http://10.0.0.5:8998",
        transfer_id="t",
    ).to_dict()
    assert answer == {
        "do_remote_prefill": True,
        "do_remote_decode": False,  # written: False is said, not left out
        "remote_engine_id": "prefill-0",
        "remote_bootstrap_addr": "http://10.0.0.5:8998",
        "transfer_id": "t",
    }
    assert KVTransferParams(do_remote_decode=True, transfer_id="t").to_dict() == {
        "do_remote_decode": True,
        "transfer_id": "t",
    }


def test_remote_complete_needs_engine_bootstrap_and_transfer() -> None:
    full = KVTransferParams(
        do_remote_prefill=True, remote_engine_id="e", remote_bootstrap_addr="b", transfer_id="t"
    )
    assert full.remote_complete
    for key in TEXTS:
        assert not msgspec.structs.replace(full, **{key: None}).remote_complete
        assert not msgspec.structs.replace(full, **{key: ""}).remote_complete
