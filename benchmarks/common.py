"""What the benchmarks share: a raw read of located block bytes, this machine's limit."""

from __future__ import annotations

import os
from collections.abc import Sequence

import xxhash

from agentkv.v1 import store_pb2 as pb


class RawReader:
    """preadv of located segments into one preallocated buffer: what no client can beat."""

    def __init__(self, locations: Sequence[pb.BlockLocation]) -> None:
        self.plan = [(loc.path, list(loc.segments)) for loc in locations]
        self.num_bytes = sum(s.num_bytes for _, segs in self.plan for s in segs)
        self.buffer = memoryview(bytearray(self.num_bytes))  # zero-filled, so already faulted in

    def read(self, verify: bool = False) -> int:
        pos = 0
        for path, segments in self.plan:
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset, size in merged_runs(segments):
                    if os.preadv(fd, [self.buffer[pos : pos + size]], offset) != size:
                        raise RuntimeError(f"{path} is short at {offset}")
                    pos += size
            finally:
                os.close(fd)
            if verify:
                self.check(segments, pos - sum(s.num_bytes for s in segments))
        return pos

    def verify(self) -> None:
        """Checks every segment's xxh3 over what the last read() left in the buffer."""
        pos = 0
        for _, segments in self.plan:
            self.check(segments, pos)
            pos += sum(s.num_bytes for s in segments)

    def check(self, segments: Sequence[pb.Segment], pos: int) -> None:
        for s in segments:
            if xxhash.xxh3_64_intdigest(self.buffer[pos : pos + s.num_bytes]) != s.checksum:
                raise RuntimeError(f"checksum mismatch in layer {s.layer}")
            pos += s.num_bytes


def merged_runs(segments: Sequence[pb.Segment]) -> list[tuple[int, int]]:
    """(offset, size) of each run of adjacent segments: one preadv each."""
    runs: list[tuple[int, int]] = []
    for s in segments:
        if runs and sum(runs[-1]) == s.offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + s.num_bytes)
        else:
            runs.append((s.offset, s.num_bytes))
    return runs
