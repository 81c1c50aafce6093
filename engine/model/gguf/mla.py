"""DeepSeek's MLA `kv_b_proj` in a GGUF file, which llama.cpp's converter writes in two parts.

For its absorbed attention, `DeepseekV2Model.modify_tensors` splits `kv_b_proj` ([heads * (nope + v),
kv_lora]) per head into `attn_k_b` (the nope rows, transposed: [heads, kv_lora, nope]) and
`attn_v_b` ([heads, v, kv_lora]). transformers' model reads the original matrix, so both parts are
recorded for it (the second under `key + V_B`) and joined back when the dense weights load. Files
converted before that split carry `attn_kv_b` itself and need none of this.
"""

from __future__ import annotations

import numpy as np

V_B = "+v_b"  # the dense-record key of the second part


def split_parts(gguf_name: str, tensors: dict) -> tuple | None:
    """(attn_k_b, attn_v_b) tensors standing in for `attn_kv_b` gguf_name, or None."""
    if not gguf_name.endswith("attn_kv_b.weight") or gguf_name in tensors:
        return None
    k_b, v_b = (tensors.get(gguf_name.replace("attn_kv_b", part)) for part in ("attn_k_b", "attn_v_b"))
    return (k_b, v_b) if k_b is not None and v_b is not None else None


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray, heads: int, kv_lora: int) -> np.ndarray:
    """`kv_b_proj` [heads * (nope + v), kv_lora] from the file's parts (their values, in any shape)."""
    k_b = k_b.reshape(heads, kv_lora, -1)
    v_b = v_b.reshape(heads, -1, kv_lora)
    return np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, kv_lora)
