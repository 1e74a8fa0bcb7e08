"""cloudtrain.layout.BucketLayouts in process, with real tensors and a real ErrorFeedback; what
DDP would hand over - a bucket's flat buffer, its parameters and their gradients as views into
it - is made by hand. No process is started.

- A layout change releases every residual, cut at parameter boundaries, into `pending` (the
  padding of a last shard is no gradient and is dropped).
- A DDP bucket made of known buckets - the same one reordered, or after a resume DDP's one
  initial bucket holding the saved buckets - is reduced as those: nothing is released.
- `inject` adds each pending piece once, where its parameter now sits.

    .venv/bin/pytest tests/test_layout.py -q
"""

from __future__ import annotations

import pytest
import torch

from cloudtrain.compress import ErrorFeedback
from cloudtrain.layout import BucketLayouts, Unit, layout_numel

SHAPES = [(3,), (2, 2), (4,)]
"""The model's parameters: 3 + 4 + 4 = 11 elements."""
INITIAL = ((2, 0, 4), (1, 4, 4), (0, 8, 3))
"""DDP's first bucket: every parameter, in the order of parameters() reversed."""
REBUILT = {0: ((0, 0, 3), (1, 3, 4)), 1: ((2, 0, 4),)}
"""DDP's buckets after its rebuild (after step 1, in the order the gradients were ready), by
index."""
REORDERED = ((0, 0, 3), (1, 3, 4), (2, 7, 4))
"""DDP's first bucket with its parameters in another order."""


def parameters() -> list[torch.Tensor]:
    return [torch.zeros(shape, requires_grad=True) for shape in SHAPES]


def ddp_bucket(params: list[torch.Tensor], layout) -> tuple[torch.Tensor, list, list]:
    """What DDP hands the hook for a bucket laid out as `layout`: its flat buffer, its
    parameters and their gradients (views into the buffer)."""
    buffer = torch.zeros(layout_numel(layout))
    grads = [buffer[offset : offset + numel].view(params[pi].shape) for pi, offset, numel in layout]
    return buffer, [params[pi] for pi, _, _ in layout], grads


def residuals(ef: ErrorFeedback, index: int, n: int, shards: int) -> list[torch.Tensor]:
    """Distinct residuals 1, 2, 3, ... for bucket `index`'s shards of ceil(n / shards) elements
    (the last padded), installed in `ef`; returns them as put."""
    m = -(-n // shards)
    values = torch.arange(1, shards * m + 1, dtype=torch.float32) + 100 * index
    out = [values[s * m : (s + 1) * m].clone() for s in range(shards)]
    for s, r in enumerate(out):
        ef.put((index, s), r)
    return out


def test_signature_is_each_parameters_place_in_ddps_buffer():
    params = parameters()
    layouts = BucketLayouts(params)
    for layout in (INITIAL, *REBUILT.values(), REORDERED):
        assert layouts.signature(*ddp_bucket(params, layout)) == layout


def test_a_known_bucket_is_learnt_once_and_then_is_its_own_unit():
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback()
    assert layouts.units(0, INITIAL, ef) == [Unit(0, INITIAL)]
    assert layouts.layouts == {0: INITIAL}
    held = residuals(ef, 0, 11, 2)
    assert layouts.units(0, INITIAL, ef) == [Unit(0, INITIAL)]
    assert layouts.pending == {}
    for s, r in enumerate(held):
        assert torch.equal(ef.residuals[(0, s)], r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layout_change_releases_residuals_at_parameter_boundaries_into_pending(dtype):
    """Bucket 0 was learnt as INITIAL (11 elements, 2 shards of 6: the last element of shard 1
    is padding); DDP rebuilds it into two buckets."""
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback(dtype)
    layouts.units(0, INITIAL, ef)
    r0, r1 = residuals(ef, 0, 11, 2)
    assert layouts.units(0, REBUILT[0], ef) == [Unit(0, REBUILT[0])]
    assert layouts.layouts == {0: REBUILT[0]}
    assert dict(ef.residuals) == {}, "every residual of the old layout left the error feedback"
    # INITIAL: parameter 2 at [0, 4), 1 at [4, 8), 0 at [8, 11); shard 0 is [0, 6), shard 1 [6, 12)
    expected = {2: [(0, r0[0:4])], 1: [(0, r0[4:6]), (2, r1[0:2])], 0: [(0, r1[2:5])]}
    assert layouts.pending.keys() == expected.keys()
    for pi, pieces in expected.items():
        got = layouts.pending[pi]
        assert [start for start, _ in got] == [start for start, _ in pieces], pi
        for (_, a), (_, b) in zip(got, pieces, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b), pi
    released = sum(piece.numel() for pieces in layouts.pending.values() for _, piece in pieces)
    assert released == 11, "the padding (r1[5]) is not gradient and is not released"
    # the second rebuilt bucket holds no parameter of a known one: learnt, nothing released
    assert layouts.units(1, REBUILT[1], ef) == [Unit(1, REBUILT[1])]
    assert layouts.layouts == REBUILT
    assert sum(len(pieces) for pieces in layouts.pending.values()) == 4


def test_a_bucket_of_the_same_parameters_in_another_order_is_the_known_one_placed():
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback()
    layouts.units(0, INITIAL, ef)
    held = residuals(ef, 0, 11, 2)
    placed = ((2, 7, 4), (1, 3, 4), (0, 0, 3))  # where INITIAL's parameters sit in REORDERED
    assert layouts.units(0, REORDERED, ef) == [Unit(0, INITIAL, placed)]
    assert layouts.layouts == {0: INITIAL} and layouts.pending == {}
    for s, r in enumerate(held):
        assert torch.equal(ef.residuals[(0, s)], r)


def test_a_bucket_that_is_neither_known_nor_made_of_known_ones_releases_every_residual():
    """Two saved buckets; DDP's bucket 0 holds bucket 0's parameter and half of bucket 1's."""
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback()
    layouts.units(0, ((2, 0, 4),), ef)
    layouts.units(1, ((1, 0, 4), (0, 4, 3)), ef)
    residuals(ef, 0, 4, 1)
    residuals(ef, 1, 7, 1)
    mixed = ((2, 0, 4), (1, 4, 4))
    assert layouts.units(0, mixed, ef) == [Unit(0, mixed)]
    assert layouts.layouts == {0: mixed}, "the old layouts are forgotten, the new one learnt"
    assert dict(ef.residuals) == {}
    assert sorted(layouts.pending) == [0, 1, 2]


def test_a_new_bucket_over_known_parameters_releases_them():
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback()
    layouts.units(0, ((0, 0, 3),), ef)
    (r,) = residuals(ef, 0, 3, 1)
    wider = ((0, 0, 3), (1, 3, 4))
    assert layouts.units(1, wider, ef) == [Unit(1, wider)]
    assert layouts.layouts == {1: wider}
    assert [start for start, _ in layouts.pending[0]] == [0]
    assert torch.equal(layouts.pending[0][0][1], r)


def test_without_error_feedback_a_layout_change_only_relearns():
    layouts = BucketLayouts(parameters())
    layouts.units(0, INITIAL, None)
    assert layouts.units(0, REBUILT[0], None) == [Unit(0, REBUILT[0])]
    assert layouts.layouts == {0: REBUILT[0]} and layouts.pending == {}


def test_a_resume_splits_ddps_one_bucket_into_the_saved_buckets():
    """The saved run had rebuilt its buckets into two; a fresh DDP starts with INITIAL. Each saved
    bucket is a unit, placed where its parameters sit in DDP's bucket; nothing is released."""
    saved = {0: ((2, 0, 4),), 1: ((1, 0, 4), (0, 4, 3))}
    before, ef = BucketLayouts(parameters()), ErrorFeedback()
    for index, layout in saved.items():
        before.units(index, layout, ef)
    held = {0: residuals(ef, 0, 4, 1), 1: residuals(ef, 1, 7, 2)}
    resumed = BucketLayouts(parameters())
    resumed.load_state_dict(before.state_dict())
    assert resumed.units(0, INITIAL, ef) == [
        Unit(0, saved[0], ((2, 0, 4),)),
        Unit(1, saved[1], ((1, 4, 4), (0, 8, 3))),
    ]
    assert resumed.layouts == saved and resumed.pending == {}
    for index, shards in held.items():
        for s, r in enumerate(shards):
            assert torch.equal(ef.residuals[(index, s)], r)
    # DDP's rebuild then lays the buckets out as saved: each is known
    assert resumed.units(1, saved[1], ef) == [Unit(1, saved[1])]


def test_inject_adds_each_pending_piece_once_where_its_parameter_now_sits():
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback()
    layouts.units(0, INITIAL, ef)
    r0, r1 = residuals(ef, 0, 11, 2)
    layouts.units(0, REBUILT[0], ef)  # released: pending
    buf1 = torch.full((4,), 0.5)  # the scaled gradients
    buf0 = torch.full((7,), 0.5)
    layouts.inject(REBUILT[1], buf1)  # only parameter 2's pieces are taken
    assert sorted(layouts.pending) == [0, 1]
    layouts.inject(REBUILT[0], buf0)
    assert layouts.pending == {}
    # INITIAL had parameter 2 at [0, 4), 1 at [4, 8), 0 at [8, 11); now 0 at [0, 3), 1 at [3, 7)
    # of bucket 0 and 2 at [0, 4) of bucket 1
    expected0, expected1 = 0.5 + torch.cat([r1[2:5], r0[4:6], r1[0:2]]), 0.5 + r0[0:4]
    assert torch.equal(buf0, expected0) and torch.equal(buf1, expected1)
    layouts.inject(REBUILT[0], buf0)  # nothing is left to add
    layouts.inject(REBUILT[1], buf1)
    assert torch.equal(buf0, expected0) and torch.equal(buf1, expected1)


def test_inject_casts_to_the_buckets_dtype():
    layouts = BucketLayouts(parameters())
    layouts.pending = {1: [(1, torch.tensor([1.0, 2.0]))]}
    buf = torch.zeros(4, dtype=torch.bfloat16)
    layouts.inject(((1, 0, 4),), buf)
    assert torch.equal(buf, torch.tensor([0.0, 1.0, 2.0, 0.0], dtype=torch.bfloat16))


def test_state_dict_round_trip_keeps_layouts_and_pending_as_copies():
    layouts, ef = BucketLayouts(parameters()), ErrorFeedback()
    layouts.units(0, INITIAL, ef)
    residuals(ef, 0, 11, 2)
    layouts.units(0, REBUILT[0], ef)
    state = layouts.state_dict()
    back = BucketLayouts(parameters())
    back.load_state_dict(state)
    assert back.layouts == layouts.layouts == {0: REBUILT[0]}
    assert back.pending.keys() == layouts.pending.keys()
    for pi, pieces in layouts.pending.items():
        for (s, a), (t, b) in zip(pieces, back.pending[pi], strict=True):
            assert s == t and torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_shard_numels_before_and_after_the_first_layout():
    params = parameters()
    params.append(torch.zeros(5))  # frozen: DDP leaves it out of its buckets
    layouts = BucketLayouts(params)
    assert layouts.shard_numels(2) == [6], "the model as one bucket: ceil(11 / 2)"
    layouts.units(0, ((2, 0, 4),), None)
    layouts.units(1, ((1, 0, 4), (0, 4, 3)), None)
    assert layouts.shard_numels(2) == [2, 4]


def test_a_unit_gathers_its_pieces_and_scatters_them_back():
    buf = torch.arange(10.0)
    # DDP's bucket holds parameter 1 at 0..3 and parameter 0 at 4..9; the unit lays 0 first
    unit = Unit(3, ((0, 0, 6), (1, 6, 4)), ((0, 4, 6), (1, 0, 4)))
    piece = unit.gather(buf)
    assert piece.tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3]
    target = torch.zeros(10)
    unit.scatter(piece * 2, target)
    assert torch.equal(target, buf * 2)
    whole = Unit(0, ((0, 0, 10),))  # DDP's bucket is the unit: itself, or a copy
    assert whole.gather(buf) is buf and whole.gather(buf, copy=True).data_ptr() != buf.data_ptr()
    copy = whole.gather(buf, copy=True).mul_(3)
    whole.scatter(copy, buf)
    assert torch.equal(buf, torch.arange(10.0) * 3)
