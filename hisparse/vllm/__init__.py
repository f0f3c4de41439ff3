"""HiSparse inside a real vLLM server: the plugin entry point, the DeepSeek-V3.2 / GLM-5 classes
as out-of-tree vLLM architectures (``dsa``), and the attention-side glue that calls the
connector.

Importing ``hisparse`` never imports this subpackage; vLLM imports it through the
``vllm.general_plugins`` entry point (``hisparse.vllm.plugin:register``).
"""
