"""The "kvdemo" attention function, registered in transformers' attention registry.

`QuantizedKVCache.update()` returns a `CacheView` instead of key/value tensors; transformers passes it
through untouched as `key`/`value` to the attention function registered for the model. Here:

- no stored past (first prefill): exact causal SDPA over this call's keys/values;
- a short query block (decode, n <= DECODE_MAX_QUERIES): attention over the packed past
  (`past_attention`: Triton on CUDA, blocked PyTorch elsewhere, never a dequantized copy of the
  whole cache) merged by log-sum-exp with exact causal attention over this call's tokens;
- a long query block over a stored past (a follow-up chat turn): the past is dequantized once for
  this call and SDPA runs over it plus the exact new states.

Plain tensors (a DynamicCache, or no cache) go to transformers' own SDPA unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cache import CacheView
from .quant import backend_for, reference  # backend_for: one rule for attention and quantize-on-append

NAME = "kvdemo"
DECODE_MAX_QUERIES = 16

# Optional observers (kvdemo.drift), called after each attention over a packed past (the decode path) as
# fn(view=CacheView, query=[B, Hq, n, D], scaling=float, mask=bool [B, 1|Hq, n, past+n] | None,
#    out=fp32 [B, Hq, n, D], lse=fp32 [B, Hq, n]) where lse is over the past and this call's tokens.
observers: list = []


def past_attention(query, packed, scaling, mask=None):
    """Dispatch: (out, lse) of `query` over a layer's packed past (see reference.past_attention)."""
    if backend_for(query.device) == "triton" and mask is None:
        from .quant import triton_kernels

        return triton_kernels.past_attention(query, packed, scaling)
    return reference.past_attention(query, packed, scaling, mask)


def _new_token_attention(query, keys, values, scaling, mask):
    """Exact causal attention of query [B, Hq, n, D] over this call's keys [B, Hkv, n, D] -> (out, lse)."""
    b, hq, n, d = query.shape
    hkv = keys.shape[1]
    grp = hq // hkv
    qg = query.float().reshape(b, hkv, grp * n, d)
    logits = (qg @ keys.float().transpose(-1, -2)) * scaling  # [B, Hkv, M, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    allowed = causal.repeat(grp, 1).expand(b, hkv, grp * n, n)
    if mask is not None:
        allowed = allowed & mask.expand(b, hq, n, n).reshape(b, hkv, grp * n, n)
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = torch.exp(logits - lse).nan_to_num_(0.0) @ values.float()
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial softmax attentions over disjoint key sets (log-sum-exp weights)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num_(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def attend(query: torch.Tensor, view: CacheView, scaling: float, attention_mask=None) -> torch.Tensor:
    """query [B, Hq, n, D] over the view's stored past + exact new states -> [B, Hq, n, D]."""
    n, past = query.shape[-2], view.past_len
    mask = attention_mask if (attention_mask is not None and attention_mask.dtype == torch.bool) else None
    if attention_mask is not None and mask is None:  # an additive float mask
        mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if past == 0:
        out = F.scaled_dot_product_attention(
            query,
            view.keys.to(query.dtype),
            view.values.to(query.dtype),
            attn_mask=mask,
            is_causal=mask is None and n > 1,
            scale=scaling,
            enable_gqa=True,
        )
        return out
    if n > DECODE_MAX_QUERIES:
        past_k, past_v = view.packed().dequantized()
        keys = torch.cat([past_k, view.keys], dim=-2).to(query.dtype)
        values = torch.cat([past_v, view.values], dim=-2).to(query.dtype)
        causal = torch.ones(n, past + n, dtype=torch.bool, device=query.device).tril(diagonal=past)
        full_mask = causal if mask is None else (mask & causal)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=full_mask, scale=scaling, enable_gqa=True)
    if n == 1 and mask is None and view.stored_exactly():
        # one decode step whose token the cache still holds exactly (sink or residual): it is just one
        # more full-precision key of the stored past, so one pass over past + new, no merge
        out, lse = past_attention(query, view.layer.packed(past + 1), scaling)
    else:
        past_mask = None if mask is None else mask[..., :past]
        new_mask = None if mask is None else mask[..., past : past + n]
        out_p, lse_p = past_attention(query, view.packed(), scaling, past_mask)
        out_n, lse_n = _new_token_attention(query, view.keys, view.values, scaling, new_mask)
        out, lse = merge(out_p, lse_p, out_n, lse_n)
    for fn in observers:
        fn(view=view, query=query, scaling=scaling, mask=mask, out=out, lse=lse)
    return out.to(query.dtype)


def kvdemo_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-function signature; returns (attn_output [B, n, Hq, D], None)."""
    if not isinstance(key, CacheView):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = attend(query, key, scaling, attention_mask)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, kvdemo_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_kvdemo_attention(model) -> None:
    """Route the model's attention through kvdemo (plain tensors still go to SDPA)."""
    model.set_attn_implementation(NAME)
