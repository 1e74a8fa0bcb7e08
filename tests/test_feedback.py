"""Error feedback: nothing is lost (conservation), state round-trips, bf16 residuals, and
non-finite gradients never poison the residual."""

from __future__ import annotations

import math

import pytest
import torch

from cloudtrain.compress import ErrorFeedback, RandomKey, make_codec, parse_spec

SPECS = [
    "fp16",
    "bf16",
    "quant:8",
    "quant:2",
    "sign",
    "topk:0.01",
    "topk-sampled:0.01",
    "randomk:0.05",
    "topk:0.05>quant:4",
    "randomk:0.1>topk:0.1>quant:4",
]


def gradients(steps: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3


@pytest.mark.parametrize("spec", SPECS)
def test_conservation_over_many_steps(spec):
    """sum(decoded packets) + residual == sum(gradients), to float rounding, after 60 steps."""
    codec, level = parse_spec(spec)
    ef = ErrorFeedback()
    n = 5000
    sent = torch.zeros(n, dtype=torch.float64)
    came_in = torch.zeros(n, dtype=torch.float64)
    for step, grad in enumerate(gradients(60, n)):
        packet = ef.encode("b0", grad, codec, level, RandomKey(seed=1, step=step))
        sent += codec.decode(packet).double()
        came_in += grad.double()
    residual = ef.residuals["b0"].double()
    scale = came_in.abs().max().item()
    assert torch.allclose(sent + residual, came_in, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("spec", ["quant:4", "topk:0.01", "topk:0.05>quant:4"])
def test_bf16_residual_conserves_to_bf16_rounding(spec):
    codec, level = parse_spec(spec)
    ef = ErrorFeedback(dtype=torch.bfloat16)
    n = 3000
    sent = torch.zeros(n, dtype=torch.float64)
    came_in = torch.zeros(n, dtype=torch.float64)
    steps = 30
    for step, grad in enumerate(gradients(steps, n, seed=2)):
        sent += codec.decode(ef.encode(0, grad, codec, level, RandomKey(step=step))).double()
        came_in += grad.double()
    assert ef.residuals[0].dtype == torch.bfloat16
    err = (sent + ef.residuals[0].double() - came_in).abs()
    # each step rounds the residual to bf16 once: relative 2**-8 of its magnitude
    bound = steps * 2**-8 * (came_in.abs().max() + ef.residuals[0].double().abs().max())
    assert err.max() <= bound
    assert ef.residuals[0].element_size() == 2  # half the memory of fp32


def test_feedback_makes_topk_deliver_every_coordinate():
    """A constant gradient under top-k (10 of 200 a step) with EF: every coordinate is sent, and
    the average delivered equals the gradient to within threshold/steps (the residual left);
    without EF the 190 smaller ones are never sent."""
    codec = make_codec("topk")
    grad = torch.linspace(0.5, 1.0, 200)
    ef = ErrorFeedback()
    total = torch.zeros(200)
    steps = 600
    for step in range(steps):
        total += codec.decode(ef.encode("b", grad, codec, 0.05, RandomKey(step=step)))
    assert bool((total != 0).all())
    threshold = grad.sum() / 10  # steady state: 10 sends a step carry the whole inflow
    assert torch.allclose(total / steps, grad, rtol=0, atol=float(threshold) / steps)
    no_ef = codec.decode(codec.encode(grad, 0.05))
    assert int((no_ef != 0).sum()) == 10


def test_fused_and_generic_paths_agree():
    """The fused top-k (reference.ef_topk_select) and the plain x + r -> encode -> r = acc - decode
    give the same packet and residual."""
    codec = make_codec("topk")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(4))
    r0 = torch.randn(10_000, generator=torch.Generator().manual_seed(5)) * 0.1
    ef = ErrorFeedback()
    ef.put("k", r0)
    fused = codec.decode(ef.encode("k", x, codec, 0.02))
    acc = x + r0
    generic = codec.decode(codec.encode(acc, 0.02))
    assert torch.equal(fused, generic)
    assert torch.equal(ef.residuals["k"], acc - generic)


@pytest.mark.parametrize("spec", ["quant:4", "topk:0.01", "randomk:0.1>topk:0.1>quant:4"])
def test_state_dict_round_trip_continues_identically(spec):
    codec, level = parse_spec(spec)
    grads = list(gradients(20, 2000, seed=9))
    a = ErrorFeedback()
    for step, g in enumerate(grads[:10]):
        a.encode("b", g, codec, level, RandomKey(step=step))
    b = ErrorFeedback()
    b.load_state_dict(a.state_dict())
    for step, g in enumerate(grads[10:], start=10):
        pa = codec.decode(a.encode("b", g, codec, level, RandomKey(step=step)))
        pb = codec.decode(b.encode("b", g, codec, level, RandomKey(step=step)))
        assert torch.equal(pa, pb)
    assert torch.equal(a.residuals["b"], b.residuals["b"])


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_pass_leaves_the_residual_alone(value):
    codec = make_codec("topk", nonfinite="pass")
    ef = ErrorFeedback()
    ef.encode("b", torch.randn(1000), codec, 0.1)
    before = ef.residuals["b"].clone()
    bad = torch.randn(1000)
    bad[3] = value
    decoded = codec.decode(ef.encode("b", bad, codec, 0.1))
    assert not bool(torch.isfinite(decoded).all())
    assert torch.equal(ef.residuals["b"], before)
    strict = make_codec("topk")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ErrorFeedback().encode("b", bad, strict, 0.1)


def test_bad_input():
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        ErrorFeedback(dtype=torch.float16)
    ef = ErrorFeedback()
    codec = make_codec("topk")
    with pytest.raises(TypeError, match="codec: expected a Codec"):
        ef.encode("b", torch.ones(4), "topk", 0.5)
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        ef.encode("b", torch.ones(4, dtype=torch.int32), codec, 0.5)
    ef.encode("b", torch.ones(4), codec, 0.5)
    with pytest.raises(ValueError, match="bucket 'b' held 4 elements and now has 5"):
        ef.encode("b", torch.ones(5), codec, 0.5)
    with pytest.raises(ValueError, match="holds bfloat16 residuals"):
        ErrorFeedback().load_state_dict(ErrorFeedback(torch.bfloat16).state_dict())
    with pytest.raises(ValueError, match="state: expected a dict"):
        ef.load_state_dict({"x": 1})
    empty = ef.encode("e", torch.empty(0), codec, 0.5)
    assert codec.decode(empty).numel() == 0


@pytest.mark.parametrize("spec", [*SPECS, "none"])
def test_padding_keeps_no_residual_and_the_rest_is_conserved(spec):
    """A shard whose tail [valid:] is padding: after every encode the residual holds nothing
    there, and over the valid part sum(decoded) + residual == sum(gradients)."""
    codec, level = parse_spec(spec)
    ef = ErrorFeedback()
    n, valid = 3000, 2100
    sent = torch.zeros(n, dtype=torch.float64)
    came_in = torch.zeros(n, dtype=torch.float64)
    for step, grad in enumerate(gradients(40, n, seed=3)):
        grad[valid:] = 0  # padding carries no gradient, whatever the codec sends for it
        packet = ef.encode(("b", 1), grad, codec, level, RandomKey(step=step), valid=valid)
        assert not bool(ef.residuals[("b", 1)][valid:].any()), "the padding keeps no residual"
        sent += codec.decode(packet).double()
        came_in += grad.double()
    residual = ef.residuals[("b", 1)].double()
    scale = came_in.abs().max().item()
    assert torch.allclose((sent + residual)[:valid], came_in[:valid], atol=1e-5 * scale, rtol=0)
    if spec in ("quant:8", "quant:2", "sign"):  # these send something for the zeros too
        assert bool(sent[valid:].any())


def test_valid_at_or_beyond_the_end_and_zero():
    codec = make_codec("quant")
    ef = ErrorFeedback()
    grad = torch.randn(100)
    ef.encode("all", grad, codec, 8, valid=100)
    ef.encode("beyond", grad, codec, 8, valid=150)
    assert torch.equal(ef.residuals["all"], ef.residuals["beyond"])
    assert bool(ef.residuals["all"].any())
    ef.encode("none-valid", grad, codec, 8, valid=0)
    assert not bool(ef.residuals["none-valid"].any())
    with pytest.raises(TypeError, match="valid=1.5 must be an int"):
        ef.encode("x", grad, codec, 8, valid=1.5)


def test_take_and_put_move_residuals_and_nothing_else_writes_them():
    codec = make_codec("topk")
    ef = ErrorFeedback(dtype=torch.bfloat16)
    ef.encode("b", torch.randn(1000), codec, 0.01)
    held = ef.residuals["b"].clone()
    taken = ef.take("b")
    assert torch.equal(taken, held) and "b" not in ef.residuals
    assert ef.take("b") is None
    # put converts to the EF's dtype and copies: the caller's tensor is never written after
    mine = torch.randn(10, 100)  # any shape: residuals are flat
    ef.put("c", mine)
    assert ef.residuals["c"].dtype == torch.bfloat16 and ef.residuals["c"].shape == (1000,)
    before = mine.clone()
    ef.encode("c", torch.randn(1000), codec, 0.01)
    assert torch.equal(mine, before)
    with pytest.raises(TypeError):
        ef.residuals["d"] = torch.zeros(3)  # read-only: write through encode / take / put
    with pytest.raises(TypeError, match="residual: expected a floating-point tensor"):
        ef.put("d", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="bucket 'c' held 1000 elements and now has 999"):
        ef.encode("c", torch.randn(999), codec, 0.01)
    # a put residual is what the next encode feeds back
    ef2 = ErrorFeedback()
    ef2.put("k", torch.full((50,), 2.0))
    packet = ef2.encode("k", torch.zeros(50), make_codec("none"))
    assert torch.equal(make_codec("none").decode(packet), torch.full((50,), 2.0))
    assert not bool(ef2.residuals["k"].any())
