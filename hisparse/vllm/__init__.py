"""HiSparse inside a real vLLM server: the plugin entry point, the reference sparse-MLA model as
an out-of-tree vLLM architecture, and the attention-side glue that calls the connector.

Importing ``hisparse`` never imports this subpackage; vLLM imports it through the
``vllm.general_plugins`` entry point (``hisparse.vllm.plugin:register``).
"""
