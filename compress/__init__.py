"""cloudtrain.compress - gradient codecs, error feedback and the packet wire format.

Pure tensor math, no torch.distributed. Start with `make_codec` / `parse_spec` (codecs/), wrap
with `ErrorFeedback` (feedback.py), and move packets with `to_wire` / `from_wire` (packet.py);
`zstd_gain` (zstd.py) says whether the packets' zstd stage pays on a link. `register_codec` adds
a codec of your own. ladders.py holds the ladders of codecs the core's controllers climb.
`reference.py` is the pure-PyTorch oracle of every hot operation; `bench.py` measures them:

    python -m cloudtrain.compress.bench --json
"""

from .codecs import (
    Codec,
    CodecKind,
    Sparse,
    Sparsifier,
    all_finite,
    check_finite,
    density_k,
    flat_float,
    make_codec,
    parse_spec,
    register_codec,
    registered_codecs,
)
from .feedback import ErrorFeedback
from .packet import (
    HEADER_NBYTES,
    Expected,
    Packet,
    PacketError,
    cut,
    from_wire,
    read_header,
    to_wire,
)
from .rng import RandomKey
from .zstd import ZstdGain, wire_zstd_gain, zstd_gain

__all__ = [
    "HEADER_NBYTES",
    "Codec",
    "CodecKind",
    "ErrorFeedback",
    "Expected",
    "Packet",
    "PacketError",
    "RandomKey",
    "Sparse",
    "Sparsifier",
    "ZstdGain",
    "all_finite",
    "check_finite",
    "cut",
    "density_k",
    "flat_float",
    "from_wire",
    "make_codec",
    "parse_spec",
    "read_header",
    "register_codec",
    "registered_codecs",
    "to_wire",
    "wire_zstd_gain",
    "zstd_gain",
]
