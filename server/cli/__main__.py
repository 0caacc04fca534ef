"""``python -m fedge.server.cli``: the ``fedge`` command."""

import sys

from fedge.server.cli.main import main

sys.exit(main())
