"""Tests for the paged KV-cache lab. Run: python -m pytest test_solution.py

The oracle behind every structure is a plain Python list of tokens: whatever the pool and
the block tables do, each sequence must read back exactly that list.
"""

import ast
import inspect
import os
import pathlib
import pickle
import platform
import random
import re
import subprocess
import sys
import warnings

import pytest

import solution

from solution import (FIFO, KVCache, LRU, load_trace, never_evicts, replay_trace, trace_ceiling,
                      trace_prompt, TraceRequest)
from solution import (run_policy,
                      admit_and_generate, beam_search, BLOCK_SIZE, BlockAllocator, BlockTable,
                      check_invariants, CHECKS, compare_with_paper, demo_bench, evict_runs,
                      expected_tokens, fuzz, hash_block_tokens, draw_length, lru_victim,
                      main, measure_block_size, OutOfBlocksError, parallel_sampling,
                      preemption_workload, prefix_reuse_lost, PrefixCachingAllocator, Request,
                      saving, ScanningAllocator, Scheduler, Sequence, share_prefix, snapshot,
                      swap_in, swap_out, SWEEP_SYSTEM_LEN, sweep_workloads, SweepRow,
                      sweet_spot, Workload)


def refused(call, exception, pool, sequences, match=None):
    """Assert call raises exception (message matching match) and changes nothing."""
    before = snapshot(pool, sequences)
    with pytest.raises(exception, match=match):
        call()
    assert snapshot(pool, sequences) == before


def serve(policy, requests, gpu_blocks, host_blocks, block_size):
    gpu, host = BlockAllocator(gpu_blocks, block_size), BlockAllocator(host_blocks, block_size)
    scheduler = Scheduler(gpu, host, policy, check=True)  # invariants after every step
    finished = scheduler.run(requests)
    assert finished == {r.req_id: expected_tokens(r) for r in requests}
    assert gpu.num_free == gpu.num_blocks and host.num_free == host.num_blocks
    return scheduler.stats


def workload(lengths, kv_slots):
    return Workload("test", "crafted", kv_slots,
                    [(list(range(p)), list(range(o))) for p, o in lengths])


def scheduler(gpu_blocks, host_blocks, block_size=2, policy="recompute"):
    host = None if host_blocks is None else BlockAllocator(host_blocks, block_size)
    return Scheduler(BlockAllocator(gpu_blocks, block_size), host, policy)


HERE = pathlib.Path(solution.__file__).resolve().parent  # the folder of solution.py
TRACES = HERE.parent / "shared" / "traces"


def trace(*id_lists):
    """Requests of whole 512-token ids, each decoding one token at block size 2."""
    return [TraceRequest(i, 512 * len(ids), 256, list(ids)) for i, ids in enumerate(id_lists)]


class TestBlockPool:
    """Part 1: the block pool and the KV cache."""

    def test_pool_shape_and_defaults(self):
        pool = BlockAllocator(10)
        assert (pool.num_blocks, pool.block_size, BLOCK_SIZE) == (10, 16, 16)
        assert (pool.num_free, pool.num_used) == (10, 0)

    @pytest.mark.parametrize("num_blocks, block_size, exception", [
        (0, 16, ValueError), (-3, 16, ValueError), (4, 0, ValueError), (4, -1, ValueError),
        ("4", 16, TypeError), (4.0, 16, TypeError), (4, 1.5, TypeError), (True, 16, TypeError),
        (None, 16, TypeError)])
    def test_pool_rejects_bad_sizes(self, num_blocks, block_size, exception):
        with pytest.raises(exception, match="must be an int >= 1"):
            BlockAllocator(num_blocks, block_size)

    def test_allocate_until_empty_then_refuse(self):
        pool = BlockAllocator(3)
        blocks = [pool.allocate() for _ in range(3)]
        assert sorted(blocks) == [0, 1, 2] and pool.num_free == 0 and pool.num_used == 3
        refused(pool.allocate, OutOfBlocksError, pool, [], match="need 1 block.s., 0 of 3 free")
        assert issubclass(OutOfBlocksError, MemoryError)

    def test_allocate_many_is_all_or_nothing(self):
        pool = BlockAllocator(4)
        pool.allocate()
        refused(lambda: pool.allocate_many(4), OutOfBlocksError, pool, [], match="need 4")
        refused(lambda: pool.allocate_many(-1), ValueError, pool, [], match="n must be an int")
        refused(lambda: pool.allocate_many(1.5), TypeError, pool, [], match="n must be an int")
        assert len(pool.allocate_many(3)) == 3

    def test_share_and_free_count_references(self):
        pool = BlockAllocator(2)
        block = pool.allocate()
        assert pool.share(block) == block and pool.refcount(block) == 2
        pool.free(block)
        assert pool.refcount(block) == 1 and pool.num_used == 1
        pool.free(block)
        assert pool.refcount(block) == 0 and pool.num_free == 2

    @pytest.mark.parametrize("method", ["share", "free"])
    @pytest.mark.parametrize("block, match", [
        (1, "is free"), (-1, "unknown block"), (2, "unknown block"), ("0", "unknown block"),
        (None, "unknown block"), (0.0, "unknown block")])
    def test_share_and_free_reject_free_or_unknown_blocks(self, method, block, match):
        pool = BlockAllocator(2)
        pool.allocate()  # block 0 in use, block 1 free
        refused(lambda: getattr(pool, method)(block), ValueError, pool, [], match=match)

    def test_double_free_is_refused(self):
        pool = BlockAllocator(2)
        block = pool.allocate()
        pool.free(block)
        refused(lambda: pool.free(block), ValueError, pool, [], match="double free")

    @pytest.mark.parametrize("block", [-1, 5, "1", None])
    def test_refcount_and_read_reject_unknown_blocks(self, block):
        pool = BlockAllocator(5)
        for method in (pool.refcount, pool.read):
            refused(lambda: method(block), ValueError, pool, [], match="unknown block")

    def test_read_returns_a_copy_and_reused_blocks_are_not_cleared(self):
        pool = BlockAllocator(1, 4)
        seq = Sequence("a", pool, [5, 6, 7])
        block = seq.block_table[0]
        assert pool.read(block) == [5, 6, 7, None]
        pool.read(block)[0] = 99
        assert pool.read(block)[0] == 5  # a copy, not the memory
        seq.free()
        again = Sequence("b", pool, [8])
        assert again.block_table[0] == block and pool.read(block) == [8, 6, 7, None]
        assert again.read() == [8]  # the table and the length, not the memory, decide

    def test_freed_blocks_are_reused_before_fresh_ones(self):
        pool = BlockAllocator(10)
        a, b = pool.allocate(), pool.allocate()
        pool.free(a)
        assert pool.allocate() == a and pool.allocate() == 2 and b == 1

    def test_allocate_many_takes_freed_blocks_last_in_first_out_then_fresh_ones(self):
        pool = BlockAllocator(10)
        blocks = pool.allocate_many(4)                    # fresh: 0, 1, 2, 3
        for block in (3, 1):
            pool.free(block)                              # the free list: [3, 1]
        assert blocks == [0, 1, 2, 3] and pool.allocate_many(3) == [1, 3, 4]
        assert pool.next_unused == 5                      # blocks 5..9 never handed out

    def test_writes_land_in_their_slots_in_consecutive_and_scattered_blocks(self):
        pool = BlockAllocator(8, 4)
        holes = [pool.allocate() for _ in range(4)]       # blocks 0..3
        pool.free(holes[2])
        scattered = Sequence("s", pool, range(10))        # blocks [2, 4, 5]: not one run
        consecutive = Sequence("c", pool, range(100, 106))  # blocks [6, 7]: one run
        assert list(scattered.block_table) == [2, 4, 5] and list(consecutive.block_table) == [6, 7]
        scattered.extend(range(10, 12))                   # fills block 5 from offset 2
        assert pool.read(5) == [8, 9, 10, 11] and pool.read(7) == [104, 105, None, None]
        assert scattered.read() == list(range(12)) and consecutive.read() == list(range(100, 106))

    def test_a_write_that_would_spill_out_of_its_block_is_refused(self):
        pool = BlockAllocator(4, 4)
        blocks = pool.allocate_many(2)
        table = BlockTable(4, blocks[:1])
        with pytest.raises(IndexError, match="tokens 2..4 not in the 4-slot table"):
            table.slot_mapping(2, 5)                       # 3 tokens from offset 2: no room
        refused(lambda: pool.kv_cache.write(table.slot_mapping(2, 4), [1, 2, 3]), ValueError, pool,
                [], match="3 tokens for 2 slots")
        for slots in ([2, 8], [-1, 2], ["2", 3], [0, 1.0]):      # block 2 was never handed out
            refused(lambda: pool.kv_cache.write(slots, [1, 2]), ValueError, pool, [],
                    match=re.escape("2 tokens for 2 slots of range(0, 8)"))
        pool.kv_cache.write(table.slot_mapping(2, 4), [1, 2])
        assert pool.read(blocks[0]) == [None, None, 1, 2] and pool.read(blocks[1]) == [None] * 4
        assert pool.kv_cache.slots[:4] == [None, None, 1, 2]  # slot = block * block_size + offset

    def test_an_empty_sequence_takes_no_blocks(self):
        for pool in (BlockAllocator(2), PrefixCachingAllocator(2)):
            seq = Sequence("e", pool)
            assert len(seq.block_table) == 0 and pool.num_used == 0 and seq.read() == []
            seq.append(5)
            assert pool.num_used == 1 and seq.read() == [5]


class TestSequences:
    """Part 2: block tables and sequences."""

    def test_block_table_slot_worked_example(self):
        table = BlockTable(16, [7, 2])
        assert list(table) == [7, 2] and len(table) == 2 and table[1] == 2
        assert table.slot(0) == (7, 0) and table.slot(17) == (2, 1) and table.slot(31) == (2, 15)
        assert BlockTable(4, [3, 0, 5]).slot_mapping(6, 9) == [2, 3, 20]  # the docstring's
        assert table.slot_mapping(15, 18) == [7 * 16 + 15, 2 * 16, 2 * 16 + 1]
        for bad in (-1, 32, "3"):
            with pytest.raises(IndexError, match="not in the 32-slot table"):
                table.slot(bad)

    @pytest.mark.parametrize("start, end, error, match", [
        (1.5, 3, TypeError, "start must be an int >= 0, got 1.5"),
        (True, 3, TypeError, "start must be an int >= 0, got True"),
        (-1, 2, ValueError, "start must be an int >= 0, got -1"),
        (0, "4", TypeError, "end must be an int >= 0, got '4'"),
        (2, 5, IndexError, "tokens 2..4 not in the 4-slot table")])
    def test_slot_mapping_names_a_position_that_is_not_an_int_in_the_table(self, start, end,
                                                                          error, match):
        with pytest.raises(error, match=match):
            BlockTable(4, [3]).slot_mapping(start, end)

    def test_sequence_allocates_only_what_it_needs(self):
        pool = BlockAllocator(10)
        seq = Sequence("a", pool, range(33))
        assert (seq.seq_id, len(seq), seq.tokens) == ("a", 33, list(range(33)))
        assert len(seq.block_table) == 3 and pool.num_used == 3
        assert Sequence("empty", pool).block_table == [] and pool.num_used == 3

    @pytest.mark.parametrize("block_size", [1, 3, 16, 32])
    def test_block_boundary_off_by_one(self, block_size):
        # Exactly k * block_size tokens need k blocks; one more token needs k + 1; and the
        # new block appears on the token that starts it, by prompt, append or extend.
        pool = BlockAllocator(64, block_size)
        for k in (1, 2, 3):
            assert len(Sequence("p", pool, range(k * block_size)).block_table) == k
            assert len(Sequence("q", pool, range(k * block_size + 1)).block_table) == k + 1
        by_append, by_extend = Sequence("a", pool), Sequence("e", pool)
        for n in range(1, 2 * block_size + 2):
            by_append.append(n)
            by_extend.extend([n])
            assert len(by_append.block_table) == len(by_extend.block_table) == -(-n // block_size)
            block, offset = by_append.block_table.slot(n - 1)
            assert block == by_append.block_table[(n - 1) // block_size]
            assert offset == (n - 1) % block_size and pool.read(block)[offset] == n
        assert by_append.read() == by_extend.read() == list(range(1, 2 * block_size + 2))

    def test_extend_crosses_several_blocks_in_one_call(self):
        pool = BlockAllocator(10, 3)
        seq = Sequence("a", pool, [1])
        seq.extend(range(2, 12))  # 11 tokens: 4 blocks
        assert len(seq.block_table) == 4 and seq.read() == list(range(1, 12))
        check_invariants(pool, [seq])

    @pytest.mark.parametrize("bad, exception", [
        ("a", TypeError), (-1, ValueError), (True, TypeError), (1.0, TypeError), (None, TypeError)])
    def test_bad_token_ids_are_refused_and_change_nothing(self, bad, exception):
        pool = BlockAllocator(4, 4)
        seq = Sequence("a", pool, [1, 2])
        refused(lambda: Sequence("b", pool, [3, bad]), exception, pool, [seq], match="token ids")
        refused(lambda: seq.append(bad), exception, pool, [seq], match="token ids")
        refused(lambda: seq.extend([3, 4, 5, bad]), exception, pool, [seq], match="token ids")
        assert seq.read() == [1, 2]

    def test_sequence_needs_a_pool_and_iterable_tokens(self):
        with pytest.raises(TypeError, match="BlockAllocator"):
            Sequence("a", object())
        pool = BlockAllocator(2)
        seq = Sequence("a", pool, [1])
        refused(lambda: Sequence("b", pool, 5), TypeError, pool, [seq],
                match="tokens must be an iterable of token ids, got 5")
        refused(lambda: seq.extend(None), TypeError, pool, [seq], match="tokens must be")

    def test_use_after_free_is_refused(self):
        pool = BlockAllocator(4)
        seq = Sequence("a", pool, range(20))
        seq.free()
        assert pool.num_free == 4 and seq.block_table == []
        for use in (lambda: seq.append(1), lambda: seq.extend([1]), seq.read, seq.free,
                    lambda: seq.fork("b"), lambda: share_prefix(seq, "b", 3)):
            refused(use, ValueError, pool, [seq], match="was freed")

    def test_a_failed_prompt_extend_or_copy_changes_nothing(self):
        pool = BlockAllocator(4, 4)
        a = Sequence("a", pool, range(10))   # 3 blocks, the last one half full
        b = a.fork("b")                      # shares all three
        refused(lambda: Sequence("c", pool, range(5)), OutOfBlocksError, pool, [a, b])
        refused(lambda: a.extend(range(7)), OutOfBlocksError, pool, [a, b])  # copy + 1 block
        Sequence("d", pool, [1])             # the pool is now full
        refused(lambda: b.append(1), OutOfBlocksError, pool, [a, b])  # needs a copy
        refused(lambda: a.extend([1, 2, 3]), OutOfBlocksError, pool, [a, b])
        assert a.read() == b.read() == list(range(10))


class TestSharing:
    """Part 3: sharing a prefix, and copy-on-write."""

    def test_free_shared_block_keeps_it_for_the_other_holder(self):
        pool = BlockAllocator(4)
        a = Sequence("a", pool, range(20))
        b = a.fork("b")
        a.free()
        assert [pool.refcount(x) for x in b.block_table] == [1, 1] and pool.num_used == 2
        assert b.read() == list(range(20))
        fresh = Sequence("c", pool, range(100, 132))  # takes only the two free blocks
        assert set(fresh.block_table).isdisjoint(b.block_table) and b.read() == list(range(20))
        check_invariants(pool, [b, fresh])

    @pytest.mark.parametrize("block_size", [3, 16, 32])
    def test_cow_on_divergence(self, block_size):
        pool = BlockAllocator(8, block_size)
        prompt = list(range(block_size + 2))  # one full block and a partial one
        a = Sequence("a", pool, prompt)
        b = a.fork("b")
        shared_tail = a.block_table[-1]
        b.append(1000)
        assert b.block_table[-1] != shared_tail and a.block_table[-1] == shared_tail
        assert b.block_table[0] == a.block_table[0]            # the full block stays shared
        assert pool.read(shared_tail)[len(prompt) % block_size] is None  # a's memory untouched
        assert a.read() == prompt and b.read() == prompt + [1000]
        refs = [pool.refcount(x) for x in (a.block_table[0], shared_tail, b.block_table[-1])]
        assert refs == [2, 1, 1]
        assert pool.num_copies == 1
        a.append(2000)  # a is now the tail's only holder: writes in place, no copy
        assert a.block_table[-1] == shared_tail and pool.num_copies == 1
        check_invariants(pool, [a, b])

    def test_fork_at_a_block_boundary_copies_nothing(self):
        pool = BlockAllocator(8, 4)
        a = Sequence("a", pool, range(8))  # exactly two full blocks
        b = a.fork("b")
        a.append(1)
        b.append(2)
        assert pool.num_copies == 0 and a.block_table[:2] == b.block_table[:2]
        assert a.block_table[2] != b.block_table[2]
        check_invariants(pool, [a, b])

    def test_fork_mid_block_copies_once_per_writer_while_shared(self):
        pool = BlockAllocator(16, 4)
        a = Sequence("a", pool, range(6))
        forks = [a.fork(i) for i in range(3)]   # the tail block has 4 holders
        for i, seq in enumerate(forks):
            seq.append(i)
        assert pool.num_copies == 3
        a.append(9)                             # a is the last holder: no copy
        assert pool.num_copies == 3
        check_invariants(pool, [a, *forks])

    def test_share_prefix_references_the_source_blocks_including_a_partial_one(self):
        pool = BlockAllocator(8, 4)
        src = Sequence("src", pool, range(10))            # blocks [x, y, z], z holds 2
        mid = share_prefix(src, "mid", 5)                 # covers x fully and 1 token of y
        assert mid.block_table == src.block_table[:2] and mid.read() == list(range(5))
        assert [pool.refcount(x) for x in src.block_table] == [2, 2, 1]
        mid.append(50)                                    # y is shared: mid copies it
        assert mid.block_table[1] != src.block_table[1] and src.read() == list(range(10))
        assert mid.read() == [0, 1, 2, 3, 4, 50]
        whole, empty = share_prefix(src, "all"), share_prefix(src, "none", 0)
        assert whole.read() == list(range(10)) and empty.block_table == []
        check_invariants(pool, [src, mid, whole, empty])

    @pytest.mark.parametrize("num_tokens, exception", [
        (-1, ValueError), (11, ValueError), ("3", TypeError), (2.0, TypeError)])
    def test_share_prefix_rejects_bad_lengths(self, num_tokens, exception):
        pool = BlockAllocator(8, 4)
        src = Sequence("src", pool, range(10))
        refused(lambda: share_prefix(src, "x", num_tokens), exception, pool, [src],
                match="num_tokens")

    def test_share_prefix_of_something_not_a_sequence_is_a_type_error(self):
        pool = BlockAllocator(8, 4)
        src = Sequence("src", pool, range(10))
        for wrong in ("src", src.block_table, None):  # was AttributeError: no _check_live
            refused(lambda: share_prefix(wrong, "x"), TypeError, pool, [src],
                    match="src must be a Sequence")

    def test_counting_physical_blocks_counts_shared_ones_once(self):
        pool = BlockAllocator(64)
        root = Sequence("root", pool, range(64))         # 4 blocks
        users = [share_prefix(root, i) for i in range(10)]
        for i, seq in enumerate(users):
            seq.extend([i] * 20)                          # 2 new blocks each (20 tokens)
        assert pool.num_used == 4 + 10 * 2
        assert sum(len(seq.block_table) for seq in [root, *users]) == 4 + 10 * 6
        check_invariants(pool, [root, *users])


class TestCoreReadsAsTheLesson:
    """Parts 1-3 are read first: short, in dependency order, nothing from a later part."""

    SOURCE = pathlib.Path(solution.__file__).read_text().splitlines()

    def part_lines(self, first, after):
        """Line numbers (1-based) of the banner of Part first to the line before Part after."""
        starts = [i for i, line in enumerate(self.SOURCE, 1) if line.startswith("# Part ")]
        titles = [self.SOURCE[i - 1] for i in starts]
        begin = starts[[t.startswith(f"# Part {first}.") for t in titles].index(True)] - 1
        end = starts[[t.startswith(f"# Part {after}.") for t in titles].index(True)] - 1
        while self.SOURCE[end - 2] == "":
            end -= 1
        return begin, end - 1

    def test_parts_1_to_3_fit_300_lines_and_the_pool_80(self):
        begin, end = self.part_lines(1, 4)
        assert end - begin + 1 <= 300
        pool = inspect.getsource(BlockAllocator).rstrip("\n").splitlines()
        assert len(pool) <= 80

    def test_parts_1_to_3_use_no_name_defined_in_a_later_part(self):
        tree = ast.parse("\n".join(self.SOURCE))
        begin, end = self.part_lines(1, 4)
        later = {node.name if hasattr(node, "name") else target.id
                 for node in tree.body if node.lineno > end
                 for target in (getattr(node, "targets", None) or [node])
                 if hasattr(node, "name") or isinstance(target, ast.Name)}
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
                and begin <= node.lineno <= end}
        assert later and used and not used & later


class TestWorkedExamples:
    """The worked examples in the docstrings of Parts 1-3 and 6, run exactly as written."""

    def test_allocate_many(self):
        pool = BlockAllocator(8)
        assert pool.allocate_many(3) == [0, 1, 2]
        pool.free(1)
        pool.free(0)
        assert pool.allocate_many(3) == [0, 1, 3]

    def test_kv_slot_and_slot_mapping(self):
        assert KVCache(4).block_slots(2)[1] == 9                  # block 2, offset 1 -> slot 9
        table = BlockTable(16, [7, 2])
        assert table.slot(17) == (2, 1) and table.slot_mapping(17, 18) == [33]
        assert BlockTable(4, [3, 0, 5]).slot_mapping(6, 9) == [2, 3, 20]

    def test_append_takes_a_block_exactly_at_the_boundary(self):
        pool = BlockAllocator(4, 4)
        pool.allocate_many(4)
        pool.free(3)
        seq = Sequence("s", pool, [5, 6, 7, 8])                   # table [3], full
        for block in (2, 1, 0):
            pool.free(block)                                      # block 0 is handed out next
        seq.append(9)
        assert seq.block_table == [3, 0] and pool.kv_cache.slots[0 * 4 + 0] == 9

    def test_share_prefix(self):
        pool = BlockAllocator(8, 16)
        src = Sequence("src", pool, range(20))
        a, b = src.block_table
        x = share_prefix(src, "x", 18)
        assert x.block_table == [a, b] and len(x) == 18
        assert pool.refcount(a) == pool.refcount(b) == 2
        x.append(99)                                              # the first to write b copies it
        assert x.block_table[1] != b and src.read() == list(range(20))

    def test_reserve_max_len(self):
        pool = BlockAllocator(200, 16)
        table = solution.reserve_max_len(pool, list(range(768)), 2048)
        assert len(table) == pool.num_used == 128 and solution.written_share(pool) == 0.375
        assert len(Sequence("paged", pool, range(768)).block_table) == 48

    def test_reserve_max_len_refuses_what_cannot_fit_before_taking_blocks(self):
        pool = BlockAllocator(8, 4)
        refused(lambda: solution.reserve_max_len(pool, range(5), 2), ValueError, pool, [],
                match="max_len 2 cannot hold the 5 tokens")
        refused(lambda: solution.reserve_max_len(pool, [1], -1), ValueError, pool, [],
                match="max_len must be an int >= 0")
        refused(lambda: solution.reserve_max_len(pool, [1], 64), OutOfBlocksError, pool, [])

    def test_block_hash_chain(self):
        h0 = hash_block_tokens(None, [1, 2, 3, 4])
        h1 = hash_block_tokens(h0, [5, 6, 7, 8])
        assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != h1

    def test_share_cached_prefix(self):
        pool = PrefixCachingAllocator(8, 4)
        a = Sequence("a", pool, range(10))
        assert a.block_table[:2] == [0, 1]
        b = Sequence("b", pool, [*range(8), *range(50, 55)])
        assert b.block_table[:2] == [0, 1] and len(b.block_table) == 4
        assert (pool.hits, pool.misses) == (2, 3)                # a's 2 misses, then b's 1
        assert pool.refcount(0) == pool.refcount(1) == 2


class TestChecks:
    """Part 4: the checks fail when they should; the randomized oracle test."""

    def test_check_invariants_names_each_broken_invariant(self):
        pool = BlockAllocator(8, 4)
        a = Sequence("a", pool, range(6))
        b = a.fork("b")
        check_invariants(pool, [a, b])
        with pytest.raises(AssertionError, match="ref-count != block-table references"):
            check_invariants(pool, [a])                   # b's references look like a leak
        pool.ref_cnt[a.block_table[0]] += 1
        with pytest.raises(AssertionError, match="ref-count != block-table references"):
            check_invariants(pool, [a, b])
        pool.ref_cnt[a.block_table[0]] -= 1
        pool.kv_cache.write([a.block_table[1] * 4], [77])  # a write that skipped copy-on-write
        with pytest.raises(AssertionError, match="read-back"):
            check_invariants(pool, [a, b])
        pool.kv_cache.write([a.block_table[1] * 4], [4])
        pool.free_block_ids.append(a.block_table[0])      # a block both used and free
        with pytest.raises(AssertionError, match="free list"):
            check_invariants(pool, [a, b])
        pool.free_block_ids.pop()
        a.block_table.pop()
        with pytest.raises(AssertionError, match="block count"):
            check_invariants(pool, [a, b])

    def test_append_copies_after_a_raw_share_of_the_last_block(self):
        # A reference taken by pool.share, outside any sequence, must make append copy,
        # whatever the sequence did before (a cached "my tail is private" once went stale).
        for prompt in ([1], [1, 2]):                       # the last block stays partly full
            pool = BlockAllocator(4, 4)
            a = Sequence("a", pool, prompt)
            a.append(3)
            tail = pool.share(a.block_table[-1])
            seen = pool.read(tail)
            a.append(4)
            assert a.block_table[-1] != tail and pool.read(tail) == seen and pool.num_copies == 1
            assert a.read() == prompt + [3, 4]

    def test_fuzz_notices_a_broken_copy_on_write(self, monkeypatch):
        # The randomized test is only worth running if it catches the classic bug.
        monkeypatch.setattr(Sequence, "_copy_last_block", lambda self: self.block_table[-1])
        with pytest.raises(AssertionError):
            fuzz(BlockAllocator(12, 3), random.Random(0), 300)

    @pytest.mark.parametrize("block_size", [1, 3, 5, 16])
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_random_operations_against_a_list_model(self, block_size, seed):
        counts = fuzz(BlockAllocator(12, block_size), random.Random(seed), 1000)
        for op in ("create", "append", "extend", "fork", "share", "raw share", "free", "refused"):
            assert counts[op] > 0, f"the run never did {op}"

    @pytest.mark.parametrize("knob, value, exception", [
        ("num_ops", -1, ValueError), ("max_live", 0, ValueError), ("vocab", 0, ValueError),
        ("vocab", 2.5, TypeError)])
    def test_fuzz_names_a_meaningless_setting(self, knob, value, exception):
        with pytest.raises(exception, match=f"{knob} must be an int"):
            fuzz(BlockAllocator(12, 3), random.Random(0), **{"num_ops": 10, knob: value})

    def test_fuzz_names_an_rng_that_is_not_one(self):
        with pytest.raises(TypeError, match="rng must be a random.Random"):
            fuzz(BlockAllocator(12, 3), 0, 10)  # was AttributeError: 'int' has no 'choice'

    @pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
    @pytest.mark.parametrize("block_size", [1, 3, 16, 256])
    def test_the_lab_checks_pass(self, check, block_size):
        assert isinstance(check(block_size, 0), str)  # the check raises AssertionError if broken

    def test_check_invariants_names_a_pool_or_sequence_that_is_not_one(self):
        with pytest.raises(TypeError, match="allocator must be a BlockAllocator, got str"):
            check_invariants("pool", [])  # was AttributeError deep in audit
        pool = BlockAllocator(4)
        with pytest.raises(TypeError, match="sequences must hold Sequence objects, got 'a'"):
            check_invariants(pool, [Sequence("a", pool, [1]), "a"])  # was AttributeError

    def test_check_invariants_refuses_a_sequence_of_another_pool(self):
        pool_a, pool_b = BlockAllocator(4, 4), BlockAllocator(4, 4)
        a, b = Sequence("a", pool_a, [1, 2]), Sequence("b", pool_b, [1, 2])
        check_invariants(pool_b, [b])
        with pytest.raises(AssertionError, match="belongs to another pool"):
            check_invariants(pool_b, [a])


class TestPitfalls:
    """Part 4: the classic pitfalls, committed on purpose and caught."""

    def test_each_pitfall_shows_the_harm_to_another_sequence_and_is_caught(self, capsys):
        main(["pitfalls"])
        out = capsys.readouterr().out
        assert out.count("caught by check_invariants:") == 4 and "NOT CAUGHT" not in out
        assert "b wrote [0, 1, 2]..., reads back [100, 101, 102]... (c's tokens)" in out
        assert "b wrote 99 last, reads back 7" in out
        assert "b wrote 100 first, reads back 99" in out
        assert "block count: sequence 'a' holds 1 block for 17 tokens, needs 2" in out
        assert "a 1-block request is refused" in out

    def test_a_count_of_one_reads_in_the_singular(self, capsys):
        # "holds 1 blocks for 17 tokens" was the default output; at block size 1, "1 tokens"
        main(["--block-size", "1", "pitfalls", "cache"])
        out = capsys.readouterr().out
        assert "a holds 1 token (" in out and "holds the same 1 token in both" in out
        main(["--block-size", "256", "sharing"])
        out += capsys.readouterr().out
        assert "USER_LEN=40 takes 1 block (256 slots)" in out
        assert re.search(r"\b1 (tokens|blocks)\b", out) is None

    @pytest.mark.parametrize("broken", [solution.EagerFreePool, solution.TableCountingPool])
    def test_the_randomized_test_catches_each_broken_pool(self, broken):
        with pytest.raises(AssertionError):
            fuzz(broken(12, 3), random.Random(0), 300)

    def test_the_pitfalls_leave_the_real_classes_exactly_as_they_were(self, capsys):
        def members():
            return {cls: dict(vars(cls)) for cls in (BlockAllocator, Sequence, KVCache, BlockTable)}
        before = members()
        main(["pitfalls"])
        assert members() == before
        counts = fuzz(BlockAllocator(12, 3), random.Random(1), 300)  # the real ones still work
        assert counts["refused"] > 0


class TestDemos:
    """Part 5: the demos print what the constants say they should."""

    def test_default_run_prints_the_core_results(self, capsys):
        main(["memory", "sharing"])
        out = capsys.readouterr().out
        s, bs = solution, BLOCK_SIZE
        naive, paged = s.POOL_TOKENS // s.MAX_LEN, s.POOL_TOKENS // s.ACTUAL_LEN  # bs divides both
        alone = s.NUM_REQUESTS * -(-(s.SYSTEM_LEN + s.USER_LEN) // bs)
        shared = s.SYSTEM_LEN // bs + s.NUM_REQUESTS * -(-s.USER_LEN // bs)  # prompt: full blocks
        for line in [
            f"== memory efficiency: sequences that fit in a {s.POOL_TOKENS // bs}-block pool ==",
            f"naive contiguous (reserve max_len={s.MAX_LEN})  : {naive:>4} sequences",
            f"paged (allocate-on-demand, actual={s.ACTUAL_LEN})    : {paged:>4} sequences   "
            f"({paged / naive:.1f}x)",
            f"== prefix sharing: {s.NUM_REQUESTS} requests, shared {s.SYSTEM_LEN}-token system "
            f"prompt ==",
            f"without sharing : {alone:>5} blocks used",
            f"with sharing    : {shared:>5} blocks used   ({alone / shared:.1f}x less; shared "
            f"prefix stored once)",
            "copy-on-write   : divergence forked block; refcounts correct",
        ]:
            assert line in out.splitlines()
        assert max(len(line) for line in out.splitlines()) <= 100

    def test_the_memory_demo_keeps_its_numbers_at_block_sizes_that_divide_its_lengths(self, capsys):
        expected = (solution.POOL_TOKENS // solution.MAX_LEN, solution.POOL_TOKENS //
                    solution.ACTUAL_LEN)
        for block_size in (1, 8, 64, 256):
            main(["memory", "--block-size", str(block_size)])
            lines = capsys.readouterr().out.splitlines()
            assert f"{expected[0]:>4} sequences" in lines[1] and f"{expected[1]:>4} sequences" in \
                lines[2]
        main(["memory", "--block-size", "3"])
        assert "at block size 3, MAX_LEN=2048 takes 683 blocks" in capsys.readouterr().out


class TestPrefixCache:
    """Part 6: automatic prefix caching."""

    def test_share_tail_of_a_free_block_is_refused_before_the_cache_changes(self):
        pool = PrefixCachingAllocator(8, 2)
        Sequence("a", pool, [1, 2, 3, 4]).free()  # blocks 0 and 1: cached, evictable
        refused(lambda: pool.share_tail(0), ValueError, pool, [], match="block 0 is free")
        check_invariants(pool, [])  # was: the cache had dropped block 0, still evictable

    @pytest.mark.parametrize("method", ["share", "free"])
    @pytest.mark.parametrize("block, match", [
        (0, "block 0 is free"), (5, "block 5 is free"), (8, "unknown block"), ("0", "unknown")])
    def test_share_and_free_refuse_an_evictable_or_unknown_block(self, method, block, match):
        pool = PrefixCachingAllocator(8, 2)
        Sequence("a", pool, [1, 2, 3, 4]).free()  # blocks 0 and 1: cached, evictable
        refused(lambda: getattr(pool, method)(block), ValueError, pool, [], match=match)
        assert pool.num_cached == 2

    @pytest.mark.parametrize("corrupt, message", [
        (lambda pool: pool.block_hash.update({0: b"other"}), "maps disagree"),
        (lambda pool: pool.block_hash.update({5: b"lost"}), "neither in use nor evictable"),
        (lambda pool: pool.cached_block_hash_to_block.pop(pool.block_hash[0]),
         "an evictable block is not cached")])
    def test_the_cache_audit_names_each_broken_cache_invariant(self, corrupt, message):
        pool = PrefixCachingAllocator(8, 2)
        Sequence("a", pool, [1, 2, 3, 4]).free()  # blocks 0 and 1: cached, evictable
        check_invariants(pool, [])
        corrupt(pool)
        with pytest.raises(AssertionError, match=message):
            check_invariants(pool, [])

    def test_cache_hits_and_misses_on_an_exact_scenario(self):
        pool = PrefixCachingAllocator(16, 4)
        assert (pool.hits, pool.misses, pool.hit_rate, pool.num_cached) == (0, 0, 0.0, 0)
        a = Sequence("a", pool, range(10))            # 2 full blocks (misses) + a partial
        assert (pool.hits, pool.misses) == (0, 2)
        b = Sequence("b", pool, [*range(8), 50, 51, 52, 53, 54])  # 2 hits, 1 miss, a partial
        assert (pool.hits, pool.misses) == (2, 3) and pool.hit_rate == 2 / 5
        assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
        assert [pool.refcount(x) for x in a.block_table] == [2, 2, 1]
        assert pool.num_used == 5 and b.read() == [*range(8), 50, 51, 52, 53, 54]
        check_invariants(pool, [a, b])

    def test_a_freed_cached_block_is_revived_not_recomputed(self):
        pool = PrefixCachingAllocator(8, 4)
        first = Sequence("first", pool, range(9))
        blocks = list(first.block_table)
        first.free()
        assert pool.num_cached == 2 and pool.num_free == 8   # evictable blocks count as free
        again = Sequence("again", pool, range(9))
        assert again.block_table[:2] == blocks[:2] and pool.hits == 2 and pool.num_cached == 0
        assert again.read() == list(range(9)) and pool.num_free == 8 - 3
        check_invariants(pool, [again])

    def test_blocks_filled_by_appended_tokens_are_cached_too(self):
        pool = PrefixCachingAllocator(8, 4)
        seq = Sequence("a", pool, [1, 2])
        for token in (3, 4, 5, 6, 7, 8):
            seq.append(token)
        seq.free()
        assert pool.num_cached == 2
        assert Sequence("b", pool, range(1, 9)).block_table[:2] == [0, 1] and pool.hits == 2

    def test_partial_blocks_are_never_reused(self):
        pool = PrefixCachingAllocator(8, 4)
        a = Sequence("a", pool, range(6))             # one full block, one partial
        b = Sequence("b", pool, range(6))
        assert pool.hits == 1 and b.block_table[1] != a.block_table[1]
        assert len(pool.cached_block_hash_to_block) == 1

    def test_equal_blocks_after_a_different_history_never_match(self):
        pool = PrefixCachingAllocator(8, 4)
        a = Sequence("a", pool, [1, 2, 3, 4, 9, 9, 9, 9])
        b = Sequence("b", pool, [5, 6, 7, 8, 9, 9, 9, 9])
        assert pool.hits == 0 and set(a.block_table).isdisjoint(b.block_table)
        second = [pool.block_hash[seq.block_table[1]] for seq in (a, b)]
        assert hash_block_tokens(None, [9] * 4) != second[0] != second[1]
        a.free()
        c = Sequence("c", pool, [9, 9, 9, 9])         # block 2 of a as a first block: no match
        assert pool.hits == 0 and c.read() == [9, 9, 9, 9]

    def test_lru_evicts_the_least_recently_freed_prompt_first(self):
        pool = PrefixCachingAllocator(4, 2)
        Sequence("a", pool, [1, 1, 2, 2]).free()      # blocks 0, 1 cached
        Sequence("b", pool, [3, 3, 4, 4]).free()      # blocks 2, 3 cached; a is older
        Sequence("c", pool, [5, 5])                   # evicts one of a's blocks
        assert pool.evictions == 1
        Sequence("b2", pool, [3, 3, 4, 4])            # b survived
        assert pool.hits == 2

    def test_a_hit_refreshes_recency(self):
        pool = PrefixCachingAllocator(4, 2)
        Sequence("a", pool, [1, 1, 2, 2]).free()
        Sequence("b", pool, [3, 3, 4, 4]).free()
        Sequence("a again", pool, [1, 1, 2, 2]).free()  # revived, then freed: a is now newest
        Sequence("c", pool, [5, 5, 6, 6])               # evicts two blocks: b's
        hits = pool.hits
        Sequence("a third time", pool, [1, 1, 2, 2])
        assert pool.hits - hits == 2 and pool.evictions == 2

    def test_a_sequence_is_evicted_tail_first(self):
        pool = PrefixCachingAllocator(3, 2)
        a = Sequence("a", pool, [1, 1, 2, 2, 3, 3])     # 3 cached blocks
        keys = [pool.block_hash[block] for block in a.block_table]
        a.free()                                        # tail first: the tail is the oldest
        Sequence("b", pool, [7, 7]).free()              # evicts one block: a's tail
        assert pool.evictions == 1
        assert [key in pool.cached_block_hash_to_block for key in keys] == [True, True, False]
        hits = pool.hits
        Sequence("a again", pool, [1, 1, 2, 2, 3, 3])   # the prefix survived
        assert pool.hits - hits == 2

    def test_never_cached_free_blocks_go_before_evicting(self):
        pool = PrefixCachingAllocator(4, 2)
        Sequence("a", pool, [1, 1, 2]).free()           # block 0 cached, block 1 plain free
        Sequence("b", pool, [5, 5, 6, 6])               # blocks 1, 2 (the never-cached ones)
        assert pool.evictions == 0 and pool.num_cached == 1

    def test_admission_is_atomic_when_the_pool_is_nearly_full_of_cached_blocks(self):
        pool = PrefixCachingAllocator(4, 2)
        Sequence("a", pool, [1, 1, 2, 2, 3, 3]).free()  # 3 cached, evictable blocks
        keep = Sequence("keep", pool, [9])              # 1 in use; free: 3, all cached
        # 2 hits revived + 2 new blocks = 4 > 3 free: refused, counters and cache untouched.
        refused(lambda: Sequence("b", pool, [1, 1, 2, 2, 8, 8, 8]), OutOfBlocksError, pool, [keep])
        assert (pool.hits, pool.misses, pool.evictions) == (0, 3, 0)
        fits = Sequence("c", pool, [1, 1, 2, 2, 8])     # 2 hits + 1 evicted block: fits
        assert pool.hits == 2 and pool.evictions == 1 and fits.read() == [1, 1, 2, 2, 8]
        check_invariants(pool, [keep, fits])

    def test_fork_and_share_prefix_keep_copy_on_write_on_a_caching_pool(self):
        pool = PrefixCachingAllocator(16, 4)
        a = Sequence("a", pool, range(6))
        b = a.fork("b")
        b.append(100)
        assert pool.num_copies == 1 and a.read() == list(range(6))
        c = share_prefix(a, "c", 5)
        c.extend([7, 7, 7])                            # fills c's copy of block 1: cached
        assert c.read() == [0, 1, 2, 3, 4, 7, 7, 7] and c.block_table[1] in pool.block_hash
        check_invariants(pool, [a, b, c])

    def test_a_block_shared_partly_leaves_the_cache_so_cached_kv_is_never_overwritten(self):
        pool = PrefixCachingAllocator(8, 4)
        src = Sequence("src", pool, range(8))           # two full, cached blocks
        part = share_prefix(src, "part", 6)             # covers block 1 only partly
        assert part.block_table == src.block_table      # referenced, as share_prefix says
        src.free()                                      # part is block 1's only holder
        part.append(99)                                 # writes block 1 in place: no copy
        assert pool.num_copies == 0 and part.read() == [0, 1, 2, 3, 4, 5, 99]
        again = Sequence("again", pool, range(8))       # block 0 hits; block 1 is not offered
        assert pool.hits == 1 and again.read() == list(range(8))
        assert again.block_table[1] != part.block_table[1]
        check_invariants(pool, [part, again])

    @pytest.mark.parametrize("policy", ["lru", "fifo", solution.OptimalPolicy])
    @pytest.mark.parametrize("block_size", [1, 2, 3, 16])
    def test_random_operations_on_a_caching_pool(self, block_size, policy):
        # each eviction policy: FIFO and the optimum (no future given: every key equal) pop
        # from a heap whose stale entries the random hits and frees leave behind
        hits = evictions = 0
        for seed in range(3):
            pool = PrefixCachingAllocator(12, block_size,
                                          policy if type(policy) is str else policy())
            counts = fuzz(pool, random.Random(seed), 1000)
            assert counts["create"] > 0 and counts["refused"] > 0
            hits, evictions = hits + pool.hits, evictions + pool.evictions
        assert hits > 0 and evictions > 0  # the runs did exercise the cache


class TestPreemption:
    """Part 7: preemption by recompute or swap, and a scheduler that ends."""

    @pytest.mark.parametrize("policy", ["recompute", "swap"])
    @pytest.mark.parametrize("block_size", [1, 3, 16])
    def test_both_policies_finish_every_request_with_its_tokens(self, policy, block_size):
        requests = preemption_workload(seed=block_size, num_requests=6)
        stats = serve(policy, requests, 512 // block_size, 256 // block_size, block_size)
        assert stats.preemptions > 0

    def test_counters_match_a_hand_computed_case(self):
        # bs 2, 4 GPU blocks; A and B: 2-token prompts, 3 tokens to generate. Step 0 admits
        # both and each takes a second block; step 2 A needs a fifth block: B (last step 1)
        # is the victim, 4 tokens in 2 blocks. A finishes; step 3 B comes back.
        requests = [Request(0, [1, 2], 3, 0), Request(1, [3, 4], 3, 0)]
        recompute = serve("recompute", requests, 4, 4, 2)
        assert (recompute.preemptions, recompute.recomputed_tokens, recompute.steps) == (1, 4, 4)
        assert recompute.swapped_out_blocks == recompute.swapped_in_blocks == 0
        swap = serve("swap", requests, 4, 4, 2)
        assert (swap.preemptions, swap.recomputed_tokens, swap.steps) == (1, 0, 4)
        assert swap.swapped_out_blocks == swap.swapped_in_blocks == 2 and swap.host_fallbacks == 0
        assert recompute.preempted_blocks == swap.preempted_blocks == 2
        rate, latency = solution.PREFILL_TOKENS_PER_S[0], solution.TRANSFER_LATENCY_S[0]
        assert recompute.recompute_seconds(rate) == 4 / rate and swap.recompute_seconds(rate) == 0
        assert swap.swap_seconds(2, 1, latency) == 4 * solution.block_copy_seconds(2, 1, latency)

    def test_the_victim_is_the_least_recently_used(self):
        assert lru_victim({0: 5, 1: 3, 2: 4}, exclude=1) == 2
        assert lru_victim({0: 5, 1: 3, 2: 4}, exclude=0) == 1
        assert lru_victim({0: 7, 1: 7, 2: 7}, exclude=0) == 2  # a tie: the latest arrival

    def test_the_scheduler_preempts_the_request_stepped_longest_ago(self):
        gpu, host = BlockAllocator(3, 2), BlockAllocator(4, 2)
        scheduler = Scheduler(gpu, host, "recompute")
        prompts = {0: [0, 0], 1: [1, 1], 2: [2]}               # the pool is full; 2 has room
        for req_id, prompt in prompts.items():
            scheduler.running[req_id] = Sequence(req_id, gpu, prompt)
        scheduler.last_step.update({0: 9, 1: 3, 2: 8})       # 1 is the oldest
        scheduler._decode({r: len(p) + 5 for r, p in prompts.items()}, step=10)
        assert 1 in scheduler.preempted and set(scheduler.running) == {0, 2}

    def test_a_full_host_pool_falls_back_to_recompute(self):
        requests = preemption_workload(seed=1, num_requests=10)
        stats = serve("swap", requests, 1024 // 16, 2, 16)    # room for 2 host blocks only
        assert stats.host_fallbacks > 0 and stats.recomputed_tokens > 0
        assert stats.preemptions >= stats.host_fallbacks

    def test_a_victim_holding_a_shared_block_is_recomputed_not_swapped(self):
        gpu, host = BlockAllocator(8, 4), BlockAllocator(8, 4)
        scheduler = Scheduler(gpu, host, "swap")
        parent = Sequence(0, gpu, range(6))
        scheduler.running[1], scheduler.last_step[1] = parent.fork(1), 0
        scheduler._preempt(1)
        assert scheduler.stats.shared_fallbacks == 1 and host.num_used == 0
        assert scheduler.preempted[1].host_blocks is None and parent.read() == list(range(6))
        check_invariants(gpu, [parent])

    def test_swap_out_and_in_keep_every_block_s_contents(self):
        gpu, host = BlockAllocator(8, 4), BlockAllocator(8, 4)
        seq = Sequence("a", gpu, range(10))
        contents = [gpu.read(block) for block in seq.block_table]
        host_blocks = swap_out(seq, host)
        assert [host.read(block) for block in host_blocks] == contents
        tokens = list(seq.tokens)
        seq.free()
        Sequence("filler", gpu, range(100, 108))        # the old GPU blocks get reused
        back = swap_in("a", tokens, host_blocks, host, gpu)
        assert [gpu.read(block) for block in back.block_table] == contents
        assert back.read() == list(range(10)) and host.num_used == 0
        back.append(10)
        assert back.read() == list(range(11))

    def test_swap_in_refuses_host_blocks_that_do_not_match_before_taking_gpu_blocks(self):
        gpu, host = BlockAllocator(8, 4), BlockAllocator(8, 4)
        seq = Sequence("a", gpu, range(10))
        host_blocks = swap_out(seq, host)                  # 3 blocks
        for tokens, blocks, message in (
                (list(range(10)), host_blocks + [5], "block 5 is free"),
                (list(range(4)), host_blocks, "4 tokens need 1 block, not the 3")):
            refused(lambda: swap_in("b", tokens, blocks, host, gpu), ValueError, gpu, [seq],
                    match=message)
            assert host.num_used == 3  # was: GPU blocks taken, host blocks freed, then raised

    def test_scheduler_rejects_bad_policies_and_requests_that_never_fit(self):
        with pytest.raises(ValueError, match="policy"):
            Scheduler(BlockAllocator(4), BlockAllocator(4), "drop")
        with pytest.raises(ValueError, match="plain BlockAllocator"):
            Scheduler(PrefixCachingAllocator(4), BlockAllocator(4), "swap")
        with pytest.raises(TypeError, match="gpu must be a BlockAllocator, got int"):
            Scheduler(3, None, "recompute")  # was told it is "not a prefix cache"
        scheduler = Scheduler(BlockAllocator(2, 2), BlockAllocator(2, 2), "swap")
        with pytest.raises(ValueError, match="can never run"):
            scheduler.run([Request(0, [1, 2, 3], 5, 0)])

    def test_a_swap_run_moves_exactly_the_blocks_the_recompute_run_preempted(self):
        # evict_runs derives swap's traffic from recompute runs: 2 x the victims' blocks. That
        # holds only if a swap run (host pool as large as the GPU's) preempts the same victims.
        for block_size in (1, 16, 64):
            requests = preemption_workload(seed=7)
            recompute = run_policy("recompute", block_size, requests)
            swap = run_policy("swap", block_size, requests, host_tokens=solution.GPU_KV_TOKENS)
            assert swap.host_fallbacks == swap.shared_fallbacks == swap.recomputed_tokens == 0
            assert swap.swapped_out_blocks == swap.swapped_in_blocks == recompute.preempted_blocks
            assert swap.preemptions == recompute.preemptions > 0
        rows = evict_runs([7], block_sizes=(1, 16, 64))[7]
        assert [(row[0], row[3]) for row in rows] == [
            (size, run_policy("recompute", size, requests).preempted_blocks)
            for size in (1, 16, 64)]

    def test_the_20_percent_verdict_agrees_with_the_printed_ratios(self, capsys, monkeypatch):
        # A ratio of 1.204 prints as 1.20 and must count as inside "never higher than 20%";
        # 1.206 prints as 1.21 and must not. The verdicts count rows of the printed table.
        for ratio, holds in ((1.204, 8), (1.206, 0)):
            monkeypatch.setattr(solution, "evict_ratios", lambda runs, *setting, r=ratio: {
                1: [0.5], 16: [1.0], 64: [r], 256: [1.1]})
            compare_with_paper({0: []})
            out = capsys.readouterr().out
            assert f"{ratio:.2f}" in out
            assert f"at every size: holds in {holds} of 8 rows" in out
            assert f"small blocks favour recompute, large ones swap: holds in 8 of 8 rows" in out

    def test_the_paper_comparison_says_what_it_cannot_judge(self, capsys, monkeypatch):
        monkeypatch.setattr(solution, "evict_ratios", lambda runs, *setting: {})  # no preemption
        compare_with_paper({0: []})
        assert "no request was preempted at any block size" in capsys.readouterr().out
        monkeypatch.setattr(solution, "evict_ratios", lambda runs, *setting: {256: [0.8]})
        compare_with_paper({0: []})
        out = capsys.readouterr().out
        assert "large ones swap: not judged (preemptions at block size 256 only)" in out
        assert "at 16-64: not judged (no preemptions at those sizes)" in out

    def test_a_ratio_cell_keeps_its_width_at_any_size(self):
        cells = [solution.ratio_cell(r) for r in (3.684, 13.2, 145.67, 13238.7, 2e6)]
        assert cells == ["3.68", "13.20", "145.7", "13239", "2e+06"]

    @pytest.mark.parametrize("knob, value", [
        ("PREFILL_TOKENS_PER_S", (1, 1)), ("PREFILL_TOKENS_PER_S", (1e6, 2e6)),
        ("TRANSFER_LATENCY_S", (1e-3, 1e-3)), ("GPU_KV_TOKENS", 65_536)])
    def test_evict_runs_and_fits_100_columns_at_the_knobs_extremes(self, capsys, monkeypatch,
                                                                   knob, value):
        monkeypatch.setattr(solution, knob, value)
        main(["evict"])
        assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 100

    def test_evict_prints_the_quote_and_every_block_size(self, capsys):
        main(["evict"])
        out = capsys.readouterr().out
        assert "recomputation overhead is never higher than 20% of swapping's latency" in \
            " ".join(out.split())
        assert f"over {solution.EVICT_SEEDS} seeds" in out
        header = next(line for line in out.splitlines() if "copies  prefill/s" in line)
        assert header.split()[3:] == [str(size) for size in solution.EVICT_SIZES]

    @pytest.mark.parametrize("gpu, requests, message", [
        (BlockAllocator(1, 4), [Request(0, [1, 2], 2, 0)], "request 0 can never run"),
        (BlockAllocator(200, 1), [Request(0, list(range(199)), 1, 0)], "request 0 can never run"),
        (BlockAllocator(2, 2), [Request(0, [1], 3, 0), Request(1, [], 1, 1)],
         "request 0 can never run"),
        (BlockAllocator(8, 2), [Request(0, [1], -1, 0)], "max_tokens must be an int >= 0"),
        (BlockAllocator(8, 2), [Request(0, [1], 1.5, 0)], "max_tokens must be an int >= 0"),
        (BlockAllocator(8, 2), [Request(0, [1], 1, 0), Request(0, [2], 1, 0)], "duplicate req_id"),
        (BlockAllocator(8, 2), [Request(0, [1, -4], 1, 0)], "request 0: token ids")])
    def test_the_scheduler_refuses_what_can_never_run_before_changing_anything(self, gpu, requests,
                                                                               message):
        host = BlockAllocator(4, gpu.block_size)
        run = Scheduler(gpu, host, "recompute")
        refused(lambda: run.run(requests, max_steps=1000), ValueError, gpu, [], match=message)
        assert run.finished == {} and run.running == {} and host.num_used == 0

    @pytest.mark.parametrize("requests, message", [
        ([Request(0, [1], 1, 0), Request("b", [2], 1, 0)], "request 'b': req_id must be an int"),
        ([Request(0, None, 1, 0)], "request 0: prompt must be a list, tuple or range .* NoneType"),
        ([Request(0, (t for t in [1, 2]), 1, 0)], "request 0: prompt must be a list, .* generator"),
        ([Request(0, [1, "2"], 1, 0)], "request 0: token ids are ints")])
    def test_a_request_of_the_wrong_type_is_refused_before_anything_runs(self, requests,
                                                                          message):
        # a str req_id used to crash in next_token mid-run, after admissions had taken blocks
        run = scheduler(8, 4)
        refused(lambda: run.run(requests), TypeError, run.gpu, [], match=message)
        assert run.finished == {} and run.running == {} and run.host.num_used == 0

    def test_requests_may_come_from_a_generator(self):
        # run reads the requests twice (checks, then the queue); a generator used to be
        # empty the second time, and the run returned {} as if nothing had been asked
        requests = [Request(i, [i, i], 3, i) for i in range(3)]
        finished = scheduler(8, 4).run(request for request in requests)
        assert finished == {r.req_id: expected_tokens(r) for r in requests}
        assert expected_tokens(Request(0, (5, 6), 1, 0))[:2] == [5, 6]  # a tuple prompt too

    def test_swap_needs_a_host_pool_of_the_same_block_size(self):
        with pytest.raises(ValueError, match="needs a host pool"):
            scheduler(8, None, policy="swap")
        with pytest.raises(ValueError, match="block size 2"):
            Scheduler(BlockAllocator(8, 2), BlockAllocator(8, 4), "swap")

    def test_max_tokens_zero_finishes_with_its_prompt(self):
        run = scheduler(8, 4)
        assert run.run([Request(0, [5, 6, 7], 0, 0), Request(1, [], 0, 3)], max_steps=100) == {
            0: [5, 6, 7], 1: []}
        assert run.gpu.num_free == run.gpu.num_blocks

    def test_idle_steps_are_skipped_to_the_next_arrival(self):
        run = scheduler(8, 4)
        finished = run.run([Request(0, [1], 2, 10**6)], max_steps=10**6 + 10)
        assert finished == {0: expected_tokens(Request(0, [1], 2, 10**6))}
        assert run.stats.steps == 10**6 + 2

    @pytest.mark.parametrize("max_steps, exception", [(0, ValueError), (-1, ValueError),
                                                      (1.5, TypeError)])
    def test_a_meaningless_max_steps_is_refused_before_any_step(self, max_steps, exception):
        run = scheduler(8, 4)
        refused(lambda: run.run([Request(0, [1], 2, 0)], max_steps=max_steps), exception,
                run.gpu, [], match="max_steps must be an int >= 1")
        assert run.finished == {} and run.running == {}

    def test_a_stalled_scheduler_raises_instead_of_looping(self, monkeypatch):
        run = scheduler(8, 4)
        monkeypatch.setattr(Scheduler, "_fits", lambda self, num_blocks: False)  # admits nothing
        with pytest.raises(RuntimeError, match="no request can resume, be admitted or decode"):
            run.run([Request(0, [1], 2, 0)], max_steps=1000)


class TestSamplingAndBeams:
    """Part 8: parallel sampling and beam search."""

    @pytest.mark.parametrize("seed", [0, 1])
    def test_beam_verdicts_agree_with_the_ranges_they_print(self, capsys, seed):
        main(["beam", "--seed", str(seed)])
        rows = [line.split() for line in capsys.readouterr().out.splitlines()
                if line.startswith(("   Alpaca ", "   ShareGPT "))]
        assert len(rows) == 4
        for row in rows:
            spans = [cell for cell in row if cell.endswith("%")]
            *ours, paper = [tuple(float(x) for x in span.rstrip("%").split("-"))
                            for span in spans]
            low, high = min(lo for lo, _ in ours), max(hi for _, hi in ours)
            expected = ("inside" if paper[0] <= low and high <= paper[1] else "above"
                        if low > paper[1] else "below" if high < paper[0] else "overlaps")
            assert row[-3].rstrip(",") == expected

    def test_parallel_sampling_off_a_block_boundary_copies_once_per_writer_but_the_last(self):
        forked = parallel_sampling(6, 3, 4, block_size=4)     # prompt: 1 full block + 2 tokens
        alone = parallel_sampling(6, 3, 4, share=False, block_size=4)
        assert forked.copies == 2 and alone.copies == 0
        assert forked.used[0] == 2 and forked.used[-1] == 1 + 3 + 3  # shared, 3 tails, 3 new
        assert alone.used[0] == 6 and alone.used[-1] == 9
        assert forked.entries == alone.used    # table entries = what copies would hold
        assert 0 < saving([forked]) == 1 - sum(forked.used) / sum(alone.used)

    def test_parallel_sampling_on_a_block_boundary_copies_nothing(self):
        forked = parallel_sampling(8, 3, 4, block_size=4)     # prompt: exactly 2 blocks
        assert forked.copies == 0 and forked.used == [2, 5, 5, 5, 5] and forked.peak == 5

    @pytest.mark.parametrize("block_size", [1, 3, 16])
    @pytest.mark.parametrize("width", [1, 3, 5])
    def test_beam_search_beams_read_back_their_histories_and_the_pool_ends_whole(
            self, block_size, width):
        # check=True compares every beam with its plain-list history and checks every
        # invariant after every step (so pruned beams must have returned their blocks);
        # beam_search itself checks the pool is whole after the last free.
        run = beam_search(7, width, 40, block_size=block_size, check=True)
        alone = beam_search(7, width, 40, share=False, block_size=block_size, check=True)
        assert len(run.used) == len(alone.used) == 41 and alone.copies == 0
        assert run.entries == alone.used == alone.entries  # the baseline measured in one run
        assert all(f <= a for f, a in zip(run.used, alone.used))
        if width > 1:
            assert run.mean < alone.mean

    def test_beam_search_picture_shows_shared_blocks_with_their_ref_counts(self):
        picture = beam_search(10, 4, 8, block_size=4, picture_step=6).picture
        assert len(picture) == 4
        assert all("[  0:4]" in line for line in picture)  # the prompt's first block, 4 beams

    def test_degenerate_arguments_name_the_argument(self):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            parallel_sampling(10, 0, 5)
        with pytest.raises(ValueError, match="width must be an int >= 1"):
            beam_search(10, 0, 5)
        with pytest.raises(TypeError, match="output_len must be an int"):
            beam_search(10, 2, 5.0)


class TestSweep:
    """Part 9: the block-size sweep."""

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_sweep_verdicts_agree_with_the_sweet_spots_they_print(self, capsys, seed):
        main(["sweep", "--seed", str(seed)])
        out = capsys.readouterr().out
        for name, low, high in (("ShareGPT-like", 16, 128), ("Alpaca-like", 16, 32)):
            line = next(l for l in out.splitlines() if l.startswith(f"   ours, {name}"))
            spots = line.split("sweet spots ")[1].split(";")[0].split(", ")
            inside = sum(s != "None" and low <= int(s) <= high for s in spots)
            assert f"{inside} of {len(spots)} inside {low}-{high}" in line

    def test_an_empty_workload_is_named_not_measured(self):
        with pytest.raises(ValueError, match="workload 'test' has no requests"):
            measure_block_size(workload([], 64), 4)

    def test_the_chart_draws_a_single_block_size_that_wastes_nothing(self, capsys):
        solution.print_sweep_chart([solution.SweepRow(1, 0.0, 10.0, 400, 5)])
        assert "0 to 0%" in capsys.readouterr().out

    @pytest.mark.parametrize("block_size", [1, 2, 4, 8])
    def test_fragmentation_is_zero_when_every_length_is_a_multiple_of_the_block_size(
            self, block_size):
        row = measure_block_size(workload([(8, 8), (16, 0), (3, 5), (24, 16)], 64), block_size)
        assert row.fragmentation == 0

    def test_fragmentation_block_tables_and_fit_on_a_hand_computed_case(self):
        # block size 4: 5 tokens -> 2 blocks (3 slots unused), 4 tokens -> 1 block,
        # 9 tokens -> 3 blocks (3 unused): 6 blocks, 24 slots, 18 tokens.
        row = measure_block_size(workload([(3, 2), (4, 0), (7, 2)], 12), 4)
        assert row.fragmentation == 6 / 24
        assert row.entries_per_seq == (2 + 1 + 3) / 3 and row.table_bytes == 6 * 4
        assert row.fit == 2                       # 12 slots = 3 blocks: the first two requests
        assert row.block_size == 4

    def test_block_table_entries_are_the_ceiling_of_length_over_size(self):
        for block_size in (1, 3, 16, 256):
            row = measure_block_size(workload([(100, 0), (17, 0), (1, 0)], 256), block_size)
            expected = sum(-(-n // block_size) for n in (100, 17, 1))
            assert row.entries_per_seq * 3 == expected and row.table_bytes == 4 * expected

    def test_prefix_reuse_lost_counts_the_partial_block_of_the_system_prompt(self):
        # Only whole blocks of the prompt are cached: the tokens past the last full one are lost.
        for size in (1, 2, 16, 256):
            lost = SWEEP_SYSTEM_LEN % size
            assert prefix_reuse_lost(size) == pytest.approx(lost / SWEEP_SYSTEM_LEN)
        assert prefix_reuse_lost(16) > 0                  # the prompt's length is not a multiple

    def test_sweet_spot_grows_the_block_until_fragmentation_reaches_the_budget(self):
        rows = [SweepRow(size, frag, 0, 0, 0) for size, frag in
                [(1, 0.0), (8, 0.01), (16, 0.04), (32, 0.06), (64, 0.03), (128, 0.2)]]
        assert sweet_spot(rows) == 16             # stops at 32, though 64 dips under again
        assert sweet_spot(rows, max_fragmentation=0.035) == 8
        assert sweet_spot(rows, max_fragmentation=0.0) is None

    def test_admit_and_generate_takes_a_whole_request_or_changes_nothing(self):
        pool = BlockAllocator(3, 4)
        seq = admit_and_generate("a", pool, [1, 2, 3], [4, 5])  # 5 tokens: 2 blocks
        assert seq.read() == [1, 2, 3, 4, 5] and pool.num_used == 2
        refused(lambda: admit_and_generate("b", pool, [6], [7, 8, 9, 10]), OutOfBlocksError,
                pool, [seq])

    def test_drawn_lengths_have_the_mean_they_name_and_stay_in_range(self):
        rng = random.Random(0)
        lengths = [draw_length(rng, 338, 2048) for _ in range(20_000)]
        assert 1 <= min(lengths) and max(lengths) <= 2048
        assert abs(sum(lengths) / len(lengths) - 338) < 10  # the exponential's mean, sampled
        assert max(draw_length(rng, 338, 100) for _ in range(100)) == 100  # capped

    def test_samples_end_at_their_own_lengths_and_free_their_blocks(self):
        run = parallel_sampling(8, 3, [1, 4, 2], block_size=4)  # prompt: 2 full blocks
        # steps: after 1, sample 0 is done and freed; after 2, sample 2; after 4, sample 1.
        assert run.used == [2, 5, 4, 3, 3] and run.entries == [6, 9, 6, 3, 3]
        with pytest.raises(ValueError, match="2 lengths for n=3"):
            parallel_sampling(8, 3, [1, 4], block_size=4)

    def test_a_dataset_with_a_mean_length_of_zero_is_named(self):
        with pytest.raises(ValueError, match="a mean length must be > 0, got 0"):
            solution.sharing_trace(("mine", 0, 50), "parallel", 2, seed=1)  # ZeroDivisionError

    def test_a_picture_step_or_kind_that_names_nothing_is_refused(self):
        for step, exception in ((8, ValueError), (-1, ValueError), ("6", TypeError)):
            with pytest.raises(exception, match="picture_step"):
                beam_search(10, 4, 8, block_size=4, picture_step=step)
        assert len(beam_search(10, 4, 8, block_size=4, picture_step=7).picture) == 4
        with pytest.raises(ValueError, match="kind must be 'parallel' or 'beam'"):
            solution.sharing_trace(solution.ALPACA, "beams", 2, 0)

    def test_nothing_to_share_saves_nothing_instead_of_dividing_by_zero(self):
        run = parallel_sampling(0, 4, 0)  # no prompt, no output: no block is ever needed
        assert run.used == run.entries == [0] and saving([run]) == saving([]) == 0.0
        with pytest.raises(ValueError, match="no block is in use"):
            solution.written_share(BlockAllocator(4))

    def test_a_sample_with_nothing_to_decode_is_freed_not_leaked(self):
        assert parallel_sampling(8, 3, 0, block_size=4).used == [2]  # then all freed
        run = parallel_sampling(8, 2, [0, 3], block_size=4)  # sample 0 ends with its prompt
        assert run.used == [2, 3, 3, 3] and run.entries == [4, 3, 3, 3]

    def test_sweep_workloads_are_seeded_and_overflow_their_budget(self):
        first, again = sweep_workloads(), sweep_workloads()
        assert [w.requests for w in first] == [w.requests for w in again]
        for w in first:
            assert sum(len(p) + len(o) for p, o in w.requests) > w.kv_slots
        assert [len(w.requests) for w in sweep_workloads(num_requests=3)] == [3, 3]
        with pytest.raises(ValueError, match="num_requests must be an int >= 1, got 0"):
            sweep_workloads(num_requests=0)  # not "the default": None is


class TestBench:
    """Part 10: the benchmark section."""

    @pytest.mark.parametrize("full", [0.0, 0.5, 0.9, 0.99])
    def test_bench_runs_end_to_end_at_tiny_sizes_and_prints_every_line(self, capsys,
                                                                       monkeypatch, full):
        monkeypatch.setattr(solution, "BENCH_FULL", full)
        demo_bench(pools=(100, 200), repeats=1)
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("== bench") and len(lines) == 17 + 2  # a row per pool in 3.
        for label in ("append, per token", "allocate + free", "fork + free", "cache admission, hit",
                      "cache admission, miss", "Sequence.append", "scan / free list", "idle pool"):
            assert any(label in line for line in lines), label
        assert sum(line.endswith("x") for line in lines) == 6 + 2  # the ratios of 1. and 3.
        assert any(line.endswith("x (target <= 5x)") for line in lines)
        assert any("x plain append (target <= 2x" in line for line in lines)
        assert any("largest/smallest <= 1.3x" in line for line in lines)
        assert any(f"at a pool {full:.0%} full" in line for line in lines)
        assert any(line.endswith(f"boundary), {platform.python_implementation()} "
                                 f"{platform.python_version()}:") for line in lines)
        assert max(len(line) for line in lines) <= 100

    def test_the_scanning_allocator_finds_the_first_free_block(self):
        pool = ScanningAllocator(5, num_used=3)
        assert pool.allocate() == 3 and pool.allocate() == 4
        pool.free(3)
        assert pool.allocate() == 3


class TestTrace:
    """Part 11: a real trace through the prefix cache."""

    def test_lru_and_fifo_differ_on_a_hand_built_trace(self):
        # Pool of 3 blocks, 2 per request (one id + one decode block). At [C] one cached block
        # must go: LRU evicts B (freed longest ago), FIFO evicts A (cached longest ago), so the
        # second [A] hits under LRU only. Hits: LRU 2, FIFO 1; the optimum also evicts B.
        requests = trace([0], [1], [0], [2], [0])
        hits = {policy: replay_trace(requests, 3, policy, block_size=2).hits
                for policy in ("lru", "fifo", "optimal")}
        assert hits == {"lru": 2, "fifo": 1, "optimal": 2}

    def test_a_fifo_pool_snapshots_without_deprecated_pickling(self):
        # FIFO's clock was an itertools.count: pickling one warns from Python 3.12 and fails
        # from 3.14, and every refused-call check snapshots the pool (this fails on 3.12+)
        pool = PrefixCachingAllocator(4, 2, "fifo")
        Sequence("a", pool, [1, 2]).free()
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert pickle.loads(snapshot(pool, []))[0]["evictable"].clock == 1

    @pytest.mark.parametrize("policy", [FIFO, solution.OptimalPolicy])
    def test_a_heap_policy_stays_within_twice_the_evictable_blocks(self, policy):
        # Each hit leaves the block's heap entry behind (lazy deletion); with no eviction to
        # pop them, the heap grew with the number of hits, not with the pool.
        pool = PrefixCachingAllocator(8, 2, policy())
        for _ in range(1000):
            Sequence("s", pool, [1, 2, 3, 4]).free()
        assert pool.hits == 2 * 999 and len(pool.evictable) == 2
        assert len(pool.evictable.heap) <= 2 * len(pool.evictable)
        taken = pool.allocate_many(8)  # every block: both cached ones evicted at the end
        assert pool.evictions == 2 and sorted(taken[-2:]) == [0, 1]

    def test_the_optimum_beats_lru_and_fifo_when_both_evict_the_block_needed_next(self):
        # At [C] both LRU and FIFO evict A; the optimum evicts B (never used again) and hits A.
        requests = trace([0], [1], [2], [0])
        hits = {policy: replay_trace(requests, 3, policy, block_size=2).hits
                for policy in ("lru", "fifo", "optimal")}
        assert hits == {"lru": 0, "fifo": 0, "optimal": 1}

    def test_with_room_for_everything_every_policy_reaches_the_ceiling(self):
        requests = trace([0, 1], [0, 1, 2], [3], [0, 1, 2, 4], [3, 5])
        ceiling, total = trace_ceiling(requests)
        assert (ceiling, total) == (2 + 3 + 1, 2 + 3 + 1 + 4 + 2)
        for policy in ("lru", "fifo", "optimal"):
            pool = replay_trace(requests, 100, policy, block_size=2)
            assert (pool.hits, pool.hits + pool.misses, pool.evictions) == (ceiling, total, 0)

    def test_trace_prompt_worked_example_and_scale(self):
        request = TraceRequest(0, 1100, 512, [7, 9, 3])  # 2 full ids and 76 tokens
        assert trace_prompt(request, 4) == [28, 29, 30, 31, 36, 37, 38, 39, 12]
        assert len(trace_prompt(request, 16)) == 2 * 16 + 2  # 76 * 16 // 512 = 2, never full
        assert len(trace_prompt(request, 1)) == 2                # block size 1: no partial token

    def test_policies_are_named_or_objects_and_optimal_needs_a_replay(self):
        assert isinstance(PrefixCachingAllocator(4, 2, "fifo").evictable, FIFO)
        assert PrefixCachingAllocator(4, 2, LRU()).num_cached == 0
        with pytest.raises(ValueError, match="needs the future"):
            PrefixCachingAllocator(4, 2, "optimal")
        with pytest.raises(ValueError, match="policy must be one of"):
            PrefixCachingAllocator(4, 2, "random")
        used = LRU()
        used.add(3)  # a policy already ordering another pool's blocks would evict them here
        for policy in (None, 3, used):
            with pytest.raises(TypeError, match="must be a new, empty LRU"):
                PrefixCachingAllocator(4, 2, policy)
        with pytest.raises(ValueError, match="cannot hold the trace's longest request"):
            replay_trace(trace([0, 1, 2]), 2, block_size=2)

    @pytest.mark.parametrize("line, message", [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 5}', "needs the fields"),
        ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}',
         "input_length must be an int >= 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": -2, "hash_ids": [1]}',
         "output_length must be an int >= 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}',
         "hash_ids must be a list of ints >= 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "1"}',
         "hash_ids must be a list"),
        ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
         "2 hash_ids for input_length 1025 (one per 512 tokens: 3)"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp must be a finite number >= 0, got nan"),
        ('{"timestamp": Infinity, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp must be a finite number >= 0, got inf")])
    def test_a_malformed_trace_line_is_named(self, tmp_path, capsys, line, message):
        path = tmp_path / "t.jsonl"
        path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, '
                        '"hash_ids": [0]}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"t.jsonl:2: .*{re.escape(message)}"):
            load_trace(str(path))
        with pytest.raises(SystemExit) as stop:
            main(["trace", str(path)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and err.count("\n") == 1

    def test_a_file_that_is_not_text_is_named(self, tmp_path, capsys):
        path = tmp_path / "t.bin"
        path.write_bytes(b'{"timestamp": 0, "input_length": 512, "output_length": 1, '
                         b'"hash_ids": [0]}\n\xd0\x00\xff\n')
        with pytest.raises(ValueError, match="t.bin: not UTF-8 text"):
            load_trace(str(path))
        with pytest.raises(SystemExit) as stop:
            main(["trace", str(path)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "t.bin: not UTF-8 text" in err and err.count("\n") == 1

    def test_a_trace_with_no_full_hash_id_is_refused_and_empty_prompts_replay(self, tmp_path,
                                                                               capsys):
        path = tmp_path / "t.jsonl"
        path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}'
                        '\n{"timestamp": 1, "input_length": 10, "output_length": 3, '
                        '"hash_ids": [4]}\n')
        with pytest.raises(SystemExit) as stop:
            main(["trace", str(path)])
        assert stop.value.code == 2
        assert "no prompt fills a 512-token hash id" in capsys.readouterr().err
        requests = load_trace(str(path))
        assert trace_prompt(requests[0], 4) == [] and trace_prompt(requests[1], 4) == [16]
        assert replay_trace(requests, 4, block_size=4).hits == 0  # an empty prompt replays

    @pytest.mark.parametrize("sizes", [2, 8])
    def test_a_trace_replays_end_to_end_within_100_columns(self, tmp_path, capsys, monkeypatch,
                                                          sizes):
        # 20 conversations of 10 turns, round robin: turn t repeats the t earlier ids
        monkeypatch.setattr(solution, "TRACE_SIZES", sizes)  # 9 made the chart 109 wide
        path = tmp_path / "chat.jsonl"
        path.write_text("".join(
            f'{{"timestamp": {t * 20 + c}, "input_length": {512 * (t + 1)}, '
            f'"output_length": 40, "hash_ids": {list(range(c * 100, c * 100 + t + 1))}}}\n'
            for t in range(10) for c in range(20)))
        main(["trace", str(path)])
        out = capsys.readouterr().out
        assert "== trace: 200 requests of chat.jsonl" in out and ": equal;" in out
        assert max(len(line) for line in out.splitlines()) <= 100
        chart_axis = next(line for line in out.splitlines() if line.startswith("   blocks "))
        assert len(chart_axis.split()) - 1 >= sizes  # every pool size has its column

    def test_trace_without_a_path_or_file_says_where_to_get_one(self, capsys):
        for argv in (["trace"], ["trace", "/no/such/file.jsonl"]):
            with pytest.raises(SystemExit) as stop:
                main(argv)
            assert stop.value.code == 2
        assert "No such file" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["trace"])
        assert "kvcache-ai/Mooncake" in capsys.readouterr().err

    @pytest.mark.skipif(not (TRACES / "conversation_trace.jsonl").exists(),
                        reason="../shared/traces/ is not here")
    def test_on_the_conversation_trace_the_optimum_bounds_lru_and_fifo(self):
        requests = load_trace(str(TRACES / "conversation_trace.jsonl"), limit=300)
        assert len(requests) == 300
        ceiling, _ = trace_ceiling(requests)
        for num_blocks in (250, 500, 1000, 2000, 4000):
            hits = {policy: replay_trace(requests, num_blocks, policy).hits
                    for policy in ("lru", "fifo", "optimal")}
            assert hits["optimal"] >= max(hits["lru"], hits["fifo"])
            assert hits["optimal"] <= ceiling
        assert never_evicts(requests, BLOCK_SIZE).hits == ceiling


class TestCommandLine:
    """The command line: sections, options, knobs."""

    @pytest.mark.parametrize("section", list(solution.SECTIONS.values()) + [demo_bench])
    @pytest.mark.parametrize("block_size, seed, exception, message", [
        (0, None, ValueError, "block_size must be an int >= 1"),
        (257, None, ValueError, "block_size must be <= 256"),
        ("16", None, TypeError, "block_size must be an int"),
        (16, -1, ValueError, "seed must be an int >= 0")])
    def test_every_section_names_a_bad_argument_before_printing(self, capsys, section,
                                                               block_size, seed, exception,
                                                               message):
        with pytest.raises(exception, match=message):
            section(block_size=block_size, seed=seed)
        assert capsys.readouterr().out == ""

    def test_sections_run_alone_and_unknown_ones_are_refused(self, capsys):
        main(["checks"])
        out = capsys.readouterr().out
        assert "correctness checks" in out and "memory efficiency" not in out
        assert out.count(" ok\n") == len(CHECKS)
        with pytest.raises(SystemExit):
            main(["nonsense"])

    def test_help_lists_every_section(self, capsys):
        with pytest.raises(SystemExit):
            main(["--help"])
        out = capsys.readouterr().out
        listed = " ".join(out.split()).split("any of: ")[1].split(" (default")[0]
        assert listed.split(", ") == ["checks", "pitfalls", "memory", "sharing", "cache", "evict",
                                      "beam", "sweep", "bench", "trace PATH"]
        assert "--block-size N" in out and "--seed N" in out and "--requests N" in out

    @pytest.mark.parametrize("block_size, seed", [(1, 0), (3, 1), (8, 2), (32, 3), (256, 4)])
    def test_every_default_section_runs_at_odd_block_sizes_and_seeds(
            self, capsys, block_size, seed):
        main(["--block-size", str(block_size), "--seed", str(seed)])
        out = capsys.readouterr().out
        assert all(f"== {title}" in out for title in ("correctness", "memory", "prefix sharing",
                                                       "cache", "evict", "beam", "sweep"))
        assert max(len(line) for line in out.splitlines()) <= 100

    @pytest.mark.parametrize("argv, message", [
        (["--block-size", "0"], "--block-size: must be an int in 1..256, got 0"),
        (["--block-size", "-3"], "--block-size: must be an int in 1..256, got -3"),
        (["--block-size", "x"], "--block-size: must be an int in 1..256, got 'x'"),
        (["--block-size", "257"], "got 257"),
        (["--seed", "-1"], "--seed: must be an int >= 0, got -1"),
        (["nonsense"], "unknown section 'nonsense'"),
        ([""], "unknown section ''; choose from"),
        (["memory", "--requests", "3"], "--requests applies to trace PATH only"),
        (["trace", "a.jsonl", "trace", "b.jsonl"], "trace PATH can be given once per run")])
    def test_bad_options_exit_2_with_one_line(self, capsys, argv, message):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and err.count("\n") == 1

    @pytest.mark.parametrize("unbuffered", ["", "1"])
    def test_a_reader_that_stops_early_gets_no_traceback(self, unbuffered):
        # python solution.py | head: the pipe closes before the output is written
        env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
        run = subprocess.Popen([sys.executable, "solution.py", "checks"], cwd=HERE, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        run.stdout.close()
        err = run.stderr.read()
        assert run.wait() == 1 and err == b""

    def test_the_host_pool_knob_changes_the_swap_run_it_labels(self, capsys, monkeypatch):
        monkeypatch.setattr(solution, "HOST_KV_TOKENS", 1024)
        main(["evict"])
        out = capsys.readouterr().out
        stats = run_policy("swap", BLOCK_SIZE, preemption_workload(5), host_tokens=1024)
        swap_row = next(line for line in out.splitlines() if line.startswith("   swap "))
        assert "a 1024-token host pool" in out  # the label and the run agree:
        assert swap_row.split()[3:5] == [f"{stats.swapped_out_blocks}/{stats.swapped_in_blocks}",
                                         str(stats.host_fallbacks)]

    @pytest.mark.parametrize("knob, value, section, expected", [
        ("CHAT_TURNS", 2, "cache", "24 chat requests (12 conversations x 2 turns"),
        ("EVICT_SIZES", (4, 16), "evict", "copies  prefill/s  us/copy      4    16"),
        ("NUM_LAYERS", 20, "evict", "400 KiB of KV per token"),
        ("NUM_LAYERS", 20, "evict", "swap ms, 40 copies/block"),
        ("MAX_FRAGMENTATION", 0.1, "sweep",
         "sweet spot: 16 (grow the block until fragmentation would reach 10%)"),
        ("BENCH_POOLS", (100, 200), "bench", "pools of 100, 200 blocks (best of 15)")])
    def test_a_knob_changed_at_run_time_takes_effect(self, capsys, monkeypatch, knob, value,
                                                      section, expected):
        # these knobs were default arguments, bound at import: the check and the printed
        # label saw the new value while the run kept the old one
        monkeypatch.setattr(solution, knob, value)
        if section == "bench":
            monkeypatch.setattr(solution, "BENCH_REPEATS", 15)
            monkeypatch.setattr(solution, "interleaved_ns_per_op",
                                lambda benches, repeats: [1.0] * len(benches))  # no timing
        main([section])
        assert expected in capsys.readouterr().out

    @pytest.mark.parametrize("knob, value, message", [
        ("MAX_LEN", 512, "MAX_LEN must be >= ACTUAL_LEN"),
        ("ACTUAL_LEN", 0, "ACTUAL_LEN must be >= 1"),
        ("HOST_KV_TOKENS", 0, "HOST_KV_TOKENS must hold one block"),
        ("POOL_TOKENS", 1024, "POOL_TOKENS must hold one MAX_LEN request"),
        ("GPU_KV_TOKENS", 256, "GPU_KV_TOKENS must hold"),
        ("BEAM_WIDTHS", (), "BEAM_WIDTHS must be"),
        ("MAX_FRAGMENTATION", 0, "MAX_FRAGMENTATION must be in (0, 1)"),
        ("HOST_KV_TOKENS", 200, "HOST_KV_TOKENS must hold one block at block size 256"),
        ("GPU_KV_TOKENS", 600, "GPU_KV_TOKENS must hold a 450-token request and the "
                               "1-block admission margin at block size 128"),
        ("SWEEP_REQUESTS", 0, "SWEEP_SEEDS and SWEEP_REQUESTS must be >= 1"),
        ("BENCH_POOLS", (10, 100), "BENCH_POOLS must be ints >= 100"),
        ("BENCH_FULL", 1.0, "BENCH_FULL must be in 0..0.99"),
        ("CHAT_TURNS", 0, "CHAT_TURNS >= 1"),
        ("CHAT_ANSWER_LEN", -5, "CHAT_ANSWER_LEN must be >= 0"),
        ("COMPARABLE", 0.5, "COMPARABLE must be >= 1"),
        ("EVICT_SIZES", (0, 16), "EVICT_SIZES ints in 1..256"),
        ("BLOCK_SIZE", 0, "BLOCK_SIZE must be an int in 1..256, got 0"),
        ("TRACE_SIZES", 1, "TRACE_SIZES must be an int in 2..8"),
        ("TRACE_SIZES", 9, "TRACE_SIZES must be an int in 2..8"),
        ("KNEE", 0, "KNEE must be in (0, 1]"), ("KNEE", 1.5, "KNEE must be in (0, 1]")])
    def test_a_knob_that_cannot_work_is_named_before_anything_runs(self, capsys, monkeypatch, knob,
                                                                    value, message):
        monkeypatch.setattr(solution, knob, value)
        with pytest.raises(SystemExit) as stop:
            main(["memory"])
        out, err = capsys.readouterr()
        assert stop.value.code == 2 and message in err and out == ""
