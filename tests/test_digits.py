"""Numbers read from network or disk text: ASCII digits only, bounded."""

from fthsdp.control.quorum import ring_key
from fthsdp.digits import ascii_int


def test_only_ascii_digits_within_the_bound_are_numbers():
    assert ascii_int("0") == 0 and ascii_int("029510") == 29510
    assert ascii_int("9" * 18) == 10**18 - 1
    for text in ("", "+5", " 5", "5 ", "1_0", "-1", "²", "٣", "1e3", "0x10", "9" * 19):
        assert ascii_int(text) is None, text
    assert ascii_int("65536", max_digits=5) == 65536 and ascii_int("123456", max_digits=5) is None


def test_replica_ids_order_numbers_first_then_text_without_mixing_types():
    ids = ["10", "b", "2", "²", "a", "1"]
    assert sorted(ids, key=ring_key) == ["1", "2", "10", "a", "b", "²"]
