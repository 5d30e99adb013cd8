"""`engine bench`: throughput, latency and serving benchmarks, with A/B of plugin choices."""
