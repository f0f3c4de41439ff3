"""5-shot GSM8K against an OpenAI-compatible server (``vllm serve`` with the HiSparse connector).

Stdlib + PyYAML only: the client, the dataset loader and the answer extraction have no other
dependencies, so the CI can test all of it without a model, a GPU or the network.
"""
