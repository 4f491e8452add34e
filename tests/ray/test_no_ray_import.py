"""The core never imports ray: only a ``RayBackend`` (mlx_serving.serving.ray, ``backend="ray"``) does."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_package_and_a_process_pool_do_not_import_ray():
    script = (
        "import sys\n"
        "import mlx_serving\n"
        "from mlx_serving import ServingPool, Serving\n"
        "import mlx_serving.serving._pool._pool\n"
        "from mlx_serving.serving import ProcessBackend\n"
        "ProcessBackend(liveness_timeout=5.0)\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
