"""mtpkit: Multi-Token-Prediction speculative decoding.

The Python API (docs/python-api.md)::

    import mtpkit
    model = mtpkit.load()  # the built-in model, or mtpkit.load("path/to/checkpoint")
    out = model.generate("Write a haiku about the sea.", max_tokens=64)
    print(out.text, out.metrics.acceptance_rate)
    report = mtpkit.doctor("path/to/checkpoint")

Its names are imported on first use, so ``import mtpkit`` (and the CLI) stays light.
"""

import types as _types

from . import doctor  # the subpackage (light: its checks import on first use)

__version__ = "0.1.0"

__all__ = ["Generation", "LoadError", "Model", "Stream", "__version__", "doctor", "evaluate",
           "load"]

_API = {"Generation", "LoadError", "Model", "Stream", "evaluate", "load"}


class _DoctorPackage(_types.ModuleType):
    """``mtpkit.doctor`` stays the subpackage (mtpkit.doctor.checks, ...) and, called, is
    the API's ``mtpkit.api.doctor``: a submodule's import would overwrite a plain function
    of that name on the package."""

    def __call__(self, path, engines=None, measure=False, reference=None, device="cpu"):
        """Diagnose a checkpoint's MTP head as `mtpkit doctor` does; returns the Report."""
        from .api import doctor as _doctor

        return _doctor(path, engines=engines, measure=measure, reference=reference,
                       device=device)


doctor.__class__ = _DoctorPackage


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'mtpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
