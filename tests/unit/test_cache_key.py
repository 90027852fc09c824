"""The prefix cache's key of a salted request (``memory/cache_key.py``)."""

from __future__ import annotations

from kvledger.memory.cache_key import cache_key

TOKENS = list(range(40))


def test_unsalted_and_short_keys_are_the_tokens():
    assert cache_key(TOKENS, None, 16) is TOKENS
    assert cache_key(TOKENS[:15], "s", 16) == TOKENS[:15]  # under a page: never matched nor cached


def test_a_salt_replaces_the_first_page_only():
    for ps in (1, 4, 16):
        key = cache_key(TOKENS, "tenant-a", ps)
        assert len(key) == len(TOKENS) and key[ps:] == TOKENS[ps:]
        # Never a real token id, always an int64 (the file tier packs keys as int64).
        assert all(-(2**62) <= k < 0 for k in key[:ps])
        assert key == cache_key(TOKENS, "tenant-a", ps)  # the same salt shares
        assert key[:ps] != cache_key(TOKENS, "tenant-b", ps)[:ps]
        assert key[:ps] != cache_key([1, *TOKENS[1:]], "tenant-a", ps)[:ps]  # the tokens still count


def test_an_adapter_has_a_namespace_no_salt_reproduces():
    """A LoRA adapter's requests key the cache apart from the base model's, another adapter's and
    any salt's (the adapter's fingerprint as a salt included); an adapter with a salt apart from both.
    PD's claim checksum folds the adapter in the same way (``disagg/wire.tokens_crc``)."""
    from kvledger.disagg.wire import tokens_crc

    fp_a, fp_b = "a" * 64, "b" * 64
    for ps in (1, 16):
        first = {
            tuple(cache_key(TOKENS, salt, ps, adapter)[:ps])
            for salt, adapter in ((None, None), ("s", None), (fp_a, None), (None, fp_a), (None, fp_b),
                                  ("s", fp_a), (fp_a, fp_a))
        }  # fmt: skip
        assert len(first) == 7
        key = cache_key(TOKENS, None, ps, fp_a)
        assert key == cache_key(TOKENS, None, ps, fp_a) and key[ps:] == TOKENS[ps:]
        assert all(-(2**62) <= k < 0 for k in key[:ps])
    assert len({tokens_crc(TOKENS), tokens_crc(TOKENS, fp_a), tokens_crc(TOKENS, fp_b)}) == 3
    assert tokens_crc(TOKENS, fp_a) == tokens_crc(list(TOKENS), fp_a)
