"""Errors raised while reading or writing checkpoints; each names the file or tensor at fault."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: a checkpoint directory cannot be used as it is."""


class MissingFileError(CheckpointError):
    """A required file (config.json, the index, a shard) is not there."""


class CorruptFileError(CheckpointError):
    """A file exists but cannot be parsed: truncated shard, bad header, invalid JSON."""


class MissingTensorError(CheckpointError):
    """A tensor the caller needs is not listed in the checkpoint."""


class OutputExistsError(CheckpointError):
    """The output directory already holds something this tool did not write."""
