"""Codecs: round trips, exact sizes, top-k exactness, unbiased stochastic rounding, shared-seed
random-k, and a clear error for every bad input."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from support import grad_like

from cloudtrain.compress import (
    Codec,
    ErrorFeedback,
    Expected,
    Packet,
    PacketError,
    RandomKey,
    from_wire,
    make_codec,
    parse_spec,
    register_codec,
    registered_codecs,
    to_wire,
)
from cloudtrain.compress.ladders import LADDER, OUTER_LADDER, rung_spec
from cloudtrain.compress.reference import magnitude_topk

# (spec, lossless?) - every registered codec, each level, and compositions
SPECS = [
    ("none", True),
    ("fp16", False),
    ("bf16", False),
    ("quant:8", False),
    ("quant:4", False),
    ("quant:2", False),
    ("sign", False),
    ("topk:0.01", False),
    ("topk:0.3", False),
    ("topk-sampled:0.001", False),
    ("topk-sampled:0.05", False),
    ("randomk:0.1", False),
    ("randomk:1.0", True),
    ("topk:0.05>quant:8", False),
    ("topk:0.05>fp16", False),
    ("topk-sampled:0.02>sign", False),
    ("randomk:0.1>topk:0.1>quant:4", False),
    ("randomk:0.5>randomk:0.5", False),
]
SIZES = [0, 1, 7, 513, 4099, 100_003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


SPARSIFIER_NAMES = ("topk", "topk-sampled", "randomk")


def replay(
    spec: str, x: torch.Tensor, key: RandomKey, rounding: str = "nearest"
) -> tuple[torch.Tensor, torch.Tensor]:
    """What decoding `spec`'s packet of x must give, rebuilt stage by stage from the reference ops
    (reference.py, the oracle of the native kernels), not from codecs.py's composition code.

    Returns (decoded fp32, tolerance per element). The oracle, per stage: top-k is
    `magnitude_topk` (exact: the native selection matches it bit for bit), random-k the shared
    draw, casts are casts, quantization `ef_quantize` with nearest rounding: exact against a
    nearest-rounding codec; a stochastic one rounds each code up or down, so it lies within one
    step of the group (and the float rounding of lo + code * step). Sign's scale is a sum, float rounding apart (1e-5 relative).
    """
    from cloudtrain.compress import reference as ref
    from cloudtrain.compress.codecs import _random_indices

    n = x.numel()
    positions, current = torch.arange(n), x.float()
    value_name, value_level = "none", None
    for i, stage in enumerate(spec.split(">")):
        name, _, level = stage.partition(":")
        if name not in SPARSIFIER_NAMES:
            value_name, value_level = name, level
            continue
        m = current.numel()
        k = 0 if m == 0 else min(m, max(1, math.ceil(float(level) * m)))
        if name == "randomk":
            local = _random_indices(m, k, key, i)
        else:
            local = ref.magnitude_topk(current.abs(), k)
        positions, current = positions[local], current[local]
    k = current.numel()
    tolerance = torch.zeros(k)
    if value_name == "fp16":
        decoded = current.clamp(-65504.0, 65504.0).half().float()
    elif value_name == "bf16":
        decoded = current.bfloat16().float()
    elif value_name in ("quant", "sign"):
        bits = int(value_level) if value_name == "quant" else 1
        packed, lo, step = ref.ef_quantize(current, None, bits, 512, stochastic=False)
        decoded = ref.dequantize(packed, lo, step, bits, k, 512)
        if value_name == "sign":
            tolerance = decoded.abs() * 1e-5
        elif rounding == "stochastic":
            # one step, plus the float rounding of lo + code * step (a few ulps of the value)
            s = step.repeat_interleave(512)[:k]
            tolerance = s + (decoded.abs() + 256 * s) * 2**-20  # |lo| <= |value| + 255 steps
    else:
        decoded = current
    out, tol = torch.zeros(n), torch.zeros(n)
    out[positions], tol[positions] = decoded, tolerance
    return out, tol


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("spec,lossless", SPECS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_and_exact_size(spec, lossless, n, rounding):
    codec, level = parse_spec(spec, rounding=rounding)
    x = grad_like(n)
    key = RandomKey(seed=3, step=5, bucket=1, rank=2)
    packet = codec.encode(x, level, key)
    wire = to_wire(packet)
    assert wire.numel() == codec.nbytes(n, level), (
        "wire size must equal the size predicted before encoding"
    )
    back = from_wire(wire, codec)
    y = codec.decode(back)
    assert y.shape == (n,) and y.dtype == x.dtype
    assert torch.equal(y, codec.decode(packet)), (
        "decoding the wire bytes must equal decoding the packet"
    )
    if lossless:
        assert torch.equal(y, x)
    expect, tolerance = replay(spec, x, key, rounding)
    assert bool(((y.float() - expect).abs() <= tolerance).all()), (
        f"decode differs from the reference replay by {(y.float() - expect).abs().max():.3g}"
    )


@pytest.mark.parametrize(
    "spec", ["none", "fp16", "bf16", "quant:8", "topk:0.1", "randomk:0.2>quant:4"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_dtypes(spec, dtype):
    codec, level = parse_spec(spec)
    x = grad_like(1000, dtype)
    packet = codec.encode(x, level)
    assert to_wire(packet).numel() == codec.nbytes(1000, level, dtype)
    y = codec.decode(from_wire(to_wire(packet), codec))
    assert y.dtype == dtype
    out = torch.empty(1000, dtype=torch.float32)
    assert codec.decode(packet, out=out) is out
    assert torch.equal(out.to(dtype), y)  # fp32 out holds the unrounded decode


@pytest.mark.parametrize("spec", ["quant:8", "quant:4", "quant:2", "sign"])
def test_quantization_error_is_within_one_step(spec):
    codec, level = parse_spec(spec)
    x = grad_like(5000)
    packet = codec.encode(x, level)
    step = packet.parts[2]
    err = (codec.decode(packet) - x).abs().view(-1)
    group = codec.group_size
    step_per_elem = step.repeat_interleave(group)[: x.numel()]
    if spec == "sign":  # decoded is +-mean|x| per group
        scale = (step / 2).repeat_interleave(group)[: x.numel()]
        assert torch.allclose(codec.decode(packet).abs(), scale)
        assert torch.equal(codec.decode(packet) >= 0, x >= 0)
    else:
        assert bool((err <= step_per_elem * (1 + 1e-5) + 1e-7).all())


def test_nearest_rounding_error_is_half_a_step():
    codec = make_codec("quant", rounding="nearest")
    x = grad_like(4096)
    packet = codec.encode(x, 4)
    step = packet.parts[2].repeat_interleave(codec.group_size)
    err = (codec.decode(packet) - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-4) + 1e-7).all())
    # deterministic: no randomness involved
    assert torch.equal(codec.decode(codec.encode(x, 4)), codec.decode(packet))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    """Each decode is lo + code*step with code in {floor(t), floor(t)+1} and expectation t, so by
    Hoeffding the mean of N independent decodes lies within step*sqrt(ln(2/delta)/(2N)) of x
    with probability 1 - delta per element. delta = 1e-9 over 2048 elements: the test fails by
    chance with probability < 3e-6."""
    codec = make_codec("quant")
    x = grad_like(2048, seed=7)
    trials, delta = 400, 1e-9
    total = torch.zeros_like(x)
    for step in range(trials):
        total += codec.decode(codec.encode(x, bits, RandomKey(seed=1, step=step)))
    mean = total / trials
    step_size = codec.encode(x, bits).parts[2].repeat_interleave(codec.group_size)[: x.numel()]
    bound = step_size * math.sqrt(math.log(2 / delta) / (2 * trials))
    assert bool(((mean - x).abs() <= bound + 1e-7).all())
    # and it really is random: a biased nearest rounding would not pass a tighter mean test
    assert not torch.equal(
        codec.decode(codec.encode(x, bits, RandomKey(step=0))),
        codec.decode(codec.encode(x, bits, RandomKey(step=1))),
    )


def test_topk_returns_exactly_the_k_largest_magnitudes():
    codec = make_codec("topk")
    x = grad_like(10_000, seed=3)
    for density in (0.0001, 0.01, 0.1, 0.5, 1.0):
        k = max(1, math.ceil(density * x.numel()))
        y = codec.decode(codec.encode(x, density))
        kept = y.nonzero().squeeze(1)
        assert kept.numel() == k
        assert torch.equal(y[kept], x[kept]), "top-k sends values exactly"
        threshold = x.abs()[kept].min()
        dropped = torch.ones_like(x, dtype=torch.bool)
        dropped[kept] = False
        assert bool((x.abs()[dropped] <= threshold).all())


def test_topk_ties_go_to_the_lowest_indices():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.5, -2.0])
    # |x| sorted: 3 (idx 1, 3), 2 (idx 2, 4, 5, 7): k = 4 keeps 1, 3 and the two lowest 2s
    for name in ("topk", "topk-sampled"):
        codec = make_codec(name)
        y = codec.decode(codec.encode(x, 0.5))
        assert y.nonzero().squeeze(1).tolist() == [1, 2, 3, 4]
    assert magnitude_topk(torch.ones(10), 3).tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "make",
    [
        lambda n: grad_like(n, seed=11),
        lambda n: torch.linspace(-1, 1, n),  # sorted: a strided sample sees a skewed picture
        lambda n: torch.ones(n),  # all ties
        lambda n: torch.cat(
            [torch.zeros(n - 50), torch.arange(50.0)]
        ),  # fewer non-zeros than samples
        lambda n: (torch.arange(n) % 7).float(),  # many ties at the threshold
    ],
)
@pytest.mark.parametrize("density", [0.0005, 0.01, 0.1])
def test_sampled_topk_equals_exact_topk(make, density):
    x = make(500_000)
    exact, sampled = make_codec("topk", sampled=False), make_codec("topk", sampled=True)
    a = to_wire(exact.encode(x, density)).numpy().tobytes()
    b = sampled.encode(x, density)
    assert torch.equal(exact.decode(exact.encode(x, density)), sampled.decode(b))
    assert (
        a[-exact.payload_nbytes(x.numel(), density) :]
        == to_wire(b).numpy().tobytes()[-exact.payload_nbytes(x.numel(), density) :]
    )


def test_randomk_is_shared_by_seed_and_needs_no_indices():
    codec = make_codec("randomk")
    x = grad_like(10_000)
    key = RandomKey(seed=42, step=7, bucket=3, rank=0)
    a = codec.decode(codec.encode(x, 0.01, key))
    b = codec.decode(codec.encode(x + 1.0, 0.01, RandomKey(seed=42, step=7, bucket=3, rank=1)))
    assert torch.equal(a != 0, b != 0), "same (seed, step, bucket) -> same indices on every rank"
    c = codec.decode(codec.encode(x, 0.01, RandomKey(seed=42, step=8, bucket=3)))
    assert not torch.equal(a != 0, c != 0), "a new step draws new indices"
    # no indices on the wire: the payload is just the k values
    assert codec.payload_nbytes(10_000, 0.01) == 100 * 4


_RANDOMK_CHILD = """
import hashlib, torch
from cloudtrain.compress import make_codec, RandomKey
torch.manual_seed({torch_seed})
codec = make_codec("randomk")
y = codec.decode(codec.encode(torch.ones(50_000), 0.1, RandomKey(seed=9, step=123, bucket=4, rank={rank})))
print(hashlib.sha256(y.nonzero().numpy().tobytes()).hexdigest())
"""


def test_randomk_picks_the_same_indices_in_two_processes():
    outs = []
    for rank, torch_seed in ((0, 1), (1, 2)):  # different ranks, different global RNG states
        code = _RANDOMK_CHILD.format(rank=rank, torch_seed=torch_seed)
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        outs.append(res.stdout.split()[-1])
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "spec", ["randomk:0.1", "quant:4", "randomk:0.1>topk:0.1>quant:4", "topk-sampled:0.01"]
)
def test_codecs_never_touch_the_global_rng(spec):
    codec, level = parse_spec(spec)
    x = grad_like(200_000)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    codec.decode(codec.encode(x, level, RandomKey(seed=5, step=1)))
    assert torch.equal(torch.get_rng_state(), before)


def test_composition_indices_are_positions_within_the_previous_selection():
    codec, level = parse_spec("randomk:0.1>topk:0.1>quant:4")
    n = 1_000_000
    # the top-k stage picks 10_000 of the 100_000 random ones: indices code in about 2 + log2(10) bits
    assert codec.payload_nbytes(n, level) < 10_000 * (5.5 + 4) / 8 + 2 * 4 * 20 + 64
    x = grad_like(n)
    positions, _ = codec.positions_and_values(codec.encode(x, level, RandomKey(seed=1)))
    assert positions.numel() == 10_000 and bool((positions.diff() > 0).all())
    # the kept ones are the largest of the random subset
    from cloudtrain.compress.codecs import _random_indices

    subset = _random_indices(n, 100_000, RandomKey(seed=1), 0)
    assert bool(torch.isin(positions, subset).all())
    assert x[positions].abs().min() >= x[subset].abs().kthvalue(100_000 - 10_000).values


def test_fp16_saturates_instead_of_overflowing():
    codec = make_codec("fp16")
    y = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 1.0]), None))
    assert torch.isfinite(y).all() and y.tolist()[:2] == [65504.0, -65504.0]


def test_empty_tensor_gives_an_empty_packet():
    for spec, _ in SPECS:
        codec, level = parse_spec(spec)
        packet = codec.encode(torch.empty(0), level)
        assert packet.nbytes == 0
        assert codec.decode(from_wire(to_wire(packet), codec)).numel() == 0


def test_non_contiguous_and_multidimensional_input_is_handled():
    codec = make_codec("none")
    x = grad_like(600).view(20, 30).t()  # non-contiguous
    assert not x.is_contiguous()
    y = codec.decode(codec.encode(x))
    assert torch.equal(y, x.reshape(-1))


# -- bad input -----------------------------------------------------------------------------------


def test_unknown_codec_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown codec 'topq'; known codecs: none, .*quant.*topk"):
        make_codec("topq")
    with pytest.raises(ValueError, match="known codecs: none, fp16, bf16, quant, sign, topk"):
        parse_spec("gzip:3")
    with pytest.raises(ValueError, match=r"unknown codec parameter\(s\) \['group_sise'\]"):
        make_codec("quant", group_sise=128)
    with pytest.raises(ValueError, match="only sparsifiers"):
        make_codec("quant>topk")
    with pytest.raises(ValueError, match="non-empty"):
        make_codec("")


@pytest.mark.parametrize(
    "spec,level,match",
    [
        ("quant", 3, "bits 2, 4 or 8"),
        ("quant", None, "bits 2, 4 or 8"),
        ("quant", 16, "bits 2, 4 or 8"),
        ("topk", 0.0, r"density in \(0, 1\]"),
        ("topk", 1.5, r"density in \(0, 1\]"),
        ("randomk", -0.1, r"density in \(0, 1\]"),
        ("topk", None, r"density in \(0, 1\]"),
        ("fp16", 8, "takes no level"),
        ("sign", 1, "takes no level"),
        ("randomk>topk>quant", (0.1, 0.1), "takes 3 level values"),
        ("randomk>topk>quant", (0.1, 0.1, 5), "bits 2, 4 or 8"),
        ("topk>fp16", (0.1, 0.2), "codec 'fp16' takes no level, got 0.2"),
        ("topk>quant", (0.1, 0.2, 8), "takes 2 level values"),
        ("quant", True, "bits 2, 4 or 8"),
        ("quant", 8.5, "bits 2, 4 or 8"),
        ("topk", True, r"density in \(0, 1\]"),
        ("topk", math.nan, r"density in \(0, 1\]"),
        ("topk>quant", (0.1, True), "bits 2, 4 or 8"),
    ],
)
def test_level_out_of_range_names_the_valid_range(spec, level, match):
    codec = make_codec(spec)
    with pytest.raises(ValueError, match=match):
        codec.encode(torch.ones(10), level)
    with pytest.raises(ValueError, match=match):
        codec.nbytes(10, level)


@pytest.mark.parametrize(
    "bad", [torch.arange(10), torch.ones(10, dtype=torch.bool), torch.ones(3, dtype=torch.int8)]
)
def test_integer_dtypes_are_rejected(bad):
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        make_codec("topk").encode(bad, 0.1)


def test_non_tensor_input_is_rejected():
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        make_codec("fp16").encode([1.0, 2.0])


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "spec", ["none", "fp16", "quant:8", "sign", "topk:0.1", "randomk:0.5>quant:4"]
)
def test_nonfinite_raise_or_pass(value, spec):
    x = grad_like(2000)
    x[1234] = value
    codec, level = parse_spec(spec)
    with pytest.raises(ValueError, match="1 of 2000 values are NaN or Inf.*nonfinite='pass'"):
        codec.encode(x, level)
    codec, level = parse_spec(spec, nonfinite="pass")
    y1 = codec.decode(from_wire(to_wire(codec.encode(x, level, RandomKey(seed=1))), codec))
    y2 = codec.decode(codec.encode(x.clone(), level, RandomKey(seed=1)))
    assert torch.equal(y1.isnan(), y2.isnan()) and torch.equal(y1.nan_to_num(), y2.nan_to_num())
    if not spec.startswith("randomk"):  # random-k may simply not pick that element
        assert not bool(torch.isfinite(y1).all()), (
            "a non-finite gradient must stay visible after decoding"
        )


def test_bad_params_are_rejected():
    with pytest.raises(ValueError, match="group_size=0"):
        make_codec("quant", group_size=0)
    with pytest.raises(ValueError, match="rounding='up'"):
        make_codec("quant", rounding="up")
    with pytest.raises(ValueError, match="nonfinite='ignore'"):
        make_codec("quant", nonfinite="ignore")
    with pytest.raises(ValueError, match="numel=-1"):
        make_codec("fp16").nbytes(-1)
    with pytest.raises(ValueError, match="RandomKey.step=-1"):
        RandomKey(step=-1)
    with pytest.raises(ValueError, match="is not a number"):
        parse_spec("topk:abc")


def test_decode_rejects_foreign_packets_and_bad_out():
    a, b = make_codec("quant"), make_codec("quant", group_size=256)
    packet = a.encode(torch.ones(100), 8)
    with pytest.raises(PacketError, match="cannot decode"):
        b.decode(packet)
    with pytest.raises(TypeError, match="packet: expected a Packet"):
        a.decode(b"xyz")
    with pytest.raises(ValueError, match="out: expected a floating-point tensor of 100"):
        a.decode(packet, out=torch.empty(99))
    assert isinstance(packet, Packet)


def test_codec_ids_differ_by_parameters():
    names = ["none", "fp16", "bf16", "quant", "sign", "topk", "randomk", "topk>quant"]
    ids = {make_codec(n).id for n in names} | {make_codec("quant", group_size=128).id}
    assert len(ids) == len(names) + 1
    # how top-k finds its threshold is not part of its identity: the same bytes either way
    assert make_codec("topk", sampled=False).id == make_codec("topk").id


# -- spec strings: levels are checked as written, never rounded or dropped ----------------------


@pytest.mark.parametrize(
    "spec,match",
    [
        ("quant:8.9", r"level=8\.9 for codec 'quant' is out of range"),
        ("quant:inf", r"level=inf for codec 'quant' is out of range"),
        ("quant:nan", r"level=nan for codec 'quant'"),
        ("topk:0.1>fp16:5", r"codec 'fp16' takes no level, got 5"),
        ("topk:0.1>sign:1", r"codec 'sign\(group=512\)' takes no level, got 1"),
        ("fp16:5", r"codec 'fp16' takes no level, got level=5"),
        ("topk:inf", r"level=inf for 'topk' is out of range"),
        ("topk:", r"':' after 'topk' but no level"),
        ("topk:0.1>quant:8.5", r"level=8\.5 for codec 'quant'"),
        ("topk:1e400", r"level=inf for 'topk'"),
    ],
)
def test_spec_levels_are_checked_as_written(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_spec_levels_that_are_whole_numbers_are_accepted():
    assert parse_spec("quant:8.0")[1] == 8
    assert parse_spec("topk:1>quant:4")[1] == (1.0, 4)
    assert parse_spec(" randomk : 0.1 > topk:0.1>quant:4 ")[1] == (0.1, 0.1, 4)


@pytest.mark.parametrize("rung", [*LADDER, *OUTER_LADDER])
def test_every_rung_of_the_ladders_is_a_codec_and_its_spec_says_the_same(rung):
    name, level = rung
    codec, parsed = parse_spec(rung_spec(rung))
    assert codec.name == make_codec(name).name
    assert parsed == codec.check_level(level) == level


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize(
    "spec,level",
    [
        ("quant", "{}"),
        ("topk", "{}"),
        ("randomk", "{}"),
        ("topk>quant", "(0.1, {})"),
        ("topk>quant", "({}, 8)"),
        ("randomk>topk", "(0.5, {})"),
        ("fp16", "{}"),
    ],
)
def test_bools_are_never_levels(spec, level, flag):
    codec = make_codec(spec)
    with pytest.raises(ValueError, match="out of range|takes no level"):
        codec.check_level(eval(level.format(flag)))


# -- topk-sampled is topk ----------------------------------------------------------------------


def test_topk_sampled_is_an_old_name_of_topk():
    for old, new in [
        ("topk-sampled", "topk"),
        ("topk-sampled>quant", "topk>quant"),
        ("randomk>topk-sampled>quant", "randomk>topk>quant"),
    ]:
        assert make_codec(old).name == make_codec(new).name
        assert make_codec(old).id == make_codec(new).id
    codec, level = parse_spec("topk-sampled:0.01>quant:8")
    assert (codec.name, level) == (make_codec("topk>quant").name, (0.01, 8))
    with pytest.raises(ValueError, match="sampled=1 must be True or False"):
        make_codec("topk", sampled=1)


@pytest.mark.parametrize(
    "spec,old_name",
    [
        ("topk:0.01", "topk-sampled"),
        ("topk:0.05>quant:8", "topk-sampled>quant(group=512,stochastic)"),
        ("randomk:0.1>topk:0.1>quant:4", "randomk>topk-sampled>quant(group=512,stochastic)"),
    ],
)
def test_packets_of_the_old_topk_sampled_codec_still_decode(spec, old_name):
    """A packet from a sender that still calls it "topk-sampled" carries that name's codec id;
    the bytes are the same, so it decodes as topk (and any other id is still refused)."""
    import struct
    import zlib

    from cloudtrain.compress import HEADER_NBYTES

    codec, level = parse_spec(spec)
    packet = codec.encode(grad_like(5000), level, RandomKey(seed=1, step=2))
    data = bytearray(to_wire(packet).numpy().tobytes())

    def with_id(codec_id: int) -> bytes:
        struct.pack_into("<I", data, 8, codec_id)  # the codec id field
        crc = zlib.crc32(bytes(data[HEADER_NBYTES:]), zlib.crc32(bytes(data[: HEADER_NBYTES - 4])))
        struct.pack_into("<I", data, HEADER_NBYTES - 4, crc)
        return bytes(data)

    old = from_wire(with_id(zlib.crc32(old_name.encode())), codec)
    assert torch.equal(codec.decode(old), codec.decode(packet))
    with pytest.raises(PacketError, match="ranks disagree"):
        from_wire(with_id(zlib.crc32(b"topk-exact")), codec)


# -- a codec of the user's own ---------------------------------------------------------------


class ScaledInt8(Codec):
    """A user's codec: int8 codes and one fp32 scale (max |x| / 127) for the whole tensor."""

    name = "test-scaled-int8"

    def layout(self, numel, level, dtype=torch.float32):
        return ((torch.int8, numel), (torch.float32, 1))

    def _encode(self, x, level, key):
        scale = (x.abs().max().float() / 127 if x.numel() else torch.tensor(1.0)).clamp_min(1e-30)
        codes = (x.float() / scale).round().clamp(-127, 127).to(torch.int8)
        return codes, scale.reshape(1)

    def _decode(self, packet):
        codes, scale = packet.parts
        return codes.float() * scale


@pytest.fixture(scope="module")
def user_codec():
    register_codec("test-scaled-int8", ScaledInt8, replace=True)
    return "test-scaled-int8"


@pytest.mark.parametrize("spec", ["{}", "topk:0.1>{}", "randomk:0.5>topk:0.2>{}"])
def test_a_registered_codec_works_everywhere(user_codec, spec):
    codec, level = parse_spec(spec.format(user_codec), nonfinite="raise", group_size=64)
    assert user_codec in registered_codecs()
    x = grad_like(3000, seed=5)
    key = RandomKey(seed=1, step=1, bucket=2, rank=0)
    packet = codec.encode(x, level, key)
    wire = to_wire(packet)
    assert wire.numel() == codec.nbytes(3000, level)
    back = from_wire(wire, codec, expect=Expected(3000, level, key))
    y = codec.decode(back)
    assert torch.equal(y, codec.decode(packet))
    kept = y != 0
    scale = x[kept].abs().max() / 127
    assert bool(((y - x).abs()[kept] <= scale / 2 * (1 + 1e-5)).all()), "within half a code"
    # accumulate: the sum of decodes, in order
    packets = [codec.encode(x * (i + 1), level, RandomKey(step=i)) for i in range(3)]
    out = codec.accumulate(packets, torch.zeros(3000))
    assert torch.equal(out, sum((codec.decode(p) for p in packets), torch.zeros(3000)))
    # error feedback: nothing lost
    ef, sent, came_in = ErrorFeedback(), torch.zeros(3000, dtype=torch.float64), 0
    for step in range(20):
        grad = grad_like(3000, seed=100 + step)
        sent += codec.decode(ef.encode("b", grad, codec, level, RandomKey(step=step))).double()
        came_in = came_in + grad.double()
    assert torch.allclose(sent + ef.residuals["b"].double(), came_in, atol=1e-5, rtol=0)


def test_register_codec_rejects_bad_registrations(user_codec):
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_codec(user_codec, ScaledInt8)
    with pytest.raises(ValueError, match="already registered"):
        register_codec("topk-sampled", ScaledInt8)  # an old name is taken too
    for bad in ("", "a>b", "a:b", " pad"):
        with pytest.raises(ValueError, match="codec name"):
            register_codec(bad, ScaledInt8)
    with pytest.raises(TypeError, match="must be callable"):
        register_codec("test-not-callable", 3)
    register_codec("test-returns-int", lambda: 3, replace=True)
    with pytest.raises(TypeError, match="factory of codec 'test-returns-int' returned 3"):
        make_codec("test-returns-int")
    with pytest.raises(ValueError, match="only sparsifiers .* can come before '>'"):
        make_codec(f"{user_codec}>topk")
