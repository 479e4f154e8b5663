"""How far one text's perplexity figures carry (kvdemo.ppl's paired block bootstrap), on synthetic blocks whose
spread is known."""

import pytest
import torch

from kvdemo import ppl
from kvdemo.results.ppl import Blocks, PplRow


def _blocks(nll: dict, kl: dict, nll_count: int = 64, kl_count: int = 16, resamples: int = 2000) -> Blocks:
    n = len(next(iter(nll.values())))
    return Blocks(
        size=64,
        resamples=resamples,
        seed=0,
        nll={k: [float(x) for x in v] for k, v in nll.items()},
        logit_kl={k: [float(x) for x in v] for k, v in kl.items()},
        nll_counts=[nll_count] * n,
        kl_counts=[kl_count] * n,
    )


def test_block_means_average_each_block_of_the_scored_range():
    values = torch.arange(20, dtype=torch.float64)  # value = scored index
    means, counts = ppl.block_means(values, torch.arange(20), lo=4, hi=20, block=6)  # blocks [4,10) [10,16) [16,20)
    assert means == [6.5, 12.5, 17.5] and counts == [6, 6, 4]
    kept = torch.arange(0, 20, 4)  # a KL kept every 4th index: 0, 4, 8, 12, 16
    means, counts = ppl.block_means(values[kept], kept, lo=4, hi=20, block=6)
    assert means == [6.0, 12.0, 16.0] and counts == [2, 1, 1]


def test_interval_width_matches_the_known_spread_of_a_mean():
    """400 independent blocks of KL with sd 0.1: the mean's standard error is 0.1 / 20, so the 95% interval spans
    about 2 x 1.96 x 0.005 = 0.0196 around the sample mean (the bootstrap's own error: a few percent)."""
    gen = torch.Generator().manual_seed(1)
    kl = (0.5 + 0.1 * torch.randn(400, generator=gen, dtype=torch.float64)).tolist()
    drawn = ppl.resampled_figures(_blocks({"full": [3.0] * 400}, {"full": [0.0] * 400, "x": kl}))
    low, high = ppl.interval95(drawn["logit_kl"]["x"])
    sample_sd = float(torch.tensor(kl).std())
    assert high - low == pytest.approx(2 * 1.96 * sample_sd / 20, rel=0.1)
    assert low < sum(kl) / 400 < high
    assert ppl.interval95(drawn["delta_vs_full"]["full"]) == [0.0, 0.0]  # full against itself, on every draw


def test_draws_are_paired_and_seeded():
    """Two caches whose blocks swing widely (sd 1 nat) but where b costs 0.05 nats more than a in every block:
    b's delta exceeds a's on every draw, as both are read on the same blocks (unpaired draws would often
    reverse them); the same blocks give the same draws on every call."""
    gen = torch.Generator().manual_seed(2)
    full = (3.0 + 0.3 * torch.randn(32, generator=gen, dtype=torch.float64)).tolist()
    a = [x + float(s) for x, s in zip(full, torch.randn(32, generator=gen, dtype=torch.float64), strict=True)]
    nll = {"full": full, "a": a, "b": [x + 0.05 for x in a]}
    blocks = _blocks(nll, {k: [0.0] * 32 for k in nll})
    drawn = ppl.resampled_figures(blocks)
    assert float((drawn["delta_vs_full"]["b"] - drawn["delta_vs_full"]["a"]).min()) > 0
    low, high = ppl.interval95(drawn["delta_vs_full"]["a"])
    assert high - low > 1.0  # a alone is far from settled
    again = ppl.resampled_figures(blocks)
    assert torch.equal(again["delta_vs_full"]["a"], drawn["delta_vs_full"]["a"])


def test_checks_say_whether_the_text_settles_them():
    """Verdicts from the difference's interval: a bar cleared on every block holds, one missed on every block
    does not, and one that half the blocks clear and half miss is not settled by this text."""
    n = 40
    gen = torch.Generator().manual_seed(3)
    base = (3.0 + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).tolist()
    swing = [0.2 if i % 2 else -0.2 for i in range(n)]  # per-block noise of the 3-bit cache around int4's cost
    nll = {
        "full": base,
        "int4": [x + 0.01 for x in base],
        "nuq3:o1": [x + 0.01 + s for x, s in zip(base, swing, strict=True)],
        "int2": [x + 0.5 for x in base],
        "nuq2:o1": [x + 0.3 for x in base],  # 60% of int2's cost per block: misses the 20% bar everywhere
        "nuq2:o1:s1": [x + 0.02 for x in base],  # 4%: clears it everywhere
    }
    kl = {k: [0.0] * n for k in nll}
    blocks = _blocks(nll, kl)
    drawn = ppl.resampled_figures(blocks)
    rows = [
        PplRow(k, 20.0, float(drawn["delta_vs_full"][k].median()), 0.0, 4.0, 4.0, 1000, 100) for k in nll if k != "full"
    ]
    checks = {c.claim: c for c in ppl.ablation_checks(rows, blocks)}
    assert checks["nuq2:o1 delta <= 20% of int2 delta"].verdict == "does not hold"
    assert checks["nuq2:o1:s1 delta <= 20% of int2 delta"].verdict == "holds"
    assert checks["nuq3:o1 delta <= int4 delta"].verdict == "not settled by this text"
    low, high = checks["nuq3:o1 delta <= int4 delta"].difference_ci95
    assert low < 0 < high
    line = checks["nuq2:o1 delta <= 20% of int2 delta"].line()
    assert line.startswith("nuq2:o1 delta <= 20% of int2 delta: does not hold (+")
    assert line.endswith(", 95%)") and "; over resampled text: does not hold (difference in [+" in line
    assert "verdict" not in ppl.ablation_checks(rows)[0].to_json()  # no blocks (an older report): point verdicts
