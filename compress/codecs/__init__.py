"""Gradient codecs: pure encode/decode pairs over a flat tensor, in a registry a user can extend.

    codec = make_codec("topk")                       # or "quant", "randomk>topk>quant", ...
    packet = codec.encode(x, level=0.01, key=RandomKey(seed, step, bucket, rank))
    y = codec.decode(packet)                          # same numel and dtype as x
    codec.nbytes(x.numel(), 0.01)                     # exact wire bytes, known before encoding

Built-in codecs. Dense ones keep every element: `none` (as is), `fp16`, `bf16`, `quant` (bits
2/4/8, per-group min/max scale, stochastic or nearest rounding, bit-packed), `sign` (1 bit +
per-group mean |x|, EF-signSGD). Sparsifiers keep k = ceil(density * n) elements: `topk` (exactly
the k largest |x|; the threshold is found from a sample first, as in DGC, unless sampled=False -
the kept elements are the same either way), `randomk` (indices from the shared RandomKey, none on
the wire). "topk-sampled" is an old name of `topk`. Compositions chain sparsifiers and end with a
dense codec for the kept values, written with ">": "randomk>topk>quant" is CocktailSGD's random-k,
then top-k of those, then 4-bit values (level (0.1, 0.1, 4)). A later sparsifier's indices are
positions within the previous selection, so they code in fewer bits.

A level is the codec's one knob: bits for `quant`, density for sparsifiers, none for the rest; a
composition's level is a tuple with one entry per stage (None for stages without a knob).
`parse_spec("randomk:0.1>topk:0.1>quant:4")` gives codec and level from one string.

Adding a codec: subclass `Codec` (a dense codec: `name`, `layout`, `_encode`, `_decode`; a level
if `takes_level`) or `Sparsifier` (a selection stage), and `register_codec("mine", factory)`.
The factory receives the parameters it names among those given to `make_codec` (`group_size`,
`rounding`, `nonfinite`, `sampled`, ...); the others are not passed. A registered dense codec can
also end a composition ("topk>mine").

Error feedback lives in feedback.py and is the only caller of `encode_ef`, the fused step it
runs (fused native ops where there are some, `x + r -> encode -> r = acc - decode` otherwise).
The hot ops come from ops.py: native kernels where built, reference.py otherwise. Non-finite
input: `nonfinite="raise"` (default) raises; "pass" lets NaN/Inf through deterministically
(NaN/Inf are selected first by top-k and poison their quantization group), so every rank sums the
same non-finite values and AMP's GradScaler skips the step on all.

The package, one family per module:

- base.py: the `Codec` contract and the input checks (`flat_float`, `all_finite`, ...);
- dense.py: `none`, `fp16`, `bf16`, `quant`, `sign`;
- sparse.py: the sparsifiers (`topk`, `randomk`) and `Sparse`, their composition;
- registry.py: `register_codec`, `make_codec`, `parse_spec`, `CodecKind`.
"""

from .base import NONFINITE, Codec, Level, all_finite, check_finite, flat_float, is_number
from .dense import QUANT_LEVELS, ROUNDINGS, Bf16, Cast, Fp16, Grouped, NoneCodec, Quant, Sign
from .registry import (
    CodecFactory,
    CodecKind,
    make_codec,
    parse_spec,
    register_codec,
    registered_codecs,
)
from .sparse import RandomK, Sparse, Sparsifier, TopK, density_k
from .sparse import _random_indices as _random_indices  # tests check the draws themselves

__all__ = [
    "NONFINITE",
    "QUANT_LEVELS",
    "ROUNDINGS",
    "Bf16",
    "Cast",
    "Codec",
    "CodecFactory",
    "CodecKind",
    "Fp16",
    "Grouped",
    "Level",
    "NoneCodec",
    "Quant",
    "RandomK",
    "Sign",
    "Sparse",
    "Sparsifier",
    "TopK",
    "all_finite",
    "check_finite",
    "density_k",
    "flat_float",
    "is_number",
    "make_codec",
    "parse_spec",
    "register_codec",
    "registered_codecs",
]
