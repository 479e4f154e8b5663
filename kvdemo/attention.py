"""The "kvdemo" attention function, registered in transformers' attention registry.

`QuantizedKVCache.update()` returns a `CacheView` instead of key/value tensors; transformers passes it
through untouched as `key`/`value` to the attention function registered for the model. Here:

- no stored past (first prefill): exact causal SDPA over this call's keys/values;
- a short query block (decode, n <= DECODE_MAX_QUERIES): attention over the packed past
  (`past_attention`: Triton on CUDA, blocked PyTorch elsewhere, never a dequantized copy of the
  whole cache) merged by log-sum-exp with exact causal attention over this call's tokens;
- a long query block over a stored past (a prefill chunk, a follow-up chat turn): the same merge, with
  the past read piece by piece (`long_past_attention`), so the extra memory is bounded by the chunk.

Masks: the "kvdemo" mask hook (`kvdemo_mask`) builds no mask for plain causal attention without
padding; causality and sliding windows are then applied here, piece by piece, so no dense
queries x (past + queries) mask is ever made for a long prompt. A batch of sequences of different
lengths (kvdemo/batch.py) arrives as a `BatchView` and attends sequence by sequence.

Plain tensors (a DynamicCache, or no cache) go to transformers' own SDPA unchanged.

What each model family passes besides the mask (docs/models.md, "Supported model families"):
- `softcap` (Gemma-2): logits become tanh(s / c) * c before the softmax, in every path: prefill and long
  blocks by exact fp32 attention (SDPA has no softcap), the packed past by the PyTorch reference;
- `sliding_window` (Mistral, Phi-3, Gemma-2/3 local layers): a query at position p sees keys at
  positions p - window < k <= p. transformers' mask already says so once the sequence is longer than the
  window; the window is also ANDed in here, so it holds whoever built the mask;
- `s_aux` (gpt-oss sinks): one learned logit per head in the softmax denominator, with no value;
- a value head_dim different from the key head_dim (MLA, DeepSeek-V3) is refused (`check_supported`
  at load, and here for a model that reached us another way).
The Triton kernel takes no mask and no softcap: those calls go to the PyTorch reference.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cache import BatchView, CacheView
from .quant import reference_attention
from .quant.backend import backend_for  # one rule for attention and quantize-on-append
from .quant.reference_attention import merge  # log-sum-exp merge of partial attentions

BF16_BELOW_FP16_MAX = 65280.0  # the largest bf16 value that is finite in fp16 (65504 rounds up to 65536 in bf16)


class ModelLoadError(ValueError):
    """A model that cannot be loaded, with a message fit for a user."""


# layer kinds kvdemo's cache and attention compute exactly (config.layer_types)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(model_or_config) -> None:
    """Raise `ModelLoadError` (one line) for a model whose attention kvdemo cannot compute exactly.

    Takes a config or a model (a model is also checked module by module). Refused: a value head_dim
    different from the key head_dim (MLA: DeepSeek-V2/V3, MiniCPM3), and layers that are not softmax
    attention over a growing KV cache (linear attention, state-space layers). Supported extras (logit
    softcap, sliding windows, gpt-oss sinks) are handled below.
    """
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = model.config if model is not None else model_or_config
    config = getattr(config, "get_text_config", lambda: config)()
    kind = getattr(config, "model_type", type(config).__name__)
    v_dim = getattr(config, "v_head_dim", None)
    if v_dim is not None:
        k_dim = getattr(config, "qk_head_dim", None) or (
            (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0)
        )
        k_dim = k_dim or getattr(config, "head_dim", None)
        if k_dim and k_dim != v_dim:
            raise ModelLoadError(
                f"{kind} is not supported: its value head_dim ({v_dim}) differs from its key head_dim ({k_dim}), "
                "and kvdemo's cache and attention need them equal"
            )
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if other:
        raise ModelLoadError(
            f"{kind} is not supported: layer types {', '.join(other)} are not softmax attention over a KV cache"
        )
    for name, module in model.named_modules() if model is not None else ():
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        heads = getattr(module, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None)
        if isinstance(k, torch.nn.Linear) and isinstance(v, torch.nn.Linear) and k.out_features != v.out_features:
            raise ModelLoadError(
                f"{kind} is not supported: in {name}, values have {v.out_features} features and keys "
                f"{k.out_features} ({heads} kv heads); kvdemo needs equal key and value head dims"
            )


NAME = "kvdemo"
DECODE_MAX_QUERIES = 16

# Optional observers (kvdemo.drift), called after each attention over a packed past (the decode path) as
# fn(view=CacheView, query=[B, Hq, n, D], scaling=float, mask=bool [B, 1|Hq, n, past+n] | None,
#    out=fp32 [B, Hq, n, D], lse=fp32 [B, Hq, n]) where lse is over the past and this call's tokens.
observers: list = []


def past_attention(query, packed, scaling, mask=None, softcap=None):
    """Dispatch: (out, lse) of `query` over a layer's packed past (see reference_attention.past_attention).

    Calls with a mask (sliding-window layers past their window, padding) or a logit softcap (Gemma-2) go
    to the PyTorch reference: the Triton kernel implements neither.
    """
    if backend_for(query.device) == "triton" and mask is None and softcap is None:
        from .quant import triton_decode

        return triton_decode.past_attention(query, fp16_clamped(packed), scaling)
    return reference_attention.past_attention(query, packed, scaling, mask, softcap=softcap)


def fp16_clamped(packed):
    """The packed past with its bf16 full-precision parts (sinks, residual) clamped to the fp16 range.

    The Triton kernel reads 16-bit keys and values as fp16; a bf16 state beyond +-65504 would become inf
    there (and NaN after the softmax). Clamped copies cover at most sinks + residual tokens; codes and
    their metadata are fp16-range already (`reference.quantize` clamps).
    """
    if packed.keys.residual.dtype != torch.bfloat16:
        return packed
    top = BF16_BELOW_FP16_MAX

    def clamp(part):
        return replace(part, sinks=part.sinks.clamp(-top, top), residual=part.residual.clamp(-top, top))

    return replace(packed, keys=clamp(packed.keys), values=clamp(packed.values))


def _exact_attention(query, keys, values, scaling, mask, softcap=None):
    """Exact causal attention in fp32 of query [B, Hq, n, D] over keys/values [B, Hkv, T, D], T >= n, whose
    last n positions are the queries' own -> (out fp32 [B, Hq, n, Dv], lse fp32 [B, Hq, n]).

    mask: optional bool [B, 1 or Hq, n, T] (True = attend); softcap: logits -> tanh(s / c) * c.
    """
    b, hq, n, d = query.shape
    hkv, t = keys.shape[1], keys.shape[-2]
    grp = hq // hkv
    qg = query.float().reshape(b, hkv, grp * n, d)
    logits = (qg @ keys.float().transpose(-1, -2)) * scaling  # [B, Hkv, M, T]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    causal = torch.ones(n, t, dtype=torch.bool, device=query.device).tril(diagonal=t - n)
    allowed = causal.repeat(grp, 1).expand(b, hkv, grp * n, t)
    if mask is not None:
        allowed = allowed & mask.expand(b, hq, n, t).reshape(b, hkv, grp * n, t)
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = torch.exp(logits - lse).nan_to_num_(0.0) @ values.float()  # [B, Hkv, M, Dv]
    return out.reshape(b, hq, n, -1), lse.reshape(b, hq, n)


OWN_TILE = 256  # long query blocks attend over their own tokens this many queries at a time


def _own_attention(query, keys, values, scaling, mask, softcap):
    """`_exact_attention` of a call's n queries over its own n tokens, OWN_TILE queries at a time, so the
    scores held are OWN_TILE x n, not n x n. mask: None or [B|1, 1|Hq, n, n] / [n, n]."""
    n = query.shape[-2]
    if mask is None and softcap is None:  # causal only: the fused CPU kernel (GQA: K/V repeated per head)
        grp = query.shape[1] // keys.shape[1]
        k, v = keys.repeat_interleave(grp, dim=1), values.repeat_interleave(grp, dim=1)
        fused = reference_attention.flash_attention(query, k, v, scaling, causal=True)
        if fused is not None:
            return fused
    outs, lses = [], []
    for a in range(0, n, OWN_TILE):
        e = min(a + OWN_TILE, n)
        m = None if mask is None else mask[..., a:e, :e]
        out, lse = _exact_attention(query[:, :, a:e], keys[:, :, :e], values[:, :, :e], scaling, m, softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _window(mask, sliding_window, n, total, device):
    """`mask` [B, 1|Hq, n, total] (or None) ANDed with a causal sliding window: the query at position p
    (the last n of `total` positions) sees keys at p - window < k <= p (transformers' convention)."""
    if sliding_window is None or total <= sliding_window:
        return mask
    q_pos = torch.arange(total - n, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    window = (k_pos > q_pos - sliding_window) & (k_pos <= q_pos)  # [n, total]
    return window if mask is None else mask & window


def _with_sink_logit(out, lse, s_aux):
    """gpt-oss sinks: a learned logit per query head s_aux [Hq] joins the softmax denominator, no value."""
    sink = s_aux.float().view(1, -1, 1).expand_as(lse)
    return merge(out, lse, torch.zeros_like(out), sink)


def _bool_mask(attention_mask):
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2  # an additive float mask


def long_past_attention(query, packed, scaling, mask=None, softcap=None, window=None):
    """(out, lse) of many queries (a prefill chunk) over a layer's packed past, in memory bounded by the
    chunk, never by the past: on CUDA the Triton decode kernel over tiles of queries (`max_block_m` rows per
    launch); elsewhere, and for masks, softcaps and sliding windows that cut the past, the streamed
    PyTorch reference (online softmax over pieces of the past)."""
    b, hq, n, d = query.shape
    window_cuts = window is not None and packed.length + n > window
    if backend_for(query.device) == "triton" and mask is None and softcap is None and not window_cuts:
        from .quant import launch, triton_decode

        tile = max(1, launch.max_block_m(d, packed) // (hq // packed.kv_heads))  # queries per launch
        kv = fp16_clamped(packed)
        parts = [triton_decode.past_attention(query[:, :, i : i + tile], kv, scaling) for i in range(0, n, tile)]
        return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)
    return reference_attention.past_attention_streamed(
        query, packed, scaling, mask, softcap, window if window_cuts else None
    )


def attend(
    query: torch.Tensor,
    view: CacheView,
    scaling: float,
    attention_mask=None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, n, D] over the view's stored past + exact new states -> [B, Hq, n, D].

    attention_mask: [B, 1|Hq, n, past + n] as transformers built it, or None: causal, no padding (the
    "kvdemo" mask hook skips building it); the causal sliding window is applied here either way.
    softcap, sliding_window, s_aux: as the model passes them (see the module docstring)."""
    n, past = query.shape[-2], view.past_len
    given = _bool_mask(attention_mask)
    own_mask = _window(None if given is None else given[..., past:], sliding_window, n, n, query.device)  # [n, n]
    if past == 0 and softcap is None and s_aux is None:
        return F.scaled_dot_product_attention(
            query,
            view.keys.to(query.dtype),
            view.values.to(query.dtype),
            attn_mask=own_mask,
            is_causal=own_mask is None and n > 1,
            scale=scaling,
            enable_gqa=True,
        )
    decode_mask = None  # the decode path's dense mask (the observers see it)
    if past == 0:  # SDPA has no softcap and no sink logit: exact fp32 attention over the call's own tokens
        out, lse = _own_attention(query, view.keys, view.values, scaling, own_mask, softcap)
    elif n > DECODE_MAX_QUERIES:  # a prefill chunk or a follow-up turn over a stored past: bounded memory
        past_mask = None if given is None else given[..., :past]
        out_p, lse_p = long_past_attention(query, view.packed(), scaling, past_mask, softcap, sliding_window)
        out_n, lse_n = _own_attention(query, view.keys, view.values, scaling, own_mask, softcap)
        out, lse = merge(out_p, lse_p, out_n, lse_n)
    else:  # decode: the scores of a few queries over the past (a dense mask is the same size)
        decode_mask = _window(given, sliding_window, n, past + n, query.device)
        if n == 1 and decode_mask is None and view.stored_exactly():
            # one decode step whose token the cache still holds exactly (sink or residual): it is just one
            # more full-precision key of the stored past, so one pass over past + new, no merge
            out, lse = past_attention(query, view.layer.packed(past + 1), scaling, softcap=softcap)
        else:
            past_mask = None if decode_mask is None else decode_mask[..., :past]
            new_mask = None if decode_mask is None else decode_mask[..., past : past + n]
            out_p, lse_p = past_attention(query, view.packed(), scaling, past_mask, softcap)
            out_n, lse_n = _exact_attention(query, view.keys, view.values, scaling, new_mask, softcap)
            out, lse = merge(out_p, lse_p, out_n, lse_n)
    if s_aux is not None:
        out, lse = _with_sink_logit(out, lse, s_aux)
    if past and n <= DECODE_MAX_QUERIES:
        for fn in observers:
            fn(view=view, query=query, scaling=scaling, mask=decode_mask, out=out, lse=lse)
    return out.to(query.dtype)


def kvdemo_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-function signature; returns (attn_output [B, n, Hq, D], None)."""
    if isinstance(key, BatchView):  # sequences of different lengths (kvdemo/batch.py): each over its own past
        rows = [
            kvdemo_attention(module, query[b : b + 1], v, v, None, dropout, scaling, **kwargs)[0]
            for b, v in enumerate(key.views)
        ]
        return torch.cat(rows), None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    softcap, window, s_aux = kwargs.get("softcap"), kwargs.get("sliding_window"), kwargs.get("s_aux")
    if not isinstance(key, CacheView):  # plain tensors: queries are the last n of the key positions
        n, total = query.shape[-2], key.shape[-2]
        mask = _window(_bool_mask(attention_mask), window, n, total, query.device)
        if mask is None and 1 < n < total:  # the hook built no mask; SDPA's is_causal would align top-left
            mask = torch.ones(n, total, dtype=torch.bool, device=query.device).tril(diagonal=total - n)
        if softcap is None and s_aux is None:
            return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, **kwargs)
        out, lse = _exact_attention(query, key, value, scaling, mask, softcap)
        if s_aux is not None:
            out, _ = _with_sink_logit(out, lse, s_aux)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    if key.values.shape[-1] != key.keys.shape[-1]:
        raise ValueError(
            f"kvdemo attention needs equal key and value head dims, got {key.keys.shape[-1]} and {key.values.shape[-1]}"
        )
    out = attend(query, key, scaling, attention_mask, softcap, window, s_aux)
    return out.transpose(1, 2).contiguous(), None


def kvdemo_mask(*args, attention_mask=None, allow_is_causal_skip: bool = True, **kwargs):
    """transformers' mask hook: no mask at all for causal (or causal sliding-window) attention without
    padding, whatever the lengths (`attend` applies causality and the window, which the model passes as
    `sliding_window`); anything else (padding, custom patterns) is transformers' own SDPA mask."""
    if allow_is_causal_skip and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


AttentionInterface.register(NAME, kvdemo_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, kvdemo_mask)


def use_kvdemo_attention(model) -> None:
    """Route the model's attention through kvdemo (plain tensors still go to SDPA). A model kvdemo cannot
    compute exactly is refused with a one-line `ModelLoadError` (`check_supported`)."""
    check_supported(model)
    model.set_attn_implementation(NAME)
