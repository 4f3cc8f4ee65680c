from __future__ import annotations

import pytest

from cascade.stages.ngram import NGramDrafter


def test_proposes_continuation_of_latest_match():
    drafter = NGramDrafter(max_ngram=3)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # the tail [1, 2, 3] occurred twice before; the latest is followed by 7, 8, 5
    assert drafter.propose([ctx], [3]) == [[7, 8, 5]]


def test_earliest_match_continues_the_first_occurrence():
    drafter = NGramDrafter(max_ngram=3, match="earliest")
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert drafter.propose([ctx], [3]) == [[9, 9, 1]]
    # token alignment holds in both directions
    assert NGramDrafter(max_ngram=1, match="earliest").propose([[0x01000000, 0x00000001, 77, 0x00000100]], [2]) == [[]]
    with pytest.raises(ValueError, match="match"):
        NGramDrafter(match="random")


def test_consensus_follows_what_most_occurrences_continue_with():
    drafter = NGramDrafter(max_ngram=3, match="consensus")
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3, 7, 5, 1, 2, 3]
    # [1, 2, 3] was followed by 9, 7, 7: the majority is 7; of the two occurrences left, one says 8 and one 5 (a tie,
    # won by the earlier), and the survivor goes on with 1.
    assert drafter.propose([ctx], [3]) == [[7, 8, 1]]
    assert NGramDrafter(max_ngram=3, match="latest").propose([ctx], [3]) == [[7, 5, 1]]
    assert NGramDrafter(max_ngram=3, match="earliest").propose([ctx], [3]) == [[9, 9, 1]]
    # Shorter tails when the longer find nothing, nothing when nothing matches, whole tokens only.
    assert drafter.propose([[4, 6, 5, 6]], [2]) == [[5, 6]]
    assert drafter.propose([[1, 2, 3, 4]], [2]) == [[]]
    assert NGramDrafter(max_ngram=1, match="consensus").propose([[0x01000000, 0x00000001, 77, 0x00000100]], [2]) == [[]]


def test_consensus_counts_the_latest_occurrences():
    # 40 old occurrences of the tail say 5, the 33 latest say 6: only the latest 32 vote.
    ctx = [1, 5] * 40 + [1, 6] * 33 + [1]
    assert NGramDrafter(max_ngram=1, match="consensus").propose([ctx], [2]) == [[6, 1]]


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    drafter = NGramDrafter(max_ngram=3, min_ngram=1)
    assert drafter.propose([[4, 6, 5, 6]], [2]) == [[5, 6]]  # only the 1-gram [6] matches
    assert drafter.propose([[1, 2, 3, 4]], [2]) == [[]]  # nothing matches: an empty draft
    assert NGramDrafter(max_ngram=3, min_ngram=2).propose([[4, 6, 5, 6]], [2]) == [[]]


def test_large_token_ids_match_only_whole_tokens():
    # Byte-level search must not match across token boundaries.
    drafter = NGramDrafter(max_ngram=1)
    ctx = [0x01000000, 0x00000001, 77, 0x00000100]
    assert drafter.propose([ctx], [2]) == [[]]
    assert drafter.propose([[100_000, 5, 100_000]], [2]) == [[5, 100_000]]


def test_depth_limits_and_short_contexts():
    drafter = NGramDrafter()
    assert drafter.propose([[1, 2, 1, 2, 1]], [1]) == [[2]]
    assert drafter.propose([[1]], [4]) == [[]]
    assert drafter.propose([[1, 1]], [0]) == [[]]


def test_invalid_ngram_range():
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(max_ngram=2, min_ngram=3)
