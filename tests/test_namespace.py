"""The distribution installs under one namespace, ``mlx_serving``: an application's own
``models``, ``serving`` and ``tokenization`` modules cannot shadow the runtime's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx_serving

_APP = {
    "models.py": "raise ImportError('the application models.py was imported by the runtime')\n",
    "serving.py": "raise ImportError('the application serving.py was imported by the runtime')\n",
    "tokenization.py": "raise ImportError('the application tokenization.py was imported by the runtime')\n",
}


def test_public_names_are_reexported():
    from mlx_serving import serving

    for name in serving.__all__:
        assert getattr(mlx_serving, name) is getattr(serving, name)
    assert mlx_serving.text_generation.from_mlx4bit is not None
    assert set(mlx_serving.__all__) >= {"Serving", "ServingPool", "Batch", "text_generation", "default_checkpoint"}


def test_an_application_with_its_own_models_and_serving_modules(tmp_path: Path, tiny_ckpt: Path):
    app = tmp_path / "app"
    app.mkdir()
    for name, text in _APP.items():
        (app / name).write_text(text)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(app)!r})
        from mlx_serving import Serving, text_generation
        serving = text_generation.from_mlx4bit({str(tiny_ckpt)!r}, max_new_tokens=3, max_len=64, max_batch=2)
        result = Serving.run(serving, "hello")["results"][0]
        assert result["num_tokens"] == 3, result
        with Serving.start(serving) as handle:
            assert Serving.batched_run(handle, "hello")["results"][0]["generated_text"] == result["generated_text"]
        loaded = [m for m in sys.modules if m in ("models", "serving", "tokenization")]
        assert not loaded, loaded
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=app, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
