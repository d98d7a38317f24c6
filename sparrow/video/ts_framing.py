"""MPEG-TS framing of a live media fed in chunks split anywhere: chunks that break the packet
framing are refused whole, and a change of the program's video stream (another codec, or
another PID: a camera reconfigured, a stream re-encoded) is where one media ends and the
next begins. One decoder cannot read across it (FFmpeg keeps the first codec's decoder for a
PID, and reads one video stream), so the live session starts a new one there.

Only the program tables are read (PAT, PMT): 188-byte packets, a section per packet (PMTs
of a few streams fit), nothing decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparrow.errors import VideoUnreadable

TS_PACKET = 188
TS_SYNC = 0x47                  # the first byte of every MPEG-TS packet
# ISO/IEC 13818-1 stream types of video elementary streams, by the decoder they need.
VIDEO_STREAM_TYPES = {0x01: "mpeg1video", 0x02: "mpeg2video", 0x10: "mpeg4", 0x1B: "h264", 0x24: "hevc",
                      0x33: "vvc"}


@dataclass(frozen=True, slots=True)
class Segment:
    data: bytes
    switch: str | None = None    # set on a segment that starts a new media: "mpeg4 -> h264"


class TsFraming:
    """Whole TS packets of a media fed in chunks (a partial packet waits for the rest), cut
    into segments where the program's video stream changes."""

    def __init__(self):
        self._fed = 0                              # bytes accepted so far
        self._tail = b""                           # a partial packet
        self._pmt_pids: set[int] = set()
        self._pat: bytes | None = None             # the newest PAT packet (a new media starts with it)
        self._video: tuple[int, int] | None = None   # (stream type, PID) of the program's video

    def push(self, chunk: bytes) -> list[Segment]:
        """The chunk's whole packets as segments (usually one). VideoUnreadable, with nothing
        taken, when a packet of the chunk has no sync byte where framing puts one."""
        marks = np.frombuffer(chunk, dtype=np.uint8)[(-self._fed) % TS_PACKET::TS_PACKET]
        if not bool((marks == TS_SYNC).all()):
            bad = int(np.argmax(marks != TS_SYNC))
            raise VideoUnreadable(f"chunk at byte {self._fed} of the stream is not MPEG-TS: no sync "
                                  f"byte at its packet {bad}; the chunk was dropped, the session goes on")
        self._fed += len(chunk)
        data = self._tail + bytes(chunk)
        whole = len(data) - len(data) % TS_PACKET
        self._tail = data[whole:]
        segments: list[Segment] = []
        start, prefix, switch = 0, b"", None
        for at in range(0, whole, TS_PACKET):
            changed = self._read_tables(data[at:at + TS_PACKET])
            if changed is not None:               # a new media from here, opened by the newest PAT
                if at > start or prefix:
                    segments.append(Segment(prefix + data[start:at], switch))
                start, prefix, switch = at, self._pat or b"", changed
        if whole > start or prefix:
            segments.append(Segment(prefix + data[start:whole], switch))
        return segments

    def _read_tables(self, packet: bytes) -> str | None:
        """Reads a PAT or PMT packet; returns "old -> new" when the video stream changed."""
        pid = ((packet[1] & 0x1F) << 8) | packet[2]
        if not packet[1] & 0x40 or (pid != 0 and pid not in self._pmt_pids):
            return None                           # not the start of a table section we read
        section = _section(packet)
        if section is None:
            return None
        if pid == 0 and section[0] == 0x00:       # PAT: program number -> PMT PID
            self._pat = packet
            end = min(len(section), 3 + _length(section)) - 4
            self._pmt_pids = {((section[i + 2] & 0x1F) << 8) | section[i + 3] for i in range(8, end - 3, 4)
                              if (section[i] << 8 | section[i + 1]) != 0}
            return None
        if section[0] != 0x02:                    # not a PMT
            return None
        video = _first_video(section)
        if video is None or video == self._video:
            return None
        old, self._video = self._video, video
        if old is None:
            return None
        return f"{_name(old)} -> {_name(video)}"


def _section(packet: bytes) -> bytes | None:
    control = (packet[3] >> 4) & 0x3
    if not control & 0x1:                     # no payload
        return None
    at = 4 + (1 + packet[4] if control & 0x2 else 0)
    if at >= TS_PACKET:
        return None
    at += 1 + packet[at]                      # pointer field
    return packet[at:] if at < TS_PACKET - 3 else None


def _length(section: bytes) -> int:
    return ((section[1] & 0x0F) << 8) | section[2]


def _first_video(pmt: bytes) -> tuple[int, int] | None:
    end = min(len(pmt), 3 + _length(pmt)) - 4             # before the CRC
    i = 12 + (((pmt[10] & 0x0F) << 8) | pmt[11])
    while i + 5 <= end:
        stream_type, pid = pmt[i], ((pmt[i + 1] & 0x1F) << 8) | pmt[i + 2]
        if stream_type in VIDEO_STREAM_TYPES:
            return stream_type, pid
        i += 5 + (((pmt[i + 3] & 0x0F) << 8) | pmt[i + 4])
    return None


def _name(video: tuple[int, int]) -> str:
    return f"{VIDEO_STREAM_TYPES[video[0]]} (PID {video[1]})"


__all__ = ["Segment", "TS_PACKET", "TS_SYNC", "TsFraming", "VIDEO_STREAM_TYPES"]
