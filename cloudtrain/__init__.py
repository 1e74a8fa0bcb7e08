"""cloudtrain - data-parallel PyTorch training over slow, uneven networks.

    import cloudtrain
    cloudtrain.init()                               # horovodrun, torchrun or a single process
    model = cloudtrain.CloudDDP(model, "auto")       # gradients compressed only across regions
    cloudtrain.fully_shard(model)                    # or: FSDP2 inside regions (cloudtrain.sharded)

Gradient codecs live in `cloudtrain.compress`. See README.md for the two commands that set up,
test and demonstrate everything. Names are imported on first use, so the `cloudtrain` command
starts without loading torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "init": "bootstrap",
    "CompressionConfig": "config",
    "OuterConfig": "options",
    "ElasticConfig": "options",
    "ControllerOptions": "options",
    "PRESETS": "config",
    "CloudDDP": "ddp",
    "fully_shard": "sharded",
    "device_mesh": "shard_units",
    "ShardedComm": "sharded",
    "ConfigMismatch": "ddp",
    "ReplicaMismatch": "hook",
    "CommError": "collectives",
    "CommStats": "stats",
    "ShareSampler": "shares",
    "RegionLeft": "quorum",
    "ElasticRefused": "quorum",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'cloudtrain' has no attribute {name!r}")
