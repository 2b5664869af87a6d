"""
The paged KV-cache lab
======================

A transformer keeps, for every token it has seen, that token's key and value vectors: the
KV cache. Serving many requests at once is mostly a question of where those vectors live.
Systems before vLLM reserved one contiguous region per request, sized for the longest
answer it might give, and wasted most of it. PagedAttention (Kwon et al., SOSP 2023)
borrowed the operating system's answer: cut the cache into fixed-size *blocks*, give each
request a *block table* from its logical positions to physical blocks, allocate a block only
when the previous one is full, and let requests that share a prefix point at the same
physical blocks, copying one only when somebody writes into it (copy-on-write).

This file is that memory manager, without the attention math: the "KV" a block stores is
the token ids themselves, so every test can read a sequence back through its block table
and compare it with a plain Python list. Read it top to bottom; each part builds on the
ones above it and ends with a demo that prints what it measured.

    Part 1  the block pool ........... KVCache (slots), BlockAllocator (free list, ref-counts)
    Part 2  block tables, sequences .. BlockTable, Sequence: grow a block at the boundary
    Part 3  sharing .................. share_prefix, fork, copy-on-write
    Part 4  checks ................... check_invariants, a randomized oracle test, pitfalls
    Part 5  demos .................... memory efficiency, prefix sharing, a block map
    Part 6  prefix caching ........... hash-chained blocks, eviction policies
    Part 7  preemption ............... recompute vs swap, a cost model, the paper's 7.3
    Part 8  parallel sampling, beams . fork and prune; the paper's 6.3
    Part 9  block-size sweep ......... fragmentation against block-table size; the paper's 7.2
    Part 10 benchmark ................ O(1) per operation, measured
    Part 11 a real trace ............. LRU and FIFO against the offline optimum

Run it (README.md has the lab: steps, questions, bugs to commit):
    python solution.py                  # every section, in reading order (about a second)
    python solution.py cache beam       # only these sections; --help lists them
    python solution.py --block-size 8   # any block size 1..256 (and --seed N), any section
    python solution.py bench            # timings (not part of the default run)
    python solution.py trace PATH       # replay a Mooncake trace (not part of the default run)
    python -m pytest test_solution.py   # the tests; test_solution.py::TestBlockPool for Part 1

Where the ideas come from:
    paper:  Kwon et al., "Efficient Memory Management for Large Language Model Serving
            with PagedAttention", SOSP 2023 (arXiv 2309.06180), sections 4, 6.3, 7.2, 7.3
            Qin et al., "Mooncake", USENIX FAST 2025 (its traces: Part 11)
    vLLM:   vllm/v1/core/block_pool.py        (BlockPool: free queue, ref_cnt, cache map)
            vllm/v1/core/kv_cache_utils.py    (FreeKVCacheBlockQueue, hash_block_tokens)
            vllm/v1/core/kv_cache_manager.py  (get_computed_blocks, allocate_slots)
            vllm/v1/core/sched/scheduler.py   (preemption)
            vllm/core/block/ (v0: copy-on-write, cpu_gpu_block_allocator.py, evictor.py)
    SGLang: python/sglang/srt/mem_cache/radix_cache.py (RadixAttention)
    nano-vllm: nanovllm/engine/block_manager.py (the whole idea in ~120 lines)

Glossary (one word per idea; the code uses these and no others)
    pool            a BlockAllocator: a fixed number of physical blocks
    block           a fixed number of token slots (block_size, 16 here as in vLLM)
    slot            one token's place in the KV cache: offset o of block b is slot
                    b * block_size + o of one flat array
    slot mapping    the slot of each token being written (vLLM's slot_mapping)
    prefill, decode writing a prompt's tokens all at once (extend); then one per step (append)
    logical index   a block's position in its sequence: token i is in logical block i // 16
    physical block  a block id in the pool; the block table maps logical -> physical
    ref-count       how many block tables point at a physical block (vLLM: ref_cnt)
    share           take one more reference to a block (ref-count + 1); sequences share a
                    prefix by sharing its blocks
    copy-on-write   before writing into a block another reference can see, copy it
    block hash      a full block's identity: SHA-256 of its tokens and its parent's hash
    hit             a full prompt block whose block hash is cached, reused, not prefilled
    evictable       a cached block nobody references: free, but kept until memory is needed
    policy          which evictable block goes first (LRU, FIFO, or the offline optimum)
"""

import argparse
import contextlib
import gc
import hashlib
import heapq
import io
import itertools
import json
import math
import multiprocessing
import os
import pickle
import platform
import random
import statistics
import sys
import textwrap
import time
import tracemalloc
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

BLOCK_SIZE = 16  # tokens per block; vLLM's default on GPUs


# ---------------------------------------------------------------------------------------
# Part 1. The block pool
# ---------------------------------------------------------------------------------------

class OutOfBlocksError(MemoryError):
    """The pool cannot satisfy a request. Raised before anything changed."""


def cdiv(a, b):
    """Ceiling division: cdiv(20, 16) == 2 blocks hold 20 tokens at 16 per block."""
    return -(-a // b)


def check_int(value, name, low=1):
    """The one int check: value if it is an int >= low; TypeError or ValueError naming it."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int >= {low}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return value


class KVCache:
    """The memory the blocks stand for: a flat list of slots; offset o of block b is slot
    b * block_size + o (block_size 4: block 2, offset 1 -> slot 9). A slot holds a token id
    as its "KV", so reads can be checked. NOTE: vLLM allocates its KV tensor at start-up;
    this list grows by a block as the pool first hands each out. Like GPU memory, never cleared."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.slots = []  # slot -> token id, for every block handed out so far

    def write(self, slot_mapping, token_ids):
        """Store token_ids[i] in slot slot_mapping[i] (vLLM's reshape_and_cache kernel)."""
        room = range(len(self.slots))  # the slots of every block handed out so far
        if len(slot_mapping) != len(token_ids) or not all(
                type(slot) is int and slot in room for slot in slot_mapping):  # 1.0 in room too
            raise ValueError(f"{len(token_ids)} tokens for {len(slot_mapping)} slots of {room}")
        for slot, token in zip(slot_mapping, token_ids):
            self.slots[slot] = token

    def gather(self, slot_mapping):
        """The token in each slot of slot_mapping, None where none was written."""
        return [self.slots[slot] if slot < len(self.slots) else None for slot in slot_mapping]

    def block_slots(self, block):
        return range(block * self.block_size, (block + 1) * self.block_size)


class BlockAllocator:
    """A fixed pool of physical blocks: a free list and a ref-count per block in use.
    Invariant: a block is in use exactly when it has a ref-count (>= 1), free otherwise,
    so num_free + num_used == num_blocks. Every operation is O(1) per block.
    NOTE: vLLM queues every block up front; counting never-used ones makes a pool O(1)."""

    def __init__(self, num_blocks, block_size=BLOCK_SIZE):
        self.num_blocks = check_int(num_blocks, "num_blocks")
        self.block_size = check_int(block_size, "block_size")  # tokens per block
        self.kv_cache = KVCache(block_size)  # what the blocks hold
        self.ref_cnt = {}         # block -> references; only blocks in use have an entry
        self.free_block_ids = []  # blocks given back, reused last in, first out
        self.next_unused = 0      # blocks next_unused.. were never handed out
        self.num_copies = 0       # blocks copied (copy-on-write, Part 3)

    @property
    def num_used(self):
        return len(self.ref_cnt)

    @property
    def num_free(self):
        return self.num_blocks - self.num_used

    def ensure_free(self, n):
        """Raise OutOfBlocksError unless n blocks are free: the check of check-then-act."""
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} block(s), {self.num_free} of {self.num_blocks} free")

    def allocate(self):
        """A free block, now with ref-count 1: the last one given back, else a new one."""
        self.ensure_free(1)
        if len(self.free_block_ids) == 0:
            self.free_block_ids.append(self.next_unused)  # a block never handed out
            self.next_unused += 1
            self.kv_cache.slots += [None] * self.block_size  # its slots (None: unwritten)
        block = self.free_block_ids.pop()
        self.ref_cnt[block] = 1
        return block

    def allocate_many(self, n):
        """n blocks or none. New pool: allocate_many(3) -> [0, 1, 2]; then free(1), free(0),
        allocate_many(3) -> [0, 1, 3]."""
        self.ensure_free(check_int(n, "n", 0))
        return [self.allocate() for _ in range(n)]

    def share(self, block):
        """One more reference to a block in use; returns it."""
        self.ref_cnt[check_block(self, block)] += 1
        return block

    def free(self, block):
        """Drop one reference; the block becomes free only when none is left."""
        self.ref_cnt[check_block(self, block)] -= 1
        if self.ref_cnt[block] == 0:
            del self.ref_cnt[block]
            self.free_block_ids.append(block)

    def refcount(self, block):
        return self.ref_cnt.get(check_block(self, block, in_use=False), 0)

    def read(self, block):
        return self.kv_cache.gather(self.kv_cache.block_slots(check_block(self, block, False)))

    # Hooks for a prefix cache (Part 6): share_cached_prefix shares a prompt's cached blocks
    # (vLLM's get_computed_blocks), block_full caches a full one (cache_full_blocks),
    # share_tail un-caches one shared partly, audit_kept lists freed ones it keeps aside.
    def share_cached_prefix(self, token_ids):
        return []  # a plain pool remembers nothing

    def block_full(self, block, parent, token_ids):
        """block, after parent (None: a first block), now holds token_ids in full."""

    def share_tail(self, block):
        return self.share(block)

    def audit_kept(self):
        return []


def check_block(pool, block, in_use=True):
    """The one block check: block if it is a block id of pool, in use unless told otherwise."""
    if type(block) is not int or not 0 <= block < pool.num_blocks:
        raise ValueError(f"unknown block {block!r}: block ids are 0..{pool.num_blocks - 1}")
    if in_use and block not in pool.ref_cnt:
        raise ValueError(f"block {block} is free (double free, or never allocated)")
    return block


# ---------------------------------------------------------------------------------------
# Part 2. Block tables and sequences
# ---------------------------------------------------------------------------------------

class BlockTable(list):
    """A sequence's page table: entry i is the physical block holding logical block i.
    Example: block_size 16, tokens 0..19 in physical blocks [7, 2]: slot(17) == (2, 1),
    token 17 lives in block 2 at offset 1, KV slot 2 * 16 + 1 = 33."""

    def __init__(self, block_size, blocks=()):
        super().__init__(blocks)
        self.block_size = block_size

    def slot(self, i):
        """(physical block, offset) of token i."""
        if type(i) is not int or not 0 <= i < len(self) * self.block_size:
            raise IndexError(f"token {i!r} not in the {len(self) * self.block_size}-slot table")
        return self[i // self.block_size], i % self.block_size

    def slot_mapping(self, start, end):
        """The KV slot of each token start..end-1 (vLLM's slot_mapping). Example:
        block_size 4, table [3, 0, 5]: tokens 6..8 are in blocks 0 (slots 0..3) and 5
        (slots 20..23), so slot_mapping(6, 9) == [2, 3, 20]."""
        size = self.block_size
        first = check_int(start, "start", 0) // size
        if not start <= check_int(end, "end", 0) <= len(self) * size:
            raise IndexError(f"tokens {start}..{end - 1} not in the {len(self) * size}-slot table")
        slots = [slot for block in self[first:cdiv(end, size)]
                 for slot in range(block * size, (block + 1) * size)]
        return slots[start - first * size:end - first * size]


def check_tokens(tokens):
    """The one token check: tokens as a list if each is an int >= 0, else an error naming it."""
    if not isinstance(tokens, Iterable):
        raise TypeError(f"tokens must be an iterable of token ids, got {tokens!r}")
    token_ids = list(tokens)
    bad = [token for token in token_ids if type(token) is not int or token < 0]
    if len(bad) > 0:
        raise (ValueError if type(bad[0]) is int else TypeError)(
            f"token ids are ints >= 0, got {bad[0]!r} ({type(bad[0]).__name__})")
    return token_ids


class Sequence:
    """A request's tokens and the block table that says where each is stored. Invariant:
    len(block_table) == cdiv(len(tokens), block_size), token i is at block_table.slot(i);
    tokens go into the last block (in place only if nothing else references it), then new ones."""

    def __init__(self, seq_id, allocator, tokens=()):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        token_ids = check_tokens(tokens)
        self.seq_id, self.allocator, self.block_size = seq_id, allocator, allocator.block_size
        self.tokens = []  # logical tokens, in order
        self.block_table = BlockTable(self.block_size)
        self.is_freed = False
        if len(token_ids) > 0:
            self.block_table.extend(allocator.share_cached_prefix(token_ids))  # Part 6's hits
            self.tokens.extend(token_ids[:len(self.block_table) * self.block_size])
            self.extend(token_ids[len(self.tokens):])

    def __len__(self):
        return len(self.tokens)

    def append(self, token):
        """Add one token (a decode step): a new block exactly when the last one is full,
        a private copy of the last block if another reference to it exists. Example:
        block_size 4, tokens [5, 6, 7, 8] in table [3]: append(9) takes a free block, say
        0, so the table is [3, 0], and writes 9 at slot 0 * 4 + 0."""
        if self.is_freed or type(token) is not int or token < 0:
            self._check_live()
            check_tokens([token])
        pool, table, block_size = self.allocator, self.block_table, self.block_size
        offset = len(self.tokens) % block_size
        if offset == 0:
            block = pool.allocate()  # the last block is full: a new one
            table.append(block)
        else:
            block = table[-1]
            if pool.ref_cnt[block] > 1:
                block = self._copy_last_block()  # shared: copy-on-write (Part 3)
        pool.kv_cache.slots[block * block_size + offset] = token  # write the slot
        self.tokens.append(token)
        if offset == block_size - 1:
            pool.block_full(block, table[-2] if len(table) > 1 else None, self.tokens[-block_size:])

    def extend(self, tokens):
        """Add tokens, all or none, as a prefill does: make room (new blocks, a copy of a
        shared last block), write them all through the slot mapping, report full blocks."""
        self._check_live()
        token_ids = check_tokens(tokens)
        pool, table, size, n = self.allocator, self.block_table, self.block_size, len(self)
        copy = len(token_ids) > 0 and n % size > 0 and pool.ref_cnt[table[-1]] > 1
        num_new = cdiv(n + len(token_ids), size) - len(table)
        pool.ensure_free(num_new + int(copy))  # check, then act
        if copy:
            self._copy_last_block()
        table.extend(pool.allocate_many(num_new))
        pool.kv_cache.write(table.slot_mapping(n, n + len(token_ids)), token_ids)
        self.tokens.extend(token_ids)
        for k in range(n // size, len(self) // size):  # the blocks these tokens filled
            pool.block_full(table[k], table[k - 1] if k > 0 else None,
                            self.tokens[k * size:(k + 1) * size])

    def read(self):
        """The sequence's tokens, gathered from the KV cache through the block table."""
        self._check_live()
        return self.allocator.kv_cache.gather(self.block_table.slot_mapping(0, len(self)))

    def free(self):
        """Release every block, tail first (NOTE: as nano-vllm does, so a prefix cache
        evicts a suffix before its prefix, which others are likelier to share)."""
        self._check_live()
        for block in reversed(self.block_table):
            self.allocator.free(block)
        self.block_table.clear()
        self.is_freed = True

    def _copy_last_block(self):
        """Swap our reference to the shared last block for one to a private copy."""
        pool, shared = self.allocator, self.block_table[-1]
        self.block_table[-1] = pool.allocate()  # may raise: nothing changed yet
        pool.kv_cache.write(pool.kv_cache.block_slots(self.block_table[-1]), pool.read(shared))
        pool.num_copies += 1
        pool.free(shared)
        return self.block_table[-1]

    def _check_live(self):
        if self.is_freed:
            raise ValueError(f"sequence {self.seq_id!r} was freed; it holds no blocks")


# ---------------------------------------------------------------------------------------
# Part 3. Sharing a prefix, and copy-on-write
# ---------------------------------------------------------------------------------------
# Sharing costs one ref-count per block and copies nothing. Full blocks are never written
# again; a shared, partly full last block would be, by whichever sharer appends first, so
# append and extend copy a last block whose ref-count is above 1, however it came about
# (_copy_last_block): the only copy there is. NOTE: as in the paper and vLLM v0; v1 has no
# fork and never shares a partly full block (n samples share full blocks, Part 6's cache).

def share_prefix(src, seq_id, num_tokens=None):
    """A new sequence whose first num_tokens tokens (default: all) are src's, in src's blocks,
    a partly covered last one included. Example: src has 20 tokens in [a, b] (block_size 16);
    share_prefix(src, "x", 18) gives x the table [a, b], ref-counts 2; who writes b copies it."""
    if not isinstance(src, Sequence):
        raise TypeError(f"src must be a Sequence, got {type(src).__name__}")
    src._check_live()
    num_tokens = len(src) if num_tokens is None else check_int(num_tokens, "num_tokens", 0)
    if num_tokens > len(src):
        raise ValueError(f"num_tokens {num_tokens} is outside 0..{len(src)} (of {src.seq_id!r})")
    pool, seq = src.allocator, Sequence(seq_id, src.allocator)
    full, partial = divmod(num_tokens, src.block_size)
    seq.block_table.extend(pool.share(block) for block in src.block_table[:full])
    if partial > 0:  # a partly covered last block: its new holder may write the rest
        seq.block_table.append(pool.share_tail(src.block_table[full]))
    seq.tokens.extend(src.tokens[:num_tokens])
    return seq


Sequence.fork = share_prefix  # seq.fork("b") == share_prefix(seq, "b"): every block shared


# ---------------------------------------------------------------------------------------
# Part 4. Checks: invariants you can execute, and an oracle to run them against
# ---------------------------------------------------------------------------------------

def _expect(condition, message):
    """Raise AssertionError(message) unless condition holds (how every check fails)."""
    if not condition:
        raise AssertionError(message)


def plural(n, noun):
    """A count and its noun: plural(1, "block") == "1 block", plural(2, "block") == "2 blocks"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def audit(pool):
    """Raise AssertionError if the pool's free blocks and ref-counts disagree."""
    free = [*pool.free_block_ids, *range(pool.next_unused, pool.num_blocks), *pool.audit_kept()]
    _expect(len(set(free)) == len(free) == pool.num_free and pool.ref_cnt.keys().isdisjoint(
        free), "free list: a block is listed free twice, or while in use, or the free and "
        "used counts do not add up")
    _expect(all(refs >= 1 for refs in pool.ref_cnt.values()), "a block in use has "
            "ref-count < 1")


def check_invariants(allocator, sequences):
    """Raise AssertionError naming the first broken invariant.

    sequences must include every live sequence on allocator (freed ones may be passed too):
    otherwise the references of the missing ones look like leaks.
    """
    if not isinstance(allocator, BlockAllocator):
        raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
    audit(allocator)
    references = Counter()
    for seq in sequences:
        if not isinstance(seq, Sequence):
            raise TypeError(f"sequences must hold Sequence objects, got {seq!r}")
        _expect(seq.allocator is allocator, f"pool: sequence {seq.seq_id!r} belongs to "
                "another pool")
        if seq.is_freed:
            _expect(len(seq.block_table) == 0, f"freed sequence {seq.seq_id!r} still holds blocks")
            continue
        need = cdiv(len(seq.tokens), allocator.block_size)
        _expect(len(seq.block_table) == need,
                f"block count: sequence {seq.seq_id!r} holds "
                f"{plural(len(seq.block_table), 'block')} for {plural(len(seq.tokens), 'token')}"
                f", needs {need}")
        references.update(seq.block_table)
        _expect(seq.read() == seq.tokens,
                f"read-back: sequence {seq.seq_id!r} reads back tokens it was not given")
    for block, refs in references.items():
        _expect(allocator.refcount(block) == refs,
                f"ref-count != block-table references: block {block} has ref-count "
                f"{allocator.refcount(block)} but {refs} block-table references")
    _expect(allocator.num_used == len(references),
            f"ref-count != block-table references: {allocator.num_used} blocks in use, "
            f"{len(references)} referenced by a block table")


def snapshot(allocator, sequences):
    """Every field of the pool and the sequences, serialized: equal before and after a
    call that raised, or the call changed something."""
    return pickle.dumps([vars(allocator)] + [
        {name: value for name, value in vars(seq).items() if name != "allocator"}
        for seq in sequences])


def random_tokens(rng, n, vocab=32_000):
    """n token ids drawn from rng: every workload in this file is seeded."""
    return rng.choices(range(vocab), k=n)


def fuzz(allocator, rng, num_ops, max_live=6, vocab=4):
    """Run num_ops random operations against a plain-list model, checking every invariant
    after every step, then free everything and check the pool is whole.

    The model is a dict seq_id -> list of tokens. A refused operation (OutOfBlocksError)
    must leave a snapshot of the pool and every sequence unchanged. A small vocabulary and
    prompts cut from other sequences, live or freed, make shared and cached prefixes
    common. "raw share" takes a reference with pool.share, outside any sequence, appends,
    then drops it. Returns a Counter of what happened, so a test can tell the run
    exercised every operation.
    """
    if not isinstance(rng, random.Random):
        raise TypeError(f"rng must be a random.Random (seeded), got {type(rng).__name__}")
    check_int(num_ops, "num_ops", 0)
    check_int(max_live, "max_live")
    check_int(vocab, "vocab")
    live, model, seen, counts = {}, {}, [[]], Counter()
    longest = 2 * allocator.block_size + 2  # tokens per create or extend: crosses boundaries
    for step in range(num_ops):
        ids = sorted(live)
        op = rng.choice(["create", "append", "extend", "fork", "share", "raw share", "free"]
                        if len(ids) > 0 else ["create"])
        if op in ("create", "fork", "share") and len(ids) >= max_live:
            op = "free"
        target = live[rng.choice(ids)] if len(ids) > 0 else None
        before = snapshot(allocator, live.values())
        try:
            if op == "create":
                past = rng.choice(seen + list(model.values()))  # freed or live sequences
                tokens = past[:rng.randint(0, len(past))] + random_tokens(
                    rng, rng.randint(0, longest), vocab)
                live[step], model[step] = Sequence(step, allocator, tokens), tokens
            elif op in ("append", "extend"):
                n = 1 if op == "append" else rng.randint(1, longest)
                tokens = random_tokens(rng, n, vocab)
                if op == "append":
                    target.append(tokens[0])
                else:
                    target.extend(tokens)
                model[target.seq_id] = model[target.seq_id] + tokens
            elif op == "raw share" and len(target.block_table) > 0:
                # A reference taken by pool.share, not through a sequence: the block's
                # holder still reads it, so the next append must copy, not write.
                tail = allocator.share(target.block_table[-1])
                held = allocator.read(tail)
                try:
                    token = random_tokens(rng, 1, vocab)[0]
                    target.append(token)
                    model[target.seq_id] = model[target.seq_id] + [token]
                finally:
                    _expect(allocator.read(tail) == held, "copy-on-write: an append wrote "
                            "into a block another holder can see")
                    allocator.free(tail)
            elif op in ("fork", "share"):
                n = len(target) if op == "fork" else rng.randint(0, len(target))
                live[step] = target.fork(step) if op == "fork" else share_prefix(target, step, n)
                model[step] = model[target.seq_id][:n]
            else:
                seen.append(model.pop(target.seq_id))
                live.pop(target.seq_id).free()
            counts[op] += 1
        except OutOfBlocksError:
            counts["refused"] += 1
            _expect(snapshot(allocator, live.values()) == before,
                    f"atomicity: a refused {op} changed the pool or a sequence")
        check_invariants(allocator, live.values())
        for seq_id, seq in live.items():
            _expect(seq.tokens == model[seq_id], f"model: sequence {seq_id} disagrees with it")
    for seq in live.values():
        seq.free()
    _expect(allocator.num_free == allocator.num_blocks, "freeing everything left blocks in use")
    audit(allocator)
    return counts


def check_block_boundary(block_size, seed):
    """A new block exactly when the last one is full."""
    sizes = sorted({1, 3, block_size})
    for size in sizes:
        seq = Sequence("s", BlockAllocator(64, size))
        for n in range(1, 3 * size + 2):
            seq.append(n)
            _expect(len(seq.block_table) == cdiv(n, size), f"block boundary: {n} tokens at "
                    f"block_size {size} hold {len(seq.block_table)} blocks")
    return f"block boundary: a new block exactly when the last is full (sizes " \
           f"{', '.join(map(str, sizes))})"


def check_free_shared(block_size, seed):
    """Freeing a shared block keeps it for the other holder."""
    pool, n = BlockAllocator(4, block_size), block_size + max(1, block_size // 4)
    a = Sequence("a", pool, range(n))  # a full block and a partly full one (size > 1)
    b = a.fork("b")
    a.free()
    _expect(pool.num_used == 2 and b.read() == list(range(n)), "freeing a shared block lost it")
    b.free()
    _expect(pool.num_free == pool.num_blocks, "the last free did not return the blocks")
    return "freeing a shared block: it stays allocated for the other holder"


def check_counting(block_size, seed):
    """Physical blocks shared by three sequences count once."""
    pool = BlockAllocator(16, block_size)
    a = Sequence("a", pool, range(2 * block_size + max(1, block_size // 2)))  # 3 blocks
    b, c = a.fork("b"), share_prefix(a, "c", 2 * block_size)
    _expect(pool.num_used == 3, f"3 shared blocks counted as {pool.num_used}")
    check_invariants(pool, [a, b, c])
    return "counting blocks: physical blocks shared by three sequences count once"


def check_refused_changes_nothing(block_size, seed):
    """A refused prompt, extend or copy-on-write changes nothing."""
    pool = BlockAllocator(3, block_size)
    a = Sequence("a", pool, range(2 * block_size + 1))  # 3 blocks: the pool is full
    b = a.fork("b")
    attempts = [lambda: Sequence("c", pool, [1]), lambda: a.extend(range(block_size + 1)),
                lambda: b.append(7)]
    for attempt in attempts:
        before = snapshot(pool, [a, b])
        try:
            attempt()
        except OutOfBlocksError:
            _expect(snapshot(pool, [a, b]) == before, "a refused call changed state")
        else:
            raise AssertionError("a call that cannot fit was not refused")
    return "a refused prompt, extend or copy-on-write changes nothing"


def check_random_ops(block_size, seed, num_ops=100):
    """Random operations against a plain-list model."""
    runs = [(size, seed + i) for i, size in enumerate(sorted({1, 3, block_size}))]
    for size, run_seed in runs:
        fuzz(BlockAllocator(12, size), random.Random(run_seed), num_ops)
    return f"random operations vs a plain-list model, invariants after each " \
           f"({num_ops * len(runs)})"


CHECKS = [check_block_boundary, check_free_shared, check_counting,
          check_refused_changes_nothing, check_random_ops]


MAX_BLOCK_SIZE = 256  # the largest block size every section is built for


def check_section_args(block_size, seed):
    """What every section checks before it prints anything: a block size in
    1..MAX_BLOCK_SIZE, and a seed that is None (the lab's own) or an int >= 0."""
    if check_int(block_size, "block_size") > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be <= {MAX_BLOCK_SIZE}, got {block_size}")
    if seed is not None:
        check_int(seed, "seed", 0)


def run_checks(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    print("== correctness checks ==")
    for check in CHECKS:
        label = check(block_size, 0 if seed is None else seed)  # raises, naming what broke
        print(f"{label:<76} ok")


def block_map(allocator, sequences):
    """One line per sequence: its block table as [block:ref-count] cells."""
    return [f"    {str(seq.seq_id):<4}" + "".join(
        f"[{block:>3}:{allocator.refcount(block)}]" for block in seq.block_table)
        for seq in sequences]


# The four classic pitfalls, committed on purpose in broken variants made here (the real
# classes are untouched), each run on a small scenario, then caught by a check above.

class EagerFreePool(BlockAllocator):
    """Pitfall 1: free gives a block back at once, whatever its ref-count."""

    def free(self, block):
        check_block(self, block)
        del self.ref_cnt[block]
        self.free_block_ids.append(block)


class NoCopySequence(Sequence):
    """Pitfall 2: the last block is written in place even while it is shared."""

    def _copy_last_block(self):
        return self.block_table[-1]  # the shared block itself


class OffByOneSequence(Sequence):
    """Pitfall 3: a new block only when the tokens overflow the table (> instead of >=;
    the first block aside): the token that should start a block lands in the next
    physical block instead."""

    def append(self, token):
        pool, n, block_size = self.allocator, len(self.tokens), self.block_size
        if n > len(self.block_table) * block_size or len(self.block_table) == 0:
            self.block_table.append(pool.allocate())
        pool.kv_cache.slots[self.block_table[-1] * block_size + n
                            - (len(self.block_table) - 1) * block_size] = token
        self.tokens.append(token)


class TableCountingPool(BlockAllocator):
    """Pitfall 4: blocks in use counted as block-table references (the sum of
    ref-counts), so a block shared by several sequences counts several times."""

    @property
    def num_used(self):
        return sum(self.ref_cnt.values())

    @property
    def num_free(self):
        return self.num_blocks - self.num_used


def caught(pool, sequences):
    """'caught by check_invariants: <its message>', wrapped, or a line saying it was not."""
    try:
        check_invariants(pool, sequences)
    except AssertionError as error:
        return "\n".join(textwrap.wrap(f"caught by check_invariants: {error}", 96,
                                       initial_indent="   ", subsequent_indent="      "))
    return "   NOT CAUGHT by check_invariants"


def demo_pitfalls(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    print("== pitfalls: each classic bug committed on purpose, what it does, what catches it ==")
    n = block_size + max(1, block_size // 4)  # a full block and a partly full one (size > 1)
    pool = EagerFreePool(4, block_size)
    a = Sequence("a", pool, range(n))
    b = a.fork("b")
    a.free()  # b still holds both blocks, but the broken free gave them back
    c = Sequence("c", pool, range(100, 100 + n))  # takes the same two blocks
    print(f"1. freeing a shared block: a and b share {len(b.block_table)} blocks; a.free() "
          f"gives them back; c takes them")
    print("\n".join(block_map(pool, [b, c])))
    print(f"   b wrote {b.tokens[:3]}..., reads back {b.read()[:3]}... (c's tokens)")
    print(caught(pool, [b, c]))
    pool = BlockAllocator(4, block_size)
    a = NoCopySequence("a", pool, range(n))
    b = NoCopySequence("b", pool)  # a fork of a, made by hand so that b skips copies too
    b.block_table.extend(pool.share(block) for block in a.block_table)
    b.tokens.extend(a.tokens)
    b.append(99)   # writes the shared last block in place
    a.append(7)    # ... and a writes the same slot
    print(f"2. writing a shared block without copying: b = a.fork('b'); b.append(99); "
          f"a.append(7)")
    if n % block_size == 0:
        print(f"   at block size {block_size} no block is ever partly full: every append "
              f"takes a new block,")
        print("   so this bug cannot happen")
    else:
        print(f"   b wrote {b.tokens[-1]} last, reads back {b.read()[-1]} (a's token, in the "
              f"block they share)")
        print(caught(pool, [a, b]))
    pool = BlockAllocator(4, block_size)
    a = OffByOneSequence("a", pool, range(block_size))  # exactly one full block
    b = Sequence("b", pool, range(100, 100 + block_size))  # the next physical block
    a.append(99)
    print(f"3. the block-boundary off-by-one: a holds {plural(block_size, 'token')} (one full "
          f"block {a.block_table[0]}), b block {b.block_table[0]};")
    print(f"   a.append(99) takes no new block and writes offset {block_size} of block "
          f"{a.block_table[-1]}: slot {block_size * (a.block_table[-1] + 1)}, inside b's block")
    print(f"   b wrote {b.tokens[0]} first, reads back {b.read()[0]}")
    print(caught(pool, [a, b]))
    pool = TableCountingPool(4, block_size)
    root = Sequence("root", pool, range(2 * block_size))
    forks = [root.fork(f"f{i}") for i in range(2)]
    need = 1  # blocks the new request needs
    try:
        Sequence("new", pool, range(need * block_size))
        verdict = "admitted"
    except OutOfBlocksError as error:
        verdict = f"refused: {error}"
    print(f"4. counting table entries as blocks: root and {len(forks)} forks share "
          f"{len(root.block_table)} blocks; the pool counts {pool.num_used}")
    print(f"   a {need}-block request is {verdict};")
    print(f"   {pool.num_blocks - len(pool.ref_cnt)} blocks are really free")
    print(caught(pool, [root, *forks]))


# ---------------------------------------------------------------------------------------
# Part 5. Demos: why paging wins
# ---------------------------------------------------------------------------------------

POOL_TOKENS = 65_536  # tokens of KV in the demo pool (4096 blocks of 16)
MAX_LEN = 2048        # tokens  a request may grow to: what naive serving reserves
ACTUAL_LEN = 768      # tokens  a request really reaches
NUM_REQUESTS = 50     # requests sharing one system prompt
SYSTEM_LEN = 1024     # tokens  of system prompt
USER_LEN = 40         # tokens  of each request's own message


def knob_problems(block_size):
    """What makes the lab's knobs unusable together with this block size (Part 5's here;
    later parts add theirs in main): a list of sentences, empty when all is well."""
    problems = []
    if ACTUAL_LEN < 1:
        problems.append(f"ACTUAL_LEN must be >= 1 (got {ACTUAL_LEN})")
    if MAX_LEN < ACTUAL_LEN:
        problems.append(f"MAX_LEN must be >= ACTUAL_LEN (got {MAX_LEN} < {ACTUAL_LEN})")
    if cdiv(MAX_LEN, block_size) > POOL_TOKENS // block_size:
        problems.append(f"POOL_TOKENS must hold one MAX_LEN request at block size {block_size}")
    if min(NUM_REQUESTS, SYSTEM_LEN) < 1 or USER_LEN < 0:
        problems.append("NUM_REQUESTS and SYSTEM_LEN must be >= 1, USER_LEN >= 0")
    elif NUM_REQUESTS * cdiv(SYSTEM_LEN + USER_LEN, block_size) > POOL_TOKENS // block_size:
        problems.append(f"POOL_TOKENS must hold NUM_REQUESTS requests of SYSTEM_LEN + "
                        f"USER_LEN tokens unshared at block size {block_size}")
    return problems


def admit_until_full(admit, limit):
    """Call admit(i) for i = 0, 1, ... until the pool refuses or limit calls succeeded;
    return how many fit. limit bounds the loop: a pool of n blocks admits at most n
    requests that take a block each."""
    count = 0
    while count < limit:
        try:
            admit(count)
        except OutOfBlocksError:
            break
        count += 1
    return count


def reserve_max_len(allocator, tokens, max_len):
    """The scheme before paging: reserve max_len slots up front, then write the tokens.
    Example: block_size 16, max_len 2048, 768 tokens: cdiv(2048, 16) = 128 blocks are
    taken and 768 of their 2048 slots written (37.5%); paging would take 48 blocks."""
    token_ids = check_tokens(tokens)
    if check_int(max_len, "max_len", 0) < len(token_ids):
        raise ValueError(f"max_len {max_len} cannot hold the {len(token_ids)} tokens")
    table = BlockTable(allocator.block_size, allocator.allocate_many(
        cdiv(max_len, allocator.block_size)))
    allocator.kv_cache.write(table.slot_mapping(0, len(token_ids)), token_ids)  # rest: unused
    return table


def written_share(allocator):
    """Share of the in-use slots that hold a token (in a fresh pool, None = never written)."""
    slots = [slot for block in allocator.ref_cnt for slot in allocator.kv_cache.block_slots(block)]
    if len(slots) == 0:
        raise ValueError("no block is in use: there is no written share to measure")
    return sum(allocator.kv_cache.slots[slot] is not None for slot in slots) / len(slots)


def rounding_note(block_size, **lengths):
    """Lines saying which lengths block_size does not divide, so that counts differ from the
    default block size's (none at the default, or when it divides them all)."""
    uneven = [f"{name}={n} takes {plural(cdiv(n, block_size), 'block')} "
              f"({cdiv(n, block_size) * block_size} slots)"
              for name, n in lengths.items() if n % block_size != 0]
    if len(uneven) == 0 or block_size == BLOCK_SIZE:
        return []
    return textwrap.wrap(f"(at block size {block_size}, {'; '.join(uneven)}: the numbers "
                         f"differ from block size {BLOCK_SIZE}'s)", 96)


def demo_memory(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    rng, num_blocks = random.Random(0 if seed is None else seed), POOL_TOKENS // block_size
    naive_pool = BlockAllocator(num_blocks, block_size)
    paged_pool = BlockAllocator(num_blocks, block_size)
    request = random_tokens(rng, ACTUAL_LEN)
    naive = admit_until_full(lambda i: reserve_max_len(naive_pool, request, MAX_LEN), num_blocks)
    paged = admit_until_full(lambda i: Sequence(i, paged_pool, request), num_blocks)
    print(f"== memory efficiency: sequences that fit in a {num_blocks}-block pool ==")
    print(f"naive contiguous (reserve max_len={MAX_LEN})  : {naive:>4} sequences")
    print(f"paged (allocate-on-demand, actual={ACTUAL_LEN})    : {paged:>4} sequences"
          f"   ({paged / naive:.1f}x)")
    naive_written, paged_written = written_share(naive_pool), written_share(paged_pool)
    print(f"slots in use that hold a token: naive {naive_written:.1%} "
          f"({1 - naive_written:.1%} reserved, never written), paged {paged_written:.1%}")
    print(f"blocks left free: naive {naive_pool.num_free}, paged {paged_pool.num_free} "
          f"(a request needs {cdiv(ACTUAL_LEN, block_size)} blocks paged, "
          f"{cdiv(MAX_LEN, block_size)} naive)")
    for line in rounding_note(block_size, MAX_LEN=MAX_LEN, ACTUAL_LEN=ACTUAL_LEN):
        print(line)


def admit_system_prompt_requests(pool, share, seed=1):
    """Admit NUM_REQUESTS requests: one SYSTEM_LEN-token system prompt, then USER_LEN
    tokens of their own; with share, through share_prefix of one system sequence.
    Returns the pool."""
    rng = random.Random(seed)
    system = random_tokens(rng, SYSTEM_LEN)
    users = [random_tokens(rng, USER_LEN) for _ in range(NUM_REQUESTS)]
    if share:
        root = Sequence("system", pool, system)
        requests = [root] + [share_prefix(root, i) for i in range(len(users))]
        for request, user in zip(requests[1:], users):
            request.extend(user)
    else:
        requests = [Sequence(i, pool, system + user) for i, user in enumerate(users)]
    check_invariants(pool, requests)
    return pool


def demo_sharing(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    num_blocks, seed = POOL_TOKENS // block_size, 1 if seed is None else seed
    alone = admit_system_prompt_requests(BlockAllocator(num_blocks, block_size), False, seed)
    shared = admit_system_prompt_requests(BlockAllocator(num_blocks, block_size), True, seed)
    print(f"== prefix sharing: {NUM_REQUESTS} requests, shared {SYSTEM_LEN}-token system prompt ==")
    print(f"without sharing : {alone.num_used:>5} blocks used")
    print(f"with sharing    : {shared.num_used:>5} blocks used   "
          f"({alone.num_used / shared.num_used:.1f}x less; shared prefix stored once)")
    for line in rounding_note(block_size, SYSTEM_LEN=SYSTEM_LEN, USER_LEN=USER_LEN):
        print(line)
    demo_cow(block_size)


def demo_cow(block_size=BLOCK_SIZE):
    pool, n = BlockAllocator(8, block_size), block_size + max(1, block_size // 4)
    a = Sequence("a", pool, range(n))  # one full block and a partly full one (size > 1)
    b = a.fork("b")
    before = block_map(pool, [a, b])
    b.append(99)
    reads_ok = a.read() == list(range(n)) and b.read() == list(range(n)) + [99]
    tail_full = n % block_size == 0
    if tail_full:  # block size 1: there is no partly full block to copy
        refs_ok = pool.num_copies == 0 and b.block_table[:-1] == a.block_table
        print(f"copy-on-write   : at block size {block_size} every block is full, so b's "
              f"append takes a new block")
        print(f"                  and nothing is copied ({pool.num_copies} copies)")
        _expect(refs_ok and reads_ok, "copy-on-write demo failed (see the line above)")
    else:
        forked = b.block_table[-1] != a.block_table[-1] and pool.num_copies == 1
        refs = [pool.refcount(x) for x in (a.block_table[0], a.block_table[1], b.block_table[1])]
        refs_ok = refs == [2, 1, 1]
        print(f"copy-on-write   : divergence {'forked block' if forked else 'WROTE IN PLACE'}; "
              f"refcounts {'correct' if refs_ok else f'WRONG {refs}'}"
              f"{'' if reads_ok else '; READS WRONG'}")
        _expect(forked and refs_ok and reads_ok, "copy-on-write demo failed (see the line above)")
    check_invariants(pool, [a, b])
    print(f"  a holds {n} tokens; b = a.fork('b'): both tables point at the same blocks "
          "[block:ref-count]")
    print("\n".join(before))
    if not tail_full:
        print(f"  b.append(99) must not write into block {a.block_table[-1]}, which a still "
              f"reads: b copies it to block {b.block_table[-1]} first")
    print("\n".join(block_map(pool, [a, b])))


# ---------------------------------------------------------------------------------------
# Part 6. Extension: automatic prefix caching
# ---------------------------------------------------------------------------------------
# share_prefix needs the caller to know who shares what. A server finds it by itself:
# every full block gets a block hash made of its tokens and the hash of the block before
# it, and a new prompt walks its full blocks, reusing each block whose hash is cached.
# Freed cached blocks are not forgotten; they wait, still holding their KV, until memory
# is needed, and then the least recently used goes first. This is vLLM's automatic prefix
# caching (SGLang's RadixAttention keeps the same prefixes as paths in a radix tree).
# It attaches to the pool through the hooks of Part 1: share_cached_prefix (the lookup),
# block_full (caching), share_tail (a block shared partly leaves the cache) and audit_kept
# (the audit counts the evictable blocks as free), and it overrides free (a cached block
# waits, evictable) and allocate (eviction).
# NOTE: one hook would not do. The lookup must come before any block is allocated: a
# prompt that fits only thanks to its hits must be admitted, and allocating first would
# evict the very blocks it was about to hit. Caching must follow every block that fills, in
# a prefill (extend) or a decode step (append). vLLM calls its pool at the same two points:
# v1's get_computed_blocks, then cache_full_blocks; v0's allocate_immutable_block (look up,
# else allocate), then promote_to_immutable_block for a block that filled later.

NONE_HASH = bytes(32)  # the parent hash of a sequence's first block (vLLM's name)


def hash_block_tokens(parent_hash, token_ids):
    """The block hash of a full block: SHA-256 of the previous block's hash (None for the
    first block) and this block's tokens.

    Example: block_size 4, prompt 1..8: h0 = hash_block_tokens(None, [1, 2, 3, 4]),
    h1 = hash_block_tokens(h0, [5, 6, 7, 8]). Prompt 9, 9, 9, 9, 5, 6, 7, 8 has the same
    second block of tokens but another parent, so its second hash differs from h1.

    NOTE: chaining makes the hash cover tokens 0..end of this block, so equal tokens after
    a different history never match (their KV differs: attention saw other tokens).
    SHA-256 rather than Python's hash(): a collision would hand one prompt another
    prompt's KV, and a 64-bit hash can be collided on purpose (vLLM added SHA-256 after a
    2025 security advisory showed exactly that). With SHA-256 we trust the hash and, like
    vLLM, do not compare tokens on a hit. Like vLLM, we hash the pickled pair: one byte
    string that cannot be read as another (parent, tokens) pair.
    """
    parent = NONE_HASH if parent_hash is None else parent_hash
    pair = pickle.dumps((parent, list(token_ids)), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(pair).digest()


class LRU:
    """Evictable blocks, least recently freed first: vLLM's eviction order."""

    def __init__(self):
        self.order = OrderedDict()  # block -> None, least recently freed first

    def __len__(self):
        return len(self.order)

    def __contains__(self, block):
        return block in self.order

    def cached(self, block):
        """block was just indexed under its hash (LRU does not care when)."""

    def add(self, block):
        """block was freed: it becomes evictable, the most recently freed."""
        self.order[block] = None

    def remove(self, block):
        """block was hit again: not evictable while in use."""
        del self.order[block]

    def pop(self):
        """The block to evict."""
        return self.order.popitem(last=False)[0]


class KeyedPolicy(LRU):
    """Evict the evictable block with the smallest key(block), ties to the smallest id.

    NOTE: a heap with lazy deletion, O(log n) per eviction: a block hit again, or whose key
    changed, leaves its old entry behind, skipped when popped. When entries outnumber
    evictable blocks twice over, the heap is rebuilt from the live ones (O(1) amortized),
    so it stays within twice the pool. The lab's baselines, not its core."""

    def __init__(self):
        super().__init__()
        self.heap = []  # (key, block), stale entries included

    def key(self, block):
        raise NotImplementedError

    def add(self, block):
        super().add(block)
        heapq.heappush(self.heap, (self.key(block), block))
        if len(self.heap) > 2 * len(self.order):
            self.heap = [(self.key(block), block) for block in self.order]
            heapq.heapify(self.heap)

    def pop(self):
        # Ends: each evictable block has an entry with its key (a key changes only while the
        # block is in use), and an empty heap raises IndexError rather than loop.
        while True:
            key, block = heapq.heappop(self.heap)
            if block in self.order and self.key(block) == key:  # else a stale entry
                del self.order[block]
                return block


class FIFO(KeyedPolicy):
    """Evict the block cached longest ago, whatever its reuse since: a hit does not save it."""

    def __init__(self):
        super().__init__()
        self.since = {}  # block -> when it was last cached
        self.clock = 0   # blocks cached so far

    def cached(self, block):
        self.since[block] = self.clock
        self.clock += 1

    def key(self, block):
        return self.since[block]


POLICIES = {"lru": LRU, "fifo": FIFO}


class PrefixCachingAllocator(BlockAllocator):
    """A block pool that remembers full blocks by their block hash, so later prompts with
    the same tokens reuse them.

    Invariants: cached_block_hash_to_block maps each hash to one block that holds it;
    block_hash knows the hash of every full block in use or cached; a cached block
    nobody references is evictable: free (counted in num_free) but kept until needed.
    """

    def __init__(self, num_blocks, block_size=BLOCK_SIZE, policy="lru"):
        super().__init__(num_blocks, block_size)
        if policy == "optimal":
            raise ValueError("policy 'optimal' needs the future: pass the OptimalPolicy a "
                             "trace replay builds (see replay_trace)")
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} or a policy "
                             f"object, got {policy!r}")
        if not isinstance(policy, str) and not (isinstance(policy, LRU) and len(policy) == 0):
            raise TypeError(f"a policy object must be a new, empty LRU (or subclass), got "
                            f"{policy!r}")
        self.cached_block_hash_to_block = {}  # block hash -> block (vLLM's name for this map)
        self.block_hash = {}                  # block -> its block hash, every full block
        self.evictable = POLICIES[policy]() if isinstance(policy, str) else policy
        self.hits = 0       # full prompt blocks found in the cache at admission
        self.misses = 0     # full prompt blocks not found
        self.evictions = 0  # cached blocks handed to someone else
        # NOTE: vLLM keeps cached and never-cached free blocks in one queue and pops its
        # head. Keeping them apart hands out never-cached blocks first and evicts only when
        # nothing else is left; the eviction order is a policy object (LRU is vLLM's).

    @property
    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total > 0 else 0.0

    @property
    def num_cached(self):
        """Evictable cached blocks right now."""
        return len(self.evictable)

    def is_cached(self, block):
        """block is the one the cache offers for its block hash."""
        return self.cached_block_hash_to_block.get(self.block_hash.get(block)) == block

    def share_cached_prefix(self, token_ids):
        """The longest run of the prompt's leading full blocks whose hashes are cached, each
        shared (ref-count + 1), after checking there is room for the rest of the prompt too
        (reviving an evictable block takes it out of num_free): all or nothing.

        Example: block_size 4, "a" = tokens 0..9 cached blocks [0, 1] (hashes h0, h1);
        "b" = tokens 0..7 then 50..54 finds h0 and h1, misses the third full block: this
        returns [0, 1], now shared, and counts 2 hits and 1 miss; b's constructor then
        writes tokens 50..54 into 2 new blocks (extend).

        NOTE: vLLM stops the walk one token short of the prompt (max_cache_hit_length =
        num_tokens - 1), so the model computes at least the last token and gets its
        logits. This lab counts memory reuse, not compute: a prompt that is all full,
        cached blocks reuses every one of them.
        """
        block_size, hashes, hits = self.block_size, [], []
        for k in range(len(token_ids) // block_size):
            hashes.append(hash_block_tokens(hashes[-1] if k > 0 else None,
                                            token_ids[k * block_size:(k + 1) * block_size]))
            block = self.cached_block_hash_to_block.get(hashes[-1])
            if block is None:
                break
            hits.append(block)
        num_new = cdiv(len(token_ids), block_size) - len(hits)
        self.ensure_free(num_new + sum(1 for block in hits if block in self.evictable))
        for block in hits:
            if block in self.evictable:
                self.evictable.remove(block)  # revived: in use again
            self.ref_cnt[block] = self.ref_cnt.get(block, 0) + 1
        self.hits += len(hits)
        self.misses += len(token_ids) // block_size - len(hits)
        return hits

    def block_full(self, block, parent, token_ids):
        """Hash the block that just filled, and cache it unless its hash already is."""
        parent_hash = None if parent is None else self.block_hash[parent]
        self.block_hash[block] = hash_block_tokens(parent_hash, token_ids)
        # NOTE: if another block already holds this hash (two sequences filled identical
        # blocks apart), the first stays the cached one and this one is freed uncached.
        # vLLM v1 keeps both; one is enough to show the idea.
        if self.block_hash[block] not in self.cached_block_hash_to_block:
            self.cached_block_hash_to_block[self.block_hash[block]] = block
            self.evictable.cached(block)

    def share_tail(self, block):
        # NOTE: a sequence that share_prefix covers only partly writes into its last block
        # once the other holders are gone. So the cache stops offering a block shared that
        # way: a later prompt would read the new tokens as this hash's KV. The block keeps
        # its hash for the blocks after it until it is rewritten or freed. (vLLM v1 never
        # shares a partly covered block.)
        check_block(self, block)  # in use: checked before the cache changes
        if self.is_cached(block):
            del self.cached_block_hash_to_block[self.block_hash[block]]
        return self.share(block)

    def audit_kept(self):
        """The cache's own checks; returns the evictable blocks, which audit counts as free."""
        cached = self.cached_block_hash_to_block
        _expect(all(self.block_hash.get(block) == block_hash for block_hash, block in
                    cached.items()), "cache: the hash -> block and block -> hash maps disagree")
        _expect(all(block in self.ref_cnt or block in self.evictable
                    for block in self.block_hash), "cache: a hashed block is neither in use "
                "nor evictable")
        evictable = [block for block in cached.values() if block in self.evictable]
        _expect(len(evictable) == len(self.evictable), "cache: an evictable block is not "
                "cached")
        return evictable

    def free(self, block):
        """Drop one reference. A cached block that loses its last one stays cached, now
        evictable (vLLM: it joins the free queue, hash and all); any other loses its hash."""
        if self.refcount(block) == 1 and self.is_cached(block):
            del self.ref_cnt[block]
            self.evictable.add(block)
        else:
            super().free(block)  # raises for a free block, before anything changes
            if block not in self.ref_cnt:
                self.block_hash.pop(block, None)

    def allocate(self):
        """A free block: blocks no cache entry will miss go first; when none is left, the
        policy's victim leaves the cache and joins the free list."""
        if len(self.free_block_ids) == 0 and self.next_unused == self.num_blocks \
                and len(self.evictable) > 0:
            block = self.evictable.pop()
            del self.cached_block_hash_to_block[self.block_hash.pop(block)]
            self.evictions += 1
            self.free_block_ids.append(block)
        return super().allocate()


CHAT_SYSTEM_LEN = 200  # tokens of the system prompt every chat request starts with
CHAT_QUESTION_LEN = 40  # tokens a user adds each turn
CHAT_ANSWER_LEN = 60    # tokens the model answers each turn
CHAT_TURNS = 4          # turns per conversation
CACHE_POOLS = (8192, 4096, 2048, 1024)  # tokens of KV in the "under pressure" pools


def cache_knob_problems(block_size):
    longest = CHAT_SYSTEM_LEN + CHAT_TURNS * (CHAT_QUESTION_LEN + CHAT_ANSWER_LEN)  # tokens
    if min(CHAT_SYSTEM_LEN, CHAT_QUESTION_LEN, CHAT_ANSWER_LEN) < 0 or CHAT_TURNS < 1 \
            or len(CACHE_POOLS) == 0:
        return ["CHAT_SYSTEM_LEN, CHAT_QUESTION_LEN and CHAT_ANSWER_LEN must be >= 0, "
                "CHAT_TURNS >= 1 and CACHE_POOLS not empty"]
    if min(CACHE_POOLS) // block_size < cdiv(longest, block_size):
        return [f"every CACHE_POOLS size must hold a {longest}-token chat request at block "
                f"size {block_size}"]
    return []


def demo_cache(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    print("== cache: automatic prefix caching (hash-chained full blocks, LRU eviction) ==")
    cache_same_blocks_as_sharing(block_size, 1 if seed is None else seed)
    cache_multi_turn(block_size, 3 if seed is None else seed)
    cache_under_pressure(block_size, 4 if seed is None else seed)
    cache_chained_hashes(block_size)


def cache_same_blocks_as_sharing(block_size, seed):
    num_blocks = POOL_TOKENS // block_size
    explicit = admit_system_prompt_requests(BlockAllocator(num_blocks, block_size), True, seed)
    cached = admit_system_prompt_requests(PrefixCachingAllocator(num_blocks, block_size),
                                          False, seed)
    print(f"1. the {NUM_REQUESTS} requests of the sharing demo, as plain Sequence(...) calls:")
    print(f"   explicit share_prefix : {explicit.num_used:>4} blocks used")
    print(f"   automatic cache       : {cached.num_used:>4} blocks used   hit rate "
          f"{cached.hit_rate:.1%} ({cached.hits} of {cached.hits + cached.misses} full "
          f"prompt blocks)")


def cache_multi_turn(block_size, seed):
    rng = random.Random(seed)
    pool = PrefixCachingAllocator(1024 // block_size, block_size)
    prompt, answer = random_tokens(rng, 200), random_tokens(rng, 100)
    turn1 = Sequence("turn 1", pool, prompt)  # system prompt + question
    for token in answer:                      # the answer, decoded
        turn1.append(token)
    history, blocks1 = turn1.tokens[:], list(turn1.block_table)
    turn1.free()
    print(f"2. multi-turn chat: turn 1 = {len(prompt)}-token prompt + {len(answer)}-token "
          f"answer in {len(blocks1)} blocks, then freed")
    last = ("the partial last block: not cached" if blocks1[-1] not in pool.block_hash
            else "the last block is full: cached")
    print(f"   live sequences: 0; cached, evictable blocks: {pool.num_cached}; {last}")
    hits_before = pool.hits
    question = random_tokens(rng, 30)
    turn2 = Sequence("turn 2", pool, history + question)
    reused = turn2.block_table[:pool.hits - hits_before]
    same = "the same physical blocks" if reused == blocks1[:len(reused)] else "OTHER BLOCKS"
    print(f"   turn 2 = turn 1 + answer + {len(question)} new tokens = {len(turn2)} tokens: "
          f"{len(reused)} of its {len(turn2) // block_size} full blocks from the cache")
    print(f"   ({same} as turn 1: {len(reused) * block_size} tokens not prefilled again)")
    check_invariants(pool, [turn2])


def chat_stream(num_conversations, num_turns, seed):
    """Chat requests, round robin over conversations: (prompt, answer) pairs where each
    prompt = a shared CHAT_SYSTEM_LEN-token system prompt + the conversation so far +
    CHAT_QUESTION_LEN new tokens, and each answer CHAT_ANSWER_LEN tokens."""
    rng = random.Random(seed)
    system = random_tokens(rng, CHAT_SYSTEM_LEN)
    histories = [list(system) for _ in range(num_conversations)]
    stream = []
    for _ in range(num_turns):
        for history in histories:
            history.extend(random_tokens(rng, CHAT_QUESTION_LEN))
            answer = random_tokens(rng, CHAT_ANSWER_LEN)
            stream.append((list(history), answer))
            history.extend(answer)
    return stream


def serve_stream(pool, stream):
    """Serve requests one at a time: admit the prompt, decode the answer, free."""
    for i, (prompt, answer) in enumerate(stream):
        seq = Sequence(i, pool, prompt)
        seq.extend(answer)
        seq.free()


def cache_under_pressure(block_size, seed, conversations=12):
    stream = chat_stream(conversations, CHAT_TURNS, seed)
    print(f"3. under pressure: {len(stream)} chat requests ({conversations} conversations x "
          f"{CHAT_TURNS} turns, round robin), one at a time")
    print("   pool blocks   hit rate    hits   evictions   cached at end")
    rows = []
    for tokens in CACHE_POOLS:
        pool = PrefixCachingAllocator(tokens // block_size, block_size)
        serve_stream(pool, stream)
        rows.append((pool.num_blocks, pool.hit_rate, pool.hits, pool.num_cached))
        print(f"   {pool.num_blocks:>11}   {pool.hit_rate:>8.1%}   {pool.hits:>5}   "
              f"{pool.evictions:>9}   {pool.num_cached:>13}")
    roomy, tight = rows[0], rows[-1]
    system_hits = (len(stream) - 1) * (CHAT_SYSTEM_LEN // block_size)  # every later request
    floor = ("only the system prompt still hits" if tight[2] == system_hits > 0
             else f"{tight[2]} blocks still hit")
    print(f"   conclusion: room for the working set ({roomy[3]} blocks) reuses {roomy[1]:.0%} "
          f"of prompt blocks; at {tight[0]}")
    print(f"   blocks LRU evicts each history before its next turn: {floor} ({tight[1]:.0%})")


def cache_chained_hashes(block_size):
    pool = PrefixCachingAllocator(16, block_size)
    x, y, z = (list(range(k * block_size + 1, (k + 1) * block_size + 1)) for k in range(3))
    a = Sequence("a", pool, x + y)
    b = Sequence("b", pool, z + y)  # the same block of tokens y, after another history
    alone = "equal" if hash_block_tokens(None, a.tokens[block_size:]) == hash_block_tokens(
        None, b.tokens[block_size:]) else "different"
    chained = "EQUAL" if pool.block_hash[a.block_table[1]] == pool.block_hash[
        b.block_table[1]] else "different"
    hits_b = pool.hits
    c = Sequence("c", pool, x + y + [3 * block_size + 1])
    print(f"4. chained hashes: a = X+Y, b = Z+Y; block Y holds the same "
          f"{plural(block_size, 'token')} in both")
    print(f"   hash of Y's tokens alone: {alone} -> a per-block cache would give b a's "
          f"block (KV made after X)")
    print(f"   chained hash of Y       : {chained} -> a {list(a.block_table)}, "
          f"b {list(b.block_table)}, b's hits: {hits_b}")
    print(f"   c = X+Y+1 token         : hits {pool.hits - hits_b}, blocks "
          f"{list(c.block_table)} (same history, same blocks)")
    check_invariants(pool, [a, b, c])


# ---------------------------------------------------------------------------------------
# Part 7. Extension: preemption by recompute or by swap
# ---------------------------------------------------------------------------------------
# Paging admits sequences before knowing how long they will grow, so a full pool is
# normal, not an error: when a running sequence needs a block and none is free, the
# scheduler takes all the blocks of another sequence (the victim) and brings it back
# later. Recompute throws the victim's KV away and prefills its tokens again on resume;
# swap copies its blocks to a pool in host memory and copies them back. Which is cheaper
# depends on bytes moved versus FLOPs redone, so the numbers below come from a cost model.

# Cost model, for OPT-13B on one A100: the paper's setting in 7.3. Sources: OPT-13B has 40
# layers of hidden size 5120, so K and V in fp16 take 2 x 40 x 5120 x 2 bytes = 800 KiB per
# token (the paper: "800 KB"); PCIe 4.0 x16 moves 32 GB/s per direction on paper, ~25 GB/s
# measured with pinned host memory; one cudaMemcpyAsync costs 5-10 us of launch and DMA
# setup. Two constants are estimates, so each is a (low, high) range and every verdict
# is printed at both ends: the copy latency, and prefill throughput, which is 2 x 13e9
# FLOPs per token on an A100 (312 TFLOP/s fp16) at 30%-60% utilization: 3,600-7,200/s.
NUM_LAYERS = 40
HIDDEN_SIZE = 5120
PCIE_BYTES_PER_S = 25e9                  # bytes/s, host <-> device
TRANSFER_LATENCY_S = (5e-6, 10e-6)       # s, fixed cost of one copy
PREFILL_TOKENS_PER_S = (3_600, 7_200)    # tokens/s recomputed


def kv_bytes_per_token():
    """K and V, every layer, fp16: 2 x NUM_LAYERS x HIDDEN_SIZE x 2 bytes."""
    return 2 * NUM_LAYERS * HIDDEN_SIZE * 2


def per_layer_transfers():
    """Copies per block when each layer's K and V move apart: 2 x NUM_LAYERS."""
    return 2 * NUM_LAYERS


@dataclass
class Request:
    req_id: int
    prompt: list
    max_tokens: int  # tokens to generate
    arrival: int     # the step it arrives at


@dataclass
class PreemptionStats:
    preemptions: int = 0
    recomputed_tokens: int = 0   # tokens prefilled again on resume
    swapped_out_blocks: int = 0  # blocks copied device -> host
    swapped_in_blocks: int = 0   # blocks copied host -> device
    host_fallbacks: int = 0      # swap wanted, host pool full: recomputed instead
    shared_fallbacks: int = 0    # swap wanted, victim holds a shared block: recomputed
    preempted_blocks: int = 0    # blocks the victims held when preempted
    steps: int = 0               # scheduler steps until every request finished

    def recompute_seconds(self, tokens_per_s):
        return self.recomputed_tokens / tokens_per_s

    def swap_seconds(self, block_size, copies_per_block, latency_s):
        return (self.swapped_out_blocks + self.swapped_in_blocks) * block_copy_seconds(
            block_size, copies_per_block, latency_s)


def block_copy_seconds(block_size, copies_per_block, latency_s):
    """Moving one block between host and GPU: a fixed cost per copy, then the bytes."""
    return copies_per_block * latency_s + block_size * kv_bytes_per_token() / PCIE_BYTES_PER_S


def next_token(req_id, position):
    """The token request req_id produces at position: a deterministic stand-in for a model,
    so a preempted request must end with exactly the tokens it would have had anyway."""
    return (req_id * 7919 + position * 104729) % 32_000


def expected_tokens(request):
    """What request holds when done, with unlimited memory."""
    start = len(request.prompt)
    return list(request.prompt) + [next_token(request.req_id, p)
                                   for p in range(start, start + request.max_tokens)]


def swap_out(seq, host):
    """Copy every block of seq into new host blocks, contents included (one copy each)."""
    host_blocks = host.allocate_many(len(seq.block_table))
    for gpu_block, host_block in zip(seq.block_table, host_blocks):
        host.kv_cache.write(host.kv_cache.block_slots(host_block), seq.allocator.read(gpu_block))
    return host_blocks


def swap_in(seq_id, tokens, host_blocks, host, gpu):
    """Copy host blocks back into new GPU blocks and rebuild the sequence over them."""
    for host_block in host_blocks:
        check_block(host, host_block)  # in use on the host: checked before anything changes
    need = cdiv(len(tokens), gpu.block_size)
    if need != len(host_blocks):
        raise ValueError(f"{plural(len(tokens), 'token')} need {plural(need, 'block')}, not "
                         f"the {len(host_blocks)} host blocks given")
    gpu_blocks = gpu.allocate_many(len(host_blocks))
    for host_block, gpu_block in zip(host_blocks, gpu_blocks):
        gpu.kv_cache.write(gpu.kv_cache.block_slots(gpu_block), host.read(host_block))
        host.free(host_block)
    seq = Sequence(seq_id, gpu)
    seq.block_table.extend(gpu_blocks)
    seq.tokens.extend(tokens)
    return seq


def lru_victim(last_step, exclude):
    """The request (other than exclude) whose last step is oldest; ties go to the latest
    arrival (the highest req_id), the request FCFS would serve last.

    NOTE: vLLM v1's FCFS scheduler preempts the last request in its running list (the
    latest admitted: self.running.pop()), and it has no swap: every victim is recomputed.
    Least recently stepped is this lab's choice, so that a request preempted and resumed
    is not the next victim; swap follows vLLM v0 and the paper.
    """
    candidates = [req_id for req_id in last_step if req_id != exclude]
    return min(candidates, key=lambda req_id: (last_step[req_id], -req_id))


@dataclass
class Preempted:
    tokens: list
    host_blocks: list = None  # where its KV waits, if swapped; None if it must recompute


def admission_margin(num_blocks):
    """Blocks that must stay free after an admission or a resume: 1% of the pool, at least 1,
    so running sequences can still grow (else a newcomer is soon preempted again).
    NOTE: vLLM v0's block manager keeps int(watermark * num_gpu_blocks), watermark=0.01,
    which is 0 below 100 blocks; at least 1 here, for the small pools of the demos."""
    return max(1, num_blocks // 100)


class Scheduler:
    """Run requests to completion on a GPU pool, preempting when the pool runs out.

    Policy lives here (whom to preempt, when to resume); mechanism lives in the pools and
    in swap_out / swap_in. Every step: resume preempted requests (oldest first) while they
    fit, then admit new ones, then give every running request one token, oldest first.
    It always terminates: run refuses up front a request that could never finish, and
    raises if a step could change nothing.
    """

    def __init__(self, gpu, host, policy, check=False):
        if policy not in ("recompute", "swap"):
            raise ValueError(f"policy must be 'recompute' or 'swap', got {policy!r}")
        if not isinstance(gpu, BlockAllocator):
            raise TypeError(f"gpu must be a BlockAllocator, got {type(gpu).__name__}")
        if isinstance(gpu, PrefixCachingAllocator):
            # NOTE: with a prefix cache, a recomputed victim would find some of its blocks
            # cached (less to recompute) and a swapped-in one would need its hashes rebuilt;
            # both are real, and both would blur what this part measures.
            raise ValueError("the scheduler runs on a plain BlockAllocator, not a prefix cache")
        if policy == "swap" and host is None:
            raise ValueError("policy 'swap' needs a host pool (host is None)")
        if host is not None and (not isinstance(host, BlockAllocator)
                                 or host.block_size != gpu.block_size):
            raise ValueError(f"the host pool must be a BlockAllocator of the GPU pool's block "
                             f"size {gpu.block_size}: blocks move whole")
        self.gpu, self.host, self.policy, self.check = gpu, host, policy, check
        self.running = {}     # req_id -> Sequence
        self.last_step = {}   # req_id -> step it last got a token (the LRU clock)
        self.preempted = {}   # req_id -> Preempted
        self.finished = {}    # req_id -> tokens read back through its block table
        self.stats = PreemptionStats()

    def run(self, requests, max_steps=None):
        """Serve requests until every one finishes; return req_id -> its tokens. max_steps
        (None: no limit) stops a run that takes longer with RuntimeError."""
        if max_steps is not None:
            check_int(max_steps, "max_steps")
        requests = list(requests)  # read twice below: a generator would be empty the second time
        self._refuse_what_cannot_run(requests)
        pending = deque(sorted(requests, key=lambda r: (r.arrival, r.req_id)))
        final_len = {request.req_id: len(request.prompt) + request.max_tokens
                     for request in requests}
        waiting, step = deque(), 0  # arrived, not yet admitted: first come, first served
        while len(pending) + len(waiting) + len(self.running) + len(self.preempted) > 0:
            if len(waiting) + len(self.running) + len(self.preempted) == 0:
                step = max(step, pending[0].arrival)  # idle until the next arrival: skip
            while len(pending) > 0 and pending[0].arrival <= step:
                waiting.append(pending.popleft())
            progress = (self._resume(step) + self._admit(waiting, step)
                        + self._decode(final_len, step))
            if progress == 0:
                raise RuntimeError(f"step {step}: no request can resume, be admitted or "
                                   f"decode ({len(waiting)} waiting, {len(self.preempted)} "
                                   f"preempted)")
            step += 1
            if max_steps is not None and step >= max_steps:
                raise RuntimeError(f"still running after max_steps={max_steps} steps")
        self.stats.steps = step
        return self.finished

    def _fits(self, num_blocks):
        return self.gpu.num_free - num_blocks >= admission_margin(self.gpu.num_blocks)

    def _refuse_what_cannot_run(self, requests):
        """ValueError or TypeError, naming the request, before anything changes."""
        seen = set()
        for request in requests:
            if not isinstance(request, Request):
                raise TypeError(f"requests must be Request objects, got {request!r}")
            name = f"request {request.req_id!r}"
            if type(request.req_id) is not int:  # next_token computes with it
                raise TypeError(f"{name}: req_id must be an int")
            if request.req_id in seen:
                raise ValueError(f"{name}: duplicate req_id")
            seen.add(request.req_id)
            for field in ("max_tokens", "arrival"):
                value = getattr(request, field)
                if type(value) is not int or value < 0:
                    raise ValueError(f"{name}: {field} must be an int >= 0, got {value!r}")
            if not isinstance(request.prompt, (list, tuple, range)):  # read more than once
                raise TypeError(f"{name}: prompt must be a list, tuple or range of token ids, "
                                f"got {type(request.prompt).__name__}")
            try:
                check_tokens(request.prompt)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{name}: {error}") from None
            need = cdiv(len(request.prompt) + request.max_tokens, self.gpu.block_size)
            margin = admission_margin(self.gpu.num_blocks)
            if need + margin > self.gpu.num_blocks:
                raise ValueError(f"{name} can never run: it needs {need} blocks, and the "
                                 f"{self.gpu.num_blocks}-block GPU pool admits only while "
                                 f"{margin} stay free")

    def _resume(self, step):
        resumed = 0
        for req_id in sorted(self.preempted):
            waiting = self.preempted[req_id]
            if not self._fits(cdiv(len(waiting.tokens), self.gpu.block_size)):
                break  # strictly oldest first: nobody overtakes a preempted request
            del self.preempted[req_id]
            if waiting.host_blocks is None:
                seq = Sequence(req_id, self.gpu, waiting.tokens)
                self.stats.recomputed_tokens += len(waiting.tokens)
            else:
                seq = swap_in(req_id, waiting.tokens, waiting.host_blocks, self.host, self.gpu)
                self.stats.swapped_in_blocks += len(waiting.host_blocks)
            self.running[req_id], self.last_step[req_id] = seq, step
            resumed += 1
        return resumed

    def _admit(self, waiting, step):
        admitted = 0
        while len(self.preempted) == 0 and len(waiting) > 0 and self._fits(
                cdiv(len(waiting[0].prompt), self.gpu.block_size)):
            request = waiting.popleft()
            seq = Sequence(request.req_id, self.gpu, request.prompt)
            if request.max_tokens == 0:  # nothing to generate: done with its prompt
                self.finished[request.req_id] = seq.read()
                seq.free()
            else:
                self.running[request.req_id], self.last_step[request.req_id] = seq, step
            admitted += 1
        return admitted

    def _decode(self, final_len, step):
        decoded = 0
        for req_id in sorted(self.running):
            seq = self.running.get(req_id)
            if seq is None:
                continue  # preempted earlier in this step
            position = len(seq.tokens)
            token = next_token(req_id, position)
            while True:
                try:
                    seq.append(token)
                    break
                except OutOfBlocksError:
                    if len(self.running) == 1:  # run's checks make this unreachable
                        raise RuntimeError(f"request {req_id} cannot grow, and nobody is "
                                           f"left to preempt") from None
                    self._preempt(lru_victim(self.last_step, exclude=req_id))
            self.last_step[req_id] = step
            decoded += 1
            if position + 1 == final_len[req_id]:
                self.finished[req_id] = seq.read()
                self._retire(req_id).free()
        if self.check:
            check_invariants(self.gpu, self.running.values())
            if self.host is not None:
                audit(self.host)
        return decoded

    def _retire(self, req_id):
        del self.last_step[req_id]
        return self.running.pop(req_id)

    def _preempt(self, req_id):
        seq = self._retire(req_id)
        self.stats.preemptions += 1
        self.stats.preempted_blocks += len(seq.block_table)
        host_blocks = None
        if self.policy == "swap":
            # NOTE: a block shared with another sequence cannot leave the GPU without that
            # sequence, and swapping it once for both needs groups (vLLM v0 swaps whole
            # sequence groups). We keep it simple: such a victim is recomputed, and counted.
            if any(self.gpu.refcount(block) > 1 for block in seq.block_table):
                self.stats.shared_fallbacks += 1
            elif self.host.num_free < len(seq.block_table):
                self.stats.host_fallbacks += 1
            else:
                host_blocks = swap_out(seq, self.host)
                self.stats.swapped_out_blocks += len(host_blocks)
        self.preempted[req_id] = Preempted(list(seq.tokens), host_blocks)
        seq.free()


GPU_KV_TOKENS = 2048  # tokens of KV the GPU pool holds, whatever the block size
HOST_KV_TOKENS = 512  # tokens of KV the host pool holds in part 1 of the demo


def evict_knob_problems(block_size):
    if EVICT_SEEDS < 1 or len(EVICT_SIZES) == 0 or not all(
            type(size) is int and 1 <= size <= MAX_BLOCK_SIZE for size in EVICT_SIZES):
        return [f"EVICT_SEEDS must be >= 1 and EVICT_SIZES ints in 1..{MAX_BLOCK_SIZE}"]
    if not COMPARABLE >= 1:
        return [f"COMPARABLE must be >= 1 (the ratio within which two times are comparable), "
                f"got {COMPARABLE}"]
    problems, largest = [], EVICT_PROMPT_LEN[1] + EVICT_OUTPUT_LEN[1]  # tokens
    if not 1 <= EVICT_PROMPT_LEN[0] <= EVICT_PROMPT_LEN[1] or \
            not 1 <= EVICT_OUTPUT_LEN[0] <= EVICT_OUTPUT_LEN[1]:
        problems.append("EVICT_PROMPT_LEN and EVICT_OUTPUT_LEN must be (low, high) with "
                        "1 <= low <= high")
    for size in sorted({block_size, *EVICT_SIZES}):  # part 1 runs one, the sweep all
        gpu_blocks = GPU_KV_TOKENS // size
        if cdiv(largest, size) + admission_margin(gpu_blocks) > gpu_blocks:
            problems.append(f"GPU_KV_TOKENS must hold a {largest}-token request and the "
                            f"{admission_margin(gpu_blocks)}-block admission margin at block "
                            f"size {size}")
        if HOST_KV_TOKENS < size:
            problems.append(f"HOST_KV_TOKENS must hold one block at block size {size}")
    if min(NUM_LAYERS, HIDDEN_SIZE, PCIE_BYTES_PER_S, *PREFILL_TOKENS_PER_S) <= 0 or \
            min(TRANSFER_LATENCY_S) < 0 or len(PREFILL_TOKENS_PER_S) != 2 or \
            len(TRANSFER_LATENCY_S) != 2:
        problems.append("the cost model's constants must be > 0, and PREFILL_TOKENS_PER_S "
                        "and TRANSFER_LATENCY_S (low, high) pairs")
    return problems


EVICT_PROMPT_LEN = (16, 200)  # tokens: a request's prompt, uniform in this range
EVICT_OUTPUT_LEN = (50, 250)  # tokens: what it generates


def preemption_workload(seed=5, num_requests=16):
    """Requests arriving every other step, prompt and output lengths uniform in
    EVICT_PROMPT_LEN and EVICT_OUTPUT_LEN."""
    rng = random.Random(seed)
    return [Request(i, random_tokens(rng, rng.randint(*EVICT_PROMPT_LEN)),
                    rng.randint(*EVICT_OUTPUT_LEN), 2 * i) for i in range(num_requests)]


def run_policy(policy, block_size, requests, host_tokens=None, check=False):
    """Serve requests under policy, with a host pool of host_tokens (None: HOST_KV_TOKENS);
    verify every result and that both pools end whole."""
    check_int(block_size, "block_size")
    host_tokens = HOST_KV_TOKENS if host_tokens is None else host_tokens
    gpu = BlockAllocator(GPU_KV_TOKENS // block_size, block_size)
    host = BlockAllocator(host_tokens // block_size, block_size)
    scheduler = Scheduler(gpu, host, policy, check)
    finished = scheduler.run(requests)
    _expect(all(finished[r.req_id] == expected_tokens(r) for r in requests),
            f"{policy}: a request finished with the wrong tokens")
    _expect(gpu.num_free == gpu.num_blocks and host.num_free == host.num_blocks,
            f"{policy}: a pool is not whole at the end")
    return scheduler.stats


EVICT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the block sizes of the paper's Figure 19
EVICT_SEEDS = 4              # workload seeds every verdict runs over (each costs 9 runs)
PAPER_73 = ("recomputation is more efficient when the block size is small, while swapping is "
            "more efficient when the block size is large, though recomputation overhead is "
            "never higher than 20% of swapping's latency. For medium block sizes from 16 to "
            "64, the two methods exhibit comparable end-to-end performance.")
COMPARABLE = 1.2  # "comparable": within 20% of each other, either way


def recovery_ms(tokens, blocks, block_size, copies, tokens_per_s, latency_s):
    """(recompute ms, swap ms) to bring back victims that held tokens in blocks: recompute
    prefills the tokens again; swap copies each block out and back in."""
    return (1e3 * tokens / tokens_per_s,
            1e3 * 2 * blocks * block_copy_seconds(block_size, copies, latency_s))


def demo_evict(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    first = 5 if seed is None else seed
    requests = preemption_workload(first)
    rates, latencies = PREFILL_TOKENS_PER_S, TRANSFER_LATENCY_S
    print(f"== evict: preemption by recompute vs swap ({len(requests)} requests, "
          f"{GPU_KV_TOKENS}-token GPU pool) ==")
    print("cost model (OPT-13B, the paper's model in 7.3; each estimate is given at both ends):")
    print(f"   {kv_bytes_per_token() // 1024} KiB of KV per token, "
          f"{PCIE_BYTES_PER_S / 1e9:g} GB/s, {latencies[0] * 1e6:g}-{latencies[1] * 1e6:g} us "
          f"per copy, prefill "
          f"{rates[0]:,.0f}-{rates[1]:,.0f} tokens/s")
    print(f"1. block size {block_size}, a {HOST_KV_TOKENS}-token host pool; every request ends "
          f"with exactly its tokens")
    print("   policy      preemptions  recomputed  swapped out/in  host full  steps  "
          "recovery ms")
    for policy in ("recompute", "swap"):
        stats = run_policy(policy, block_size, requests)
        ends = [stats.recompute_seconds(rate) + stats.swap_seconds(block_size, 1, latency)
                for rate, latency in ((rates[1], latencies[0]), (rates[0], latencies[1]))]
        swapped = f"{stats.swapped_out_blocks}/{stats.swapped_in_blocks}"
        print(f"   {policy:<10}  {stats.preemptions:>11}  {stats.recomputed_tokens:>10}  "
              f"{swapped:>14}  {stats.host_fallbacks:>9}  {stats.steps:>5}  "
              f"{ends[0] * 1e3:>5.0f}-{ends[1] * 1e3:.0f}")
    runs = evict_runs(range(first, first + EVICT_SEEDS))
    print_evict_sweep(runs[first])
    compare_with_paper(runs)


def evict_runs(seeds, block_sizes=None):
    """seed -> [(block size, preemptions, tokens restored, blocks the victims held)], from
    one recompute run per seed and size (None: EVICT_SIZES). A swap run (host pool as large
    as the GPU's, so it never falls back) preempts the same victims and moves exactly those
    blocks, out and back: a test checks it."""
    block_sizes = EVICT_SIZES if block_sizes is None else block_sizes
    return {seed: [(size, stats.preemptions, stats.recomputed_tokens, stats.preempted_blocks)
                   for size in block_sizes
                   for stats in [run_policy("recompute", size, preemption_workload(seed))]]
            for seed in seeds}


def print_evict_sweep(rows):
    rate = sum(PREFILL_TOKENS_PER_S) / 2
    latency = sum(TRANSFER_LATENCY_S) / 2
    print(f"2. recovery time by block size, one seed, at the midpoints: {rate:,.0f} tokens/s, "
          f"{latency * 1e6:g} us/copy")
    print(f"   block  preemptions  tokens restored  recompute ms  swap ms  "
          f"swap ms, {per_layer_transfers()} copies/block")
    times = [(size, recovery_ms(tokens, blocks, size, 1, rate, latency),
              recovery_ms(tokens, blocks, size, per_layer_transfers(), rate, latency)[1])
             for size, _, tokens, blocks in rows]
    for (size, preemptions, tokens, _), (_, (recompute, swap), layered) in zip(rows, times):
        print(f"   {size:>5}  {preemptions:>11}  {tokens:>15}  {recompute:>12.1f}  "
              f"{swap:>7.1f}  {layered:>23.1f}")
    longest = max(max(pair + (layered,)) for _, pair, layered in times)
    print(f"   chart, ms (R recompute, S swap, L swap with {per_layer_transfers()} copies per "
          f"block)")
    for size, (recompute, swap), layered in times:
        for mark, ms in zip("RSL", (recompute, swap, layered)):
            label = f"{size:>5} " if mark == "R" else " " * 6
            print(f"   {label}{mark} |{'#' * round(60 * ms / max(longest, 1e-9)):<60} {ms:6.1f}")


def evict_ratios(runs, copies, tokens_per_s, latency_s):
    """block size -> recompute ms / swap ms of each seed (sizes where nobody was preempted
    are left out: nothing to compare)."""
    ratios = {}
    for rows in runs.values():
        for size, _, tokens, blocks in rows:
            if tokens > 0:
                recompute, swap = recovery_ms(tokens, blocks, size, copies, tokens_per_s,
                                              latency_s)
                ratios.setdefault(size, []).append(recompute / swap)
    return ratios


def ratio_cell(ratio):
    """A ratio in at most 5 characters: 2 decimals while they fit (3.68), fewer after."""
    for digits in (2, 1, 0):
        if len(f"{ratio:.{digits}f}") <= 5:
            return f"{ratio:.{digits}f}"
    return f"{ratio:.0e}"  # 1e+04


def compare_with_paper(runs):
    """Each of the paper's three claims in 7.3, checked at every block size, over every
    seed, and at both ends of both estimates; the verdicts are computed."""
    settings = [(copies, rate, latency) for copies in (per_layer_transfers(), 1)
                for rate in PREFILL_TOKENS_PER_S for latency in TRANSFER_LATENCY_S]
    by_setting = [evict_ratios(runs, *setting) for setting in settings]
    sizes = sorted({size for ratios in by_setting for size in ratios})
    print(f"3. vs the paper (7.3), over {len(runs)} seeds, quoted:")
    print("\n".join(textwrap.wrap(f'"{PAPER_73}"', 92, initial_indent="   ",
                                  subsequent_indent="   ")))
    if len(sizes) == 0:
        print("   ours: no request was preempted at any block size (the GPU pool holds the "
              "workload):")
        print("   nothing to compare")
        return
    print("   ours: recompute time / swap time, the largest over the seeds (< 1: recompute "
          "is faster)")
    print("   copies  prefill/s  us/copy " + "".join(f"{size:>6}" for size in sizes))
    verdicts = Counter()
    for (copies, rate, latency), ratios in zip(settings, by_setting):
        worst = {size: round(max(values), 2) for size, values in ratios.items()}
        best = {size: round(min(values), 2) for size, values in ratios.items()}
        print(f"   {copies:>6}  {rate:>9,.0f}  {latency * 1e6:>7g} " + "".join(
            f"{ratio_cell(worst[size]) if size in worst else '-':>6}" for size in sizes))
        small, large = min(worst), max(worst)
        verdicts["shape"] += worst[small] < 1 < best[large]
        verdicts["20%"] += max(worst.values()) <= COMPARABLE
        verdicts["medium"] += all(1 / COMPARABLE <= best[s] and worst[s] <= COMPARABLE
                                  for s in worst if 16 <= s <= 64)
    n, medium = len(settings), [size for size in sizes if 16 <= size <= 64]
    print("   small blocks favour recompute, large ones swap: " + (
        f"holds in {verdicts['shape']} of {n} rows" if len(sizes) > 1 else
        f"not judged (preemptions at block size {sizes[0]} only)"))
    print(f"   recompute never more than {COMPARABLE}x swap, at every size: holds in "
          f"{verdicts['20%']} of {n} rows")
    print(f"   comparable (within {COMPARABLE}x either way) at 16-64: " + (
        f"holds in {verdicts['medium']} of {n} rows" if len(medium) > 0 else
        "not judged (no preemptions at those sizes)"))
    if verdicts["20%"] < n:
        print("   Where ours falls outside, we think the difference is the model's: it charges "
              "recompute a")
        print("   fixed prefill rate per token and swap only its copies, while the paper "
              "measured end to end.")


# ---------------------------------------------------------------------------------------
# Part 8. Extension: parallel sampling and beam search
# ---------------------------------------------------------------------------------------
# n samples of one prompt, or k beams, are sequences with a long common past. With fork,
# that past is stored once and each sequence pays only for where it diverges: a block of
# its own tokens, plus one copy of the shared tail block if the fork happened mid-block.
# Without sharing, every block-table entry would be a block of its own, so one run
# measures both: the pool's blocks in use, and the sum of the tables' entries.
# NOTE: vLLM v1's engine has neither fork nor beam search: n samples are child requests of
# a ParentRequest (vllm/v1/engine/parallel_sampling.py) that share full blocks through the
# prefix cache, and beam search runs above the engine (LLM.beam_search), as new requests.
# Forking with copy-on-write of a partly full block is the paper's design and vLLM v0's.

ALPACA = ("Alpaca", 19.31, 58.45)       # mean prompt / output tokens in the vLLM paper's
SHAREGPT = ("ShareGPT", 161.31, 337.99)  # traces (its Fig. 11)
MAX_SEQ_LEN = 2048       # tokens: OPT's context, the cap on drawn lengths
NUM_SAMPLES = (2, 4, 6)  # parallel samples n, as in the paper
BEAM_WIDTHS = (2, 4, 6)  # beam widths k, as in the paper
SHARING_SEEDS = 3        # traces per dataset: each verdict is a range over them
SHARING_REQUESTS = 2     # requests per trace
PAPER_63 = {  # the paper's 6.3, quoted; the first pair is Alpaca's
    "quote": "We show 6.1% - 9.8% memory saving on parallel sampling and 37.6% - 55.2% on "
             "beam search. In the same experiments with the ShareGPT dataset, we saw 16.2% - "
             "30.5% memory saving on parallel sampling and 44.3% - 66.3% on beam search.",
    ("Alpaca", "parallel"): (0.061, 0.098), ("Alpaca", "beam"): (0.376, 0.552),
    ("ShareGPT", "parallel"): (0.162, 0.305), ("ShareGPT", "beam"): (0.443, 0.663)}


def beam_knob_problems():
    widths = [*NUM_SAMPLES, *BEAM_WIDTHS]
    if len(NUM_SAMPLES) == 0 or len(BEAM_WIDTHS) == 0 or \
            not all(type(w) is int and w >= 1 for w in widths):
        return ["NUM_SAMPLES and BEAM_WIDTHS must be non-empty tuples of ints >= 1"]
    if not all(0 < mean < MAX_SEQ_LEN / 2 for _, *means in (ALPACA, SHAREGPT) for mean in means):
        return [f"ALPACA and SHAREGPT mean lengths must be in (0, {MAX_SEQ_LEN // 2})"]
    if min(SHARING_SEEDS, SHARING_REQUESTS) < 1:
        return ["SHARING_SEEDS and SHARING_REQUESTS must be >= 1"]
    return []


@dataclass
class SharingRun:
    used: list     # blocks in use after the prompt and after every decoding step
    entries: list  # block-table entries then: the blocks independent copies would hold
    copies: int    # copy-on-write copies made
    picture: list  # a block map of the sequences at one step, if asked for

    @property
    def peak(self):
        return max(self.used)

    @property
    def mean(self):
        return sum(self.used) / len(self.used)


def saving(runs):
    """Blocks saved by sharing over blocks needed without it, summed over the runs' steps:
    the paper's "number of blocks we saved by sharing divided by the number of total blocks
    without sharing"."""
    used, entries = (sum(sum(getattr(run, name)) for run in runs) for name in ("used", "entries"))
    return 1 - used / entries if entries > 0 else 0.0  # nothing needed: nothing saved


def table_entries(sequences):
    return sum(len(seq.block_table) for seq in sequences)


def parallel_sampling(prompt_len, n, output_len, share=True, block_size=BLOCK_SIZE, seed=6):
    """n samples of one prompt, each decoding its own tokens and ending at its own length
    (output_len: one int for all, or a list of n); forks if share, else copies."""
    lengths = [output_len] * n if isinstance(output_len, int) else list(output_len)
    for value, name, low in [(prompt_len, "prompt_len", 0), (n, "n", 1),
                             (block_size, "block_size", 1), *((length, "output_len", 0)
                                                              for length in lengths)]:
        check_int(value, name, low)
    if len(lengths) != n:
        raise ValueError(f"output_len has {len(lengths)} lengths for n={n} samples")
    rng = random.Random(seed)
    prompt = random_tokens(rng, prompt_len)
    outputs = [random_tokens(rng, length) for length in lengths]
    pool = BlockAllocator(max(1, n * cdiv(prompt_len + max(lengths), block_size)), block_size)
    first = Sequence(0, pool, prompt)
    samples = [first] + [first.fork(i) if share else Sequence(i, pool, prompt)
                         for i in range(1, n)]
    used, entries, done = [pool.num_used], [table_entries(samples)], []
    for sample, output in zip(samples, outputs):
        if len(output) == 0:
            sample.free()  # nothing to decode: finished once its prompt is in
    for step in range(max(lengths)):
        for sample, output in zip(samples, outputs):
            if step < len(output):
                sample.append(output[step])
                if step + 1 == len(output):
                    _expect(sample.read() == prompt + output, "a sample lost tokens")
                    done.append(sample)
        used.append(pool.num_used)
        entries.append(table_entries(seq for seq in samples if not seq.is_freed))
        for sample in done:
            sample.free()  # finished: its blocks go back (shared ones stay with the others)
        done.clear()
    _expect(pool.num_free == pool.num_blocks, "parallel sampling leaked blocks")
    return SharingRun(used, entries, pool.num_copies, [])


def beam_search(prompt_len, width, output_len, share=True, block_size=BLOCK_SIZE, seed=7,
                picture_step=None, check=False):
    """Beam search with pruning over seeded random scores (no model): every step each beam
    proposes width candidates, the best width survive, a parent chosen by several
    survivors is forked, a parent chosen by none is freed. With check, every beam is
    compared with a plain-list history and every invariant is checked after every step."""
    for value, name, low in [(prompt_len, "prompt_len", 0), (width, "width", 1),
                             (output_len, "output_len", 0), (block_size, "block_size", 1)]:
        check_int(value, name, low)
    if picture_step is not None and check_int(picture_step, "picture_step", 0) >= output_len:
        raise ValueError(f"picture_step {picture_step} is past the last of {output_len} steps")
    rng = random.Random(seed)
    pool = BlockAllocator(width * (cdiv(prompt_len + output_len, block_size) + 1), block_size)
    prompt = random_tokens(rng, prompt_len)
    beams = [(0.0, Sequence(0, pool, prompt), prompt)]  # (log-prob, sequence, history)
    used, entries, picture, next_id = [pool.num_used], [pool.num_used], [], 1
    for step in range(output_len):
        best = sorted(((score + math.log(1 - rng.random()), i)
                       for i, (score, _, _) in enumerate(beams) for _ in range(width)),
                      reverse=True)[:width]
        picks = {}  # parent -> its surviving (score, token) candidates
        for (score, i), token in zip(best, random_tokens(rng, width)):  # tokens of survivors
            picks.setdefault(i, []).append((score, token))
        for i, (_, seq, _) in enumerate(beams):
            if i not in picks:
                seq.free()  # pruned: blocks it shares stay with the other beams
        survivors = []
        for i, (_, seq, history) in enumerate(beams):
            if i not in picks:
                continue
            for score, token in picks[i][:-1]:  # extra survivors fork; the parent goes on
                child = seq.fork(next_id) if share else Sequence(next_id, pool, seq.tokens)
                survivors.append((score, child, history + [token] if check else [token]))
                next_id += 1
            score, token = picks[i][-1]
            survivors.append((score, seq, history + [token] if check else [token]))
        for _, seq, history in survivors:  # forks first, then writes: copy-on-write
            seq.append(history[-1])
        beams = survivors
        used.append(pool.num_used)
        entries.append(table_entries(seq for _, seq, _ in beams))
        if step == picture_step:
            picture = block_map(pool, [seq for _, seq, _ in beams])
        if check:
            check_invariants(pool, [seq for _, seq, _ in beams])
            _expect(all(seq.read() == history for _, seq, history in beams),
                    "a beam does not read back its own history")
    copies = pool.num_copies
    for _, seq, _ in beams:
        seq.free()
    _expect(pool.num_free == pool.num_blocks, "beam search leaked blocks")
    return SharingRun(used, entries, copies, picture)


def draw_length(rng, mean, cap):
    """A length from an exponential distribution with this mean, in 1..cap.
    NOTE: the paper gives each dataset's means (its Fig. 11 shows long-tailed histograms);
    the exponential is the least-assuming distribution with a given mean, and long-tailed."""
    if not mean > 0:
        raise ValueError(f"a mean length must be > 0, got {mean!r}")
    return min(cap, max(1, round(rng.expovariate(1 / mean))))


def sharing_trace(dataset, kind, width, seed, block_size=BLOCK_SIZE):
    """SHARING_REQUESTS requests with drawn lengths; for "parallel", width samples each
    with its own output length; for "beam", width beams. Returns the runs."""
    if kind not in ("parallel", "beam"):
        raise ValueError(f"kind must be 'parallel' or 'beam', got {kind!r}")
    _, prompt_mean, output_mean = dataset
    rng, runs = random.Random(seed), []
    for request in range(SHARING_REQUESTS):
        prompt = draw_length(rng, prompt_mean, MAX_SEQ_LEN // 2)
        if kind == "parallel":
            outputs = [draw_length(rng, output_mean, MAX_SEQ_LEN - prompt) for _ in range(width)]
            runs.append(parallel_sampling(prompt, width, outputs, True, block_size,
                                          seed * 1000 + request))
        else:
            output = draw_length(rng, output_mean, MAX_SEQ_LEN - prompt)
            runs.append(beam_search(prompt, width, output, True, block_size,
                                    seed * 1000 + request))
    return runs


def demo_beam(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    first = 6 if seed is None else seed
    print("== beam: parallel sampling and beam search on forked sequences ==")
    print(f"1. a prompt, forked: block size {block_size}, {SHARING_REQUESTS} requests per "
          f"trace, lengths drawn around the paper's means")
    samples = 4
    for prompt_len in sorted({6 * block_size + max(1, block_size // 4), 6 * block_size},
                             reverse=True):
        run = parallel_sampling(prompt_len, samples, 8, block_size=block_size)
        mid_block = prompt_len % block_size != 0
        where = "mid-block" if mid_block else "on a block boundary"
        why = " (every writer but the last)" if mid_block else ""
        print(f"   prompt of {prompt_len} tokens ends {where}: {samples} samples make "
              f"{run.copies} copies{why}")
    prompt_len, width, output_len, size, step = 10, 4, 8, 4, 6  # small enough to draw
    print(f"2. the beams after step {step} (prompt {prompt_len}, width {width}, block size "
          f"{size}), one row per beam id, [block:ref-count]")
    print("\n".join(beam_search(prompt_len, width, output_len, block_size=size,
                                picture_step=step).picture))
    seeds = range(first, first + SHARING_SEEDS)
    savings = {}  # (dataset, kind) -> width -> [saving of each seed's trace]
    for dataset in (ALPACA, SHAREGPT):
        for kind, widths in (("parallel", NUM_SAMPLES), ("beam", BEAM_WIDTHS)):
            savings[dataset[0], kind] = {width: [saving(sharing_trace(
                dataset, kind, width, s, block_size)) for s in seeds] for width in widths}
    print_paper_comparison(savings, len(seeds))


def print_paper_comparison(savings, num_seeds):
    def span(values):
        return f"{min(values) * 100:.1f}-{max(values):.1%}"
    print(f"3. saved memory vs the paper (6.3), over {num_seeds} traces per cell, quoted:")
    print("\n".join(textwrap.wrap(f'"{PAPER_63["quote"]}"', 92, initial_indent="   ",
                                  subsequent_indent="   ")))
    print("   dataset   kind      ours, width by width (n or k)             paper       "
          "ours vs paper")
    for (name, kind), by_width in savings.items():
        low, high = PAPER_63[name, kind]
        by_width = {width: [round(value, 3) for value in values]  # decide on what is printed
                    for width, values in by_width.items()}
        per_seed = [[values[i] for values in by_width.values()] for i in range(num_seeds)]
        inside = sum(low <= min(seed) and max(seed) <= high for seed in per_seed)
        everything = [value for values in by_width.values() for value in values]
        where = ("inside" if low <= min(everything) and max(everything) <= high else
                 "above" if min(everything) > high else "below" if max(everything) < low
                 else "overlaps")
        cells = "".join(f"{width}: {span(values):<12}" for width, values in by_width.items())
        paper = f"{low * 100:.1f}-{high:.1%}"
        print(f"   {name:<9} {kind:<9} {cells:<42}{paper:<12}{where}, {inside}/{num_seeds} in")
    print("   (a cell: the range over traces; a trace's saving is over all its requests' steps;"
          " \"n/N in\":")
    print("   traces whose every width lands inside the paper's range)")


# ---------------------------------------------------------------------------------------
# Part 9. Extension: the block-size sweep
# ---------------------------------------------------------------------------------------
# Small blocks waste little at the end of each sequence but need long block tables (more
# metadata, more indirection for the attention kernel, more and smaller copies, finer but
# costlier sharing); large blocks are the reverse. Each measure below comes from running
# the workload through the allocators at each size.

SWEEP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TABLE_ENTRY_BYTES = 4        # bytes per block-table entry: int32, as in vLLM's block_tables
SWEEP_SYSTEM_LEN = 501       # tokens of a shared system prompt: odd, so sizes > 1 split it
MAX_FRAGMENTATION = 0.05     # the sweet spot's waste budget
SWEEP_SEEDS = 3              # workloads drawn per kind: the verdicts are counts over them
SWEEP_REQUESTS = 16          # requests per workload


def sweep_knob_problems():
    if len(SWEEP_SIZES) == 0 or not all(type(s) is int and s >= 1 for s in SWEEP_SIZES):
        return ["SWEEP_SIZES must be a non-empty tuple of ints >= 1"]
    if not 0 < MAX_FRAGMENTATION < 1:
        return [f"MAX_FRAGMENTATION must be in (0, 1), got {MAX_FRAGMENTATION}"]
    if min(TABLE_ENTRY_BYTES, SWEEP_SYSTEM_LEN) < 1:
        return ["TABLE_ENTRY_BYTES and SWEEP_SYSTEM_LEN must be >= 1 (the prefix reuse row "
                "measures a shared system prompt)"]
    if min(SWEEP_SEEDS, SWEEP_REQUESTS) < 1:
        return ["SWEEP_SEEDS and SWEEP_REQUESTS must be >= 1"]
    return []


@dataclass
class Workload:
    name: str
    description: str
    kv_slots: int   # tokens of KV for "sequences that fit", the same at every block size
    requests: list  # (prompt tokens, output tokens) pairs of token lists


def sweep_workloads(seed=8, num_requests=None):
    """An Alpaca-like and a ShareGPT-like workload: prompt and output lengths drawn around
    the paper's means (draw_length, Part 8), each with a KV budget about half of it fits."""
    rng = random.Random(seed)
    num_requests = check_int(SWEEP_REQUESTS if num_requests is None else num_requests,
                             "num_requests")
    workloads = []
    for (name, prompt_mean, output_mean), kv_slots in ((ALPACA, 512), (SHAREGPT, 4_096)):
        lengths = [(draw_length(rng, prompt_mean, MAX_SEQ_LEN // 2),
                    draw_length(rng, output_mean, MAX_SEQ_LEN // 2)) for _ in range(num_requests)]
        workloads.append(Workload(f"{name}-like", f"lengths around the paper's means "
                                  f"{prompt_mean:.0f}/{output_mean:.0f}", kv_slots,
                                  [(random_tokens(rng, p), random_tokens(rng, o))
                                   for p, o in lengths]))
    return workloads


@dataclass
class SweepRow:
    block_size: int
    fragmentation: float     # unused share of allocated slots
    entries_per_seq: float   # block-table entries per sequence
    table_bytes: int         # bytes of all block tables together
    fit: int                 # sequences admitted into the workload's kv_slots


def admit_and_generate(seq_id, pool, prompt, output):
    """Admit a request and generate its output, or refuse it before anything changes.
    (The check counts every block as new: exact on a plain pool, as the sweep uses.)"""
    pool.ensure_free(cdiv(len(prompt) + len(output), pool.block_size))  # check, then act
    seq = Sequence(seq_id, pool, prompt)
    seq.extend(output)
    return seq


def measure_block_size(workload, block_size):
    """Admit, generate and free the workload at block_size; measure what it cost.

    Requests go, in order, into a pool of the workload's kv_slots token slots until it
    refuses one: how many fit. That one and the rest go to a second pool with room for
    all, so fragmentation and tables are measured over every request.
    """
    check_int(block_size, "block_size")
    requests = workload.requests
    if len(requests) == 0:
        raise ValueError(f"workload {workload.name!r} has no requests to measure")
    total = sum(len(p) + len(o) for p, o in requests)
    budget = BlockAllocator(workload.kv_slots // block_size, block_size)
    rest = BlockAllocator(cdiv(total, block_size) + len(requests), block_size)
    seqs = []
    fit = admit_until_full(lambda i: seqs.append(admit_and_generate(i, budget, *requests[i])),
                           limit=len(requests))
    seqs += [admit_and_generate(i, rest, *requests[i]) for i in range(fit, len(requests))]
    slots = (budget.num_used + rest.num_used) * block_size
    fragmentation = (slots - sum(len(seq) for seq in seqs)) / slots
    entries = sum(len(seq.block_table) for seq in seqs)
    for seq in seqs:
        seq.free()
    _expect(budget.num_free == budget.num_blocks and rest.num_free == rest.num_blocks,
            "sweep: a pool is not whole after freeing")
    return SweepRow(block_size, fragmentation, entries / len(seqs),
                    entries * TABLE_ENTRY_BYTES, fit)


def prefix_reuse_lost(block_size, seed=10):
    """Share of a shared system prompt that a second request cannot take from the cache."""
    check_int(block_size, "block_size")
    rng = random.Random(seed)
    system = random_tokens(rng, SWEEP_SYSTEM_LEN)
    pool = PrefixCachingAllocator(2 * cdiv(SWEEP_SYSTEM_LEN + 50, block_size), block_size)
    Sequence("first", pool, system + random_tokens(rng, 50))
    hits = pool.hits
    Sequence("second", pool, system + random_tokens(rng, 50))
    return 1 - (pool.hits - hits) * block_size / SWEEP_SYSTEM_LEN


def sweet_spot(rows, max_fragmentation=None):
    """Tables, copies and per-block work all shrink as blocks grow, so grow them until the
    waste bites: the last size, going up, before fragmentation reaches max_fragmentation
    (None: MAX_FRAGMENTATION; the result is None if the smallest already does)."""
    max_fragmentation = MAX_FRAGMENTATION if max_fragmentation is None else max_fragmentation
    best = None
    for row in sorted(rows, key=lambda row: row.block_size):
        if row.fragmentation >= max_fragmentation:
            break
        best = row.block_size
    return best


def demo_sweep(block_size=BLOCK_SIZE, seed=None):
    check_section_args(block_size, seed)
    first = 8 if seed is None else seed
    print("== sweep: block size against fragmentation, block-table size, capacity, "
          "prefix reuse ==")
    print(f"prefix reuse lost: share of a {SWEEP_SYSTEM_LEN:,}-token shared system prompt "
          f"that a prefix cache cannot reuse")
    print("   block  " + "".join(f"{size:>7}" for size in SWEEP_SIZES))
    print("   lost   " + "".join(f"{prefix_reuse_lost(size, first + 2):>7.1%}"
                                 for size in SWEEP_SIZES))
    print(f"tables: {TABLE_ENTRY_BYTES}-byte entries; fit: sequences admitted into the "
          f"workload's KV budget")
    spots = {}  # workload name -> sweet spot of each seed
    for s in range(first, first + SWEEP_SEEDS):
        for workload in sweep_workloads(s):
            rows = [measure_block_size(workload, size) for size in SWEEP_SIZES]
            spots.setdefault(workload.name, []).append(sweet_spot(rows))
            if s == first:
                print_workload_lengths(workload)
                print_sweep_table(rows)
                print_sweep_chart(rows)
                print(f"   sweet spot: {spots[workload.name][0]} (grow the block until "
                      f"fragmentation would reach {MAX_FRAGMENTATION:.0%})")
    print_sweep_verdicts(spots)


PAPER_72 = ("In the ShareGPT trace, block sizes from 16 to 128 lead to the best performance. "
            "In the Alpaca trace, while the block size 16 and 32 work well, larger block sizes "
            "significantly degrade the performance since the sequences become shorter than "
            "the block sizes.")


def print_sweep_verdicts(spots):
    """The sweet spots of every seed against the paper's ranges (7.2), counted."""
    seeds = len(next(iter(spots.values())))
    print(f"vs the paper (7.2), over {seeds} seeds per workload, quoted:")
    print("\n".join(textwrap.wrap(f'"{PAPER_72}"', 92, initial_indent="   ",
                                  subsequent_indent="   ")))
    inside_all = 0
    for name, paper in (("ShareGPT-like", range(16, 129)), ("Alpaca-like", range(16, 33))):
        found = spots[name]
        inside = sum(spot is not None and spot in paper for spot in found)
        inside_all += inside
        print(f"   ours, {name}: sweet spots {', '.join(map(str, found))}; {inside} of {seeds} "
              f"inside {paper.start}-{paper.stop - 1}")
    longer = sum(a is None or (b is not None and b >= a)
                 for a, b in zip(spots["Alpaca-like"], spots["ShareGPT-like"]))
    print(f"   the longer workload's sweet spot is at least the shorter's in {longer} of "
          f"{seeds} seeds")
    if inside_all < 2 * seeds:
        print("   Where ours falls outside, we think the reason is what the sweet spot weighs: "
              "fragmentation only.")
        print("   The paper measured throughput, where small blocks also cost kernel speed "
              "(not modelled here).")


def print_workload_lengths(workload):
    def stats(lengths):
        lengths = sorted(lengths)
        p90 = lengths[math.ceil(0.9 * len(lengths)) - 1]  # nearest rank
        return (f"mean {sum(lengths) / len(lengths):,.0f}, median "
                f"{statistics.median(lengths):,g}, p90 {p90:,}")
    print(f"{workload.name}: {workload.description}; {len(workload.requests)} requests, "
          f"budget {workload.kv_slots:,} tokens")
    print(f"   prompts {stats(len(p) for p, _ in workload.requests)}; "
          f"outputs {stats(len(o) for _, o in workload.requests)}")


def print_sweep_table(rows):
    print("   block  fragmentation  entries/seq  tables KiB    fit")
    for row in rows:
        print(f"   {row.block_size:>5}  {row.fragmentation:>13.1%}  {row.entries_per_seq:>11.1f}"
              f"  {row.table_bytes / 1024:>10.1f}  {row.fit:>5}")


def print_sweep_chart(rows):
    """Two aligned bar charts: fragmentation (linear) and table bytes (log scale)."""
    worst = max(max(row.fragmentation for row in rows), 1e-9)  # a block size 1 wastes none
    low, high = (math.log2(f(row.table_bytes for row in rows)) for f in (min, max))
    span = max(high - low, 1e-9)  # one block size: one table size
    print(f"   block  fragmentation, 0 to {worst:.0%}{' ' * 17}block tables, log scale")
    for row in rows:
        frag_bar = "#" * round(30 * row.fragmentation / worst)
        table_bar = "#" * round(1 + 29 * (math.log2(row.table_bytes) - low) / span)
        print(f"   {row.block_size:>5}  |{frag_bar:<30} {row.fragmentation:>5.1%}  "
              f"|{table_bar:<30} {row.table_bytes / 1024:>6.1f} KiB")


# ---------------------------------------------------------------------------------------
# Part 10. Benchmark: O(1) per operation, whatever the pool size
# ---------------------------------------------------------------------------------------
# vLLM calls its block manager for every token of every running sequence, so it must be
# invisible: it moved its free queue to an intrusive linked list and its evictor from an
# O(n) scan to O(1) structures when the slow versions showed up in latency. Here the same
# operations are timed at pools of very different sizes; flat rows are the point.

BENCH_POOLS = (1_000, 100_000, 1_000_000)  # blocks
BENCH_REPEATS = 15
BENCH_FULL = 0.9  # the share of the pool in use when a free list and a scan are compared


def bench_knob_problems():
    if len(BENCH_POOLS) == 0 or not all(type(n) is int and n >= 100 for n in BENCH_POOLS) \
            or type(BENCH_REPEATS) is not int or BENCH_REPEATS < 1:
        return ["BENCH_POOLS must be ints >= 100 (a bench uses a 20th of the smallest) and "
                "BENCH_REPEATS an int >= 1"]
    if not 0 <= BENCH_FULL <= 0.99:
        return [f"BENCH_FULL must be in 0..0.99 (a share of the pool left in use), got "
                f"{BENCH_FULL}"]
    return []


def best_seconds(make_run, repeats):
    """Best time of make_run()() over repeats, with the garbage collector paused: setup
    stays outside the clock, and the least disturbed run is closest to the code's cost."""
    best = math.inf
    for _ in range(repeats):
        run = make_run()
        gc.disable()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
        gc.enable()
    return best


def bench_append(num_blocks, num_tokens, pool_class=BlockAllocator, block_size=BLOCK_SIZE):
    """Appends into a warm pool, whose blocks come back from the free list, as in a server
    that has run for a while (and as in the bare loop below). On a prefix-caching pool
    each block that fills is hashed and cached: the decode step of a served request."""
    def make_run():
        pool, tokens = pool_class(num_blocks, block_size), list(range(num_tokens))
        Sequence("warm-up", pool, tokens).free()
        seq = Sequence(0, pool)
        def run():
            append = seq.append
            for token in tokens:
                append(token)
        return run
    return make_run, num_tokens


def bench_bare_append(num_blocks, num_tokens, block_size=BLOCK_SIZE):
    """Only the unavoidable work: write the slot, take a block from a list at boundaries."""
    def make_run():
        free, tokens = list(range(num_blocks)), list(range(num_tokens))
        kv_cache = [None] * (num_blocks * block_size)
        def run():
            table, slot = [], 0
            for n, token in enumerate(tokens):
                offset = n % block_size
                if offset == 0:
                    block = free.pop()
                    table.append(block)
                    slot = block * block_size
                kv_cache[slot + offset] = token
        return run
    return make_run, num_tokens


def bench_allocate_free(num_blocks, count):
    """allocate + free on a warm pool (blocks come back from the free list), as above."""
    def make_run():
        pool = BlockAllocator(num_blocks)
        for block in pool.allocate_many(count):
            pool.free(block)
        def run():
            blocks = [pool.allocate() for _ in range(count)]
            for block in blocks:
                pool.free(block)
        return run
    return make_run, count


def bench_fork_free(num_blocks, seq_blocks, forks=20, block_size=BLOCK_SIZE):
    def make_run():
        seq = Sequence(0, BlockAllocator(num_blocks, block_size), range(seq_blocks * block_size))
        def run():
            for i in range(forks):
                seq.fork(i).free()
        return run
    return make_run, forks * seq_blocks


def bench_cache_admission(num_blocks, prompt_blocks, prompts, hit, block_size=BLOCK_SIZE):
    """Admit and free prompts on a prefix-caching pool: the same prompt every time (after a
    warm-up, every block a hit) or a new prompt every time (every block a miss)."""
    rng = random.Random(11)
    texts = [random_tokens(rng, prompt_blocks * block_size)
             for _ in range(1 if hit else prompts)]
    def make_run():
        pool = PrefixCachingAllocator(num_blocks, block_size)
        Sequence("warm-up", pool, texts[0]).free()
        order = [texts[0]] * prompts if hit else texts
        def run():
            for i, text in enumerate(order):
                Sequence(i, pool, text).free()
        return run
    return make_run, prompts * prompt_blocks


class ScanningAllocator:
    """The slow way, for comparison: search the ref-counts for a free block on every call
    (list.index runs in C, and it is still O(pool))."""

    def __init__(self, num_blocks, num_used=0):
        self.ref_cnt = [1] * num_used + [0] * (num_blocks - num_used)

    def allocate(self):
        block = self.ref_cnt.index(0)
        self.ref_cnt[block] = 1
        return block

    def free(self, block):
        self.ref_cnt[block] = 0


def bench_free_list(num_blocks, calls=200):
    """allocate + free on a pool BENCH_FULL full."""
    def make_run():
        pool = BlockAllocator(num_blocks)
        pool.allocate_many(int(num_blocks * BENCH_FULL))
        def run():
            for _ in range(calls):
                pool.free(pool.allocate())
        return run
    return make_run, calls


def bench_scan(num_blocks, calls=20):
    """allocate + free on a pool BENCH_FULL full, its free blocks at the far end."""
    def make_run():
        pool = ScanningAllocator(num_blocks, num_used=int(num_blocks * BENCH_FULL))
        def run():
            for _ in range(calls):
                pool.free(pool.allocate())
        return run
    return make_run, calls


def interleaved_ns_per_op(benches, repeats):
    """Best ns per operation of each bench, taking turns so every bench sees the same
    machine (a warm-up or a noisy neighbour hits all of them, not the first one)."""
    best = [math.inf] * len(benches)
    for _ in range(repeats):
        for i, (make_run, ops) in enumerate(benches):
            best[i] = min(best[i], best_seconds(make_run, 1) / ops * 1e9)
    return best


def demo_bench(block_size=BLOCK_SIZE, seed=None, pools=None, repeats=None):
    """The bench section; pools and repeats default to BENCH_POOLS and BENCH_REPEATS."""
    check_section_args(block_size, seed)
    pools = BENCH_POOLS if pools is None else pools
    repeats = BENCH_REPEATS if repeats is None else repeats
    print(f"== bench: cost per operation at pools of {', '.join(f'{n:,}' for n in pools)} "
          f"blocks (best of {repeats}) ==")
    smallest = pools[0]
    rows = [
        ("append, per token", lambda n: bench_append(
            n, smallest * block_size // 2, BlockAllocator, block_size)),
        ("append, prefix-caching pool", lambda n: bench_append(
            n, smallest * block_size // 2, PrefixCachingAllocator, block_size)),
        ("allocate + free, per block", lambda n: bench_allocate_free(n, smallest // 2)),
        ("fork + free, per block shared", lambda n: bench_fork_free(
            n, smallest // 20, block_size=block_size)),
        ("cache admission, hit, per block",
         lambda n: bench_cache_admission(n, smallest // 20, 20, True, block_size)),
        ("cache admission, miss, per block",
         lambda n: bench_cache_admission(n, smallest // 20, 20, False, block_size)),
    ]
    print(f"1. scaling, ns per operation {'':>9}" + "".join(f"{n:>12,}" for n in pools)
          + "   largest/smallest")
    for label, bench in rows:
        times = interleaved_ns_per_op([bench(n) for n in pools], repeats)
        print(f"   {label:<35}" + "".join(f"{t:>12.0f}" for t in times)
              + f"   {times[-1] / times[0]:>15.2f}x")
    print(f"   (target: largest/smallest <= {SCALING_TARGET}x on every row)")
    bench_against_the_limit(smallest, repeats, block_size)
    bench_free_list_vs_scan(pools, repeats)
    bench_memory(pools[-1], block_size)


APPEND_TARGET = 5   # plain append may cost this many times the bare loop
CACHING_TARGET = 2  # append on a prefix-caching pool, this many times plain append
SCALING_TARGET = 1.3  # the largest pool's cost per operation over the smallest's


def bench_against_the_limit(num_blocks, repeats, block_size):
    num_tokens = num_blocks * block_size // 2
    ours, caching, bare = interleaved_ns_per_op([
        bench_append(num_blocks, num_tokens, BlockAllocator, block_size),
        bench_append(num_blocks, num_tokens, PrefixCachingAllocator, block_size),
        bench_bare_append(num_blocks, num_tokens, block_size)], repeats)
    print(f"2. append vs a bare inline loop (write the slot, pop a block at each boundary), "
          f"{platform.python_implementation()} {platform.python_version()}:")
    print(f"   Sequence.append {ours:.0f} ns/token, bare loop {bare:.0f} ns/token: "
          f"{ours / bare:.1f}x (target <= {APPEND_TARGET}x)")
    print(f"   on a prefix-caching pool {caching:.0f} ns/token: {caching / ours:.1f}x plain "
          f"append (target <= {CACHING_TARGET}x;")
    print(f"   it hashes a block every {block_size} tokens)")


def bench_free_list_vs_scan(pools, repeats):
    print(f"3. why a free list: allocate + free at a pool {BENCH_FULL:.0%} full, ns per call")
    print("   pool blocks     free list   scanning (list.index)   scan / free list")
    for n in pools:
        free_list, scan = interleaved_ns_per_op([bench_free_list(n), bench_scan(n)], repeats)
        print(f"   {n:>11,}  {free_list:>12.0f}  {scan:>22.0f}  {scan / free_list:>16,.0f}x")


def bench_memory(num_blocks, block_size):
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = BlockAllocator(num_blocks, block_size)
    idle = tracemalloc.get_traced_memory()[0] - base
    pool.allocate_many(num_blocks)  # fresh blocks: 0..num_blocks-1
    in_use = tracemalloc.get_traced_memory()[0] - base
    for block in range(num_blocks):
        pool.free(block)
    freed = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(f"4. allocator memory at {num_blocks:,} blocks (tracemalloc; the KV store, "
          f"{pool.block_size} slots per block, included):")
    print(f"   idle pool {idle:,} bytes; every block in use {in_use / num_blocks:.0f} "
          f"bytes/block; all freed again {freed / num_blocks:.0f} bytes/block")


# ---------------------------------------------------------------------------------------
# Part 11. Extension: a real trace through the prefix cache, against the offline optimum
# ---------------------------------------------------------------------------------------
# The question a serving engineer brings: on my traffic, how big must the cache be, and
# how far is LRU from the best any policy could do? Mooncake's FAST'25 traces
# (kvcache-ai/Mooncake, FAST25-release/traces/, Apache-2.0) give, per request, an arrival
# time, lengths, and one hash id per 512-token block of the prompt; equal ids mean an
# equal prefix. This part replays them through PrefixCachingAllocator and Sequence, one
# request at a time, under three eviction policies and many pool sizes.

TRACE_ID_TOKENS = 512  # tokens each Mooncake hash id stands for
TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
TRACE_HELP = ("trace needs a Mooncake-format JSONL file: python solution.py trace PATH "
              "[--requests N]; the FAST'25 traces are in FAST25-release/traces/ of the "
              "kvcache-ai/Mooncake repository (conversation_trace.jsonl, "
              "synthetic_trace.jsonl)")


@dataclass
class TraceRequest:
    timestamp: float   # ms since the trace began
    input_length: int  # tokens of prompt
    output_length: int  # tokens generated
    hash_ids: list     # one id per 512-token block of the prompt, the last maybe partial


def load_trace(path, limit=None):
    """The first limit requests (all if None) of a Mooncake-format JSONL file. ValueError
    naming the line for anything malformed; OSError if the file cannot be read."""
    if limit is not None:
        check_int(limit, "limit")
    requests = []
    with open(path, encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, 1):
                if limit is not None and len(requests) == limit:
                    break
                if line.strip() == "":
                    continue
                requests.append(parse_trace_line(line, f"{path}:{number}"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text; a trace is Mooncake-format JSONL, one "
                             f"request per line") from None
    return requests


def parse_trace_line(line, where):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg}); a trace is Mooncake-format "
                         f"JSONL, one request per line") from None
    if not isinstance(record, dict) or any(field not in record for field in TRACE_FIELDS):
        raise ValueError(f"{where}: a request needs the fields {', '.join(TRACE_FIELDS)}")
    timestamp, input_length, output_length, hash_ids = (record[f] for f in TRACE_FIELDS)
    if type(timestamp) not in (int, float) or not 0 <= timestamp < math.inf:  # NaN too
        raise ValueError(f"{where}: timestamp must be a finite number >= 0, got {timestamp!r}")
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}: {name} must be an int >= 0, got {value!r}")
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of ints >= 0")
    if len(hash_ids) != cdiv(input_length, TRACE_ID_TOKENS):
        raise ValueError(f"{where}: {len(hash_ids)} hash_ids for input_length {input_length} "
                         f"(one per {TRACE_ID_TOKENS} tokens: "
                         f"{cdiv(input_length, TRACE_ID_TOKENS)})")
    return TraceRequest(timestamp, input_length, output_length, hash_ids)


def trace_prompt(request, block_size):
    """The prompt the replay admits: each hash id h becomes one block of block_size tokens
    h * block_size + k; a partial last id (input_length % 512 != 0) keeps
    min(block_size - 1, max(1, rem * block_size // 512)) of them, so it is never full.

    Example: block_size 4, input_length 1100, hash_ids [7, 9, 3]: ids 7 and 9 are full
    (tokens 28..31, 36..39); 76 tokens remain, so id 3 keeps max(1, 76 * 4 // 512) = 1
    token: 12. Block-level reuse is what a prefix cache sees, so with room for everything
    the scale does not change which blocks hit; under pressure a request's partial and
    decode blocks (one or two) take room in the pool too, so hits move a little with it.
    """
    full = request.input_length // TRACE_ID_TOKENS
    tokens = list(itertools.chain.from_iterable(
        range(h * block_size, (h + 1) * block_size) for h in request.hash_ids[:full]))
    partial = trace_partial_len(request, block_size)  # 0 when no id is partial (or none)
    last = request.hash_ids[-1] * block_size if partial > 0 else 0
    return tokens + list(range(last, last + partial))


def trace_partial_len(request, block_size):
    """Tokens kept of a partial last id: 0 if the prompt ends on an id's boundary."""
    rem = request.input_length % TRACE_ID_TOKENS
    return 0 if rem == 0 else min(block_size - 1, max(1, rem * block_size // TRACE_ID_TOKENS))


def trace_decode_len(request, block_size):
    """Fresh tokens appended after the prompt, at the prompt's scale (at least one)."""
    return max(1, request.output_length * block_size // TRACE_ID_TOKENS)


def trace_blocks_needed(request, block_size):
    full = request.input_length // TRACE_ID_TOKENS
    return cdiv(full * block_size + trace_partial_len(request, block_size)
                + trace_decode_len(request, block_size), block_size)


def trace_ceiling(requests):
    """(hits, full prompt blocks) of a cache that never forgets: in each request, the
    leading full blocks whose id an earlier request already had."""
    seen, hits, total = set(), 0, 0
    for request in requests:
        full = request.input_length // TRACE_ID_TOKENS
        k = 0
        while k < full and request.hash_ids[k] in seen:
            k += 1
        hits, total = hits + k, total + full
        seen.update(request.hash_ids[:full])
    return hits, total


class OptimalPolicy(KeyedPolicy):
    """Belady's offline optimum: evict the evictable block whose next use is farthest away,
    blocks never used again first; on a tie, the deeper block (it needs its parent).

    NOTE: farthest-next-use is the optimum for one cache of equal-size pages. A prefix
    cache adds one twist: a block hits only if its parent does. But every request that
    uses a child uses its parent, so a child's next use is never before its parent's, and
    the tie goes to the child: the policy never keeps a child it cannot reach. The replay
    sets next_use, which needs the future."""

    def __init__(self):
        super().__init__()
        self.next_use = {}  # block -> (index of the next request using it, depth)

    def key(self, block):
        next_request, depth = self.next_use.get(block, (math.inf, 0))
        return -next_request, -depth  # the smallest key: the farthest use, the deepest block


def next_uses(requests):
    """For each request, for each full prompt block: the index of the next request that
    has the same hash id (math.inf if none)."""
    later, table = {}, [None] * len(requests)
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids[:requests[i].input_length // TRACE_ID_TOKENS]
        table[i] = [later.get(h, math.inf) for h in ids]
        later.update(dict.fromkeys(ids, i))
    return table


def replay_trace(requests, num_blocks, policy="lru", block_size=BLOCK_SIZE, uses=None):
    """Replay requests in order on a fresh PrefixCachingAllocator(num_blocks, block_size)
    with this eviction policy ("lru", "fifo", "optimal" or a policy object): admit the
    prompt (trace_prompt), append the decode tokens one at a time from a counter above
    every prompt token, free. Returns the pool (.hits, .misses, .hit_rate). uses: the
    next_uses(requests) table, if the caller has it already."""
    check_int(block_size, "block_size")
    need = max((trace_blocks_needed(r, block_size) for r in requests), default=0)
    if check_int(num_blocks, "num_blocks") < need:
        raise ValueError(f"num_blocks {num_blocks} cannot hold the trace's longest request "
                         f"({need} blocks at block size {block_size})")
    optimal = OptimalPolicy() if policy == "optimal" else None
    pool = PrefixCachingAllocator(num_blocks, block_size,
                                  policy if optimal is None else optimal)
    if optimal is not None and uses is None:
        uses = next_uses(requests)
    top = max((h for r in requests for h in r.hash_ids), default=-1)
    fresh = itertools.count((top + 1) * block_size)  # above every prompt token
    for i, request in enumerate(requests):
        seq = Sequence(i, pool, trace_prompt(request, block_size))
        for _ in range(trace_decode_len(request, block_size)):
            seq.append(next(fresh))
        if optimal is not None:  # what the future says of each block, before it is freed
            for depth, block in enumerate(seq.block_table):
                if depth < len(uses[i]):
                    optimal.next_use[block] = (uses[i][depth], depth)
                else:
                    optimal.next_use.pop(block, None)  # decode or partial: never again
        seq.free()
    return pool


TRACE_POLICIES = ("lru", "fifo", "optimal")
TRACE_SIZES = 6  # pool sizes on a log scale from the longest request to "never evicts"
KNEE = 0.9  # the share of the ceiling where a hit-rate curve counts as flattened
CHART_CELL = 9  # characters per pool size in the trace chart, after an 11-character margin


def trace_knob_problems():
    most = (100 - 11) // CHART_CELL - 1  # sizes that fit 100 columns, the 3M-token pool aside
    problems = [] if type(TRACE_SIZES) is int and 2 <= TRACE_SIZES <= most else [
        f"TRACE_SIZES must be an int in 2..{most} (the smallest and the largest pool; the "
        f"chart fits {most + 1} pool sizes in 100 columns, the 3M-token pool among them)"]
    if not 0 < KNEE <= 1:
        problems.append(f"KNEE must be in (0, 1] (a share of the ceiling), got {KNEE}")
    return problems


def never_evicts(requests, block_size):
    """A replay on a pool with room for every block ever written: its peak use
    (pool.next_unused) is the smallest pool that never evicts on this trace."""
    room = sum(trace_blocks_needed(r, block_size) for r in requests)
    return replay_trace(requests, max(1, room), "lru", block_size)


def trace_sizes(smallest, largest, count, extra=()):
    """count pool sizes spaced evenly on a log scale, plus extra ones inside the range."""
    ratio = (largest / smallest) ** (1 / max(1, count - 1))
    sizes = {round(smallest * ratio ** k) for k in range(count)} | {largest}
    return sorted(sizes | {size for size in extra if smallest < size < largest})


_TRACE = None  # (requests, block_size) in a replay worker process: see replay_job


def _trace_worker(requests, block_size):
    global _TRACE
    _TRACE = (requests, block_size, next_uses(requests))


def replay_job(job):
    """One replay in a worker (the trace, and the future the optimum reads, are handed
    over once per worker, not per job)."""
    policy, num_blocks = job
    requests, block_size, uses = _TRACE
    pool = replay_trace(requests, num_blocks, policy, block_size, uses)
    return policy, num_blocks, pool.hits, pool.misses


def replay_all(requests, sizes, block_size, known=None, workers=2):
    """hits[(policy, size)] for every policy and size (known: ones already replayed);
    progress on stderr."""
    hits, tty = dict(known or {}), sys.stderr.isatty()
    jobs = [(policy, size) for size in sorted(sizes, reverse=True) for policy in TRACE_POLICIES
            if (policy, size) not in hits]
    with multiprocessing.Pool(workers, _trace_worker, (requests, block_size)) as workers_pool:
        for done, (policy, size, got, _) in enumerate(
                workers_pool.imap_unordered(replay_job, jobs), 1):
            hits[policy, size] = got
            line = f"trace: replayed {done}/{len(jobs)} ({policy}, {size:,} blocks)"
            print(f"\r{line:<60}" if tty else line, end="" if tty else "\n", file=sys.stderr,
                  flush=True)
    if tty:
        print(file=sys.stderr)
    return hits


def demo_trace(path, limit=None, block_size=BLOCK_SIZE):
    requests = load_trace(path, limit)
    if len(requests) == 0:
        raise ValueError(f"{path}: no requests")
    ceiling, total = trace_ceiling(requests)
    if total == 0:
        raise ValueError(f"{path}: no prompt fills a {TRACE_ID_TOKENS}-token hash id, so a "
                         f"prefix cache has nothing to reuse")
    longest = max(trace_blocks_needed(r, block_size) for r in requests)
    infinite = never_evicts(requests, block_size)
    roomy = infinite.next_unused
    three_m = cdiv(3_000_000, TRACE_ID_TOKENS)  # the paper's 3M-token local cache, in ids
    sizes = trace_sizes(longest, roomy, TRACE_SIZES, extra=(three_m,))
    hits = replay_all(requests, sizes, block_size, {("lru", roomy): infinite.hits})
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    print(f"== trace: {len(requests):,} requests of {name} through the prefix cache ==")
    print(f"{total:,} full prompt blocks (one per hash id, {TRACE_ID_TOKENS} tokens each; "
          f"block size {block_size} in the replay)")
    print(f"ceiling, a cache that never forgets: {ceiling:,} hits = {ceiling / total:.1%}; "
          f"the replay on {roomy:,} blocks")
    print(f"(which never evicts) gets {infinite.hits:,}: "
          f"{'equal' if infinite.hits == ceiling else 'NOT EQUAL'}; tokens below: blocks x "
          f"{TRACE_ID_TOKENS}, the trace's scale")
    print_trace_table(sizes, hits, total, ceiling)
    print_trace_chart(sizes, hits, total, ceiling)
    print_trace_answers(sizes, hits, total, ceiling, three_m, name)


def print_trace_table(sizes, hits, total, ceiling):
    print(f"   pool blocks   {f'tokens (x{TRACE_ID_TOKENS})':>13}      LRU     FIFO  optimal   "
          f"LRU/optimal  optimal/ceiling")
    for size in sizes:
        rates = [hits[policy, size] / total for policy in TRACE_POLICIES]
        share = hits["lru", size] / max(1, hits["optimal", size])
        print(f"   {size:>11,}   {size * TRACE_ID_TOKENS:>13,}   " + "  ".join(
            f"{rate:>7.1%}" for rate in rates) + f"   {share:>11.0%}  "
            f"{hits['optimal', size] / max(1, ceiling):>15.0%}")


def print_trace_chart(sizes, hits, total, ceiling, height=10):
    """Hit rate (rows) against pool size (columns, log scale): L lru, F fifo, O optimal;
    * where marks fall on one cell; the top row is the ceiling."""
    print(f"   hit rate against pool size (L LRU, F FIFO, O optimal, * several; top = "
          f"ceiling {ceiling / total:.1%})")
    cells = {}
    for column, size in enumerate(sizes):
        for policy, mark in zip(TRACE_POLICIES, "LFO"):
            row = round(height * hits[policy, size] / max(1, ceiling))
            cells[row, column] = mark if (row, column) not in cells else "*"
    for row in range(height, -1, -1):
        label = f"{row / height * ceiling / total:6.1%}" if row % 5 == 0 else " " * 6
        print((f"   {label} |" + "".join(f"{cells.get((row, c), ' '):^{CHART_CELL}}"
                                        for c in range(len(sizes)))).rstrip())
    print("          +" + "-" * CHART_CELL * len(sizes))
    print(("   blocks  " + "".join(f"{size:^{CHART_CELL},}" for size in sizes)).rstrip())


def smallest_reaching(sizes, hits, policy, target):
    reached = [size for size in sizes if hits[policy, size] >= target]
    return f"{min(reached):,} blocks" if len(reached) > 0 else "none of these sizes"


def print_trace_answers(sizes, hits, total, ceiling, three_m, name):
    def say(text):
        print("\n".join(textwrap.wrap(text, 96, initial_indent="   ",
                                      subsequent_indent="   ")))
    for share in (0.5, KNEE):
        say(f"{share:.0%} of the ceiling: LRU at "
            f"{smallest_reaching(sizes, hits, 'lru', share * ceiling)}, the optimum at "
            f"{smallest_reaching(sizes, hits, 'optimal', share * ceiling)}")
    knee = [size for size in sizes if hits["optimal", size] >= KNEE * ceiling]
    if len(knee) > 0:
        gap = (hits["optimal", knee[0]] - hits["lru", knee[0]]) / total
        say(f"at the knee ({knee[0]:,} blocks, where the optimum first reaches {KNEE:.0%} of the "
            f"ceiling), LRU leaves {gap:.1%} of full prompt blocks on the table")
    at_3m = hits["lru", three_m] / max(1, ceiling) if ("lru", three_m) in hits else None
    print("Quoted, Mooncake (FAST'25), on its conversation trace:")
    say('"the workload has an average of approximately 40% prefix caching ratio brought '
        'about by multi-turn conversations"')
    say("its Table 2 gives the cache ratio of each trace: conversation 40%, synthetic 66%")
    say(f"ours, {name}: a ceiling of {ceiling / total:.1%} of full prompt blocks")
    say('"a local cache with a 3M token capacity does not achieve 50% of the theoretical '
        'maximum hit rate in most scenarios"')
    say("ours: no pool here is 3M tokens" if at_3m is None else
        f"ours: LRU at 3M tokens ({three_m:,} blocks) reaches {at_3m:.0%} of the ceiling, "
        f"{'under' if at_3m < 0.5 else 'not under'} 50%")
    print("Quoted, Mooncake (arXiv report), on its earlier trace, not this one:")
    say('"LRUCache performs best under this dataset\'s patterns"')
    lru_vs = sum(hits["lru", s] >= hits["fifo", s] for s in sizes)
    say(f"ours: LRU >= FIFO at {lru_vs} of {len(sizes)} sizes; the optimum is >= both at "
        f"{sum(hits['optimal', s] >= max(hits['lru', s], hits['fifo', s]) for s in sizes)}")


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

SECTIONS = {  # the default run, in reading order
    "checks": run_checks,
    "pitfalls": demo_pitfalls,
    "memory": demo_memory,
    "sharing": demo_sharing,
    "cache": demo_cache,
    "evict": demo_evict,
    "beam": demo_beam,
    "sweep": demo_sweep,
}
ON_REQUEST = {"bench": demo_bench}  # timings: run only when named


def knob_problems_all(block_size):
    """Every reason the constants and this block size cannot run together."""
    if type(block_size) is not int or not 1 <= block_size <= MAX_BLOCK_SIZE:  # the default
        return [f"BLOCK_SIZE must be an int in 1..{MAX_BLOCK_SIZE}, got {block_size!r}"]
    return (knob_problems(block_size) + cache_knob_problems(block_size)
            + evict_knob_problems(block_size) + beam_knob_problems() + sweep_knob_problems()
            + bench_knob_problems() + trace_knob_problems())


def section_output(name, block_size, seed):
    """What a section prints, as a string (run in a worker process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        SECTIONS[name](block_size=block_size, seed=seed)
    return out.getvalue()


def run_in_parallel(names, block_size, seed, workers=2):
    """Each section's output, in the order named, from workers that start with the
    costliest sections. NOTE: the sections share nothing, so the default run uses both
    cores; the output is the same as running them one by one."""
    costliest_first = sorted(names, key=lambda name: -SECTION_COST.get(name, 0))
    with multiprocessing.Pool(workers) as pool:
        pending = {name: pool.apply_async(section_output, (name, block_size, seed))
                   for name in costliest_first}
        return [pending[name].get() for name in names]


SECTION_COST = {"beam": 3, "evict": 3, "sweep": 2, "cache": 1}  # rough shares of the run


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        """Exit with status 2 and one line naming what was wrong (no usage dump)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_option(low, high=None):
    """An argparse type: an int in low..high, or an error naming the option."""
    def parse(text):
        span = f"in {low}..{high}" if high is not None else f">= {low}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int {span}, got {text!r}")
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an int {span}, got {value}")
        return value
    return parse


def main(argv=None):
    every = {**SECTIONS, **ON_REQUEST}
    parser = OneLineParser(
        prog="solution.py",
        description="The paged KV-cache lab: run every section, or only the ones named.")
    parser.add_argument("sections", nargs="*", metavar="SECTION",
                        help=f"any of: {', '.join(every)}, trace PATH (default: all "
                             f"but {', '.join(ON_REQUEST)} and trace, in this order)")
    parser.add_argument("--block-size", type=int_option(1, MAX_BLOCK_SIZE),
                        default=BLOCK_SIZE, metavar="N",
                        help=f"tokens per block, 1..{MAX_BLOCK_SIZE} (default {BLOCK_SIZE}); "
                             f"pools and workloads are sized in tokens")
    parser.add_argument("--seed", type=int_option(0), default=None, metavar="N",
                        help="seed every workload with N (default: the lab's own seeds)")
    parser.add_argument("--requests", type=int_option(1), default=None, metavar="N",
                        help="trace: replay only the first N requests of the file")
    args = parser.parse_args(argv)
    names, trace_path = list(args.sections), None
    if names.count("trace") > 1:
        parser.error("trace PATH can be given once per run")
    if "trace" in names:  # trace PATH: the word after "trace" is the file
        at = names.index("trace")
        if at + 1 >= len(names) or names[at + 1] in every:
            parser.error(TRACE_HELP)
        trace_path = names.pop(at + 1)
    if args.requests is not None and trace_path is None:
        parser.error("--requests applies to trace PATH only (no other section replays a file)")
    unknown = [name for name in names if name not in every and name != "trace"]
    if len(unknown) > 0:
        parser.error(f"unknown section {', '.join(map(repr, unknown))}; choose from "
                     f"{', '.join([*every, 'trace PATH'])}")
    problems = knob_problems_all(args.block_size)
    if len(problems) > 0:
        parser.error(f"a knob cannot work: {problems[0]}")
    if len(names) == 0:  # the default run
        print("\n".join(run_in_parallel(list(SECTIONS), args.block_size, args.seed)), end="")
        return
    for i, name in enumerate(names):
        if i > 0:
            print()
        if name == "trace":
            try:
                demo_trace(trace_path, args.requests, args.block_size)
            except BrokenPipeError:
                raise  # the reader of the output went away: not the trace file's fault
            except (OSError, ValueError) as error:  # a missing file, a malformed line
                parser.error(str(error))
        else:
            every[name](block_size=args.block_size, seed=args.seed)


if __name__ == "__main__":
    try:
        main()
        sys.stdout.flush()  # a broken pipe shows here, not at exit
    except BrokenPipeError:  # the reader stopped early (python solution.py | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python docs' recipe
        sys.exit(1)
