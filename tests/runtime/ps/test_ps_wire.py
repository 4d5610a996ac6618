"""The data-plane frame format: exact round trips, MAC authentication, refusal of malformed frames.

Hostile header frames are built by hand with msgspec (plain MessagePack, not the codec under test)."""

import hashlib

import msgspec
import numpy as np
import pytest
import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305

from runtime.transport.wire import (
    MAX_HEADER_DEPTH,
    AuthError,
    LinkGuard,
    ReplayError,
    WireError,
    decode,
    decode_signed,
    encode,
    link_key,
    sign,
)

KEY = b"shared-secret"


def _arrays():
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(3, 5)).astype(np.float32),
        np.arange(7, dtype=np.int64),
        np.float64(2.5),
        np.zeros((0, 4), np.float16),
        np.array([True, False]),
        rng.normal(size=(4, 6))[:, ::2],  # not contiguous
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian
    ]


@pytest.mark.parametrize("secret", [None, KEY])
def test_round_trip_keeps_values_dtypes_shapes(secret):
    header = {"op": "push", "table": "emb", "step": 3, "nested": {"a": [1, 2]}}
    got_header, got = decode(encode(header, _arrays(), secret), secret)
    assert got_header == header
    for a, b in zip(_arrays(), got, strict=True):
        a = np.asarray(a)
        assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("=")
        np.testing.assert_array_equal(b, a)


def test_round_trip_over_zeromq_without_copies():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://wire-test")
    b.connect("inproc://wire-test")
    big = np.arange(300_000, dtype=np.float32).reshape(-1, 16)
    a.send_multipart(encode({"k": 1}, [big, np.arange(3)], KEY), copy=False)
    header, (x, y) = decode(b.recv_multipart(copy=False), KEY)
    a.close()
    b.close()
    assert header == {"k": 1}
    np.testing.assert_array_equal(x, big)
    np.testing.assert_array_equal(y, np.arange(3))


@pytest.mark.parametrize("n", [8, 20_000])  # 64 B: a BLAKE2b tag; 160 KB: a Poly1305 tag
def test_mac_rejects_wrong_key_missing_tag_tampering_and_recut_frames(n):
    frames = [bytes(f) for f in encode({"op": "pull"}, [np.arange(n, dtype=np.int64)], KEY)]
    with pytest.raises(AuthError, match="does not match"):
        decode(frames, b"other-secret")
    with pytest.raises(AuthError, match="no MAC tag"):
        decode([bytes(f) for f in encode({"op": "pull"}, [np.arange(8)])], KEY)
    tampered = list(frames)
    tampered[1] = b"\x01" + tampered[1][1:]
    with pytest.raises(AuthError, match="does not match"):
        decode(tampered, KEY)
    recut = [frames[0] + frames[1][:8], frames[1][8:], frames[2]]  # same bytes, other boundaries
    with pytest.raises(AuthError):
        decode(recut, KEY)
    with pytest.raises(WireError, match="MAC tag, but this endpoint has no secret"):
        decode(frames, None)
    nonce_flipped = [*frames[:-1], bytes([frames[-1][0] ^ 1]) + frames[-1][1:]]  # the one-time key changes
    with pytest.raises(AuthError, match="does not match"):
        decode(nonce_flipped, KEY)


def _expected_tag(frames: list[bytes], nonce: bytes) -> bytes:
    """The tag the module docstring specifies, computed here with hashlib and cryptography directly."""
    key = hashlib.blake2b(KEY, digest_size=64, person=b"hetps-wire-key").digest()
    data = b"".join(len(f).to_bytes(8, "little") + f for f in frames)
    if len(data) <= 64 << 10:
        return hashlib.blake2b(data, key=key, salt=nonce, digest_size=16, person=b"hetps-wire-tag").digest()
    one_time = hashlib.blake2b(nonce, key=key, digest_size=32, person=b"hetps-wire-mac").digest()
    return Poly1305.generate_tag(one_time, data)


@pytest.mark.parametrize("n", [0, 1, 8188, 8189, 100_000])  # 8188: 65 535 bytes, 8189: 65 543
def test_the_tag_is_keyed_blake2b_for_small_messages_and_poly1305_for_large_ones(n):
    frames = encode({"k": 1}, [np.zeros(n, np.int64)], KEY)
    body, tag = [bytes(f) for f in frames[:-1]], bytes(frames[-1])
    assert tag[16:] == _expected_tag(body, tag[:16])
    assert decode(frames, KEY)[1][0].size == n


def test_each_message_gets_a_fresh_nonce_and_long_secrets_work():
    a, b = (encode({"op": "pull"}, [np.arange(4)], KEY)[-1] for _ in range(2))
    assert bytes(a)[:16] != bytes(b)[:16] and bytes(a) != bytes(b)
    long_key = bytes(range(256)) * 2  # more than BLAKE2b's 64-byte key limit
    header, _ = decode(encode({"k": 1}, [np.arange(3)], long_key), long_key)
    assert header == {"k": 1}
    with pytest.raises(AuthError, match="does not match"):
        decode(encode({"k": 1}, [], long_key), long_key[:-1])


def _raw(header, descs=(), *buffers: bytes) -> list[bytes]:
    """A message whose header frame is MessagePack of [header, descs], built without transport.wire."""
    return [msgspec.msgpack.encode([header, list(descs)]), *buffers]


def _nested(depth: int) -> bytes:
    """[{"x": [[...[nil]...]]}, []] with `depth` arrays around nil, as raw MessagePack."""
    return b"\x92\x81\xa1x" + b"\x91" * depth + b"\xc0\x90"


GOOD = _raw({"op": "push", "table": "w"}, [["<f4", [2]]], b"\0" * 8)[0]


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"\xc1"], "not MessagePack.*invalid opcode"),
        ([GOOD[:-3], b"\0" * 8], "not MessagePack.*truncated"),  # truncated header
        ([GOOD + b"\0", b"\0" * 8], "not MessagePack.*trailing"),
        ([b'{"arrays": []}'], "header frame is not"),  # the old JSON format
        (_raw([1, 2]), "a map of string keys.*got `array`"),
        ([msgspec.msgpack.encode({"op": "x"})], "header frame is not"),
        ([msgspec.msgpack.encode([{}])], "at least length 2"),
        ([msgspec.msgpack.encode([{}, [], 5])], "at most length 2"),  # an extra element
        (_raw({1: "x"}), "string keys.*Expected `str`, got `int`"),
        (_raw({"x": b"pickle"}), "got `bytes`"),  # bin is not a value
        (_raw({}, [["|O", [1]]], b"\x80\x04K\x01."), "descriptor refused: Invalid enum value '|O'"),
        (_raw({}, [["<f4", [2.0]]], b"\0" * 8), "descriptor refused: Expected `int`, got `float`"),
        (_raw({}, [["<f4", "2"]], b"\0" * 8), "descriptor refused"),
        (_raw({}, [["<f4", [2, 2]]], b"\x00" * 12), "needs 16 bytes, frame has 12"),
        (_raw({}, [["<f4", [-1]]], b""), "descriptor refused: Expected `int` >= 0"),
        (_raw({}, [["<f4", [1]]]), "describes 1 arrays but 0 buffer frames"),
        (_raw({}, [], b"\0"), "describes 0 arrays but 1 buffer frames"),
        ([], "empty message"),
        ([_nested(100_000)], f"nested deeper than {MAX_HEADER_DEPTH}"),
        ([_nested(MAX_HEADER_DEPTH)], f"nested deeper than {MAX_HEADER_DEPTH}"),
        (_raw({}, [["<f4", [1] * 33]], b"\0" * 4), "descriptor refused: Expected `array` of length <= 32"),
        (_raw({}, [["<f4", [0, 2**63]]], b""), "not a valid array shape"),
        (_raw({}, [["<f4", [0, 2**62, 2**62]]], b""), "not a valid array shape"),
        ([b"\xc0" * ((1 << 20) + 2)], "header frame is 1048578 bytes"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(frames, message):
    with pytest.raises(WireError, match=message):
        decode(frames)
    if frames:
        with pytest.raises(WireError, match=message):  # signed with the right key: refused all the same
            decode(sign(frames, KEY), KEY)


def test_a_signed_hostile_header_with_a_bad_mac_is_refused_before_it_is_parsed():
    frames = sign(_raw({}, [["|O", [1]]], b"\x80"), KEY)
    with pytest.raises(AuthError, match="does not match"):
        decode([frames[0] + b"\0", *frames[1:]], KEY)
    with pytest.raises(AuthError, match="no MAC tag"):
        decode(frames[:-1], KEY)
    with pytest.raises(AuthError, match="no MAC tag"):
        decode([*frames[:-1], frames[-1][:-1]], KEY)  # a truncated tag


def test_header_values_keep_their_types_and_numpy_scalars_travel_as_numbers():
    header = {
        "i": -(2**63),
        "u": 2**64 - 1,
        "f": 0.1,
        "nan": float("nan"),
        "s": "é",
        "b": True,
        "n": None,
        "l": [1, "a", None],
        "m": {"k": [1.5]},
        "np": np.float32(0.5),
        "npi": np.int64(7),
    }
    got, _ = decode(encode(header))
    assert got.pop("nan") != got.get("nan")  # NaN
    assert got == {
        "i": -(2**63),
        "u": 2**64 - 1,
        "f": 0.1,
        "s": "é",
        "b": True,
        "n": None,
        "l": [1, "a", None],
        "m": {"k": [1.5]},
        "np": 0.5,
        "npi": 7,
    }
    assert type(got["npi"]) is int and type(got["b"]) is bool


@pytest.mark.parametrize(
    "header, message", [({"x": 2**64}, "cannot be encoded"), ({"x": object()}, "cannot be encoded")]
)
def test_encode_refuses_headers_that_cannot_travel(header, message):
    with pytest.raises(WireError, match=message):
        encode(header)


def test_a_message_over_max_bytes_is_refused_before_it_is_parsed():
    frames = encode({"op": "push"}, [np.zeros(1000, np.float32)])
    assert decode(frames, max_bytes=5000)[1][0].size == 1000
    with pytest.raises(WireError, match="more than the limit of 3000"):
        decode(frames, max_bytes=3000)


def test_a_header_just_inside_the_depth_limit_is_accepted():
    x = 1
    for _ in range(MAX_HEADER_DEPTH - 1):
        x = [x]
    header = {"x": x}  # MAX_HEADER_DEPTH levels with the object itself
    assert decode(encode(header))[0] == header
    with pytest.raises(WireError, match=f"nested deeper than {MAX_HEADER_DEPTH}"):
        decode(encode({"x": [x]}))


def test_decode_signed_says_which_key_signed():
    data, admin = b"data-key", b"admin-key"
    assert decode_signed(encode({"op": "pull"}, [], data), [data, admin]).key == 0
    assert decode_signed(encode({"op": "save"}, [], admin), [data, admin]).key == 1
    with pytest.raises(AuthError, match="does not match"):
        decode_signed(encode({"op": "save"}, [], b"other"), [data, admin])


def test_link_guard_refuses_old_and_repeated_numbers_and_ids_past_its_bounds():
    guard = LinkGuard(max_senders=3, max_ids=2)
    guard.check("a", {"cid": "a/1", "seq": 1})
    guard.check("a", {"cid": "a/1", "seq": 5})  # gaps are fine
    guard.check("b", {"cid": "b/1", "seq": 1})  # senders are independent
    for seq in (5, 4):
        with pytest.raises(ReplayError, match="replayed or reordered"):
            guard.check("a", {"cid": "a/1", "seq": seq})
    with pytest.raises(ReplayError, match="signed with the link key of 'b'"):
        guard.check("b", {"cid": "a/1", "seq": 99})  # b claims to be a
    for bad in ({"seq": 9}, {"cid": "a", "seq": 1}, {"cid": "a/1", "seq": True}, {"cid": 3, "seq": 1}):
        with pytest.raises(ReplayError, match="needs a se"):
            guard.check("a", bad)
    guard.check("a", {"cid": "a/2", "seq": 1})
    with pytest.raises(ReplayError, match="one too many"):  # a's third id: past 2 per name
        guard.check("a", {"cid": "a/3", "seq": 1})
    with pytest.raises(ReplayError, match="one too many"):  # c's first: past 3 in all
        guard.check("c", {"cid": "c/1", "seq": 1})
    with pytest.raises(ReplayError, match="replayed"):  # nothing was forgotten
        guard.check("a", {"cid": "a/1", "seq": 5})


def test_link_keys_differ_per_direction_and_verify_only_as_their_sender():
    master = b"m" * 32
    ab, ba = link_key(master, "a", "b"), link_key(master, "b", "a")
    assert len({ab, ba, link_key(master, "a", "c"), link_key(b"n" * 32, "a", "b")}) == 4
    keys = {"a": ab}
    assert decode_signed(encode({"k": 1}, [], ab, "a"), key_of=keys.__getitem__).sender == "a"
    with pytest.raises(AuthError, match="no link to this endpoint"):
        decode_signed(encode({"k": 1}, [], ab, "c"), key_of=keys.__getitem__)
    with pytest.raises(AuthError, match="does not match"):
        decode_signed(encode({"k": 1}, [], ba, "a"), key_of=keys.__getitem__)
    with pytest.raises(WireError, match="no '/'"):
        link_key(master, "a/b", "c")


def test_encode_refuses_object_arrays_and_arrays_is_an_ordinary_key():
    with pytest.raises(WireError, match="dtype object"):
        encode({}, [np.array([{}], dtype=object)])
    assert decode(encode({"arrays": [1]}, [np.arange(2)]))[0] == {"arrays": [1]}
