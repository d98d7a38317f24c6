"""Opening a path a request names (services.sources.HashedFile): the errors a caller gets
name the file but none of the server's directories, and a missing file is NOT_FOUND."""

from __future__ import annotations

import os

import pytest

from sparrow.errors import SourceNotAllowed, VideoUnreadable
from sparrow.services.grpc_status import VideoNotFound
from sparrow.services.video_store import HashedFile, content_id
from sparrow.video import SourcePolicy


@pytest.fixture()
def root(tmp_path):
    root = tmp_path / "media-dir-secret-name"
    root.mkdir()
    (root / "clip.mp4").write_bytes(b"not decoded here")
    os.mkfifo(root / "pipe.mp4")                  # opening it for reading would block until a writer came
    (tmp_path / "outside.mp4").write_bytes(b"x")
    (root / "link.mp4").symlink_to(tmp_path / "outside.mp4")
    return root


def test_a_file_inside_the_root_is_hashed_through_the_open_file(root):
    f = HashedFile(root / "clip.mp4", SourcePolicy(media_root=root), max_bytes=1 << 20)
    try:
        assert f.content_id == content_id(b"not decoded here")
    finally:
        f.close()


@pytest.mark.parametrize("name, error, message", [
    ("missing.mp4", VideoNotFound, "no video file 'missing.mp4' in the media directory"),
    ("pipe.mp4", VideoUnreadable, "'pipe.mp4' is not a regular file"),
    ("link.mp4", VideoUnreadable, "cannot read video file 'link.mp4'"),        # O_NOFOLLOW: ELOOP
])
def test_errors_name_the_file_not_the_servers_directories(root, name, error, message):
    with pytest.raises(error) as info:
        HashedFile(root / name, SourcePolicy(media_root=root), max_bytes=1 << 20)
    assert str(info.value).startswith(message) and root.name not in str(info.value)
    exc = info.value             # what a traceback would print after it: no OSError, which names the full path
    assert (exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)) is None


def test_a_file_opened_outside_the_root_is_refused(root, tmp_path):
    (root / "sub").symlink_to(tmp_path)            # a directory link: O_NOFOLLOW guards only the last component
    with pytest.raises(SourceNotAllowed, match="outside the allowed media directory"):
        HashedFile(root / "sub" / "outside.mp4", SourcePolicy(media_root=root), max_bytes=1 << 20)
