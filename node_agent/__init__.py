"""Node agent: the partial-layer PyTorch engine and its iteration-level scheduler.

The engine half lives here (``config``, ``weights``, ``gguf_convert``, ``model``, ``kv_cache``,
``sampling``, ``scheduler``, ``engine``); the ZeroMQ agent that drives a
:class:`node_agent.engine.StageEngine` step by step is a thin wrapper around it. Agents see token
ids only: tokenization and the chat template are the coordinator's (``router.tokenizer``).
"""
