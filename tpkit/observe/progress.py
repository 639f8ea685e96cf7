"""The rank-0 progress line: step / total, ETA and the window's figures, one line per
logging window. On a terminal a bar leads the line and the line rewrites itself; on
anything else (a Slurm log, a pipe) each window prints a plain line of its own."""
from __future__ import annotations

import sys

__all__ = ["ProgressLine", "format_duration"]

_BAR = 20


def format_duration(seconds: float) -> str:
    """``3h07m``, ``12m05s``, ``42s``."""
    s = int(round(max(seconds, 0.0)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _fields(row: dict) -> list[str]:
    out = []
    for key, fmt in (("loss", "loss {:.6f}"), ("val_loss", "val_loss {:.6f}"),
                     ("lr", "lr {:.2e}"), ("grad_norm", "grad_norm {:.3f}"),
                     ("tokens_per_s", "{:,.0f} tokens/s"),
                     ("tflops_per_device", "{:.3g} TFLOP/s/device"), ("mfu", "MFU {:.3f}"),
                     ("mfu_fp8", "MFU(fp8 peak) {:.3f}"), ("step_time_s", "step {:.3f} s")):
        if key in row:
            out.append(fmt.format(row[key]))
    if "time_fwd_bwd_s" in row:
        out.append("(data {:.3f} fwd+bwd {:.3f} opt {:.3f} ckpt {:.3f})".format(
            row["time_data_s"], row["time_fwd_bwd_s"], row["time_optimizer_s"],
            row["time_checkpoint_s"]))
    if "slowest_rank" in row:
        out.append(f"slowest rank {row['slowest_rank']:.0f} ({row['slowest_ratio']:.2f}x)")
    for key in ("memory_peak_allocated_gib", "memory_rss_gib"):
        if key in row:
            out.append(f"mem {row[key]:.2f} GiB (rank {row['memory_max_rank']:.0f})")
    if "moe_load_imbalance" in row:
        out.append(f"moe load max/mean {row['moe_load_imbalance']:.2f}")
    return out


class ProgressLine:
    """``update(step, row)`` after each logging window; ``note(step, row)`` for an
    out-of-window row (validation). ``total``: steps of the run (None: no ETA)."""

    def __init__(self, total: int | None, *, stream=None, tty: bool | None = None):
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._open = False   # a terminal line waiting for its newline

    def format(self, step: int, row: dict) -> str:
        head = f"step {step + 1}" + (f"/{self.total}" if self.total else "")
        if self.total and "step_time_s" in row:
            head += f"  eta {format_duration((self.total - step - 1) * row['step_time_s'])}"
        return "  ".join([head] + _fields(row))

    def update(self, step: int, row: dict) -> None:
        line = self.format(step, row)
        if self.tty and self.total:
            done = min(1.0, (step + 1) / self.total)
            bar = "#" * int(done * _BAR) + "." * (_BAR - int(done * _BAR))
            self.stream.write(f"\r\x1b[2K[{bar}] {done:4.0%} {line}")
            self._open = True
            if step + 1 >= self.total:
                self._newline()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, step: int, row: dict) -> None:
        self._newline()
        self.stream.write("  ".join([f"step {step + 1}"] + _fields(row)) + "\n")
        self.stream.flush()

    def _newline(self) -> None:
        if self._open:
            self.stream.write("\n")
            self._open = False

    def close(self) -> None:
        self._newline()
        self.stream.flush()
