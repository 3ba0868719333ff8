"""Relaying a child process's output to ours, each line prefixed with the process's rank.

`zaya launch` runs one relay thread per pipe of every child. A child writes a line in pieces
(Python's `print` writes the text, then the newline; the children are unbuffered), so a relay
holds a partial line until its end arrives and writes whole lines in one call under a lock the
relays share: two processes' lines never interleave. A line still partial after the child has
been quiet for `PARTIAL_WAIT_S` is written as it is, so a progress bar (redrawn after `\\r`,
never ended by `\\n`) still shows while it runs.
"""

from __future__ import annotations

import codecs
import os
import re
import select
import threading

PARTIAL_WAIT_S = 0.2


def relay(stream, sink, prefix: str, lock: threading.Lock) -> None:
    """Copy `stream` (a child's pipe) to `sink` until the child closes it."""
    fd, decoder = stream.fileno(), codecs.getincrementaldecoder("utf-8")(errors="replace")
    line = _Line(sink, prefix, lock)
    poller = select.poll()  # not select(): no limit on the descriptor's number
    poller.register(fd, select.POLLIN)
    while True:
        if not poller.poll(PARTIAL_WAIT_S * 1000 if line.pending else None):
            line.flush_partial()
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            line.add(decoder.decode(b"", final=True))
            line.flush_partial()
            return
        line.add(decoder.decode(chunk))


class _Line:
    """The text between the last line end written and what has arrived since."""

    def __init__(self, sink, prefix: str, lock: threading.Lock):
        self.sink, self.prefix, self.lock = sink, prefix, lock
        self.pending = ""
        self.at_start = True  # the next text begins a line: it gets the prefix

    def add(self, text: str) -> None:
        pieces = re.split(r"([\r\n])", self.pending + text)
        self.pending = pieces.pop()  # after the last line end (or all of it, without one)
        self._write(pieces)

    def flush_partial(self) -> None:
        if self.pending:
            pieces, self.pending = [self.pending], ""
            self._write(pieces)

    def _write(self, pieces: list[str]) -> None:
        out = []
        for piece in pieces:
            if piece in ("\r", "\n"):
                out.append(piece)
                self.at_start = True
            elif piece:
                out.append((self.prefix if self.at_start else "") + piece)
                self.at_start = False
        if out:
            with self.lock:
                self.sink.write("".join(out))
                self.sink.flush()
