"""Python's cycle collector beside a loaded model.

A loaded model is hundreds of thousands of Python objects (modules, parameters, the tokenizer's
vocabulary) that live as long as it does, and every full pass of the cycle collector walks all of
them. Such a pass comes every so many allocations, so now and then it fell inside a reply and held
that token up by the whole walk (the longest of these passes also set a benchmark's decode speed by
where it fell). Frozen after the load, those objects are left out of every later pass. They are
unfrozen when the model closes, so that the cycles between its modules and the expert cache can be
freed before the next model loads.
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """After a load: free the load's own cyclic garbage (and that of a model dropped without closing,
    frozen by its own load), then freeze what is left."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def unfreeze_for_unload() -> None:
    """When a model closes: its objects can be collected again (the caller's gc.collect frees them)."""
    gc.unfreeze()
