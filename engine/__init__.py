"""MoEScope engine: offloaded, exact inference for Mixture-of-Experts models.

This package never imports Qt. `engine.protocol` and `engine.process.client` are also kept free of
torch so the GUI process can import them. Importing the engine sets nothing process-wide: each entry
point calls `engine.system.process_settings.apply_process_settings` first.
"""

__version__ = "0.1.0"
