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
"""
