"""The allocator setting of processes that run engine steps: freed blocks are reused, not mapped afresh."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt"
)

# A step's temporaries growing with the batch: each tensor a little larger than the last, every page touched. glibc's
# own policy maps each afresh (a freed mapping raises its threshold only to that size, and the next is larger); kept
# freed memory serves each from the heap, which grows only by the difference. Prints whether the setting was applied
# and the loop's minor page faults (fresh pages the kernel had to zero).
_STEPS = """
import resource, torch
from cascade.allocator import keep_freed_memory
applied = keep_freed_memory() if {tuned} else False
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(64):
    rows = torch.empty(((1 << 20) + i * (1 << 16)) // 4).fill_(1.0)  # 1 MiB and growing by 64 KiB a step
    del rows
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuned: bool, env: dict[str, str] | None = None) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS.format(tuned=tuned)], capture_output=True, text=True, check=True,
        env={**os.environ, **(env or {})},
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.slow  # two Python processes
def test_freed_step_tensors_are_reused_instead_of_mapped_afresh():
    applied, tuned = _faults(True)
    _, untuned = _faults(False)
    assert applied
    # 190 MiB mapped afresh (~48,000 pages) against ~5 MiB of heap: a factor of 5 leaves room for the interpreter.
    assert tuned * 5 < untuned, (tuned, untuned)


@pytest.mark.slow  # two Python processes
def test_the_environment_variable_turns_it_off():
    applied, faults = _faults(True, {"CASCADE_KEEP_FREED_MEMORY": "0"})
    _, untuned = _faults(False)
    assert not applied
    assert faults * 5 > untuned, (faults, untuned)


def _huge_pages_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), or None without THP."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _huge_bytes_at(begin: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [begin, end), in bytes."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            overlaps = low < end and begin < high
        elif head == "AnonHugePages:" and overlaps:
            total += int(line.split()[1]) * 1024
    return total


def test_a_kv_cache_buffer_is_zeros_on_huge_pages_where_the_kernel_offers_them():
    from cascade.stages.slots import SlotCache

    cache = SlotCache(num_layers=4, kv_heads=4, head_dim=64, dtype=torch.float32, device=torch.device("cpu"),
                      slots=16, capacity=1024)  # 64 MiB
    buffer = cache.buffer
    assert buffer.shape == (4, 2, 16, 4, 1024, 64) and not buffer.any()
    begin = buffer.data_ptr()
    huge = _huge_bytes_at(begin, begin + buffer.numel() * buffer.element_size())
    if _huge_pages_mode() in ("madvise", "always"):
        assert huge >= 32 << 20, huge  # at least half of it (the unaligned ends and a busy kernel may keep some small)
    else:
        assert huge == 0
    cache.reserve(2048)  # growing keeps the contents and the advice
    assert cache.buffer.shape[4] == 2048 and not cache.buffer.any()
