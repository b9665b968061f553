"""Read the history of an offline W&B run back from its ``.wandb`` file (wandb 0.31 ships no reader for it).

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of records, each
``crc32c (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle, 4: last) | data``; a block's last 6 or
fewer bytes are padding. Each reassembled record is a ``wandb_internal_pb2.Record``; history rows carry their items
as JSON.
"""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pending, offset = [], b"", _HEADER
    while offset + 7 <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < 7:  # block trailer
            offset += room
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        if length == 0 and kind == 0:  # zero padding to the end of a block
            offset += room
            continue
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def history(run_dir: Path) -> list[dict[str, object]]:
    """The logged rows of the offline run in ``run_dir`` (``.../wandb/offline-run-*``), in order."""
    (log,) = run_dir.glob("*.wandb")
    rows = []
    for raw in records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
