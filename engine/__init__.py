"""MoEScope engine: offloaded, exact inference for Mixture-of-Experts models.

This package never imports Qt. `engine.protocol` and `engine.process.client` are also kept free of
torch so the GUI process can import them.
"""

import os

__version__ = "0.1.0"

# MKL's float32 products (torch's grouped_mm among them) take alignment-dependent paths on some CPUs
# (its AVX2 code): the same weights at another address give other last bits. In its strict
# reproducible mode a result no longer depends on where a slot lies, so `--exact` replies do not
# change with the budget's slot layout, and equal transformers' run in the same mode (the tests do).
# It must be set before MKL's first call, hence here, on the first import of any engine module.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
