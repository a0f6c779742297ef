"""``python -m attnkit.cli``: the ``attnkit`` command."""

import sys

from attnkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
