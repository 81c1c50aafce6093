"""One decode token of DeepSeek-V3-style multi-head latent attention (MLA) with the up-projection
absorbed, inside a native step.

transformers caches MLA's compressed latents (one `kv_lora_rank` row and one shared rotary key per
position) and, every step, expands the whole cache through `kv_b_proj` into per-head keys and values
before attending: for a one-query step that is a [positions x rank] by [rank x heads*(nope+v)]
product per layer, growing with the context, which outweighs the rest of the layer. The same
scores and output follow from the latents directly (DeepSeek-V2's paper, "absorbed" attention):
  score_h(t) = (W_uk[h]^T q_nope_h) . c_t + q_rot_h . k_rot_t
  out_h      = W_uv[h] (sum_t p_h(t) c_t)
so the per-token cost is two small per-head products with `kv_b_proj`'s halves plus an attention
over the latents. Everything up to the cache update is the module's own code, so the cache holds
what transformers would put there. The same arithmetic in another order (float32 scores, the
absorbed products rounded to bf16 once): not bit-identical, like the rest of the native path.
Once the native kernels are built, the part after the cache update is one call per layer
(`latent_attend` in engine/decode/native/moe_decode.cpp): in torch, the two per-head products
copied both halves of `kv_b_proj` every token and ran as small batched matmuls, most of the layer's time.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from engine.decode.modules.switch import switched_on
from engine.decode.native import kernels as native
from engine.model.cache_argument import cache_from_call


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    """The names of the class's forward arguments after `self`, in order (asked every layer of every token)."""
    return tuple(inspect.signature(cls.forward).parameters)[1:]


def latent_attention_forward(self, *args, **kwargs):
    """The fast forward of a listed MLA attention class (engine.decode.modules.families): one token
    absorbed inside a native step; anything else takes the module's own forward. The arguments are
    read by the class's own signature (DeepSeek-V2 takes the mask before the rotations, V3 after)."""
    given = dict(zip(_positional_names(self._moescope_plain), args, strict=False)) | kwargs  # fewer args than names
    hidden_states, position_embeddings = given["hidden_states"], given["position_embeddings"]
    attention_mask = given.get("attention_mask")
    kv = cache_from_call((), given)
    batch, length = hidden_states.shape[:-1]
    if (not switched_on(self) or kv is None or length != 1 or attention_mask is not None
            or hidden_states.device.type != "cpu" or self.kv_b_proj.weight.dtype != hidden_states.dtype):
        return self._plain_forward(*args, **kwargs)
    code = sys.modules[self._moescope_plain.__module__]  # the family's own rotary functions
    heads, nope, rope, v_dim, rank = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                                      self.kv_lora_rank)

    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden_states)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_states = q_states.view(batch, 1, heads, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
    compressed = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed, [rank, rope], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, 1, rank)
    k_rot = k_rot.view(batch, 1, 1, rope)
    if isinstance(position_embeddings, torch.Tensor):  # DeepSeek-V2: rotations as complex numbers
        q_rot, k_rot = code.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))
    else:
        cos, sin = position_embeddings
        rotate = code.apply_rotary_pos_emb_interleave if self.config.rope_interleave else code.apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    latents, k_rot = kv.update(kv_nope, k_rot, self.layer_idx)  # [batch, 1, positions, rank]

    kernels = native.ready()
    if kernels is not None and batch == 1 and self.kv_b_proj.weight.is_contiguous():
        # the same arithmetic per head in one native call, reading kv_b_proj's halves in place
        out = kernels.latent_attend(self.kv_b_proj.weight, q_pass.reshape(heads, nope), q_rot.reshape(heads, rope),
                                    latents.reshape(-1, rank), k_rot.reshape(-1, rope), v_dim, self.scaling)
        return self.o_proj(out), None
    up = self.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    w_uk, w_uv = up[:, :nope], up[:, nope:]  # [heads, nope, rank], [heads, v, rank]
    absorbed = torch.matmul(q_pass.transpose(0, 1).reshape(heads, batch, nope), w_uk)  # [heads, batch, rank]
    # The one shared latent row per position meets every head as one [heads x rank] by [rank x
    # positions] product per sequence (a [heads, 1, ...] broadcast against the cache would copy it per head).
    positions = latents.shape[-2]
    lat = latents.float().reshape(batch, positions, rank)
    query = absorbed.transpose(0, 1).float()  # [batch, heads, rank]
    scores = torch.bmm(query, lat.transpose(1, 2))
    rot = torch.bmm(q_rot.float().reshape(batch, heads, rope), k_rot.float().reshape(batch, positions, rope).transpose(1, 2))
    scores += rot
    weights = torch.softmax(scores * self.scaling, dim=-1)
    context = torch.bmm(weights, lat).to(hidden_states.dtype)  # [batch, heads, rank]
    # W_uv [heads, v, rank] times the contexts as columns: the weight as stored (a transposed view of it
    # would be copied whole every step)
    out = torch.matmul(w_uv, context.permute(1, 2, 0))  # [heads, v, batch]
    out = out.permute(2, 0, 1).reshape(batch, 1, heads * v_dim)
    return self.o_proj(out), None
