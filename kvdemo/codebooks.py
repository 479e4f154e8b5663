"""nuq codebooks: per layer, for keys and values, 2^b levels in [-1, 1] fitted offline (KVQuant's "nuq").

Calibration (`calibrate`, `python -m kvdemo calibrate`): one forward and one backward pass of the model
over calibration text (Pride and Prejudice, not the held-out text the perplexity is scored on) capture
every layer's keys and values as the cache receives them and the gradient of the loss with respect to
each; the Fisher information of an element is its squared gradient. Each element is normalized as the
quantizer normalizes it at run time (`reference._ranges` / `_nuq_scale`: keys per channel over blocks
of `group` tokens to [-1, 1] by their [min, max]; values per token by their absmax; the outlier
variants with the narrowed ranges, clipped outliers left out since the sparse corrections hold them),
and the levels are the weighted k-means of those samples (1-D Lloyd from weighted quantiles), each weighted
by its Fisher information times its group's scale squared (an error in normalized units is that much
in the cache), clipped at its 99th percentile (a single pass gives a noisy per-element Fisher; unclipped, a
few elements pull the levels to themselves and the fit does worse on other text): levels go where the
loss is sensitive, not only where the values are many.

One file per model, safetensors (never pickle), tensors named
``layers.{i}.{key|value}.nuq{b}[.o][.prerope]`` (``.o``: fitted for outlier runs, ``.prerope``: keys before
RoPE); the embedded model's ships in assets/codebooks. A model without a file gets NormalFloat levels
(normal quantiles scaled to [-1, 1], QLoRA's NF construction) until it is calibrated.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .precision import CODE_BITS, PrecisionSpec, outlier_cap

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "codebooks"
BITS = (2, 3, 4)
CALIB_TOKENS = 2048
GROUP = 128  # key blocks of the default spec (the levels are in normalized units: the group matters little)
OUTLIER_PCT = 1.0  # the `.o` codebooks are fitted at o1
ITERATIONS = 40
FISHER_CLIP = 0.99  # weights are clipped at this quantile: one pass gives a noisy per-element Fisher


def tensor_name(layer: int, part: str, bits: int, outliers: bool, pre_rope: bool) -> str:
    return f"layers.{layer}.{part}.nuq{bits}" + (".o" if outliers else "") + (".prerope" if pre_rope else "")


def normal_float(bits: int) -> torch.Tensor:
    """2^bits levels at the normal quantiles (i + 1/2) / 2^bits, scaled so the outermost are -1 and 1."""
    n = 1 << bits
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    v = torch.distributions.Normal(0.0, 1.0).icdf(p)
    return (v / v.abs().max()).float()


def weighted_kmeans(
    samples: torch.Tensor, weights: torch.Tensor, n: int, iterations: int = ITERATIONS, ends: bool = True
) -> torch.Tensor:
    """1-D k-means of `samples` [N] in [-1, 1] with `weights` [N] >= 0 -> n ascending levels (Lloyd from
    weighted quantiles). ends: the outer levels stay at -1 and 1, where every group's extremes land after
    normalization (its min and max, or its absmax), so those are stored exactly as uniform codes store them.

    Samples are sorted once; each iteration finds the cells' boundaries by binary search and their weight
    and weighted sum from prefix sums (O(n log N) per iteration, not O(N))."""
    order = samples.argsort()
    s, w = samples[order].double(), weights[order].double() + 1e-12
    cw = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)])  # prefix sums: cell [i, j) = c[j] - c[i]
    cws = torch.cat([torch.zeros(1, dtype=torch.float64), (w * s).cumsum(0)])
    levels = s[
        torch.searchsorted(cw[1:] / cw[-1], (torch.arange(n, dtype=torch.float64) + 0.5) / n).clamp(max=len(s) - 1)
    ]
    if ends:
        levels[0], levels[-1] = -1.0, 1.0
    for _ in range(iterations):
        cuts = torch.searchsorted(s, (levels[1:] + levels[:-1]) / 2)  # cell k: samples [cuts[k-1], cuts[k])
        edges = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([len(s)])])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        total = cws[edges[1:]] - cws[edges[:-1]]
        new = torch.where(mass > 1e-30, total / mass.clamp(min=1e-30), levels)
        if ends:
            new[0], new[-1] = -1.0, 1.0
        new, _ = new.sort()
        if torch.allclose(new, levels, atol=1e-7):
            break
        levels = new
    return levels.float()


def normalized_samples(x: torch.Tensor, fisher: torch.Tensor, part: str, outliers: float, group: int = GROUP):
    """x, fisher [B, H, T, D] -> (samples, weights) [N]: x normalized as the nuq quantizer does at run time
    (keys per channel over `group`-token blocks, values per token), the outlier picks and elements outside
    [-1, 1] dropped; weights: Fisher x the group's scale squared."""
    from .quant.reference import _grouped, _mask, _nuq_scale, _ranges, outlier_picks

    d = x.shape[-1]
    cap = outlier_cap(outliers, d)
    x = x.float()
    if part == "key":
        t = x.shape[-2] // group * group
        x, fisher = x[:, :, :t], fisher[:, :, :t]
        axis, g, red = "channel", group, -2
    else:
        axis, g, red = "token", min(group, d), -1
    picked = _mask(x, outlier_picks(x, axis, g, cap)) if cap else torch.zeros(x.shape, dtype=torch.bool)
    xg = _grouped(x, axis, g)
    lo, hi = _ranges(xg, red, _grouped(picked, axis, g) if cap else None)
    scale, zero = _nuq_scale(lo, hi, axis)
    norm = ((xg - (0.0 if zero is None else zero)) / scale).reshape(-1)
    keep = (norm.abs() <= 1.0) & ~picked.reshape(-1)  # the picked ones are held by the sparse corrections
    # an error e in normalized units is scale * e in the cache: weight by Fisher x scale^2, so the k-means
    # minimizes the Fisher-weighted squared error of the stored values themselves
    weight = (_grouped(fisher.float(), axis, g) * scale.square()).reshape(-1)[keep]
    if len(weight) > 1:  # unclipped, a handful of elements pull the levels to themselves (held-out error grows)
        weight = weight.clamp(max=weight.kthvalue(max(1, int(FISHER_CLIP * len(weight)))).values)
    return norm[keep], weight


@torch.enable_grad()
def capture(lm, ids: Sequence[int]) -> list[dict]:
    """Per layer {"key", "value", "key_grad", "value_grad"} [1, Hkv, T, D] fp32: the keys (after RoPE) and
    values the model's attention receives over `ids`, and the loss gradients with respect to them (one backward)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from .runner import attention_impl

    layers: dict[int, dict] = {}

    def hooked(module, query, key, value, attention_mask, **kwargs):
        slot = layers.setdefault(module.layer_idx, {})
        slot["key"], slot["value"] = key.detach().float(), value.detach().float()
        key.register_hook(lambda g: slot.__setitem__("key_grad", g.detach().float()))
        value.register_hook(lambda g: slot.__setitem__("value_grad", g.detach().float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvdemo_calibrate", hooked)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvdemo_calibrate", sdpa_mask)
    embed = lm.model.get_input_embeddings()
    handle = embed.register_forward_hook(lambda m, i, out: out.detach().requires_grad_(True))
    trained = [p for p in lm.model.parameters() if p.requires_grad]
    for p in trained:  # gradients flow to the activations only; the weights get none
        p.requires_grad_(False)
    try:
        with attention_impl(lm, "kvdemo_calibrate"):
            x = torch.tensor([list(ids)], device=lm.device)
            logits = lm.model(input_ids=x, use_cache=False).logits[0, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits, x[0, 1:])
            loss.backward()
    finally:
        handle.remove()
        for p in trained:
            p.requires_grad_(True)
    return [layers[i] for i in sorted(layers)]


def calibrate(
    lm,
    ids: Sequence[int] | None = None,
    bits: Sequence[int] = BITS,
    on_progress: Callable[[str, float], None] | None = None,
) -> Codebooks:
    """Fit every codebook of a model (nuq2/3/4, plain and `.o`, keys also before RoPE where the model allows)."""
    from .quant.rotations import Rope
    from .texts import prose_ids

    t0 = time.perf_counter()
    ids = list(ids) if ids is not None else prose_ids(lm, CALIB_TOKENS)
    report = on_progress or (lambda what, frac: None)
    report("forward and backward pass", 0.0)
    captured = capture(lm, ids)
    try:
        rope = Rope.from_model(lm.model)
    except ValueError:
        rope = None
    tensors = {}
    for i, layer in enumerate(captured):
        report(f"layer {i + 1} of {len(captured)}", (i + 1) / (len(captured) + 1))
        parts = [
            ("value", layer["value"], layer["value_grad"] ** 2, False),
            ("key", layer["key"], layer["key_grad"] ** 2, False),
        ]
        if rope is not None:  # gradients turn like the keys: dL/dk_pre = A^T dL/dk_post, A^T = a^2 A^-1 (a constant)
            pre_grad = rope.undo(layer["key_grad"], 0)
            parts.append(("key", rope.undo(layer["key"], 0), pre_grad**2, True))
        for part, x, fisher, pre_rope in parts:
            for outliers in (False, True):
                samples, weights = normalized_samples(x, fisher, part, OUTLIER_PCT if outliers else 0.0)
                for b in bits:  # 2 bits: 4 levels, two pinned to the ends would leave 2 for the bulk
                    levels = weighted_kmeans(samples, weights, 1 << b, ends=b > 2)
                    tensors[tensor_name(i, part, b, outliers, pre_rope)] = levels.half()
    meta = {
        "model": lm.name,
        "source": lm.source,
        "calibration_tokens": str(len(ids)),
        "calibration_text": "kvdemo.texts.prose (Pride and Prejudice)",
        "seconds": f"{time.perf_counter() - t0:.1f}",
        "date": time.strftime("%Y-%m-%d"),
        "layers": str(len(captured)),
    }
    report("done", 1.0)
    return Codebooks(tensors, meta)


class Codebooks:
    """A model's fitted levels by tensor name, or none (NormalFloat for every layer)."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict | None = None):
        self.tensors, self.metadata = tensors, dict(metadata or {})

    @classmethod
    def normal_float(cls) -> Codebooks:
        return cls({}, {"source": "normalfloat"})

    @property
    def fitted(self) -> bool:
        return bool(self.tensors)

    def levels(self, layer: int, part: str, spec: PrecisionSpec) -> torch.Tensor:
        """fp16 levels for `part` of `layer` under `spec` (fitted if present, else NormalFloat rounded to fp16): the
        quantizer picks codes with the very levels the cache stores and the kernels read."""
        fmt = spec.key_format if part == "key" else spec.value_format
        b = CODE_BITS[fmt]
        name = tensor_name(layer, part, b, spec.outliers > 0, spec.pre_rope and part == "key")
        found = self.tensors.get(name)
        return (normal_float(b) if found is None else found).half()

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path), metadata=self.metadata)
        return path

    @classmethod
    def load(cls, path: Path) -> Codebooks:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return cls({k: f.get_tensor(k) for k in f.keys()}, f.metadata())


def file_name(source: str) -> str:
    """The codebook file of a model source (`embedded`, a hub id, a folder)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", source.strip("/")).strip("_") + ".safetensors"


def user_dir() -> Path:
    from .models import cache_dir

    return cache_dir() / "codebooks"


def find(source: str) -> Path | None:
    """The codebook file of `source`: calibrated by the user (cache dir) first, then the shipped ones."""
    for folder in (user_dir(), ASSET_DIR):
        path = folder / file_name(source)
        if path.exists():
            return path
    return None


def for_model(lm) -> Codebooks:
    """The model's fitted codebooks when a file exists (and matches its layer count), else NormalFloat."""
    path = find(lm.source)
    if path is None:
        return Codebooks.normal_float()
    books = Codebooks.load(path)
    if books.metadata.get("layers") not in (None, str(lm.num_layers)):
        return Codebooks.normal_float()
    return books


def from_file(lm, path: str | Path) -> Codebooks:
    """The codebooks in the file at `path` for `lm` (ValueError with the reason when the file is missing, is
    not a codebook file, or was fitted on a model with another layer count)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"codebook file not found: {path}")
    try:
        books = Codebooks.load(path)
    except Exception as err:  # safetensors raises its own error types for a file that is not one of its
        raise ValueError(f"{path} is not a codebook file (safetensors): {err}") from err
    layers = books.metadata.get("layers")
    if not books.fitted:
        raise ValueError(f"{path} holds no codebooks")
    if layers not in (None, str(lm.num_layers)):
        raise ValueError(f"{path} holds codebooks of a {layers}-layer model; {lm.name} has {lm.num_layers} layers")
    return books


def used_by(lm, specs: Sequence[PrecisionSpec], books: Codebooks | None = None) -> str | None:
    """For a report: what the nuq precisions among `specs` read their levels from (`books`, default the model's
    own: `describe`), or None when none of them takes a codebook."""
    if not any(any(s.codebook_levels().values()) for s in specs):
        return None
    return describe(books if books is not None else for_model(lm))


def describe(books: Codebooks) -> str:
    if not books.fitted:
        return "NormalFloat levels (no calibration file for this model)"
    m = books.metadata
    text = f" of {m['calibration_text']}" if m.get("calibration_text") else ""
    return (
        f"fitted on {m.get('calibration_tokens', '?')} tokens{text}, {m.get('date', '?')} ({m.get('seconds', '?')} s)"
    )
