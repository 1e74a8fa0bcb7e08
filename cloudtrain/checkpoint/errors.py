"""The errors of cloudtrain.checkpoint, in a module of their own because the stores, the format
and the Checkpointer all raise them. CheckpointError and CheckpointNotFoundError are public
(import them from cloudtrain.checkpoint); IncompleteStep never leaves the package: it tells a
reader to skip a step and try an older one.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says where and what to do."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint exists under the URI (or not the step asked for)."""


class IncompleteStep(Exception):
    """This step is not a usable checkpoint (half-written or corrupt): try an older one."""
