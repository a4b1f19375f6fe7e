"""Mutation checks: each removes one feature in a scratch copy of the repository and runs the
tests that name it; a test that still PASSES does not prove its feature, and the check fails.

    python tests/mutation/run.py [--list] [--dry-run] [NAME ...]

``--dry-run`` only checks that every mutation still applies (the code it edits is where the
table says). When the code moves, update FILES (one line per module) or the mutation's
``old`` text. `make mutation` runs these, then mutmut over the pure cores ([mutmut] in setup.cfg;
its score and survivors: tests/mutation/README.md).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Where each mutated module lives: the one place to update when the library is reorganised.
FILES = {
    "worker": "rstreamer/worker/loop.py",
    "streaming": "rstreamer/worker/generative_lane.py",
    "job_sink": "rstreamer/jobs/sink.py",
    "groups": "rstreamer/client/groups.py",
    "webhooks": "rstreamer/jobs/webhooks.py",
    "deadletters": "rstreamer/ops/deadletters.py",
    "finish_lua": "rstreamer/wire/lua/finish.lua",
    "cancel_lua": "rstreamer/wire/lua/cancel.lua",
    "enqueue_lua": "rstreamer/wire/lua/enqueue_calls.lua",
    "supervisor": "rstreamer/worker/supervisor.py",
    "batching": "rstreamer/batching/batcher.py",
    "status": "rstreamer/ops/status.py",
}

FAULTS = "tests/integration/test_faults.py"
STREAMING = "tests/integration/test_streaming_redis.py"
JOBS = "tests/integration/test_jobs_durability.py"
WIRE = "tests/integration/test_wire.py"
COALESCING = "tests/integration/test_coalescing.py"
ASYNC = "tests/integration/test_async_client.py"
HARDENING = "tests/integration/test_worker_hardening.py"
WEBHOOKS = "tests/integration/test_job_webhooks.py"
QUOTAS = "tests/integration/test_quotas_redis.py"
TRACING = "tests/integration/test_tracing.py"
PRIORITY = "tests/integration/test_priority_redis.py"
CANCEL = "tests/integration/test_cancel_redis.py"
FINISH = "tests/integration/test_finish_script.py"


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (found exactly once) by ``new`` in ``FILES[module]``; every test must fail."""

    name: str
    module: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    # The worker runs expired items (answer_batch sees every deadline as ahead).
    Mutation("worker-expiry", "worker", "costs=request_costs, clock=self._clock.now,",
             "costs=request_costs, clock=lambda: 0.0,",
             (f"{FAULTS}::test_expired_item_is_not_run_and_its_reply_key_is_removed",
              f"{WIRE}::test_a_worker_whose_clock_is_25s_behind_does_not_run_an_expired_item")),
    # The generative lane never drops a sequence past its deadline.
    Mutation("lane-expiry", "streaming", "events = self.scheduler.expire(now)", "events = []",
             (f"{STREAMING}::test_a_sequence_past_its_deadline_is_dropped_at_the_next_step",)),
    # Workers run the items of jobs that are no longer queued or running.
    Mutation("job-admit", "job_sink", 'if state in (b"queued", b"running"):', "if True:",
             (f"{JOBS}::test_expired_job_is_gone_and_its_items_do_not_run",
              f"{JOBS}::test_cancel_runs_no_more_items",
              f"{JOBS}::test_items_of_a_job_whose_keys_vanished_do_not_run",
              f"{JOBS}::test_a_replayed_item_of_a_finished_job_does_not_run")),
    # A caller that gives up leaves what was answered in its reply key.
    Mutation("reply-delete", "groups", 'yield command("delete", group.reply_key)',
             'yield command("exists", group.reply_key)',
             (f"{FAULTS}::test_a_caller_that_times_out_deletes_its_reply_key",
              f"{ASYNC}::test_a_caller_that_times_out_deletes_its_reply_key")),
    # SIGTERM's watchdog never ends a drain whose batch never ends.
    Mutation("drain-watchdog", "worker", "threading.Timer(self._drain_timeout, os._exit",
             "threading.Timer(3600.0, os._exit",
             (f"{HARDENING}::test_a_drain_whose_batch_never_ends_exits_1_after_drain_timeout_and_its_entries_are_reclaimed",)),
    # No webhook sender takes over the deliveries of a dead one (its heartbeat lapsed).
    Mutation("webhook-dead-takeover", "webhooks",
             "entries = self._take_over_dead(client) or self._claim_stale(client) or self._read_new(client)",
             "entries = self._claim_stale(client) or self._read_new(client)",
             (f"{WEBHOOKS}::test_a_killed_worker_leaves_neither_its_delivery_nor_its_consumer",
              f"{WEBHOOKS}::test_a_delivery_survives_its_worker_stopping_during_the_backoff")),
    # No webhook sender takes over a delivery pending past a whole retry schedule (claim_idle).
    Mutation("webhook-stale-claim", "webhooks",
             "entries = self._take_over_dead(client) or self._claim_stale(client) or self._read_new(client)",
             "entries = self._take_over_dead(client) or self._read_new(client)",
             (f"{WEBHOOKS}::test_a_delivery_pending_past_a_whole_retry_schedule_is_taken_over_from_a_live_sender",)),
    # ... or takes it over at once, while its sender may still be inside its retry schedule.
    Mutation("webhook-claim-idle", "webhooks", "int(self.settings.claim_idle * 1000)", "0",
             (f"{WEBHOOKS}::test_a_delivery_pending_past_a_whole_retry_schedule_is_taken_over_from_a_live_sender",)),
    # A dead letter forgets its level / is replayed onto level 0.
    Mutation("dead-level", "worker", "        if letter.level:\n", "        if False:\n",
             (f"{HARDENING}::test_a_dead_letter_keeps_its_level_and_is_replayed_onto_it",)),
    Mutation("replay-level", "deadletters", "pipe.xadd(keys.requests_at(_level(fields)), entry)",
             "pipe.xadd(keys.requests, entry)",
             (f"{HARDENING}::test_a_dead_letter_keeps_its_level_and_is_replayed_onto_it",)),
    # The dead-letter stream is not capped in length / keeps oversized fields whole.
    Mutation("dead-max-len", "finish_lua", "redis.call('XTRIM', KEYS[1], 'MAXLEN', dead_len)", "",
             (f"{HARDENING}::test_dead_letters_are_capped_in_length_and_an_oversized_field_is_kept_as_its_size",)),
    Mutation("dead-dropped-field", "worker", "if len(value) > self.settings.dead_max_bytes // 2:", "if False:",
             (f"{HARDENING}::test_dead_letters_are_capped_in_length_and_an_oversized_field_is_kept_as_its_size",)),
    # A call refused for a full queue still takes its tenant's tokens.
    Mutation("quota-refund", "enqueue_lua", "reason, detail = 1, ahead\n",
             "reason, detail = 1, ahead\n      if b then redis.call('HSET', KEYS[2 + tenant], 'tokens', "
             "tostring(b.tokens - size), 'ms', now_ms) end\n",
             (f"{QUOTAS}::test_a_refused_call_takes_no_tokens",)),
    # A supervisor does not replace a worker its heartbeat process killed.
    Mutation("supervisor-restart", "supervisor", "del self._restart_at[slot]\n                self._start(slot)",
             "del self._restart_at[slot]",
             (f"{HARDENING}::test_a_stopped_worker_is_replaced_after_stuck_after_and_its_entries_reclaimed",)),
    # A reply to a version-1 entry (or any) without its TTL.
    Mutation("reply-ttl", "finish_lua", "    redis.call('PEXPIRE', KEYS[k], ttl)\n", "",
             (f"{WIRE}::test_a_version_1_entry_is_served_and_answered_in_version_1",)),
    # The batch close reason the metrics and traces report.
    Mutation("closed-reason", "batching", '            closed = "queue_empty"\n            break',
             '            closed = "latency"\n            break',
             (f"{TRACING}::test_one_trace_from_the_call_to_the_batch_that_served_it",)),
    # A call that times out leaves its entries queued for the workers.
    Mutation("timeout-withdraw", "groups", "if serving() and (yield from withdraw(group.unanswered(), True, calls)):",
             "if False:",
             (f"{COALESCING}::test_calls_that_time_out_before_or_after_their_enqueue_leave_nothing_queued",
              f"{ASYNC}::test_no_worker_times_out_and_withdraws_its_entries")),
    # FINISH trims the stream past entries another worker still holds.
    Mutation("finish-trim-pending", "finish_lua",
             "if newest and #redis.call('XPENDING', stream, group, '-', newest, 1) == 0 then", "if newest then",
             (f"{FINISH}::test_entries_another_worker_holds_stay_when_a_newer_batch_finishes_first",)),
    # A token withdrawn whole while a worker holds its item still gets its late reply written.
    Mutation("cancel-tombstone", "cancel_lua", "    redis.call('SET', KEYS[6], 'withdrawn', 'PX', tombstone)\n", "",
             (f"{CANCEL}::test_finish_writes_no_reply_for_a_token_withdrawn_whole_and_still_acks[True]",
              f"{CANCEL}::test_a_call_that_times_out_while_a_worker_runs_it_gets_no_reply_written[sync]")),
    # A caller that times out deletes the tombstone its withdrawal left, so the late reply is written.
    Mutation("keep-tombstone", "groups", "        return  # the tombstone", "        pass  #",
             (f"{CANCEL}::test_a_call_that_times_out_while_a_worker_runs_it_gets_no_reply_written[sync]",
              f"{CANCEL}::test_a_call_that_times_out_while_a_worker_runs_it_gets_no_reply_written[async]")),
    # rstreamer status reports no wait for a level with waiting items.
    # A stale copy of the published levels refuses a level the fleet has just added.
    Mutation("levels-copy-check", "enqueue_lua", "if not levels or fair or top >= levels then",
             "if not levels or fair then",
             (f"{PRIORITY}::test_levels_published_after_a_streamer_read_its_copy_are_served_at_once",)),
    # A copy that says fair holds items for a fleet gone back to fifo, which never runs them.
    Mutation("levels-copy-fair", "enqueue_lua", "if not levels or fair or top >= levels then",
             "if not levels or top >= levels then",
             (f"{PRIORITY}::test_a_copy_of_the_levels_that_says_fair_is_checked_against_the_key",)),
    Mutation("status-oldest-wait", "status", "round(max(0, snapshot.now_ms - d.oldest_ms) / 1000, 3)", "0.0",
             (f"{PRIORITY}::test_status_shows_depth_and_wait_per_level",)),
]


def scratch_copy() -> Path:
    """The repository's files (tracked and untracked, not ignored) in a temporary folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    copy = Path(tempfile.mkdtemp(prefix="rs-mutation-"))
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def apply(mutation: Mutation, root: Path) -> str | None:
    """Mutate the file under ``root``; the reason it cannot be applied, or None."""
    path = root / FILES[mutation.module]
    if not path.exists():
        return f"{FILES[mutation.module]} is gone: update FILES"
    text = path.read_text()
    if text.count(mutation.old) != 1:
        return f"{mutation.old!r} occurs {text.count(mutation.old)} times in {FILES[mutation.module]}: update the table"
    path.write_text(text.replace(mutation.old, mutation.new))
    return None


def run(mutation: Mutation, dry_run: bool) -> bool:
    """True when the mutation applies and every one of its tests fails under it."""
    copy = scratch_copy()
    try:
        problem = apply(mutation, copy)
        if problem:
            print(f"[{mutation.name}] CANNOT APPLY: {problem}")
            return False
        print(f"[{mutation.name}] {FILES[mutation.module]}: {mutation.old!r} -> {mutation.new!r}")
        if dry_run:
            return True
        ok = True
        for test in mutation.tests:
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test],
                                    cwd=copy, capture_output=True, text=True)
            last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
            caught = result.returncode == 1
            ok &= caught
            print(f"[{mutation.name}]   {'killed ' if caught else 'SURVIVED'} {test}: {last}")
        return ok
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="only check that the mutations apply")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.list:
        for mutation in chosen:
            print(mutation.name, FILES[mutation.module], *mutation.tests, sep="\n  ")
        return 0
    results = [run(mutation, args.dry_run) for mutation in chosen]
    print(f"{sum(results)}/{len(results)} mutation checks {'apply' if args.dry_run else 'caught by their tests'}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
