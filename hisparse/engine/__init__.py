"""The engines that host HiSparse without a server: the DeepSeek-V3.2 / GLM-5 engine over the
attention core (``dsa``) and the GPU-bound graph step (``graph``); docs/engine.md's "Code map"
says which module holds what.

May import: ``hisparse.connector``, ``hisparse.models``, ``hisparse.runtime``, ``hisparse.ops``;
never vLLM.
"""
