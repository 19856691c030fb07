import pytest

from serving import HAVE_HTTP


@pytest.fixture(scope="module")
def pair(demo_pair) -> tuple[str, str]:
    return demo_pair


@pytest.fixture(scope="module")
def http():
    if not HAVE_HTTP:
        pytest.skip("fastapi, uvicorn, httpx and openai are needed for the HTTP tests")
