"""``python -m mlx_serving``: the ``mlx-serving`` command."""

import sys

from .cli import main

sys.exit(main())
