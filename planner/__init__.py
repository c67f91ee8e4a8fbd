"""The planner: cluster + profiles -> Plan (which contiguous layers every node holds).

``planner.graph`` builds the paper's max-flow graph for any placement and evaluates it;
``planner.optimize`` searches placements; ``planner.baselines`` holds the paper's
baselines; ``planner.api`` ties them into :func:`planner.api.make_plan`.
"""
