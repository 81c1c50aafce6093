"""The model library: find MoE models on the Hugging Face Hub, size them up against this machine,
download them into the shared HF cache, and list or remove what is already there.

Modules: catalog (curated list), supported (families the engine runs), remote (Hub metadata and
search), estimate (sizes from config.json), machine + fit (the verdict), download, local (cache and
folders), cli (`moescope models`). Importing this package is cheap; torch loads only to estimate.
"""
