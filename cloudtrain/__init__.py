"""cloudtrain - data-parallel PyTorch training over slow, uneven networks.

Gradient codecs live in `cloudtrain.compress`. See README.md for the two commands that set up,
test and demonstrate everything.
"""

__version__ = "0.1.0"
