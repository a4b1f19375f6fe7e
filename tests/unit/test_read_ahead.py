"""ReadAhead: after a read ahead that found nothing, the next full batches carry their FINISH with
a waiting read, 1, then 2, 4, at most 8 of them; a read ahead that finds entries starts again."""
from __future__ import annotations

from rstreamer.worker.carry import ReadAhead


def reads_ahead(policy: ReadAhead, batches: int, finds: bool) -> list[bool]:
    """For ``batches`` full batches in a row, whether each read ahead (each read ahead finding
    entries or not as ``finds`` says)."""
    done = []
    for _ in range(batches):
        due = policy.due()
        done.append(due)
        if due:
            policy.found(finds)
    return done


def test_a_new_source_reads_ahead_and_goes_on_while_entries_wait():
    assert reads_ahead(ReadAhead(), 20, finds=True) == [True] * 20


def test_reads_ahead_that_find_nothing_come_ever_fewer_up_to_one_in_nine():
    done = reads_ahead(ReadAhead(), 40, finds=False)
    ahead = [n for n, due in enumerate(done) if due]
    # Skipped after each: 1, 2, 4, 8, 8, ...
    assert ahead == [0, 2, 5, 10, 19, 28, 37]


def test_a_read_ahead_that_finds_entries_starts_the_skips_again_at_one():
    policy = ReadAhead()
    reads_ahead(policy, 11, finds=False)  # reads ahead at 0, 2, 5, 10: the next skip is 8
    assert reads_ahead(policy, 8, finds=True) == [False] * 8
    assert reads_ahead(policy, 1, finds=True) == [True]
    assert reads_ahead(policy, 3, finds=False) == [True, False, True]  # one skipped, as at first
