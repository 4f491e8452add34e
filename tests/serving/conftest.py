import pytest
from serving_fakes import RecordingBackend


@pytest.fixture
def recording() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test on asyncio and on trio."""
    return request.param
