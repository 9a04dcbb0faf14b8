"""Peak host memory of writing a GGUF file with ``moefit.tools.gguf_write``.

The model is the runtime benchmark's random Qwen3-MoE (``bench_runtime.py``: hidden 1024,
8 layers x 48 experts of width 384, vocabulary 32768; 0.55B parameters, 1.1 GB in bf16),
written once into ``--dir``. Each measurement runs in its own process and prints the peak
resident-set size (``ru_maxrss``, mapped file pages included) above the process's size once
the input is ready, and the peak of its allocated memory (``RssAnon``, sampled every 10 ms):

- ``state``: the tests' way: the whole state dict loaded (torch tensors), then
  ``write_gguf(state, config, out)``;
- ``checkpoint``: ``convert_checkpoint(dir, out)``, which reads the safetensors files
  tensor by tensor (when the writer has it).

Experts Q8_0, dense weights BF16, as ``bench_gguf.py`` writes them.

Measured on the 2-core CI machine (issue 12, item 13b): the writer that held every tensor
as float32 (stacked, quantized and dequantized copies all at once) peaked at 7763 MiB RSS,
6.5 GiB allocated above the loaded input; tensor by tensor: 1483 MiB RSS (of which 1 GiB
is the input's memory-mapped safetensors pages) and 0.25 GiB allocated, for both ways.

    .venv/bin/python benchmarks/gguf_write_memory.py [--dir /tmp/moefit-gguf-mem] [--how state checkpoint]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20


def _rss_peak() -> int:
    """Peak resident set of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rss_anon() -> int:
    """Anonymous resident memory now (``RssAnon``): what the process allocated, without the
    pages of memory-mapped files (safetensors are read through mmap)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _AnonPeak:
    """The largest ``RssAnon`` seen, sampled every 10 ms on a thread."""

    def __init__(self):
        import threading

        self.peak, self._stop = _rss_anon(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_anon())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, _rss_anon())


def child(how: str, root: Path) -> dict:
    """One measurement (runs in a fresh process)."""
    from safetensors.torch import load_file

    from bench_runtime import CONFIG

    ckpt, out = root / "bf16", root / f"out-{how}.gguf"
    kw = dict(expert_types="Q8_0", dense_type="BF16", file_type=7)
    if how == "state":
        state = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            state.update(load_file(str(f)))
        from moefit.tools.gguf_write import write_gguf

        base, anon0 = _rss_now(), _rss_anon()
        sampler = _AnonPeak()
        t0 = time.perf_counter()
        write_gguf(state, CONFIG, out, **kw)
    else:
        from moefit.tools.gguf_write import convert_checkpoint

        base, anon0 = _rss_now(), _rss_anon()
        sampler = _AnonPeak()
        t0 = time.perf_counter()
        convert_checkpoint(ckpt, out, **kw)
    seconds = time.perf_counter() - t0
    anon_peak = sampler.stop()
    peak = _rss_peak()
    return {"how": how, "seconds": round(seconds, 1), "base_mib": base // MIB,
            "peak_mib": peak // MIB, "above_base_mib": (peak - base) // MIB,
            "anon_before_mib": anon0 // MIB, "anon_peak_mib": anon_peak // MIB,
            "file_mib": out.stat().st_size // MIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/moefit-gguf-mem", help="work directory (reused)")
    ap.add_argument("--how", nargs="+", default=["state", "checkpoint"],
                    choices=("state", "checkpoint"), help="which writes to measure")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.dir)
    if args.child:
        print(json.dumps(child(args.child, root)))
        return
    from bench_runtime import write_checkpoint

    write_checkpoint(root / "bf16")
    size = sum(f.stat().st_size for f in (root / "bf16").glob("*.safetensors"))
    print(f"checkpoint: {size / MIB:.0f} MiB of bf16 safetensors in {root / 'bf16'}")
    for how in args.how:
        r = subprocess.run([sys.executable, __file__, "--dir", str(root), "--child", how],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"{how}: failed\n{r.stderr[-2000:]}")
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{how:10s}  peak RSS {d['peak_mib']} MiB, {d['above_base_mib']} MiB above the "
              f"{d['base_mib']} MiB before writing; allocated (RssAnon) {d['anon_before_mib']} -> "
              f"{d['anon_peak_mib']} MiB; {d['seconds']} s; file {d['file_mib']} MiB")


if __name__ == "__main__":
    main()
