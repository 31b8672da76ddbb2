"""Runnable micro-benchmarks: `python -m benchmarks.<name> [--quick]`.

Results are in benchmarks/README.md.

- `losses`: every loss kernel against a per-datum loop, the memory roofline and torch.compile.
- `datums`: rollout records to PyTRIO Datums, fast path against per-token validated construction.
- `loop`: the training loop's own overhead next to a backend with fixed per-call latency.
- `local`: the embedded local backend's sampling and forward_backward throughput.
"""
