"""An elastic outer loop's plan for the regions present (cloudtrain.replan): the pure parts - the
book of links, what each region's link is for the schedule, and a schedule's codecs by region
name. The runs that plan on the emulated WAN are in tests/test_elastic.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cloudtrain.outer import Schedule
from cloudtrain.probe import LinkMatrix
from cloudtrain.replan import LinkBook, PairLink

MBIT = 1e6 / 8


def book_of(**links: tuple[float, float]) -> LinkBook:
    """LinkBook from a="b": (Mbit/s, ms) keyword pairs written "a_b"."""
    return LinkBook(
        {
            tuple(k.split("_")): PairLink(ms / 1000, mbit * MBIT, 1)
            for k, (mbit, ms) in links.items()
        }
    )


def test_a_regions_link_is_its_slowest_uplink_to_the_regions_present() -> None:
    book = book_of(a_b=(200, 80), b_a=(200, 80), a_c=(20, 180), c_a=(50, 180), b_c=(100, 180),
                   c_b=(50, 180))  # fmt: skip
    a, b, c = book.links(("a", "b", "c"), shards=2)
    assert a.bandwidth == pytest.approx(20 * MBIT / 2) and a.rtt == pytest.approx(0.08)
    assert b.bandwidth == pytest.approx(100 * MBIT / 2) and c.rtt == pytest.approx(0.18)
    # c lost: a's slow link to it no longer counts; nothing was measured again
    a, b = book.links(("a", "b"), shards=2)
    assert a.bandwidth == pytest.approx(200 * MBIT / 2) == b.bandwidth
    (alone,) = book.links(("a",), shards=1)
    assert alone.rtt == 0 and alone.bandwidth > 1e9


def test_only_the_pairs_nobody_measured_are_probed_and_the_newest_reading_counts() -> None:
    known = book_of(a_b=(200, 80), b_a=(150, 80))
    assert known.missing(("a", "b")) == []
    assert known.missing(("a", "b", "c")) == [(0, 2), (1, 2), (2, 0), (2, 1)]
    beta = ((math.inf, 0.0, 9.0), (0.0, math.inf, 8.0), (7.0, 6.0, math.inf))
    alpha = ((0.0, 0.0, 0.2), (0.0, 0.0, 0.3), (0.4, 0.5, 0.0))
    known.record(("a", "b", "c"), [(0, 2), (2, 1)], LinkMatrix(alpha, beta), stamp=7)
    assert known.pairs["a", "c"] == PairLink(0.2, 9.0, 7) and known.pairs["c", "b"].rtt == 0.5
    assert known.missing(("a", "b", "c")) == [(1, 2), (2, 0)]
    older = LinkBook({("a", "c"): PairLink(0.1, 99.0, 3)})
    merged = LinkBook.merged([older, known])
    assert merged.pairs["a", "c"] == PairLink(0.2, 9.0, 7)  # the newer, not the faster
    assert LinkBook.merged([known, older]).rows() == merged.rows()  # whatever the order
    assert LinkBook.from_rows(merged.rows()).pairs == merged.pairs


def test_a_schedules_codecs_go_by_region_name_and_a_newcomer_gets_the_fallback() -> None:
    q8, q4, top = ("quant", 8), ("quant", 4), ("topk>quant", (0.02, 2))
    planned = Schedule(50, (q8, q4), 0.3, True, regions=("a", "c"), start=105)
    assert planned.rungs_of(("a", "c"), top) == (q8, q4)
    assert planned.rungs_of(("a", "b", "c"), top) == (q8, top, q4)  # b joined since
    fixed = Schedule(10, (q8,), 0.0, True)  # a fixed codec, regions not named
    assert fixed.rungs_of(("a", "b", "c"), top) == (q8, q8, q8)
    provisional = Schedule(5, (), 0.0, False)
    assert provisional.provisional and not planned.provisional
    assert provisional.rungs_of(("a", "b"), top) == (top, top)
    state = {
        "sync_every": 50,
        "rungs": [["quant", 8], ["quant", 4]],
        "exchange_s": 0.3,
        "fits": True,
    }  # fmt: skip  (saved before elastic plans)
    assert Schedule.from_state(state) == Schedule(50, (q8, q4), 0.3, True)
    assert Schedule.from_state(dataclasses.asdict(planned)) == planned
