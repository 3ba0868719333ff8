"""Reading a finished run's outputs in tests."""

import glob
import json
import os
import struct


def losses(workdir) -> dict[int, float]:
    """step → loss; a step logged twice (before a failure and after the resume) keeps its last value."""
    out = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def tensorboard_events(directory) -> list:
    """Every Event in the TensorBoard files under `directory`, parsed from their TFRecord framing."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            pos += 8 + 4  # length, length crc
            events.append(event_pb2.Event.FromString(data[pos:pos + length]))
            pos += length + 4  # data, data crc
    return events
