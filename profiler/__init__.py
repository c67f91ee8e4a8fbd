"""Profiler: measures GPUs (through the real engine) and links (through ZeroMQ), or estimates
GPUs from spec sheets (roofline), and writes the profiles file the planner reads.

May import helix (and node_agent, to drive the real engine); never planner, router, simulator.
"""
