"""``mtpkit doctor``: why MTP is broken in a checkpoint; ``graft`` / ``fix-config``: repair it.

Heavy modules (torch, the model families) are imported only when a check needs them.
"""

from __future__ import annotations

__all__ = ["diagnose", "fix_config", "graft"]


def diagnose(path, engines=None, vllm_version=None):
    """Static checks of a checkpoint folder or GGUF file (see ``checks.diagnose``)."""
    from .checks import diagnose as _diagnose

    return _diagnose(path, engines, vllm_version)


def graft(*args, **kwargs):
    """Copy an MTP head into a checkpoint that lost it (see ``graft.graft``)."""
    from .graft import graft as _graft

    return _graft(*args, **kwargs)


def fix_config(*args, **kwargs):
    """Repair config, index and ignore list only (see ``graft.fix_config``)."""
    from .graft import fix_config as _fix

    return _fix(*args, **kwargs)
