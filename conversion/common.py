"""Wrapper of :mod:`hf_xformers.conversion.common` (the code lives in the package, so that it ships in the wheel)."""

import sys

from hf_xformers.conversion import common as _module

if __name__ == "__main__":
    if hasattr(_module, "main"):
        _module.main()
else:
    sys.modules[__name__] = _module
