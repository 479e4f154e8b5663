"""Attention over the packed cache in PyTorch: the twin of kvdemo/quant/triton_decode.py, and the path
every call takes where no kernel does (the CPU, masks, softcaps, formats the kernel does not read).

Scores come straight from the codes, never from a dequantized copy in the original space: per-channel keys as
``q . (scale * code) + q . zero`` within each key block, values as ``(p * scale) @ code + p @ zero``; a Hadamard
turns the query instead of the keys, sparse outliers add ``q[idx] * delta``. Codes are turned into floats
CPU_BLOCK positions at a time, so a step's extra memory is bounded by the block, not the past.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .reference import QuantizedTensor, dequantize, group_scale, inverse_order, looked_up, scaled_codes

CPU_BLOCK = 4096  # stored positions turned into floats at a time: a multiple of every group size


def _rows(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Rows [start, stop) of a stored QuantizedTensor (channel axis: whole groups, start % group == 0)."""
    if q.axis == "channel":
        meta = slice(start // q.group, -(-stop // q.group))
    else:
        meta = slice(start, stop)
    zero = None if q.zero is None else q.zero[:, :, meta]
    out = replace(q, codes=q.codes[:, :, start:stop], scale=q.scale[:, :, meta], zero=zero, start=q.start + start)
    if q.outlier_delta is not None:
        out.outlier_delta, out.outlier_index = q.outlier_delta[:, :, start:stop], q.outlier_index[:, :, start:stop]
    if q.tensor_scale is not None:
        first = q.start // q.block
        out.tensor_scale = q.tensor_scale[
            :, :, (q.start + start) // q.block - first : (q.start + stop - 1) // q.block - first + 1
        ]
    return out


def _channel_key_scores(qg: torch.Tensor, keys: QuantizedTensor) -> torch.Tensor:
    """Scores of qg [B, H, M, D] against per-channel-quantized keys (whole groups), from the codes.

    k[t, c] = scale[b(t), c] * code[t, c] + zero[b(t), c]  =>
    q . k_t = q . (scale_b * code_t) + q . zero_b   (codes scaled in their float buffer, one matmul)
    """
    b, h, m, d = qg.shape
    scale = keys.scale.float()  # [B, H, NB, D]
    nb, g = scale.shape[-2], keys.group
    vals, order = looked_up(keys)
    codes = vals.view(b, h, nb, g, d)  # [B, H, NB, G, D]
    q_ordered = qg if order is None else qg.index_select(-1, order)  # q . k is the same in any channel order
    codes.mul_((scale if order is None else scale.index_select(-1, order)).unsqueeze(3))
    scores = (q_ordered @ codes.view(b, h, nb * g, d).transpose(-1, -2)).view(b, h, m, nb, g)  # [B, H, M, NB, G]
    if keys.zero is not None:
        scores = scores + (qg @ keys.zero.float().transpose(-1, -2)).unsqueeze(-1)  # + [B, H, M, NB, 1]
    return scores.view(b, h, m, nb * g)


def _key_scores(qg: torch.Tensor, keys: QuantizedTensor) -> torch.Tensor:
    """Scores qg [B, H, M, D] . k_t for every stored row of `keys` (channel axis: whole groups) -> [B, H, M, T].

    From the codes, never a dequantized copy in the original space: a Hadamard turns the query instead
    of the keys ((q R) . (k R) = q . k), sparse outliers add q[idx] * delta. Pre-RoPE keys are turned per
    position, so they are dequantized (and RoPE applied) first."""
    if keys.rope is not None:
        return qg @ dequantize(keys).transpose(-1, -2)
    qk = qg if keys.rotation is None else qg @ keys.rotation
    if keys.axis == "channel":
        scores = _channel_key_scores(qk, keys)
    else:
        scores = qk @ scaled_codes(keys).transpose(-1, -2)
    if keys.outlier_delta is not None:  # sum_j q[idx_tj] delta_tj
        b, h, m, _ = qk.shape
        t, cap = keys.outlier_index.shape[-2:]
        idx = keys.outlier_index.long().view(b, h, 1, t * cap).expand(b, h, m, t * cap)
        picked = qk.gather(-1, idx).mul_(keys.outlier_delta.float().view(b, h, 1, t * cap))
        scores += picked if cap == 1 else picked.view(b, h, m, t, cap).sum(-1)  # scores: this call's own buffer
    return scores


def _token_value_output(p: torch.Tensor, values: QuantizedTensor) -> torch.Tensor:
    """sum_t p[m, t] v_t for stored values (any format and method): the codes' output in the stored space,
    sparse outliers scattered in, a Hadamard undone on the output [M, D] rather than on every value."""
    out = _plain_value_output(p, values)
    if values.outlier_delta is not None:
        b, h, m, t = p.shape
        cap = values.outlier_index.shape[-1]
        src = (p.unsqueeze(-1) * values.outlier_delta.float().unsqueeze(2)).view(b, h, m, t * cap)
        idx = values.outlier_index.long().view(b, h, 1, t * cap).expand(b, h, m, t * cap)
        out = out.scatter_add_(-1, idx, src)  # out: this call's own buffer
    if values.rotation is not None:
        out = out @ values.rotation.T
    return out


def _plain_value_output(p: torch.Tensor, values: QuantizedTensor) -> torch.Tensor:
    """sum_t p[m, t] v_t for per-token-quantized values, from the codes.

    p [B, H, M, T]; values: codes [B, H, T, D/P], scale/zero [B, H, T, D/G]; v_tc = s_tj code_tc + z_tj (j = c // G).
    One group per token (G = D): out = (p * s) @ code + (p @ z); else the scales go into the codes.
    """
    b, h, m, t = p.shape
    codes, order = looked_up(values)  # [B, H, T, D]
    d, group, scale, zero = codes.shape[-1], values.group, group_scale(values), values.zero
    if group == d:
        out = (p * scale.float()[..., 0].unsqueeze(2)) @ codes  # [B, H, M, D]
        if order is not None:  # back to channel order: [M, D], not the [T, D] values
            out = out.index_select(-1, inverse_order(order))
    else:
        if order is not None:
            codes = codes.index_select(-1, inverse_order(order))
        codes.view(b, h, t, d // group, group).mul_(scale.float().unsqueeze(-1))
        out = p @ codes
    if zero is not None and group == d:  # sum_t p_t z_t: a reduction (a [M, T] @ [T, 1] matmul is ~7x slower on CPU)
        out = out + (p * zero.float()[..., 0].unsqueeze(2)).sum(-1, keepdim=True)
    elif zero is not None:
        out = out + (p @ zero.float()).repeat_interleave(group, dim=-1)
    return out


def _coded_key_logits(qg: torch.Tensor, keys: QuantizedTensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Write qg's scores against coded positions [start, stop) into out [B, H, M, stop - start], CPU_BLOCK
    positions at a time (channel-axis blocks aligned to whole groups)."""
    for a in range((start // CPU_BLOCK) * CPU_BLOCK, stop, CPU_BLOCK):
        e = min(a + CPU_BLOCK, keys.codes.shape[-2])
        lo, hi = max(a, start), min(e, stop)
        if keys.axis == "channel":
            scores = _key_scores(qg, _rows(keys, a, e))[..., lo - a : hi - a]
        else:
            scores = _key_scores(qg, _rows(keys, lo, hi))
        out[..., lo - start : hi - start] = scores


def _past_logits(
    query: torch.Tensor, kv, scaling: float, mask: torch.Tensor | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Scaled scores of query [B, Hq, n, D] over the packed past -> fp32 [B, Hkv, M, length] (M = Hq/Hkv * n).

    Rows are (head in group, query), so `.reshape(B, Hq, n, length)` is the per-query-head layout.
    Masked positions are -inf. softcap (Gemma-2): scores -> tanh(s / softcap) * softcap, before the mask.
    """
    b, hq, n, d = query.shape
    r, hkv = kv.regions, kv.kv_heads
    grp = hq // hkv
    qg = query.float().reshape(b, hkv, grp * n, d)  # [B, Hkv, M, D], rows = (head in group, query)
    logits = torch.empty(b, hkv, grp * n, r.tokens, dtype=torch.float32, device=query.device)
    logits[..., : r.sinks] = qg @ kv.keys.sinks.float().transpose(-1, -2)
    if r.has_codes:
        _coded_key_logits(qg, kv.keys.quantized, r.sinks, r.quantized, logits[..., r.sinks : r.quantized])
    logits[..., r.residual_start :] = qg @ kv.keys.residual.float().transpose(-1, -2)
    logits *= scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        m = mask.expand(b, hq, n, r.tokens).reshape(b, hkv, grp * n, r.tokens)
        logits = logits.masked_fill(~m, float("-inf"))
    return logits


def past_attention(
    query: torch.Tensor, kv, scaling: float, mask: torch.Tensor | None = None, softcap: float | None = None
):
    """Attention of every query over the stored past of one layer (no causal mask is needed: every
    stored position precedes every query). Grouped-query: one K/V read serves each group of heads.

    query: [B, Hq, n, D]; kv: cache.PackedKV with kv.length > 0, Hkv heads dividing Hq;
    mask: optional bool [B, 1 or Hq, n, length], True = attend; softcap: optional logit cap (Gemma-2).
    Returns (out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n]) for a log-sum-exp merge with other parts.

    Memory: besides the scores (M x length fp32, the attention weights themselves), codes are turned into
    floats CPU_BLOCK positions at a time, so the extra memory is bounded by the block, not the past.
    """
    b, hq, n, d = query.shape
    r = kv.regions
    logits = _past_logits(query, kv, scaling, mask, softcap)  # [B, Hkv, M, length]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, Hkv, M, 1]
    probs = torch.exp(logits - lse).nan_to_num_(0.0)
    out = probs[..., : r.sinks] @ kv.values.sinks.float()
    for lo in range(r.sinks, r.quantized if r.has_codes else r.sinks, CPU_BLOCK):
        hi = min(lo + CPU_BLOCK, r.quantized)
        out = out + _token_value_output(probs[..., lo:hi], _rows(kv.values.quantized, lo, hi))
    if r.residual:
        out = out + probs[..., r.residual_start :] @ kv.values.residual.float()
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


SCORE_ELEMENTS = 1 << 21  # streamed attention: scores held at once (query rows x piece, fp32: 8 MiB)


def flash_attention(query, keys, values, scaling: float, causal: bool = False):
    """(out fp32, lse fp32 [B, H, M]) of query [B, H, M, D] over keys/values [B, H, L, D] with PyTorch's fused
    CPU flash-attention kernel (tiled: no M x L scores), or None where it is missing or not on the CPU.
    causal: query i sees keys [0, i] (M == L). The kernel is private API of the pinned torch, probed once."""
    if query.device.type != "cpu" or not _FLASH:
        return None
    q, k, v = (t.float().contiguous() for t in (query, keys, values))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)
    return out, lse


_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _segment_tensors(kv, part: str, kind: str, lo: int, hi: int) -> torch.Tensor:
    """Keys or values of positions [lo, hi) of one piece of the past, as fp32 [B, H, hi - lo, D]."""
    stored = getattr(kv, part)
    r = kv.regions
    if kind != "coded":
        offset = 0 if kind == "sinks" else r.residual_start
        return (stored.sinks if kind == "sinks" else stored.residual)[:, :, lo - offset : hi - offset].float()
    q = stored.quantized
    if q.axis == "channel":  # whole groups of tokens, sliced to [lo, hi)
        a, e = (lo // q.group) * q.group, -(-hi // q.group) * q.group
        return dequantize(_rows(q, a, e))[:, :, lo - a : hi - a]
    return dequantize(_rows(q, lo, hi))


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial softmax attentions over disjoint key sets (log-sum-exp weights)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num_(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def _segments(r, block: int):
    """Pieces (kind, start, stop) of the stored past [0, r.tokens): the sinks, the coded positions in
    `block`-aligned pieces, the residual in pieces of at most `block`."""
    if r.sinks:
        yield "sinks", 0, r.sinks
    if r.has_codes:
        for a in range((r.sinks // block) * block, r.quantized, block):
            yield "coded", max(a, r.sinks), min(a + block, r.quantized)
    for a in range(r.residual_start, r.tokens, block):
        yield "residual", a, min(a + block, r.tokens)


def _segment_keys_values(kv, kind: str, lo: int, hi: int, qg: torch.Tensor):
    """Scores of qg [B, H, M, D] against positions [lo, hi) (unscaled, fp32) and a function p -> p @ V."""
    r = kv.regions
    if kind != "coded":
        offset = 0 if kind == "sinks" else r.residual_start
        part_k = kv.keys.sinks if kind == "sinks" else kv.keys.residual
        part_v = kv.values.sinks if kind == "sinks" else kv.values.residual
        v = part_v[:, :, lo - offset : hi - offset].float()
        return qg @ part_k[:, :, lo - offset : hi - offset].float().transpose(-1, -2), lambda p: p @ v
    keys = kv.keys.quantized
    if keys.axis == "channel":  # whole groups of tokens, sliced to [lo, hi)
        a, e = (lo // keys.group) * keys.group, -(-hi // keys.group) * keys.group
        scores = _key_scores(qg, _rows(keys, a, e))[..., lo - a : hi - a]
    else:
        scores = _key_scores(qg, _rows(keys, lo, hi))
    values = _rows(kv.values.quantized, lo, hi)
    return scores, lambda p: _token_value_output(p, values)


def past_attention_streamed(
    query: torch.Tensor,
    kv,
    scaling: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
):
    """`past_attention` for many queries (a prefill chunk over a long stored past), in bounded memory.

    The past is read piece by piece (sinks, coded blocks, residual) with an online softmax: at any time
    one piece's scores (query rows x piece, at most SCORE_ELEMENTS fp32) and one piece of codes turned
    into floats are held, never scores over the whole past nor a float copy of it. Without a mask, softcap
    or window, on the CPU, each piece (CPU_BLOCK positions, dequantized) goes through PyTorch's fused
    flash-attention kernel instead, which holds no scores at all.
    query: [B, Hq, n, D], the queries at positions kv.length + i (they follow the whole stored past);
    mask: optional bool [B, 1 or Hq, n, length]; softcap as in `past_attention`; window: a sliding
    window (query at p sees keys k > p - window). Returns (out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n]).
    """
    b, hq, n, d = query.shape
    r, hkv = kv.regions, kv.kv_heads
    grp = hq // hkv
    rows = grp * n
    qg = query.float().reshape(b, hkv, rows, d)  # [B, Hkv, M, D], rows = (head in group, query)
    block = max(256, (SCORE_ELEMENTS // rows) // 256 * 256)  # a multiple of every group size
    q_pos = (kv.length + torch.arange(n, device=query.device)).repeat(grp)  # [M] the row's position
    out = torch.zeros(b, hkv, rows, d, dtype=torch.float32, device=query.device)
    lse = torch.full((b, hkv, rows), float("-inf"), dtype=torch.float32, device=query.device)
    if mask is None and softcap is None and window is None and query.device.type == "cpu" and _FLASH:
        for kind, lo, hi in _segments(r, CPU_BLOCK):  # the fused kernel over dequantized pieces of the past
            k, v = _segment_tensors(kv, "keys", kind, lo, hi), _segment_tensors(kv, "values", kind, lo, hi)
            out, lse = merge(out, lse, *flash_attention(qg, k, v, scaling))
        return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)
    for kind, lo, hi in _segments(r, block):
        if window is not None and hi <= int(q_pos.min()) - window + 1:
            continue  # every query's window starts after this piece
        scores, weighted_values = _segment_keys_values(kv, kind, lo, hi, qg)
        logits = scores * scaling  # [B, Hkv, M, hi - lo]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is not None:
            logits = logits.masked_fill(~mask[..., lo:hi].expand(b, hq, n, hi - lo).reshape(logits.shape), -torch.inf)
        if window is not None:
            k_pos = torch.arange(lo, hi, device=query.device)
            logits = logits.masked_fill(k_pos <= (q_pos[:, None] - window), -torch.inf)
        seg_lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, M]
        probs = torch.exp(logits - seg_lse.unsqueeze(-1)).nan_to_num_(0.0)
        out, lse = merge(out, lse, weighted_values(probs), seg_lse)
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


def past_probabilities(
    query: torch.Tensor,
    kv,
    scaling: float,
    mask: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention probabilities of every query over the packed past (the weights `past_attention` uses).

    query: [B, Hq, n, D]; kv: cache.PackedKV; mask as in `past_attention`; lse: optional fp32
    [B, Hq, n], the log-sum-exp to normalize by (e.g. over past + new tokens, so these probabilities
    are the past's slice of the whole distribution); default: the past's own, so each row sums to 1.
    Returns fp32 [B, Hq, n, length] (masked positions are 0).
    """
    b, hq, n, _ = query.shape
    logits = _past_logits(query, kv, scaling, mask, softcap).reshape(b, hq, n, kv.length)  # [B, Hq, n, length]
    norm = torch.logsumexp(logits, dim=-1) if lse is None else lse.float()  # [B, Hq, n]
    return torch.exp(logits - norm.unsqueeze(-1)).nan_to_num_(0.0)
