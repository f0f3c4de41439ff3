"""Evaluations for hisparse: GSM8K on real deployments (``evals.gsm8k``) and the
HiSparse-vs-resident parity eval on the DSA engine (``evals.parity``)."""
