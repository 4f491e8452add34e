"""``python -m mlx_serving``: the ``mlx-serving`` command."""

import sys

from .models.__main__ import main

sys.exit(main())
