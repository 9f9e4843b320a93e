"""Wrapper of :mod:`hf_xformers.conversion.convert_from_transformers` (the code lives in the package, so that it ships in the wheel)."""

import sys

from hf_xformers.conversion import convert_from_transformers as _module

if __name__ == "__main__":
    if hasattr(_module, "main"):
        _module.main()
else:
    sys.modules[__name__] = _module
