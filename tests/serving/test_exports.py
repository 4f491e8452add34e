from mlx_serving import serving


def test_all_lists_exactly_the_public_names():
    public = {name for name in vars(serving) if not name.startswith("_")}
    assert set(serving.__all__) == public
    assert serving.__all__ == sorted(serving.__all__)


def test_error_tree():
    for name in ("ServingStopped", "ServingOverloaded", "RequestCancelled", "DeadlineExceeded",
                 "WorkerCrashed", "RemoteError", "BackendError"):
        assert issubclass(getattr(serving, name), serving.ServingError)
