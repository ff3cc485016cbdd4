"""The running MTA: `sluice serve` and its parts, the queue manager, the demos."""
