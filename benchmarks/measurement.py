"""Measuring a call on a shared machine, for every benchmark here: peak memory (:class:`PeakRSS`), the CPU share
other processes take meanwhile (:class:`BackgroundLoad`), and which hf_xformers sources a number was measured with
(:func:`hfx_source_hash`, :func:`git_describe`)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path


def rss_kib() -> int:
    """This process's resident set size now, KiB (Linux)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


class PeakRSS:
    """Peak RSS from a point on. Linux: reset the kernel's high-water mark (``/proc/self/clear_refs``) and read
    ``VmHWM``; elsewhere: poll ``psutil`` in a thread (may miss short spikes)."""

    def __init__(self) -> None:
        self._poll = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.mode = "VmHWM"
        except OSError:
            import psutil

            self.mode = "psutil-poll"
            self._proc = psutil.Process()
            self._peak = self._proc.memory_info().rss
            self._stop = threading.Event()
            self._poll = threading.Thread(target=self._run, daemon=True)
            self._poll.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def peak_bytes(self) -> int:
        if self._poll is None:
            with open("/proc/self/status") as f:
                return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024
        self._stop.set()
        self._poll.join()
        return self._peak


class BackgroundLoad:
    """Share of the machine's CPU used by *other* processes during a call (0..1), from system and own CPU times."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process()
        self.ncpu = psutil.cpu_count() or 1

    def _snap(self):
        sys_t = self.psutil.cpu_times()
        busy = sum(sys_t) - sys_t.idle - getattr(sys_t, "iowait", 0.0)
        own = self.proc.cpu_times()
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def other_share(self, interval: float) -> float:
        """Share of the CPU used by other processes over the next ``interval`` seconds (while we idle)."""
        return self.measure(lambda: time.sleep(interval))[1]

    def wait_quiet(self, threshold: float, max_wait: float) -> float:
        """Idle until other processes use at most ``threshold`` of the CPU (checked over 0.5 s), or ``max_wait``."""
        t0 = time.perf_counter()
        while True:
            other = self.other_share(0.5)
            if other <= threshold or time.perf_counter() - t0 > max_wait:
                return other

    def measure(self, fn):
        t0, b0, o0 = self._snap()
        fn()
        t1, b1, o1 = self._snap()
        wall = t1 - t0
        other = max(0.0, (b1 - b0) - (o1 - o0)) / (wall * self.ncpu) if wall > 0 else 0.0
        return wall, min(other, 1.0)


def hfx_source_hash(model=None) -> str:
    """Short hash of hf_xformers sources, to catch code that changed between cells of one run: with ``model``,
    only the files defining the classes it is built from (so unrelated architectures can change meanwhile)."""
    import hashlib
    import inspect

    import hf_xformers

    root = Path(hf_xformers.__file__).resolve().parent
    if model is None:
        files = set(root.rglob("*.py"))
    else:
        files = set()
        for cls in {c for m in model.modules() for c in type(m).__mro__} | {type(model.config)}:
            try:
                f = Path(inspect.getsourcefile(cls)).resolve()
            except (TypeError, OSError):
                continue
            if root in f.parents:
                files.add(f)
    h = hashlib.sha1()
    for f in sorted(files):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:10]



def git_describe() -> str:
    """The checkout a number was measured on: short commit, whether ``hf_xformers/`` had local changes, and
    :func:`hfx_source_hash` (``"?"`` outside a git checkout)."""
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_xformers"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
        return f"{rev}{' (hf_xformers modified)' if dirty else ''}, src {hfx_source_hash()}"
    except Exception:  # noqa: BLE001 - informational only
        return "?"

