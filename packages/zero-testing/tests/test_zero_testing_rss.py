"""``zero_testing.rss``: the fresh-process memory tests' reading follows real allocations."""

from __future__ import annotations

from zero_testing.rss import peak_bytes, resident_bytes, rest_and_peak

MIB = 1 << 20


def _touched(nbytes: int) -> bytearray:
    block = bytearray(nbytes)  # 32 MiB and more: its own mapping, returned to the kernel when freed
    block[::4096] = b"\1" * len(block[::4096])  # touch every page
    return block


def test_rest_and_peak_see_what_is_kept_and_what_one_step_holds_briefly():
    kept: list[bytearray] = []

    def step() -> None:
        first = not kept
        kept.append(_touched(48 * MIB) if first else bytearray())  # the first step keeps 48 MiB
        transient = _touched((160 if first else 96) * MIB)  # held for a moment: 160 MiB, then 96
        del transient

    base = resident_bytes()
    measured = rest_and_peak(step, base)
    assert 40 * MIB <= measured.rest <= 64 * MIB, measured
    # the peak was reset after the warm-up steps: the third step's 96 MiB, not the first's 160
    assert measured.rest + 88 * MIB <= measured.peak <= measured.rest + 112 * MIB, measured
    assert peak_bytes() >= resident_bytes()


def test_memory_freed_one_step_late_is_not_counted_at_rest():
    """The warm-up's last step leaves 64 MiB behind that the next step frees (as memory handed back
    late does): a single reading would count it, the lowest of the readings does not."""
    late: list[bytearray] = []
    calls = [0]

    def step() -> None:
        calls[0] += 1
        late.clear()
        if calls[0] == 2:  # the last warm-up step
            late.append(_touched(64 * MIB))

    base = resident_bytes()
    measured = rest_and_peak(step, base)
    assert measured.rest < 16 * MIB, measured
    assert calls[0] == 2 + 2 + 1  # warm-up, two more readings, the peak's step
