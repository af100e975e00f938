"""``python -m gear_server``: the same as the ``gear-server`` command."""

import sys

from gear_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
