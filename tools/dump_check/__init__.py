"""The checks of tools/check_dump.py (docs/dump-format.md), one module per part:

  formats      the numeric formats (BF16, FP8 E4M3, NVFP4 E2M1 with E4M3 or UE8M0 block scales,
               the swizzled scale storage, LogFMT) as numpy computes them
  expected     the layer model, each rank's inputs and what the APIs must deliver and combine,
               derived from the inputs only
  compare      the bitwise comparison and the list of mismatches
  rows         compact and expanded received rows (V2, V1 normal, the dispatcher's normal and
               V2 expanded formats)
  slab         the low-latency slabs (V1 low-latency, the dispatcher's low-latency format)
  v2, v1, low_latency, dispatcher
               one API each: the check config.json's "api" selects

Importing the package first keeps numpy on the kernels whose float32 log2 and exp2 are the C
library's (use_c_library_log2_exp2), before any module of it imports numpy.
"""
import os


def use_c_library_log2_exp2():
    """LogFMT is defined with the C library's log2f and exp2f (docs/quantized-formats.md). numpy
    computes float32 log2 and exp2 with them too, except in its AVX-512 kernels, which round some
    results differently: keep numpy on its baseline kernels where the CPU has AVX-512 (before
    numpy is imported; a value the caller set is kept)."""
    if "NPY_DISABLE_CPU_FEATURES" in os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return
    names = {"avx512f": "AVX512F", "avx512cd": "AVX512CD"}
    wanted = [names[f] for f in ("avx512f", "avx512cd") if f in flags]
    groups = [("AVX512_SKX", {"avx512vl", "avx512bw", "avx512dq"}), ("AVX512_CLX", {"avx512_vnni"}),
              ("AVX512_CNL", {"avx512ifma", "avx512vbmi"}), ("AVX512_ICL", {"avx512_vbmi2", "avx512_bitalg",
                                                                        "avx512_vpopcntdq"})]
    for name, needed in groups:
        if "avx512f" in flags and needed <= set(flags):
            wanted.append(name)
    if wanted:
        os.environ["NPY_DISABLE_CPU_FEATURES"] = " ".join(wanted)


use_c_library_log2_exp2()
