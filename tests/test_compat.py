"""The compatibility check's rules (pure, synchronous) and its wire types: a description
travels in pulls and registrations, within its limits, and an older peer's messages still
decode."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdactors.config import ReceiverConfig, SenderConfig
from pdactors.core.compat import COMPAT_FIELDS, Mismatch, check_relax, identity, judge, mismatches
from pdactors.core.registry import BootstrapRegistry
from pdactors.errors import ConfigError
from pdactors.wire import (
    MAX_COMPAT_FIELD,
    PROTOCOL_VERSION,
    BootstrapEntry,
    Compat,
    FrameError,
    PullRequest,
    RegisterWorker,
    decode_frames,
    encode_frames,
)
from pdactors.wire.layout import WireBlockIds
from pdactors.wire.limits import MAX_FRAME_BYTES, Id

BASE = Compat(
    wire=PROTOCOL_VERSION,
    model="TinyForCausalLM:0123456789abcdef",
    weights="3f2a" + "0" * 60,
    dtype="bfloat16",
    kv_dtype="bfloat16",
    block_size=16,
    layout="layers=2 kv_heads=4 head_dim=16 HND",
)


def _changed(field: str) -> Compat:
    value = getattr(BASE, field)
    new = value + 1 if isinstance(value, int) else "9c1b" + value
    return msgspec.structs.replace(BASE, **{field: new})


def test_identity_keeps_the_identity_fields_alone() -> None:
    assert identity(None) is None
    ident = identity(BASE)
    assert ident is not None
    assert {f: getattr(ident, f) for f in COMPAT_FIELDS if getattr(ident, f)} == {
        f: getattr(BASE, f) for f in ("model", "weights", "dtype")
    }


def test_a_value_of_24_characters_is_shown_whole_and_a_longer_one_cut() -> None:
    assert Mismatch("layout", "1" + "a" * 23, "2" + "a" * 23).reason("P") == (
        f"incompatible peer: layout differs (P 1{'a' * 23}, D 2{'a' * 23})"
    )
    assert Mismatch("layout", "1" + "a" * 24, "2" + "a" * 24).reason("P") == (
        f"incompatible peer: layout differs (P 1{'a' * 11}…, D 2{'a' * 11}…)"
    )


def test_the_fields_are_compared_in_the_order_the_struct_declares() -> None:
    assert COMPAT_FIELDS == ("wire", "model", "weights", "dtype", "kv_dtype", "block_size",
                             "layout")  # fmt: skip


def test_equal_descriptions_and_absent_ones_pass() -> None:
    assert judge(BASE, BASE).refused is None
    assert judge(BASE, None).refused is None  # an older peer, or the library without adapter
    assert judge(None, BASE).refused is None
    assert judge(None, None).refused is None


def test_a_field_unknown_on_either_side_is_not_compared() -> None:
    no_weights = msgspec.structs.replace(BASE, weights="")
    assert judge(no_weights, _changed("weights")).refused is None
    assert judge(_changed("weights"), no_weights).refused is None


def test_the_reason_names_the_field_and_both_values_p_first() -> None:
    d = _changed("weights")
    refused = judge(BASE, d).refused  # as P sees it
    assert refused is not None
    shown = "(P 3f2a00000000…, D 9c1b3f2a0000…)"
    assert refused.reason("P") == f"incompatible peer: weights differ {shown}"
    assert judge(d, BASE).refused.reason("D") == refused.reason("P")  # type: ignore[union-attr]
    block = judge(BASE, _changed("block_size")).refused
    assert block is not None and block.reason("P") == (
        "incompatible peer: block_size differs (P 16, D 17)"
    )


def test_long_values_with_a_common_start_are_shown_whole() -> None:
    a = msgspec.structs.replace(BASE, weights="x" * 40 + "a")
    b = msgspec.structs.replace(BASE, weights="x" * 40 + "b")
    refused = judge(a, b).refused
    assert refused is not None and "x" * 40 + "a" in refused.reason("P")


def test_the_first_differing_field_is_named_and_relaxed_ones_are_reported() -> None:
    d = msgspec.structs.replace(BASE, kv_dtype="fp8_e4m3", block_size=32)
    assert [m.field for m in mismatches(BASE, d)] == ["kv_dtype", "block_size"]
    verdict = judge(BASE, d, relax=["kv_dtype"])
    assert verdict.refused is not None and verdict.refused.field == "block_size"
    assert [m.field for m in verdict.relaxed] == ["kv_dtype"]
    verdict = judge(BASE, d, relax=["kv_dtype", "block_size"])
    assert verdict.refused is None and len(verdict.relaxed) == 2


@given(st.sampled_from(COMPAT_FIELDS), st.sets(st.sampled_from(COMPAT_FIELDS)))
def test_any_single_field_change_is_named_unless_relaxed(field: str, relax: set[str]) -> None:
    verdict = judge(BASE, _changed(field), relax)
    if field in relax:
        assert verdict.refused is None and [m.field for m in verdict.relaxed] == [field]
    else:
        assert verdict.refused is not None and verdict.refused.field == field
        assert f"incompatible peer: {field} " in verdict.refused.reason("D")
        assert verdict.relaxed == ()


@given(st.lists(st.sampled_from(COMPAT_FIELDS), min_size=1, unique=True))
def test_of_several_changes_the_first_in_field_order_is_named(fields: list[str]) -> None:
    d = BASE
    for field in fields:
        d = msgspec.structs.replace(d, **{field: getattr(_changed(field), field)})
    refused = judge(BASE, d).refused
    assert refused is not None
    assert refused.field == min(fields, key=COMPAT_FIELDS.index)


def test_relax_names_only_fields() -> None:
    assert check_relax(["kv_dtype"]) == ("kv_dtype",)
    with pytest.raises(ConfigError, match="'kv_type', which is not a compatibility field"):
        SenderConfig(engine_id="p", compat_relax=("kv_type",))
    with pytest.raises(ConfigError, match="not a compatibility field"):
        ReceiverConfig(compat_relax=("weight",))


# ---------------------------------------------------------------------- the wire


def _pull(**kw: object) -> PullRequest:
    return PullRequest("t", "s", 0, 1, 0, 1, ((1, 2),), "lid", **kw)  # type: ignore[arg-type]


def test_a_pull_carries_its_description() -> None:
    pull = _pull(compat=BASE)
    assert decode_frames(encode_frames(pull)) == pull
    assert decode_frames(encode_frames(_pull())).compat is None  # D did not say


class _OldPull(msgspec.Struct, frozen=True, array_like=True, tag_field="t", tag="pull"):
    """A pull as protocol version 2 sent it before descriptions existed."""

    transfer_id: Id
    session: Id
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    block_ids: WireBlockIds
    layout_id: Id
    layout: None = None
    kv_heads: int = 0
    p_tp_size: int = 0
    p_pp_size: int = 0


def test_an_older_peers_pull_decodes_and_an_older_p_skips_the_new_field() -> None:
    old = _OldPull("t", "s", 0, 1, 0, 1, ((1, 2),), "lid", None, 4, 1, 1)
    new = decode_frames([encode_frames(_pull())[0], msgspec.msgpack.encode(old)])
    assert isinstance(new, PullRequest) and new.compat is None and new.kv_heads == 4
    # An older P decodes our pull with the description trailing: msgspec skips it.
    seen = msgspec.msgpack.decode(encode_frames(_pull(compat=BASE))[1], type=_OldPull)
    assert seen.transfer_id == "t" and seen.block_ids == ((1, 2),)


def test_a_description_beyond_its_limits_refuses_the_pull() -> None:
    big = msgspec.structs.replace(BASE, model="m" * (MAX_COMPAT_FIELD + 1))
    with pytest.raises(FrameError, match="pull"):
        decode_frames(encode_frames(_pull(compat=big)))
    huge = msgspec.structs.replace(BASE, block_size=1 << 40)
    with pytest.raises(FrameError):
        decode_frames(encode_frames(_pull(compat=huge)))


def test_the_frame_limit_covers_a_pull_with_the_largest_description() -> None:
    widest = Compat(
        **{  # type: ignore[arg-type]
            f: ("\U0010ffff" * MAX_COMPAT_FIELD if isinstance(getattr(BASE, f), str) else 255)
            for f in COMPAT_FIELDS
        }
    )
    grown = len(encode_frames(_pull(compat=widest))[1]) - len(encode_frames(_pull())[1])
    assert grown <= 7 * (16 + 4 * MAX_COMPAT_FIELD + 5) < MAX_FRAME_BYTES


def test_registrations_carry_descriptions_and_leave_upstreams_shape_alone_without() -> None:
    body = msgspec.json.encode(RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5"))
    assert b"compat" not in body  # upstream's shape
    worker = RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5", compat=BASE)
    decoded = msgspec.json.decode(msgspec.json.encode(worker), type=RegisterWorker)
    assert decoded.compat == BASE
    registry = BootstrapRegistry()
    registry.register(decoded)
    registry.register(RegisterWorker("p", 0, 1, 0, "tcp://127.0.0.1:6"))
    entry = registry.answer()[0]
    assert entry.compats == {0: {0: BASE}}  # tp 1 registered none
    wire = msgspec.json.encode(registry.answer())
    assert msgspec.json.decode(wire, type=dict[int, BootstrapEntry])[0].compats == entry.compats
    bare = BootstrapRegistry()
    bare.register(RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5"))
    assert b"compats" not in msgspec.json.encode(bare.answer())
    registry.register(RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5"))  # without, again
    assert registry.answer()[0].compats == {}


def test_a_registration_with_a_field_beyond_its_limit_does_not_decode() -> None:
    long = Compat(weights="w" * (MAX_COMPAT_FIELD + 1))
    body = msgspec.json.encode(RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5", compat=long))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=RegisterWorker)
