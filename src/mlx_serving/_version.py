"""``__version__``: the installed distribution's version (``0+unknown`` from an uninstalled tree)."""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("mlx-serving")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
