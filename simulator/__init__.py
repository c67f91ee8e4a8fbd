"""Discrete-event simulation of a planned cluster under a workload (Helix section 5).

:mod:`simulator.workload` makes requests (length distributions, Poisson/Gamma arrivals, an
Azure-conversation-like synthetic trace, trace replay); :mod:`simulator.routing` adapts the
router's own policy objects (IWRR + KV masking) and the baselines (random, shortest queue,
Swarm-style); :mod:`simulator.engine` runs nodes, links and the coordinator;
:mod:`simulator.commands` is ``helix simulate``.
"""
