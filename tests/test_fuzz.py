"""Fuzzing the packet decoder: 100,000 damaged or hostile packets of every codec, in a child process
that measures its own peak memory. Every failure must be a PacketError, nothing may decode to a
tensor other than the one that was sent, and no packet may make the receiver allocate more than
it expects.

    python tests/test_fuzz.py [count] [seed]     # the child on its own: prints its figures

Kinds of damage: random byte flips, truncation, extension and splices (the CRC catches these);
header fields rewritten to random or extreme values with the CRC fixed up (a buggy or hostile
sender: `from_wire(..., expect=...)` must catch these against the receiver's plan); payload bytes
rewritten with the CRC fixed up (must decode to *some* tensor of the right shape, or raise); and
hand-made hostile headers: huge numel, huge part sizes, zstd frames that lie about their size or
are real bombs, a step >= 2**63, a random-k packet claiming 2**28 elements.
"""

from __future__ import annotations

import json
import random
import resource
import struct
import subprocess
import sys
import time

import torch
from support import grad_like
from wire import FIELDS, HEADER, forge, with_crc

from cloudtrain.compress import (
    HEADER_NBYTES,
    Expected,
    PacketError,
    RandomKey,
    from_wire,
    make_codec,
    parse_spec,
    to_wire,
)
from cloudtrain.compress.bench import CORE_CASES

COUNT = 100_000
SPECS = [
    *CORE_CASES,
    "topk:0.3",
    "randomk:0.1",
    "topk:0.05>quant:8",
    "topk:0.05>fp16",
    "randomk:0.1>topk:0.1>quant:4",
    "randomk:0.5>randomk:0.5",
]
WIDTH = {"B": 8, "I": 32, "Q": 64}
KINDS = HEADER.format.lstrip("<").replace("4s", "s").replace("4d", "dddd").replace("8I", "I" * 8)
KEY = RandomKey(seed=7, step=3, bucket=2, rank=1)


def zstd_bomb(nbytes: int) -> bytes:
    """A real zstd frame of nbytes zeros that states its size, made without holding nbytes."""
    import io

    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, size=nbytes, closefd=False) as w:
        chunk = bytes(1 << 20)
        for _ in range(nbytes >> 20):
            w.write(chunk)
    return out.getvalue()


def extreme(rng: random.Random, kind: str, old):
    if kind == "d":
        return rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e300, 2.0, old * 2, old / 3])
    if kind == "s":
        return rng.choice([b"CTPK", b"CTPL", bytes(rng.randrange(256) for _ in range(4))])
    top = (1 << WIDTH[kind]) - 1
    return rng.choice([0, 1, top, top >> 1, (top >> 1) + 1, old + 1, max(old - 1, 0), old * 2])


def make_originals():
    """(codec, wire bytes, expect, decoded) for every codec at a few sizes, with and without zstd."""
    originals = []
    for spec in SPECS:
        for n in (5, 1500):
            for zstd in (None, 3):
                codec, level = parse_spec(spec)
                x = grad_like(n, seed=n)
                if zstd is not None:
                    x[::3] = 0  # something for zstd to find
                wire = to_wire(codec.encode(x, level, KEY), zstd_level=zstd)
                expect = Expected(n, level, KEY, zstd=zstd is not None, dtype=torch.float32)
                decoded = codec.decode(from_wire(wire, codec, expect=expect))
                originals.append((codec, bytes(wire.numpy().tobytes()), expect, decoded))
    return originals


def make_hostile():
    """(codec, bytes, expect) of hand-made attacks; expect None where the attack does not need
    the receiver's plan to be refused."""
    none, randomk, quant = make_codec("none"), make_codec("randomk"), make_codec("quant")
    small = bytes(to_wire(none.encode(torch.ones(64), None, KEY)).numpy().tobytes())
    plan = Expected(64, None, KEY, zstd=True)
    gib = dict(numel=2**28, size0=2**30, flags=1)
    tib_frame = b"\x28\xb5\x2f\xfd\xe0" + (2**40).to_bytes(8, "little") + b"\x01\x00\x00"
    gib_frame = b"\x28\xb5\x2f\xfd\xe0" + (2**30).to_bytes(8, "little") + b"\x01\x00\x00"
    bomb = zstd_bomb(64 << 20)  # 64 MiB of zeros in about 2 KiB
    bomb_header = dict(numel=16 << 20, size0=64 << 20, flags=1)
    rk = bytes(to_wire(randomk.encode(torch.ones(64), 4 / 64, KEY)).numpy().tobytes())
    q = bytes(to_wire(quant.encode(torch.ones(64), 8, KEY)).numpy().tobytes())
    hostile = [
        (none, forge(small, step=2**63), None),
        (none, forge(small, step=2**64 - 1), plan),
        (none, forge(small, seed=2**63), None),
        (none, forge(small, tib_frame, **gib), None),  # 16 bytes claiming 1 TiB
        (none, forge(small, gib_frame, **gib), None),  # 16 bytes claiming the layout's 1 GiB
        (none, forge(small, tib_frame, **gib), plan),
        (none, forge(small, tib_frame, numel=2**38, flags=1), None),  # part size cannot hold it
        (none, forge(small, bomb, **bomb_header), plan),  # a real bomb, for another numel
        (none, forge(small, bomb, **bomb_header), Expected(16 << 20, None, KEY)),  # no zstd
        (none, forge(small, bomb, flags=1), plan),  # a real bomb where 256 bytes are expected
        (none, forge(small, numel=2**64 - 1), None),
        (none, forge(small, numel=2**40, size0=0), plan),
        (none, forge(small, nparts=8, **{f"size{i}": 2**32 - 1 for i in range(8)}), None),
        (randomk, forge(rk, numel=2**28, l0=4 / 2**28), Expected(64, 4 / 64, KEY)),
        (quant, forge(q, numel=2**40, size0=2**32 - 1, size1=2**31, size2=2**31), None),
        (quant, forge(q, l0=float("nan")), None),
        (quant, forge(q, nlevels=4, l1=8.0), None),
    ]
    return hostile


def fuzz(count: int = COUNT, seed: int = 0) -> dict:
    rng = random.Random(seed)
    originals = make_originals()
    hostile = make_hostile()
    # warm up every decode path before the baseline, so lazy initialisation is not counted
    for codec, data, expect, _ in originals:
        codec.decode(from_wire(data, codec, expect=expect))
    # a splice can rebuild another valid packet exactly: that one's tensor is the right answer
    sent = {data: decoded for _, data, _, decoded in originals}
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # a high-water mark: taken
    # before any hostile packet, so what one of them allocates counts as growth
    for codec, data, expect in hostile:  # the hostile ones must all be refused, every time
        try:
            from_wire(data, codec, expect=expect)
        except PacketError:
            continue
        raise AssertionError(f"hostile packet accepted: {HEADER.unpack(data[:HEADER_NBYTES])}")
    outcomes = {"rejected": 0, "accepted": 0}
    failures, wrong, by_kind = [], [], {}
    start = time.perf_counter()
    for _ in range(count):
        kind = rng.choices(
            ["flip", "truncate", "extend", "splice", "header", "payload", "hostile"],
            weights=[30, 8, 6, 6, 35, 10, 5],
        )[0]
        codec, data, expect, decoded = rng.choice(originals)
        use_expect = kind in ("header", "payload") or rng.random() < 0.5
        if kind == "flip":
            buf = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] ^= rng.randrange(1, 256)
            buf = bytes(buf)
        elif kind == "truncate":
            buf = data[: rng.randrange(len(data))]
        elif kind == "extend":
            buf = data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif kind == "splice":
            other = rng.choice(originals)[1]
            cut = rng.randrange(min(len(data), len(other)))
            buf = data[:cut] + other[cut:]
        elif kind == "header":
            values = list(HEADER.unpack(data[:HEADER_NBYTES]))
            for _ in range(rng.randint(1, 2)):
                i = rng.randrange(len(FIELDS) - 1)  # any field but the CRC
                values[i] = extreme(rng, KINDS[i], values[i])
            try:
                buf = with_crc(values, data[HEADER_NBYTES:])
            except struct.error:  # e.g. a level of another type: not representable, skip
                continue
        elif kind == "payload":
            if len(data) == HEADER_NBYTES:
                continue
            body = bytearray(data[HEADER_NBYTES:])
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            buf = forge(data, bytes(body))
        else:
            codec, buf, expect = rng.choice(hostile)
            use_expect, decoded = expect is not None, None
        by_kind[kind] = by_kind.get(kind, 0) + 1
        try:
            y = codec.decode(from_wire(buf, codec, expect=expect if use_expect else None))
        except PacketError:
            outcomes["rejected"] += 1
            continue
        except Exception as e:  # the bug this test exists for
            failures.append(f"{kind}: {type(e).__name__}: {e}"[:300])
            continue
        outcomes["accepted"] += 1
        if kind == "payload":  # a sender's own bytes: any tensor of the planned shape
            if y.numel() != expect.numel or y.dtype != expect.dtype:
                wrong.append(f"payload: {y.numel()} elements of {y.dtype}")
            continue
        decoded = sent.get(buf, decoded)
        if decoded is None or y.dtype != decoded.dtype or not torch.equal(y, decoded):
            wrong.append(f"{kind}: decoded to another tensor")
    seconds = time.perf_counter() - start
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kib) / 1024
    return {
        "packets": count,
        "seconds": round(seconds, 2),
        "peak_memory_growth_mb": round(growth_mb, 1),
        "baseline_mb": round(base_kib / 1024, 1),
        **outcomes,
        "by_kind": by_kind,
        "hostile_kinds": len(hostile),
        "failures": failures[:20],
        "wrong": wrong[:20],
    }


def test_fuzzed_packets_raise_packet_error_or_decode_exactly():
    result = subprocess.run(
        [sys.executable, __file__, str(COUNT)], capture_output=True, text=True, timeout=500
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(figures)  # shown with pytest -s: the figures of the closing note
    assert figures["failures"] == [], "every failure must be a PacketError"
    assert figures["wrong"] == [], "nothing may decode to a tensor other than the one sent"
    # below the smallest bomb (64 MiB of zeros in a 2 KiB zstd frame): one decompressed shows
    assert figures["peak_memory_growth_mb"] < 32, figures
    assert figures["rejected"] > 0.7 * COUNT and figures["accepted"] > 0  # both paths ran
    assert figures["by_kind"].get("hostile", 0) > 0.02 * COUNT


if __name__ == "__main__":
    print(json.dumps(fuzz(*(int(a) for a in sys.argv[1:]))))
