"""The OpenAI-compatible HTTP server (``mlx-serving serve``): an optional extra,
``pip install 'mlx-serving[server]'``. The core never imports this package."""
