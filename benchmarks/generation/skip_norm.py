"""KilnSkipNorm's kernel alone (``kiln_skip_norm``, native/norm.c): one thread, no onnxruntime, the
residual add and RMS norm of ROWS x HIDDEN floats, median of --repeat calls.

    python benchmarks/generation/skip_norm.py [--shapes 16x576,64x576,64x2048] [--repeat 200]"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

from modelkiln.machine import cpu_description
from modelkiln.native import library_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x576,64x576,64x2048", help="ROWSxHIDDEN, comma-separated")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    lib = ctypes.CDLL(library_path())
    pointer = ctypes.c_void_p
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({cpu['isa']}), one thread")
    for shape in args.shapes.split(","):
        rows, hidden = (int(v) for v in shape.split("x"))
        rng = np.random.default_rng(0)
        x, skip = (rng.standard_normal((rows, hidden)).astype(np.float32) for _ in range(2))
        gamma = rng.standard_normal(hidden).astype(np.float32)
        out, total = np.zeros_like(x), np.zeros_like(x)
        call = [x.ctypes.data_as(pointer), skip.ctypes.data_as(pointer), gamma.ctypes.data_as(pointer),
                ctypes.c_int64(rows), ctypes.c_int64(hidden), ctypes.c_float(1e-5), out.ctypes.data_as(pointer),
                total.ctypes.data_as(pointer)]
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            lib.kiln_skip_norm(*call)
            times.append(time.perf_counter() - started)
        print(f"{rows} x {hidden}: {1e6 * statistics.median(times):.1f} us")


if __name__ == "__main__":
    main()
