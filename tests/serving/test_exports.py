import types

from mlx_serving import serving


def test_all_lists_exactly_the_public_names():
    """Every public name is in __all__ (subpackages such as serving.ray, imported on demand, are
    not names of the package's API)."""
    public = {name for name, value in vars(serving).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert set(serving.__all__) == public
    assert serving.__all__ == sorted(serving.__all__)


def test_error_tree():
    for name in ("ServingStopped", "ServingOverloaded", "RequestCancelled", "DeadlineExceeded",
                 "WorkerCrashed", "RemoteError", "BackendError"):
        assert issubclass(getattr(serving, name), serving.ServingError)
