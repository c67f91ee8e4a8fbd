"""The coordinator's routing: per-request pipelines over a plan's max-flow solution.

The pure policy modules (no sockets, no HTTP, no torch) are :mod:`router.iwrr` (interleaved
weighted round robin), :mod:`router.pipeline` (stages, pipelines, hop-by-hop construction),
:mod:`router.kv` (KV-cache estimation and high-watermark masking) and :mod:`router.policy`
(the :class:`~router.policy.Router` facade). The simulator uses exactly these objects; the
HTTP coordinator wraps them.
"""
