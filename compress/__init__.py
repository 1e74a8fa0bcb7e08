"""cloudtrain.compress - gradient codecs, error feedback and the packet wire format.

Pure tensor math, no torch.distributed. Start with `make_codec` / `parse_spec` (codecs.py), wrap
with `ErrorFeedback` (feedback.py), and move packets with `to_wire` / `from_wire` (packet.py).
`reference.py` is the pure-PyTorch oracle of every hot operation; `bench.py` measures them:

    python -m cloudtrain.compress.bench --json
"""

from .codecs import (
    Codec,
    CodecKind,
    Dense,
    Sparse,
    all_finite,
    check_finite,
    density_k,
    flat_float,
    make_codec,
    parse_spec,
)
from .feedback import ErrorFeedback
from .packet import HEADER_NBYTES, Packet, PacketError, from_wire, read_header, to_wire
from .rng import RandomKey

__all__ = [
    "HEADER_NBYTES",
    "Codec",
    "CodecKind",
    "Dense",
    "ErrorFeedback",
    "Packet",
    "PacketError",
    "RandomKey",
    "Sparse",
    "all_finite",
    "check_finite",
    "density_k",
    "flat_float",
    "from_wire",
    "make_codec",
    "parse_spec",
    "read_header",
    "to_wire",
]
