"""Helix shared kernel: file formats (spec, profile, plan), wire messages, errors and units.

Nothing in this package holds serving or planning logic; every other package imports it and
it imports none of them (``helix.cli`` imports them lazily, inside commands).
"""

__version__ = "0.1.0"
