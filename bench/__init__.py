"""Benchmarks for mcpresume: throughput, added latency, resume latency and memory, measured side by side
against a direct connection to the upstream and against nginx. Run ``python -m bench --help``."""
