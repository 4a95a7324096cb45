"""`mtp bench`: the serving benchmark (TTFT, TPOT, throughput, acceptance vs concurrency)."""
