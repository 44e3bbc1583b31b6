"""The KV pool's page advice: the kernel's THP mode parsed, the advisable span, the switch."""
import pytest
import torch

from engine import host_memory
from engine.host_memory import HUGE_PAGE, advisable_range, thp_mode


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]", "never"), ("", "unavailable"),
                                       ("garbage", "unavailable")])
def test_thp_mode(text, mode):
    assert thp_mode(text) == mode


def test_advisable_range_is_the_whole_huge_pages_inside():
    assert advisable_range(0, 3 * HUGE_PAGE) == (0, 3 * HUGE_PAGE)
    assert advisable_range(4096, 3 * HUGE_PAGE) == (HUGE_PAGE, 2 * HUGE_PAGE)  # both ends cut to whole pages
    assert advisable_range(HUGE_PAGE - 1, HUGE_PAGE + 1) == (HUGE_PAGE, HUGE_PAGE)
    assert advisable_range(4096, HUGE_PAGE) is None  # no whole page inside
    assert advisable_range(0, HUGE_PAGE - 1) is None


@pytest.mark.parametrize("switch", ["0", "1"])
def test_zeros_is_zeroed_either_way(monkeypatch, switch):
    monkeypatch.setenv(host_memory.SWITCH, switch)
    t, how = host_memory.zeros((3, 5, HUGE_PAGE // 4), torch.float32, torch.device("cpu"))
    assert t.shape == (3, 5, HUGE_PAGE // 4) and t.dtype == torch.float32 and not t.any()
    if switch == "0":
        assert how.startswith("4 KiB pages") and host_memory.SWITCH in how
    elif thp_mode() in ("madvise", "always"):
        assert how.startswith("2 MiB pages")
