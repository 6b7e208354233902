"""Errors raised while reading or writing checkpoints."""


class CheckpointError(Exception):
    """A checkpoint file is missing, unreadable or malformed; the message names the file and fix."""
