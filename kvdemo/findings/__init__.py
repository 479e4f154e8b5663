"""Findings: the claims about KV-cache quantization, measured on the loaded model, with computed verdicts.

Each claim is a section of a report (`python -m kvdemo findings`, the Findings page): the claim, its
verdict on this model, a figure and how it was measured. One measurement is shared by every claim: a
single token sequence of up to the model's context, held-out prose with needles near its start, is read
on at growing positions from a cache at each KV precision (perplexity windows, needle answers, live bytes).

- `text`: the token sequence the measurements run over (`build_text` -> `FindingsText`), RULER's needles.
- `measure`: one precision over that text (`measure_spec`), weight quantization (`with_weights`), and the
  disk cache of measurements and exact states.
- `run`: what a run measures (`plan`: sizes, units, the empty report) and the loop (`run_plan`,
  `run_findings`) under the progress protocol (`kvdemo.progress`).
- `verdicts`: the claims (`CLAIMS`), each judged from the numbers (`evaluate`); `caption`.
- `render`: the report as files: standalone HTML, a PDF and PNG figures by headless Chromium.

The report itself is `kvdemo.results.findings.Findings` (with `load` / `save` and the numbers the verdicts
and figures read). The embedded model's weights already come from a Q4_1 GGUF (dequantized to fp32 at
load): "as loaded" is itself 4-bit-derived (`run.WEIGHT_NOTE`).
"""
