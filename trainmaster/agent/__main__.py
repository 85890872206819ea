"""``python -m trainmaster.agent``: the local node agent daemon."""

import sys

from trainmaster.agent.server import main

sys.exit(main())
