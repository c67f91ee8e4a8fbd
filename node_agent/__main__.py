"""``python -m node_agent --cluster C --plan P --node N``: the same as ``helix agent``."""

import sys

from node_agent.commands import main

sys.exit(main())
