"""The quality gate: does a quantized (or otherwise changed) model still predict text like the
model it came from? `tokenmill quality-gate` and `tokenmill serve --quality-gate`.

text_set.py    the shipped texts (texts/*.txt) as token windows and greedy prompts
measure.py     base first (its log-probabilities kept on the CPU), then the candidate against them
metrics.py     the numbers measured (torch-free)
verdict.py     thresholds with their defaults, and which metrics are past them
gate.py        which two engines are compared, running both, the report
table.py       the report as a table and as JSON
cli.py         the flags and `tokenmill quality-gate`
serve_gate.py  `serve --quality-gate`: the gate in a child process (child.py) before serving

docs/QUALITY_GATE.md describes the metrics and why the default thresholds are what they are.
"""
