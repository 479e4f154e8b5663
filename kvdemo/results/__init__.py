"""What crosses the layers: each run's result as data, and the numbers derived from it.

One module per subject. A producer (kvdemo/needle/, ppl.py, drift.py, findings.py, ...) builds its result; the
figures, the pages, the CLI and the reports read it through these modules, so none of them needs the code
that ran the model. Nothing here imports torch or loads a model.
"""
