"""zaya launch's output relay: whole prefixed lines, never two processes' lines interleaved."""

import io
import os
import threading
import time

from zaya_jax.cluster import relay


class _Sink(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def _start(sink, lock, rank):
    read, write = os.pipe()
    thread = threading.Thread(target=relay.relay, args=(os.fdopen(read, "rb", buffering=0), sink, f"[{rank}] ", lock))
    thread.start()
    return write, thread


def test_lines_written_in_pieces_by_two_processes_come_out_whole():
    sink, lock = _Sink(), threading.Lock()
    (a, ta), (b, tb) = _start(sink, lock, 0), _start(sink, lock, 1)
    os.write(a, b"zaya: error: from rank 0")  # print(): the text, then the newline
    os.write(b, b"zaya: error: from rank 1")
    time.sleep(0.05)  # both texts are in before either newline
    os.write(a, b"\n")
    os.write(b, b"\n")
    os.close(a), os.close(b)
    ta.join(5), tb.join(5)
    assert sorted(sink.getvalue().splitlines()) == ["[0] zaya: error: from rank 0", "[1] zaya: error: from rank 1"]
    assert all(w.endswith("\n") for w in sink.writes)


def test_a_progress_bar_shows_between_redraws_and_its_line_goes_on_unprefixed():
    sink = _Sink()
    write, thread = _start(sink, threading.Lock(), 3)
    os.write(write, "step 1/2 ▏".encode()[:-1])  # a redraw, cut inside a character
    deadline = time.monotonic() + 5
    while not sink.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sink.getvalue() == "[3] step 1/2 "  # shown while the child is quiet
    os.write(write, "▏".encode()[-1:] + b"\rstep 2/2\ndone\n")
    os.close(write)
    thread.join(5)
    assert sink.getvalue() == "[3] step 1/2 ▏\r[3] step 2/2\n[3] done\n"
