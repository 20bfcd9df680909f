"""Keep freed tensor memory for reuse on glibc (Linux) CPUs: faster steps, a higher peak. Opt-in.

Why it helps: glibc serves a large allocation with its own ``mmap`` and returns it to the kernel when it
is freed, so the next tensor of that size starts on fresh pages, and each first touch of a page is a page
fault. glibc raises that size threshold as it sees large blocks freed, but never above 32 MiB, and the
DP-SGD step's mix of sizes (per-example gradients, float64 Grams, the noise draw) kept it below many of the
step's tensors: 19,865 page faults and 92 ms of kernel time per step of the 1.1M-parameter CNN, against
5,472 and 24 ms for the non-private step; a non-private UNet step on 256 images, whose activations pass
32 MiB, faulted 213,162 pages (1.0 s of kernel time) every step (experiments/engine_phases.py,
BENCHMARKS.md). With a fixed threshold above a step's tensors and no trimming of the heap's top, freed
blocks are reused and a step faults no pages: the effect of the ``jemalloc``/``tcmalloc`` preloads that
CPU training guides recommend.

Why it is not the default: blocks of many sizes then share the heap, and its fragmentation raises the
process' peak resident memory. dp-gan's CIFAR-10 preset (micro-batches of 477 examples) peaked at 1.24 GB
with it against 0.71 GB without (its slow paper-scale test, ``tests/test_paper_scale.py``), past the dry
run's estimate. The benchmarks call
:func:`reuse_freed_memory` for every row they compare; a user trades memory for speed by calling it
first in a Python process, or for any command with glibc's own tunables, e.g.
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824 dpsynth run ...``.
"""

from __future__ import annotations

import ctypes
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Some glibc versions refuse an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit); then that is used.
_THRESHOLDS = (1 << 30, 32 << 20)
_TRIM_THRESHOLD = 1 << 30


@functools.cache
def reuse_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process (a no-op elsewhere); True when set."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl, Windows)
        return False
    if not any(mallopt(_M_MMAP_THRESHOLD, threshold) for threshold in _THRESHOLDS):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
