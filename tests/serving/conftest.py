import pytest
from serving_fakes import RecordingBackend


@pytest.fixture
def recording() -> RecordingBackend:
    return RecordingBackend()
