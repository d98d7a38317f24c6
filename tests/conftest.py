import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from sparrow.testing import synthetic_frames, tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def qwen_target():
    return tiny_target("qwen2_5_vl", seed=0)


@pytest.fixture(scope="session")
def llava_target():
    return tiny_target("llava_onevision", seed=0)


@pytest.fixture(scope="session", params=["qwen2_5_vl", "llava_onevision"])
def any_target(request, qwen_target, llava_target):
    return qwen_target if request.param == "qwen2_5_vl" else llava_target


@pytest.fixture(scope="session")
def small_video():
    return synthetic_frames(4, 56, 56, seed=1)


@pytest.fixture(scope="session")
def large_video():
    return synthetic_frames(8, 84, 112, seed=2)
