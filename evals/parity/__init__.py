"""HiSparse-vs-resident parity on the DSA engine (runs in CI, no GPU needed)."""
