"""`strata-nb bench`: measured prefill and decode speed, checked output, and the peer.

run.py times the engine per (format, resident or streamed, depth); check.py holds each
configuration's first greedy tokens against the numpy backend; peer.py times HF
transformers on the same shapes in the same run; profile.py breaks one decode step into
kernels; report.py writes the JSON, the markdown table and the plot.
"""
