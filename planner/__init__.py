"""The planner: cluster + profiles -> Plan (which contiguous layers every node holds).

``planner.capacity`` is the planning problem every module reads (:class:`~planner.capacity.CapacityModel`);
``planner.graph`` builds the paper's max-flow graph for any placement and evaluates it;
``planner.optimize`` searches placements; ``planner.milp`` and ``planner.baselines`` hold the
paper's MILP and baselines; ``planner.solvers`` is the one solver layer (highspy, pulp);
``planner.api`` ties them into :func:`planner.api.make_plan` (its settings: ``planner.options``).
"""
