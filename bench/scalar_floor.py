"""How close can 3-bit scalar key codes come to int4 on this model? An oracle floor for nuq3.

nuq3:o1 misses int4's perplexity in its keys (docs/methods.md, "Keys or values: where the loss sits"). Its keys are one fitted codebook of 8
levels per layer, stretched over each channel's range in each 128-token block, with 1% of the elements kept
exact. The oracle here gives every 128-token channel block its own 8 levels instead: the two ends pinned at
the block's min and max (as nuq pins its codebook's ends at -1 and 1 and int codes keep the range's ends) and
the six between them fitted by Lloyd's algorithm (1-D k-means) to that block's own values, the same 1% kept
exact. No cache could store that for free (six fp16 levels per channel per block are 0.75 bits per element
more), and no calibration can know the block it will meet: it is what any scalar 3-bit key code with a
codebook per layer, per head or per block could reach at best on this text, by squared error.

Three measures, keys only (values at int8):
- key error on the held-out prose the perplexity is scored on: the squared error of every key element,
  weighted by its Fisher information from one backward pass (the loss's sensitivity, as calibration weighs
  it), and plain, relative to each block's variance;
- perplexity and logit KL at `--tokens` of that prose with keys alone quantized, the ppl protocol of
  `kvdemo.ppl`. The oracle's keys ride in an int8 cache: each block's oracle values are what int8 then
  stores (int8 keys alone cost a logit KL of about 2e-5, a thousandth of what is measured here);
- the passkey grid of docs/methods-passkey.md (`--passkey-repeats` seeds) with 2-bit keys alone: nuq2:o1's keys beside the
  oracle's 4 free levels per block.

And one reference without the model: the same codes on Gaussian channels, beside the distortion-rate
function of a Gaussian source, the least squared error any code of 3 bits per element can have
(2^-6 of the variance, vector codes included).

    python bench/scalar_floor.py --passkey-repeats 5 --out assets/reports/scalar_floor.json
    # 46 min on 2 CPU cores (2026-12-06)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from kvdemo import cache as kv_cache  # noqa: E402
from kvdemo import calibration  # noqa: E402
from kvdemo import codebooks as books  # noqa: E402
from kvdemo.precision import outlier_cap, parse_precision  # noqa: E402
from kvdemo.quant import reference as ref  # noqa: E402

GROUP = 128  # tokens per key block (the default spec's)
OUTLIERS = 1.0  # percent kept exact, as nuq3:o1
LEVELS = 8  # 3 bits
ITERATIONS = 40
CARRIER = "int8"  # the precision whose keys the oracle replaces in the perplexity run
PPL_KEYS = {"k4v8": "int4 keys", "knuq3v8:o1": "nuq3:o1 keys", CARRIER: "oracle 3-bit keys"}
ERROR_METHODS = ("int4", "nuq4:o1", "int3", "nuq3:o1", "oracle")
GAUSSIAN_SHAPE = (1, 4, 1024, 64)  # [B, H, T, D]
PASSKEY_KEYS = {"knuq2v8:o1": "nuq2:o1 keys", CARRIER: "oracle 2-bit keys"}  # the passkey grid, 2-bit keys alone
PASSKEY_LENGTHS, PASSKEY_DEPTHS = (1024, 2048, 4096), (0.0, 25.0, 50.0, 75.0, 100.0)
PASSKEY_BAR = (13, 15)


def block_lloyd(x: torch.Tensor, keep: torch.Tensor, n: int = LEVELS, iterations: int = ITERATIONS) -> torch.Tensor:
    """x, keep [R, G] (one block per row; keep: the elements the levels are fitted to) -> x's kept elements
    replaced by the nearest of the row's own n levels, fitted by Lloyd from the row's quantiles; above 4 levels
    the ends are pinned at the row's kept min and max (as calibration fits nuq3 and nuq4, and leaves nuq2's four
    levels free). The others are returned as they are (held exact)."""
    x = x.double()
    lo = torch.where(keep, x, torch.inf).amin(1)
    hi = torch.where(keep, x, -torch.inf).amax(1)
    levels = torch.nanquantile(torch.where(keep, x, torch.nan), (torch.arange(n, dtype=x.dtype) + 0.5) / n, dim=1).T
    levels = levels.contiguous()  # [R, n]

    def nearest(levels):
        return (x[:, :, None] - levels[:, None, :]).abs().argmin(-1)  # [R, G]

    ends = n > 4

    for _ in range(iterations):
        if ends:
            levels[:, 0], levels[:, -1] = lo, hi
        cell = torch.nn.functional.one_hot(nearest(levels), n).to(x.dtype) * keep[:, :, None]  # [R, G, n]
        mass, total = cell.sum(1), (cell * x[:, :, None]).sum(1)
        levels = torch.where(mass > 0, total / mass.clamp(min=1), levels)
    if ends:
        levels[:, 0], levels[:, -1] = lo, hi
    levels = levels.sort(1).values
    return torch.where(keep, levels.gather(1, nearest(levels)), x)


def oracle_keys(k: torch.Tensor, group: int = GROUP, outliers: float = OUTLIERS, levels: int = LEVELS) -> torch.Tensor:
    """k [B, H, T, D] (T a multiple of group) -> k as the oracle stores it: per channel and block of `group`
    tokens its own `levels` levels (block_lloyd), the outliers nuq3:o1 would pick held exact."""
    b, h, t, d = k.shape
    kf = k.float()
    cap = outlier_cap(outliers, d)
    picked = (
        ref._mask(kf, ref.outlier_picks(kf, "channel", group, cap)) if cap else torch.zeros_like(kf, dtype=torch.bool)
    )

    def rows(z):  # [B, H, T, D] -> [B*H*NB*D, group]: one channel of one block per row
        return z.view(b, h, t // group, group, d).transpose(-1, -2).reshape(-1, group)

    out = block_lloyd(rows(kf), ~rows(picked), levels).float()
    return out.view(b, h, t // group, d, group).transpose(-1, -2).reshape(b, h, t, d).to(k.dtype)


@contextlib.contextmanager
def oracle_in_carrier(levels: int = LEVELS):
    """While open, every key block the cache quantizes as CARRIER (keys: axis "channel") is first replaced by
    its oracle values (`levels` per block); values and every other format quantize as they do."""
    real = kv_cache.quantize

    def quantize(x, fmt, axis, group, **methods):
        if fmt == CARRIER and axis == "channel":
            x = oracle_keys(x, group, levels=levels)
        return real(x, fmt, axis, group, **methods)

    kv_cache.quantize = quantize
    try:
        yield
    finally:
        kv_cache.quantize = real


def reconstructed(k: torch.Tensor, method: str, levels) -> torch.Tensor:
    """k [B, H, T, D] through one key code: "oracle", or a precision whose key format it uses (nuq: `levels`)."""
    if method == "oracle":
        return oracle_keys(k)
    spec = parse_precision(method)
    q = ref.quantize(
        k, spec.key_format, "channel", GROUP, outliers=spec.outliers,
        levels=levels(spec) if spec.key.codebook else None,
    )  # fmt: skip
    return ref.dequantize(q)


def error_rows(keys: list[torch.Tensor], fisher: list[torch.Tensor] | None, levels) -> list[dict]:
    """Key error of each ERROR_METHODS code over layers of keys [B, H, T, D]: squared error over each
    128-token channel block's variance, averaged; with fisher (same shapes), the Fisher-weighted squared error
    summed, and as a multiple of int4's."""
    rows = []
    for method in ERROR_METHODS:
        weighted, relative = 0.0, 0.0
        for i, k in enumerate(keys):
            err2 = (reconstructed(k, method, lambda s, i=i: levels(i, s)) - k).square()
            var = k.view(*k.shape[:2], -1, GROUP, k.shape[-1]).var(-2, keepdim=True).clamp(min=1e-12)
            relative += float((err2.view(var.shape[:-2] + (GROUP, -1)) / var).mean()) / len(keys)
            weighted += float((fisher[i] * err2).sum()) if fisher is not None else 0.0
        rows.append({"keys": method, "relative_mse": relative, "fisher_weighted": weighted if fisher else None})
    if fisher is not None:
        base = rows[0]["fisher_weighted"]
        for r in rows:
            r["vs_int4"] = r["fisher_weighted"] / base
    return rows


def gaussian_rows(seed: int = 0) -> dict:
    """The key codes on Gaussian channels (random mean and spread per channel) beside the Gaussian
    distortion-rate function at 3 bits: what no 3-bit code of any kind can beat on such a source."""
    g = torch.Generator().manual_seed(seed)
    b, h, t, d = GAUSSIAN_SHAPE
    k = torch.randn(GAUSSIAN_SHAPE, generator=g) * torch.rand(d, generator=g).add(0.2) + torch.randn(d, generator=g)
    rows = error_rows([k], None, lambda i, spec: books.normal_float(3 if "3" in spec.key_format else 4))
    return {"shape": list(GAUSSIAN_SHAPE), "seed": seed, "rows": rows, "distortion_rate_3_bits": 2.0**-6}


def key_error_rows(lm, ids) -> list[dict]:
    """error_rows on the keys the model's cache receives over `ids` (after RoPE), Fisher from one backward."""
    captured = calibration.capture(lm, ids)
    shipped = books.for_model(lm)
    t = len(ids) // GROUP * GROUP
    keys = [layer["key"][:, :, :t] for layer in captured]
    fisher = [layer["key_grad"][:, :, :t].square() for layer in captured]
    return error_rows(keys, fisher, lambda i, spec: shipped.levels(i, "key", spec))


def ppl_rows(lm, tokens: int, prefix: int, precisions=tuple(PPL_KEYS)) -> list[dict]:
    """run_ppl over `precisions` (full precision first) with CARRIER's keys replaced by the oracle's."""
    from kvdemo.ppl import run_ppl

    with oracle_in_carrier():
        report = run_ppl(lm, list(precisions), tokens=tokens, prefix=prefix)
    keep = ("precision", "ppl", "delta_vs_full", "logit_kl", "logit_kl_ci95", "delta_vs_full_ci95")
    return [
        {"keys": PPL_KEYS.get(r.precision, r.precision), **{k: r.to_json().get(k) for k in keep}}
        for r in report.results
    ]


def passkey_rows(lm, repeats: int) -> dict:
    """The passkey grid (the default lengths and depths), `repeats` seeds, with 2-bit keys alone (values int8):
    nuq2:o1's keys beside the oracle's 4 levels per block in CARRIER. The summary per precision, its bar check
    and the pairing."""
    from kvdemo.needle import run_grid
    from kvdemo.results.needle import found_check, paired_difference, summarize

    with oracle_in_carrier(levels=4):
        grid = run_grid(lm, PASSKEY_LENGTHS, PASSKEY_DEPTHS, list(PASSKEY_KEYS), repeats=repeats, prefill_mode="exact")
    summary = summarize(grid.rows)
    for r in summary:
        r["keys"] = PASSKEY_KEYS.get(r["precision"], r["precision"])
        if r["precision"] != "full":
            r["bar"] = found_check(r, *PASSKEY_BAR)
    return {
        "repeats": repeats,
        "lengths": list(PASSKEY_LENGTHS),
        "depths": list(PASSKEY_DEPTHS),
        "summary": summary,
        "oracle_vs_nuq2": paired_difference(grid.rows, CARRIER, "knuq2v8:o1"),
        "rows": [r.to_json() for r in grid.rows],
    }


ORACLE_NAME = "oracle, own levels per block"  # the carrier's name in docs/methods-passkey.md's tables


def markdown(report: dict) -> str:
    """docs/methods-passkey.md's tables: each key code's error beside its keys-alone perplexity delta and logit KL; then, when the
    report has it, the passkey grid with 2-bit keys alone (`kvdemo.results.needle.repeats_markdown`'s table)."""
    from kvdemo.results.needle import NeedleRow, repeats_markdown

    ppl = {r["precision"]: r for r in report["ppl"]}
    names = {"int4": "k4v8", "nuq3:o1": "knuq3v8:o1", "oracle": CARRIER}
    lines = [
        "| keys (values at int8) | key error, Fisher-weighted | key error / block variance | delta vs full | logit KL |",
        "|---|---|---|---|---|",
    ]
    for r in report["key_error"]:
        p = ppl.get(names.get(r["keys"], ""))
        label = f"{ORACLE_NAME}, 3-bit" if r["keys"] == "oracle" else r["keys"]
        tail = f"{p['delta_vs_full']:+.3f} | {p['logit_kl']:.2e}" if p else " | "
        lines.append(f"| {label} | {r['vs_int4']:.2f}x int4 | {r['relative_mse']:.4f} | {tail} |")
    tables = ["\n".join(lines)]
    if "passkey" in report:
        renamed = {CARRIER: f"{ORACLE_NAME}, 2-bit"}

        def named(row):
            return {**row, "precision": renamed.get(row["precision"], row["precision"])}

        pk = report["passkey"]
        tables.append(repeats_markdown([NeedleRow.from_json(named(r)) for r in pk["rows"]], pk["repeats"]))
    return "\n\n".join(tables)


def main(argv=None) -> int:
    from kvdemo.machine import machine_info
    from kvdemo.models import load_model
    from kvdemo.texts import held_out_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--passkey-repeats", type=int, default=5, help="seeds of the passkey grid (0: skip it)")
    p.add_argument("--out", default="assets/reports/scalar_floor.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    lm = load_model(args.model, device="cpu")
    report = {
        "model": lm.name,
        "tokens": args.tokens,
        "prefix": args.prefix,
        "group": GROUP,
        "outliers_pct": OUTLIERS,
        "gaussian": gaussian_rows(),
        "key_error": key_error_rows(lm, held_out_ids(lm, args.tokens)),
        "ppl": ppl_rows(lm, args.tokens, args.prefix),
    }
    if args.passkey_repeats:
        report["passkey"] = passkey_rows(lm, args.passkey_repeats)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["command"] = "python bench/scalar_floor.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    report["date"] = datetime.date.today().isoformat()
    report["machine"] = machine_info(lm)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"wrote {args.out} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
