"""Keep one GPU architecture's device code in a CUDA shared library, dropping the rest.

``tools/gpu/prepare`` uses it on Transformer Engine's ``libtransformer_engine.so`` (343 MB,
cubins for sm_75 ... sm_120, of which sm_90's are 18 MB). Each fatbin keeps its place and
its length in the file: its header's size is cut to the kept entries, which move to its
front, and the bytes after them become zeros. Every ELF section and every fatbin address
stays where it was (the registration records point at them), each fatbin holds only its
sm_90 cubins, as a build for sm_90 alone would, and the wheel's zip compresses the zeros
away. The CUDA driver picks, per fatbin, the cubin of the device's
architecture (or JIT-compiles a PTX of a lower one), so on an sm_90 GPU (H100, H200) the
library behaves as before; on any other GPU it would find no kernels.

A fatbin is ``magic 0xBA55ED50 (u32), version 1 (u16), header size 16 (u16), size of
the entries (u64)`` followed by entries, each ``kind (u16: 1 PTX, 2 cubin), version
(u16), header size (u32), payload size (u64), ...``, its architecture (u32) at byte 28,
the (possibly compressed) payload right after its header; entries are 8-byte aligned. A
candidate is taken only when its entries tile it exactly; a fatbin with nothing for the
kept architecture is left whole.
"""
from __future__ import annotations

import struct

MAGIC = struct.pack("<I", 0xBA55ED50)
PTX, CUBIN = 1, 2


def _entries(data, start: int):
    """[(payload offset, payload size, kind, arch, header size)] of the fatbin at ``start``, and its
    end; None when ``start`` is no well-formed fatbin."""
    if start + 16 > len(data):
        return None
    version, header, size = struct.unpack_from("<HHQ", data, start + 4)
    end = start + header + size
    if version != 1 or header != 16 or end > len(data):
        return None
    out, p = [], start + header
    while p < end:
        if p + 32 > end:
            return None
        kind, _, ehdr, psize = struct.unpack_from("<HHIQ", data, p)
        arch = struct.unpack_from("<I", data, p + 28)[0]
        if kind not in (PTX, CUBIN) or ehdr < 32 or p + ehdr + psize > end:
            return None
        out.append((p + ehdr, psize, kind, arch, ehdr))
        p += ehdr + psize
    return (out, end) if p == end else None


def prune(data: bytearray, arch: int = 90) -> dict:
    """Drop, in place, every entry of every fatbin in ``data`` except the cubins for
    ``arch`` and the PTX for ``arch`` or lower; returns counts of what was done."""
    stats = {"fatbins": 0, "kept": 0, "dropped": 0, "freed_bytes": 0, "left_whole": 0}
    pos = 0
    while (i := data.find(MAGIC, pos)) >= 0:
        found = _entries(data, i)
        if found is None:
            pos = i + 4
            continue
        entries, end = found
        stats["fatbins"] += 1
        kept = [data[off - hdr:off + size] for off, size, kind, a, hdr in entries
                if (kind == CUBIN and a == arch) or (kind == PTX and a <= arch)]
        if not kept:
            stats["left_whole"] += 1
        else:
            body = b"".join(kept)
            stats["kept"] += len(kept)
            stats["dropped"] += len(entries) - len(kept)
            stats["freed_bytes"] += end - (i + 16 + len(body))
            struct.pack_into("<Q", data, i + 8, len(body))
            data[i + 16:end] = body + bytes(end - (i + 16 + len(body)))
        pos = end
    return stats
