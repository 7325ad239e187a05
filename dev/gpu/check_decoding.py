"""
`nanoeuler_cuda.py check`'s decoding part alone (check_decoding, fp32 and bf16), whose variants compare the
default's bits with plain launches (PDL) and with the layers' kernels one by one (DECODE_PERSISTENT's other way).
From the repository root, on a GPU:

    python dev/gpu/check_decoding.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import nanoeuler_cuda as nc                                     # noqa: E402


def main():
    failed = []

    def reporter(tol):
        def report(what, err):
            ok = err < tol                                      # NaN fails too
            failed.extend([] if ok else [what])
            print(f"{what:<60} {err:9.1e}  {tol:.0e}  {'OK' if ok else 'NOT OK'}", flush=True)
        return report

    rng = np.random.default_rng(0)
    for precision in ("fp32", "bf16"):
        nc.init_gpu(precision)
        nc.check_decoding(rng, reporter(nc.DECODE_TOLERANCE[precision]), precision)
    print(f"overall okay: {int(not failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
