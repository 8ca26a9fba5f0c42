"""tritonclient-based client tools for the ``generate`` model (CLI, datasets, benchmarks)."""
