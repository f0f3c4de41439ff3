"""HiSparse-vs-resident parity on the reference engine (runs in CI, no GPU needed)."""
