"""
The paged KV-cache lab
======================

A transformer keeps, for every token it has seen, that token's key and value vectors: the
KV cache. Serving many requests at once is mostly a question of where those vectors live.
Before vLLM, servers reserved one contiguous region per request, sized for the longest
answer it might give, and wasted most of it. PagedAttention (Kwon et al., SOSP 2023) took
the operating system's answer: cut the cache into fixed-size *blocks*, give each request a
*block table* from its logical positions to physical blocks, allocate a block only when the
last one is full, and let requests that share a prefix point at the same physical blocks,
copying one only when somebody writes into it (copy-on-write).

This file is that memory manager without the attention math: the "KV" a slot stores is the
token id itself, so every sequence reads back through its block table, checked against a
plain list. Read it top to bottom; each part builds on the ones above it.

    Part 1  the block pool ........... KVCache (slots), BlockAllocator (free list, ref-counts)
    Part 2  block tables, sequences .. BlockTable, Sequence: blocks on demand, fork, copy-on-write
    Part 3  sharing a prefix ......... share_prefix
    Part 4  checks ................... check_invariants, a randomized oracle, the pitfalls
    Part 5  demos .................... memory efficiency, prefix sharing, a block map
    Part 6  prefix caching ........... one seam, two indexes: vLLM's hash chain and its block
                                       policies (6a, 6c), SGLang's radix tree of leaves (6b)
    Part 7  preemption ............... recompute vs swap; the paper's 7.3 (Fig. 19)
    Part 8  parallel sampling, beams . fork and prune; the paper's 6.3 (Fig. 15)
    Part 9  block-size sweep ......... fragmentation against block-table size; the paper's 7.2
    Part 10 benchmark ................ O(1) per operation; admission against the hash alone
    Part 11 a real trace ............. online policies against the offline optimum
    Part 12 a fleet .................. where a request goes among prefill instances (Mooncake)
    Part 13 hybrid models ............ sliding-window and full-attention groups on one pool

    python solution.py                 # the core: checks, pitfalls, memory, sharing
    python solution.py all             # and the extensions but bench, trace and fleet
    python solution.py trace PATH      # replay a Mooncake trace; fleet PATH: on a fleet
    python solution.py starter 1 FILE  # this lab with step 1's bodies removed: write them
    LAB_FILE=FILE python -m pytest test_solution.py  # the tests, on FILE (default: this one)

Where the ideas come from:
    paper:  Kwon et al., "Efficient Memory Management for Large Language Model Serving
            with PagedAttention", SOSP 2023 (arXiv 2309.06180), sections 4, 6.3, 7.2, 7.3;
            Qin et al., "Mooncake", USENIX FAST 2025 (its traces: Part 11; its fleet: 12)
    vLLM:   vllm/v1/core/block_pool.py, kv_cache_utils.py, kv_cache_manager.py (v1: the
            free queue, ref_cnt, hash_block_tokens, get_computed_blocks); vllm/core/block/
            (v0, since removed by PR #25321: copy-on-write, swapping); v1's
            kv_cache_coordinator.py and single_type_kv_cache_manager.py,
            docs/design/hybrid_kv_cache_manager.md (Part 13)
    SGLang: python/sglang/srt/mem_cache/radix_cache.py and evict_policy.py; sgl-router's
            cache_aware policy

Glossary (one word per idea; the code uses these and no others)
    pool            a BlockAllocator: a fixed number of physical blocks
    block           block_size token slots (16 here, as in vLLM)
    slot            a token's place in the flat KV cache: block b, offset o is b * block_size + o
    prefill, decode writing a prompt's tokens at once (extend); then one per step (append)
    block table     a sequence's map from logical block i to a physical block id
    ref-count       how many block tables point at a physical block (vLLM: ref_cnt)
    share           take one more reference to a block; sequences share a prefix this way
    copy-on-write   before writing into a block another reference can see, copy it
    block hash      a full block's identity: SHA-256 of its tokens and its parent's hash
    index           what finds, keeps and evicts cached blocks: a hash chain, or a radix tree
    seam            the events a caching pool tells its index of: match, lock, insert,
                    release, evict(n), check
    hit             a full prompt block found in the cache, reused, not prefilled
    evictable       a cached block nobody references: free, but kept until memory is needed
    policy          which evictable block goes first: for the hash chain a block policy (LRU,
                    FIFO, S3-FIFO, a look-ahead), for the radix tree a leaf priority
    cached          a full block its index holds, in use or evictable
    lock            a match taken into use: a locked block (radix: node) is never evicted
    group           a KV cache group: layers of one attention type sharing a block table
    window          a sliding window of W tokens: a group that keeps only the last W
"""

import argparse
import ast
import bisect
import gc
import hashlib
import heapq
import inspect
import itertools
import json
import math
import pathlib
import pickle
import platform
import random
import re
import sys
import textwrap
import time
import tracemalloc
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

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
    """value if it is an int >= low; else TypeError or ValueError naming it."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return value


def check_tokens(tokens):
    """tokens as a list, if each is an int >= 0; else TypeError or ValueError naming it."""
    token_ids = list(tokens)  # TypeError if tokens is not iterable
    if [*map(type, token_ids)] != [int] * len(token_ids) or min(token_ids, default=0) < 0:
        for token in token_ids:  # raises at the first bad one
            check_int(token, "a token id", 0)
    return token_ids


class KVCache:
    """The memory the blocks stand for: slots, one flat list; offset o of block b is slot
    b * block_size + o (block_size 4: block 2, offset 1 -> slot 9). A slot holds a token id as
    its "KV" (None: never written), never cleared; Part 2's append writes a slot of slots directly.
    NOTE: vLLM makes its KV tensor at start-up; grow adds a block's slots on first hand-out."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.slots = []  # slot -> token id

    def grow(self):  # the next block's slots, None: never written
        self.slots += [None] * self.block_size

    def write(self, block, offset, token_ids):
        """Store token_ids in block from offset on, with one slice (they fit in the block)."""
        start = block * self.block_size + offset
        self.slots[start:start + len(token_ids)] = token_ids

    def copy(self, src, dst):  # dst's slots become src's
        self.slots[dst * self.block_size:(dst + 1) * self.block_size] = self.read(src)

    def read(self, block):
        """A copy of block's slots (a block never handed out: all None)."""
        slots = self.slots[block * self.block_size:(block + 1) * self.block_size]
        return slots + [None] * (self.block_size - len(slots))

    def gather(self, slot_mapping):
        """The token in each slot of slot_mapping (vLLM writes KV by slot_mapping; its attention
        reads through the block table)."""
        return [self.slots[slot] for slot in slot_mapping]


class BlockAllocator:
    """A fixed pool of physical blocks: a free list and a ref-count per block in use.
    Invariant: a block is in use exactly when ref_cnt holds it (ref-count >= 1), free otherwise,
    so num_free + num_used == num_blocks. Every operation is O(1) per block. State later parts
    read: num_blocks, block_size (its arguments); ref_cnt, block -> references;
    free_block_ids, blocks given back, reused last in, first out; next_unused, the blocks
    next_unused.. never handed out; kv_cache, a KVCache; num_copies, copies made. Refusals,
    changing nothing: TypeError for a num_blocks, block_size or n that is not an int (a bool is
    not); ValueError for one below 1 (n: below 0), for a block not an int in 0..num_blocks - 1
    (True is not block 1; refcount, read, copy_block too) or, to share, free or copy, not in
    use; OutOfBlocksError when too few blocks are free. NOTE: vLLM's BlockPool queues every
    block in its free_block_queue at start-up (and keeps block 0 aside, its null block);
    next_unused makes a new pool O(1). NOTE: vLLM's queue hands a freed table's uncached blocks
    out tail first; given them tail first, this list hands out the head first."""

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
        """Blocks in use. Pitfall 4 of Part 4 edits `return len(self.ref_cnt)`."""
        return len(self.ref_cnt)

    @property
    def num_free(self):
        """Blocks with no ref-count, num_blocks - num_used: a block a cache keeps aside, on no
        free list (list_free lists it), is free too."""
        return self.num_blocks - self.num_used

    def ensure_free(self, n):
        """Raise OutOfBlocksError unless n blocks are free: the check of check-then-act (any int n:
        n <= 0 passes; only allocate_many refuses n below 0)."""
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} block(s), {self.num_free} of {self.num_blocks} free")

    def allocate(self):
        """A free block, now with ref-count 1 (allocate_many's first)."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n):
        """n free blocks, each now with ref-count 1, or none: the last ones given back, then new
        ones. New pool: allocate_many(3) -> [0, 1, 2]; then free(1), free(0), allocate_many(3)
        -> [0, 1, 3]."""
        self.ensure_free(check_int(n, "n", 0))
        blocks = []
        for _ in range(n):
            if len(self.free_block_ids) > 0:
                block = self.free_block_ids.pop()
            else:
                block, self.next_unused = self.next_unused, self.next_unused + 1
                self.kv_cache.grow()
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def allocate_prompt(self, token_ids):
        """(a prompt's blocks, how many of its first tokens they hold already: whole blocks), its
        tokens checked first: here cdiv(len(token_ids), block_size) new blocks, and 0. A prefix
        cache (Part 6) shares its cached ones first. vLLM: get_computed_blocks, then allocate_slots
        (which also caches the full blocks, as cache_blocks here, and runs at each decode step)."""
        return self.allocate_many(cdiv(len(check_tokens(token_ids)), self.block_size)), 0

    def share(self, block):
        """One more reference to a block in use; returns it."""
        self.share_blocks([check_block(self, block)])
        return block

    def share_blocks(self, blocks):
        """One more reference to each of blocks, trusted: in use (a sequence sharing its own
        table), or free but on no free list (a cache's, Part 6); returns them."""
        for block in blocks:
            self.ref_cnt[block] = self.ref_cnt.get(block, 0) + 1
        return blocks

    def free(self, block):
        """Drop one reference; the block becomes free only when none is left. Through
        free_blocks([block]), which a prefix cache (Part 6) overrides."""
        self.free_blocks([check_block(self, block)])

    def free_blocks(self, blocks):
        """free each of blocks (a list), trusted to be in use (a sequence giving back its table);
        those left with none go onto the free list's end."""
        self.free_block_ids += self.unref(blocks)

    def unref(self, blocks):
        """Drop a reference to each of blocks; returns those left with none, in order, now free and
        on no list (free_blocks lists them; Part 6 keeps some). Pitfall 1 of Part 4 edits
        `if ref_cnt[block] == 1:`."""
        ref_cnt, unused = self.ref_cnt, []
        for block in blocks:
            if ref_cnt[block] == 1:  # the last reference
                del ref_cnt[block]
                unused.append(block)
            else:
                ref_cnt[block] -= 1
        return unused

    def list_free(self):
        """Every free block, once each (for a check: O(num_blocks)): the given back, then the never
        handed out; a prefix cache (Part 6) adds those it keeps aside."""
        return [*self.free_block_ids, *range(self.next_unused, self.num_blocks)]

    def refcount(self, block):
        """block's references: 0 if it is free."""
        return self.ref_cnt.get(check_block(self, block, in_use=False), 0)

    def read(self, block):
        """A copy of block's block_size slots, in use or not."""
        return self.kv_cache.read(check_block(self, block, in_use=False))

    def copy_block(self, block):
        """A new block holding a copy of block's slots: copy-on-write's copy (Part 3)."""
        check_block(self, block)
        copy = self.allocate()
        self.kv_cache.copy(block, copy)
        self.num_copies += 1
        return copy

    def cache_blocks(self, table, tokens, first, last, decode=False):
        """The one hook that does nothing here, a prefix cache's (Part 6, which extends
        allocate_prompt, list_free, free_blocks, allocate_many too; vLLM's cache_full_blocks).
        Blocks first..last-1 of a block table now hold tokens[first * block_size:last * block_size],
        the last of them maybe partly (a cache keeps full ones); decode: a decode step filled the
        last block (SGLang caches those when the sequence ends)."""


def check_block(pool, block, in_use=True):
    """block if it is a block id of pool (in use, unless told otherwise); else ValueError."""
    if type(block) is not int or not 0 <= block < pool.num_blocks:
        raise ValueError(f"unknown block {block!r}: block ids are 0..{pool.num_blocks - 1}")
    if in_use and block not in pool.ref_cnt:
        raise ValueError(f"block {block} is free (a double free, or never allocated)")
    return block


# ---------------------------------------------------------------------------------------
# Part 2. Block tables and sequences
# ---------------------------------------------------------------------------------------

class BlockTable(list):
    """A sequence's page table: entry i is the physical block holding logical block i.
    Example: block_size 16, table [7, 2]: slot(17) == (2, 1), so KV slot 2 * 16 + 1 = 33."""

    def __init__(self, block_size):  # starts empty, as list() does
        self.block_size = block_size

    def slot(self, i):
        """(block, offset) of token i, an int in 0..len(self) * block_size - 1 (else IndexError)."""
        if type(i) is not int or not 0 <= i < len(self) * self.block_size:
            raise IndexError(f"token {i!r} is not in the {len(self) * self.block_size}-slot table")
        return self[i // self.block_size], i % self.block_size

    def slot_mapping(self, n):
        """The KV slot of each of the first n tokens (vLLM's slot_mapping). Example:
        block_size 4, table [3, 0]: slot_mapping(6) == [12, 13, 14, 15, 0, 1]."""
        size = self.block_size
        return [block * size + offset for block in self for offset in range(size)][:n]


class Sequence:
    """A request's tokens and the block table that says where each one is stored.
    Invariant: len(block_table) == cdiv(len(tokens), block_size), and token i is at
    block_table.slot(i). Only the last block is ever written, and only in place if no
    other reference to it exists. State later parts read: seq_id, allocator, tokens (a list),
    block_table (a BlockTable), is_freed. Refusals, changing nothing: TypeError for an
    allocator that is not a BlockAllocator, tokens not iterable, a token that is not an int
    (a bool is not); ValueError for a token below 0, and for any use of a freed sequence
    (append, extend, read, fork, free), whose block table is empty (its tokens stay). A prompt's
    blocks come from pool.allocate_prompt (a prefix cache's hold some of its tokens), the rest
    written as extend writes them; with no tokens, it asks the pool nothing (share_prefix makes
    one, and may then be refused)."""

    def __init__(self, seq_id, allocator, tokens=()):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {allocator!r}")
        token_ids = list(tokens)  # TypeError if tokens is not iterable
        self.seq_id, self.allocator, self.is_freed = seq_id, allocator, False
        self.tokens = []  # logical tokens, in order
        self.block_table = BlockTable(allocator.block_size)
        if len(token_ids) > 0:
            blocks, reused = allocator.allocate_prompt(token_ids)  # checks the tokens
            self.block_table.extend(blocks)
            self.tokens.extend(token_ids[:reused])
            self._prefill(token_ids[reused:])

    def __len__(self):
        return len(self.tokens)

    def append(self, token):
        """Add one token (a decode step): a new block exactly when the last is full, a private
        copy of a shared last block. Example: block_size 4, tokens [5, 6, 7, 8] in table [3]:
        append(9) takes a free block, say 0 (table [3, 0]), and writes 9 at slot 0 * 4 + 0. A
        block it fills is reported once written: pool.cache_blocks(table, tokens, k, k + 1,
        decode=True)."""
        if self.is_freed or type(token) is not int or token < 0:
            self._check_live()
            check_tokens([token])
        pool, table, size = self.allocator, self.block_table, self.allocator.block_size
        offset = len(self.tokens) % size
        if offset == 0:
            block = pool.allocate()  # the last block is full: a new one
            table.append(block)
        else:
            block = table[-1]
            if pool.ref_cnt[block] > 1:
                block = self._copy_last_block()  # shared: copy-on-write (Part 3)
        pool.kv_cache.slots[block * size + offset] = token
        self.tokens.append(token)
        if offset == size - 1:
            pool.cache_blocks(table, self.tokens, len(table) - 1, len(table), decode=True)

    def extend(self, tokens):
        """Add tokens, all or none, as a prefill does."""
        self._check_live()
        self._prefill(check_tokens(tokens))

    def _prefill(self, token_ids):
        """Make room (new blocks, a copy of a shared last block), write each block's run of
        tokens with one slice, then report the blocks that filled, n // size .. end // size - 1 (n,
        end: the tokens before and after), in one pool.cache_blocks call, decode False, made even
        when none did. Pitfall 3 of Part 4 edits `num_new = cdiv(end, size) - len(table)`."""
        pool, table, n = self.allocator, self.block_table, len(self)
        size, end = pool.block_size, n + len(token_ids)
        copy = n % size > 0 and end > n and pool.ref_cnt[table[-1]] > 1
        num_new = cdiv(end, size) - len(table)
        pool.ensure_free(num_new + copy)  # check, then act
        if copy:
            self._copy_last_block()
        table.extend(pool.allocate_many(num_new))
        i, offset = 0, n % size  # the next token to write, and its offset in its block
        for block in table[n // size:]:
            pool.kv_cache.write(block, offset, token_ids[i:i + size - offset])
            i, offset = i + size - offset, 0
        self.tokens.extend(token_ids)
        pool.cache_blocks(table, self.tokens, n // size, end // size)  # the blocks filled

    def read(self):
        """The sequence's tokens, gathered from the KV cache through the block table."""
        self._check_live()
        return self.allocator.kv_cache.gather(self.block_table.slot_mapping(len(self)))

    def fork(self, seq_id):
        """A new sequence sharing every block of this one: share_prefix of all (Part 3)."""
        return share_prefix(self, seq_id)

    def free(self):
        """Release every block, tail first, in one pool.free_blocks call (a prefix cache hears one
        release a table). NOTE: tail first as vLLM's manager (free: reversed) and nano-vllm do, so
        a prefix cache evicts a suffix before the prefix others are likelier to share."""
        self._check_live()
        self.allocator.free_blocks(self.block_table[::-1])
        self.block_table.clear()
        self.is_freed = True

    def _copy_last_block(self):
        """Swap our reference to the shared last block for one to a private copy; returns it.
        Pitfall 2 of Part 4 edits `self.block_table[-1] = self.allocator.copy_block(shared)`."""
        shared = self.block_table[-1]
        self.block_table[-1] = self.allocator.copy_block(shared)  # may raise: nothing changed
        self.allocator.free_blocks([shared])
        return self.block_table[-1]

    def _check_live(self):
        if self.is_freed:
            raise ValueError(f"sequence {self.seq_id!r} was freed; it holds no blocks")


# ---------------------------------------------------------------------------------------
# Part 3. Sharing a prefix, and copy-on-write
# ---------------------------------------------------------------------------------------
# Sharing costs one ref-count per block. A full block is never written again, so a share that
# ends inside one gets a copy of it at once. A shared, partly full last block would be written by
# whichever sharer writes first, so append and extend copy a last block whose ref-count is above
# 1, however it came to be shared (_copy_last_block): copy-on-write, the paper's design and vLLM
# v0's. NOTE: vLLM v1 has no fork and shares only full blocks, through its prefix cache (Part 6).

def share_prefix(src, seq_id, num_tokens=None):
    """A new sequence, type(src)(seq_id, pool) with no tokens, whose first num_tokens (default all)
    are src's, in src's blocks; a partly covered block is shared if it is src's partly full last,
    copied if full. Example: src has 20 tokens in [a, b] (block_size 16); share_prefix(src, "x",
    18) gives x [a, b], ref-counts 2, and who writes b copies it; share_prefix(src, "y", 5) gives
    y [a copy of a]. Refusals, changing nothing: TypeError for a src not a Sequence or a num_tokens
    not an int; ValueError for num_tokens outside 0..len(src), or a freed src; OutOfBlocksError
    for a copy with no block free."""
    if not isinstance(src, Sequence):
        raise TypeError(f"src must be a Sequence, got {src!r}")
    if src.is_freed:
        raise ValueError(f"sequence {src.seq_id!r} was freed; it holds no blocks")
    num_tokens = len(src) if num_tokens is None else check_int(num_tokens, "num_tokens", 0)
    if num_tokens > len(src):
        raise ValueError(f"num_tokens {num_tokens} is outside 0..{len(src)} (of {src.seq_id!r})")
    pool, seq = src.allocator, type(src)(seq_id, src.allocator)  # a Sequence like src
    full, partial = divmod(num_tokens, pool.block_size)
    tail = []  # the block the share ends inside
    if partial > 0:
        block, filled = src.block_table[full], len(src) >= (full + 1) * pool.block_size
        tail = [pool.copy_block(block) if filled else pool.share(block)]  # may raise: first
    seq.block_table.extend([*pool.share_blocks(src.block_table[:full]), *tail])
    seq.tokens.extend(src.tokens[:num_tokens])
    return seq


# ---------------------------------------------------------------------------------------
# Part 4. Checks: invariants you can execute, an oracle to run them against, the pitfalls
# ---------------------------------------------------------------------------------------

def expect(condition, message):
    """Raise AssertionError(message) unless condition holds: how every check fails."""
    if not condition:
        raise AssertionError(message)


def plural(n, noun, nouns=None):
    """plural(1, "block") == "1 block", plural(2, "block") == "2 blocks"."""
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


def audit(pool):
    """The pool's own bookkeeping, the free list first: each block with no ref-count is listed
    once (given back, never used, kept by a cache), none with one; then the counts: num_used is
    the blocks with a ref-count, num_free the rest."""
    free = pool.list_free()
    expect(len(set(free)) == len(free) == pool.num_blocks - len(pool.ref_cnt) and
           pool.ref_cnt.keys().isdisjoint(free),
           "free list: a block is listed free twice, or while in use, or missing")
    expect(pool.num_used == len(pool.ref_cnt) and pool.num_free + pool.num_used ==
           pool.num_blocks, f"counts: num_used {pool.num_used}, num_free {pool.num_free}; "
           f"{len(pool.ref_cnt)} of the {pool.num_blocks} blocks hold a ref-count")


def check_invariants(allocator, sequences):
    """Raise AssertionError naming the first broken invariant: "free list" or "counts" (audit),
    "block count", "read-back", "ref-count != block-table references". sequences (any iterable):
    all live ones, one listed twice counted once; Sequences, or Part 13's, a table per group (None
    where a block left the window), which check their own read-back and windows (check_windows)."""
    audit(allocator)
    references, size = Counter({block: 0 for block in allocator.ref_cnt}), allocator.block_size
    for seq in {id(seq): seq for seq in sequences if not seq.is_freed}.values():  # each once
        tables = [seq.block_table] if isinstance(seq, Sequence) else seq.block_tables
        for table in tables:
            held, need = len(table), cdiv(len(seq.tokens), size)
            expect(held == need, f"block count: sequence {seq.seq_id!r} holds "
                   f"{plural(held, 'block')} for {plural(len(seq.tokens), 'token')}, needs {need}")
            references.update(block for block in table if block is not None)
        if isinstance(seq, Sequence):
            expect(seq.read() == seq.tokens, f"read-back: sequence {seq.seq_id!r} reads back "
                   "tokens it was not given")
        else:
            seq.check_windows()
    for block, refs in references.items():  # every block in use or in a table
        expect(allocator.refcount(block) == refs, f"ref-count != block-table references: "
               f"block {block}: ref-count {allocator.refcount(block)}, references {refs}")


def random_tokens(rng, n, vocab=32_000):
    """rng.choices(range(vocab), k=n): n token ids drawn from rng; every workload here is seeded."""
    return rng.choices(range(vocab), k=n)


def fuzz(allocator, rng, num_ops, max_live=6, vocab=4):
    """num_ops random operations against a plain-list model (seq_id -> its tokens), checked
    after each (a failure: AssertionError); a refused one (OutOfBlocksError) must change no
    field of the pool or a live sequence, a subclass's too (their vars; the pool once, not in
    each sequence: "atomicity: ..."). Returns a Counter, one count an operation (a refused one
    only as "refused"): "create", "append", "extend", "fork", "share" (share_prefix), "raw
    share" (the pool shares a last block while its sequence appends: still in use, it reads back
    unchanged, else "copy-on-write: ..."; then it is freed), "free"; all are freed at the end.
    At most max_live live (past that, a create, fork or share frees one; none live: a create). A
    small vocab, and prompts that start with an earlier prompt's prefix, make shared prefixes
    common. A create or extend adds up to 2 * block_size + 2 new tokens: run_checks' pools
    refuse some."""
    live, model, seen, counts = {}, {}, [[]], Counter()
    longest = 2 * allocator.block_size + 2  # tokens per create or extend: crosses boundaries
    def snapshot():  # every field of the pool and the live sequences: a refusal leaves it equal
        sequences = [{**vars(seq), "allocator": None} for seq in live.values()]
        return pickle.dumps([vars(allocator)] + sequences)
    for step in range(num_ops):
        ops = ["create", "append", "extend", "fork", "share", "raw share", "free"]
        op = rng.choice(ops if len(live) > 0 else ["create"])
        if op in ("create", "fork", "share") and len(live) >= max_live:
            op = "free"
        target = live[rng.choice(sorted(live))] if len(live) > 0 else None
        held = target.block_table[-1:] if op == "raw share" else []  # held outside any sequence
        kept = [(allocator.share(block), allocator.read(block)) for block in held]
        saved = snapshot()
        try:
            if op == "create":
                past = rng.choice(seen + list(model.values()))  # freed or live sequences
                tokens = past[:rng.randint(0, len(past))] + random_tokens(
                    rng, rng.randint(0, longest), vocab)
                live[step], model[step] = Sequence(step, allocator, tokens), tokens
            elif op in ("append", "extend", "raw share"):
                tokens = random_tokens(rng, rng.randint(1, longest) if op == "extend" else 1, vocab)
                if op == "extend":
                    target.extend(tokens)
                else:
                    target.append(tokens[0])
                model[target.seq_id] = model[target.seq_id] + tokens
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
            expect(snapshot() == saved, f"atomicity: a refused {op} changed the pool or a sequence")
        for block, slots in kept:  # the outside holder still reads what it shared; drop it
            expect(block in allocator.ref_cnt and allocator.read(block) == slots, "copy-on-write: "
                   "an append freed or wrote into a block another holder can see")
            allocator.free(block)
        check_invariants(allocator, live.values())
        expect(all(seq.tokens == model[seq_id] for seq_id, seq in live.items()),
               "model: a sequence disagrees with the plain-list model")
    for seq in live.values():
        seq.free()
    check_invariants(allocator, [])  # all freed: no block may still be in use
    return counts


def check_block_boundary(sizes):
    """A new block exactly when the last is full, at each size; returns a label. "grown" appends
    1, 2, ...; after each, check_invariants on it and "prompt", range(len(grown)), then freed."""
    for size in sizes:
        pool = BlockAllocator(64, size)
        grown = Sequence("grown", pool)
        for n in range(1, 3 * size + 2):
            grown.append(n)
            prompt = Sequence("prompt", pool, range(n))
            check_invariants(pool, [grown, prompt])
            prompt.free()
    return f"block boundary: a new block exactly when the last is full (sizes {str(sizes)[1:-1]})"


def sharing_scenario(size, pool_class=BlockAllocator, seq_class=Sequence, done=None):
    """Where each sharing bug shows, on a pool of 8 blocks of size (3 or more): a = range(size),
    extended by [size, size + 1]; b = share_prefix(a, "b", size + 1) appends 99 (a copy); a is freed
    (b keeps the shared block); c = range(100, size + 102). Each step's name ("a", "a.extend",
    "b", "b.append", "a.free", "c") goes to done before it runs; check_invariants after it runs.
    Returns a label."""
    pool, live, done = pool_class(8, size), {}, [] if done is None else done
    steps = {"a": lambda: live.update(a=seq_class("a", pool, range(size))),
             "a.extend": lambda: live["a"].extend([size, size + 1]),
             "b": lambda: live.update(b=share_prefix(live["a"], "b", size + 1)),
             "b.append": lambda: live["b"].append(99), "a.free": lambda: live.pop("a").free(),
             "c": lambda: live.update(c=seq_class("c", pool, range(100, 100 + size + 2)))}
    for what, step in steps.items():
        done.append(what)
        step()
        check_invariants(pool, live.values())
    return f"sharing: counted once, copied before a write, kept while held (size {size})"


def run_checks(block_size, seed):
    """The checks at sizes 1, 3 and block_size (sorted, each once): block boundary, sharing (at
    max(3, block_size)), then fuzz on a 12-block pool, 100 operations at the i-th size,
    random.Random(i + seed) (None: 0), its Counter unused; a line each, as the README shows."""
    sizes = sorted({1, 3, block_size})  # the block sizes checked
    print("== correctness checks ==")
    print(f"{check_block_boundary(sizes):<78} ok")  # a failing check raises, naming what broke
    print(f"{sharing_scenario(max(3, block_size)):<78} ok")  # size 1 or 2 cannot hold it
    ops = 100  # random operations at each size
    for i, size in enumerate(sizes):
        fuzz(BlockAllocator(12, size), random.Random(i + (0 if seed is None else seed)), ops)
    label = f"random operations vs a plain-list model ({ops * len(sizes)}), refused ones inert"
    print(f"{label:<78} ok")


def block_map(allocator, sequences):
    """A list of lines, one per sequence: "    " and its seq_id in 4 columns, then its table as
    [block:ref-count] cells, the block right-aligned in 3: "    a   [  0:2][  1:1]"."""
    return [f"    {seq.seq_id!s:<4}" + "".join(f"[{block:>3}:{allocator.refcount(block)}]"
                                             for block in seq.block_table) for seq in sequences]


# The four classic pitfalls, (name, method, a line of it, the bug): README's "Break it" edits.
PITFALLS = [
    ("freeing a shared block", BlockAllocator.unref, "if ref_cnt[block] == 1:",
     "if True:"),
    ("writing a shared block without copying", Sequence._copy_last_block,
     "self.block_table[-1] = self.allocator.copy_block(shared)", "return shared"),
    ("the block-boundary off-by-one", Sequence._prefill,
     "num_new = cdiv(end, size) - len(table)", "num_new = end // size + 1 - len(table)"),
    ("counting block-table entries as blocks", vars(BlockAllocator)["num_used"].fget,
     "return len(self.ref_cnt)", "return sum(self.ref_cnt.values())"),
]


def commit_bug(method, line, bug):
    """A subclass of method's class, line replaced by bug wherever in method (else ValueError)."""
    source = textwrap.dedent(inspect.getsource(method))
    if line not in source:
        raise ValueError(f"{method.__qualname__} has no line {line!r}: commit this bug by hand")
    namespace = {}
    exec(source.replace(line, bug), globals(), namespace)  # noqa: S102 (the edit, and only it)
    owner = globals()[method.__qualname__.split(".")[0]]
    return type(f"Broken{owner.__name__}", (owner,), namespace)


def demo_pitfalls(block_size, seed):
    """Each of PITFALLS committed by commit_bug, and the step of sharing_scenario that fails,
    at block size max(3, block_size): the scenario needs a full block and a partly full one."""
    size = max(3, block_size)
    print(f"== pitfalls: each classic bug committed, and what catches it (block size {size}) ==")
    print(f"   a = Sequence('a', pool, range({size})); a.extend([{size}, {size + 1}]); "
          f"b = share_prefix(a, 'b', {size + 1});")
    print(f"   b.append(99); a.free(); c = Sequence('c', pool, range(100, {100 + size + 2})); "
          "check_invariants after each")
    for number, (name, method, line, bug) in enumerate(PITFALLS, 1):
        print(f"{number}. {name}, in {method.__qualname__}:\n   {line!r} -> {bug!r}")
        broken, done, caught = commit_bug(method, line, bug), [], "NOT CAUGHT"
        classes = [broken if issubclass(broken, cls) else cls for cls in (BlockAllocator, Sequence)]
        try:
            sharing_scenario(size, *classes, done)
        except (AssertionError, OutOfBlocksError, ValueError) as error:
            caught = f"caught after {done[-1]}: {type(error).__name__}: {error}"
        print(textwrap.fill(caught, 96, initial_indent="   ", subsequent_indent="      "))


# ---------------------------------------------------------------------------------------
# Part 5. Demos: why paging wins
# ---------------------------------------------------------------------------------------

POOL_TOKENS = 65_536  # tokens of KV in the demo pool (4096 blocks of 16)
MAX_LEN = 2048        # tokens a request may grow to: what naive serving reserves
ACTUAL_LEN = 768      # tokens a request really reaches
NUM_REQUESTS = 50     # requests sharing one system prompt
SYSTEM_LEN = 1024     # tokens of system prompt
USER_LEN = 40         # tokens of each request's own message


def admit_until_full(admit):
    """Call admit(i) for i = 0, 1, ... until the pool refuses; return how many fit."""
    for count in itertools.count():
        try:
            admit(count)
        except OutOfBlocksError:
            return count


def reserve_max_len(pool, tokens, max_len):
    """The scheme before paging: reserve max_len slots up front, then write the tokens.
    Example: block_size 16, max_len 2048, 768 tokens: cdiv(2048, 16) = 128 blocks are
    taken and 768 of their 2048 slots written (37.5%); paging would take 48 blocks."""
    blocks, size = pool.allocate_many(cdiv(max_len, pool.block_size)), pool.block_size
    for k in range(cdiv(len(tokens), size)):  # the rest stays reserved, never written
        pool.kv_cache.write(blocks[k], 0, tokens[k * size:(k + 1) * size])
    return blocks


def written_share(pool):
    """The share of the slots of blocks in use that hold a token, read from the KV cache."""
    slots = [token for block in pool.ref_cnt for token in pool.read(block)]
    return sum(token is not None for token in slots) / len(slots)


def demo_memory(block_size, seed):
    """Requests that fit when each reserves MAX_LEN, and when paged, each the same ACTUAL_LEN
    tokens (one draw of random.Random(seed), None: 0); then the share of the slots in use written
    (written_share) and the blocks left free, each way."""
    naive_pool, paged_pool = (BlockAllocator(POOL_TOKENS // block_size, block_size) for _ in (0, 1))
    request = random_tokens(random.Random(0 if seed is None else seed), ACTUAL_LEN)
    naive = admit_until_full(lambda i: reserve_max_len(naive_pool, request, MAX_LEN))
    paged = admit_until_full(lambda i: Sequence(i, paged_pool, request))
    print(f"== memory efficiency: sequences that fit in a {naive_pool.num_blocks}-block pool ==")
    print(f"{f'naive contiguous (reserve max_len={MAX_LEN})':<42}: {naive:>4} sequences")
    print(f"{f'paged (allocate-on-demand, actual={ACTUAL_LEN})':<42}: {paged:>4} sequences"
          f"   ({paged / naive:.1f}x)")
    naive_written, paged_written = written_share(naive_pool), written_share(paged_pool)
    print(f"slots in use that hold a token: naive {naive_written:.1%} ({1 - naive_written:.1%} "
          f"reserved, never written), paged {paged_written:.1%}")
    print(f"blocks left free: naive {naive_pool.num_free}, paged {paged_pool.num_free} (a request "
          f"needs {cdiv(ACTUAL_LEN, block_size)} blocks paged, {cdiv(MAX_LEN, block_size)} naive)")


def system_prompt_requests(pool, share, seed):
    """NUM_REQUESTS requests, seq_ids 0..: one SYSTEM_LEN-token system prompt, then USER_LEN tokens
    of their own, drawn from random.Random(seed) in that order; with share, through share_prefix
    of one sequence "system". Either way check_invariants on all of them, then returns the pool."""
    rng = random.Random(seed)
    system = random_tokens(rng, SYSTEM_LEN)
    users = [random_tokens(rng, USER_LEN) for _ in range(NUM_REQUESTS)]
    if share:
        root = Sequence("system", pool, system)
        requests = [root] + [share_prefix(root, i) for i in range(NUM_REQUESTS)]
        for request, user in zip(requests[1:], users, strict=True):
            request.extend(user)
    else:
        requests = [Sequence(i, pool, system + user) for i, user in enumerate(users)]
    check_invariants(pool, requests)
    return pool


def demo_sharing(block_size, seed):
    """NUM_REQUESTS requests with and without share_prefix (seed 1, or seed), each way on a
    POOL_TOKENS pool (OutOfBlocksError if they do not fit); then a of block_size + max(1,
    block_size // 4) tokens on an 8-block pool, b = a.fork('b'), b.append(99), check_invariants:
    the line says "divergence " and "forked block" ("new block" if a's blocks are full, "WROTE IN
    PLACE" if it wrote in place); block maps before and after, a line between (the README's; if
    a's blocks are full: "  every block is full: b.append(99) takes a new block (0 copies)")."""
    num_blocks, seed = POOL_TOKENS // block_size, 1 if seed is None else seed
    alone, shared = (system_prompt_requests(BlockAllocator(num_blocks, block_size), share, seed)
                     for share in (False, True))
    print(f"== prefix sharing: {NUM_REQUESTS} requests, shared {SYSTEM_LEN}-token system prompt ==")
    print(f"without sharing : {alone.num_used:>5} blocks used")
    print(f"with sharing    : {shared.num_used:>5} blocks used   "
          f"({alone.num_used / shared.num_used:.1f}x less; shared prefix stored once)")
    pool, n = BlockAllocator(8, block_size), block_size + max(1, block_size // 4)
    a = Sequence("a", pool, range(n))  # a full block and (block_size > 1) a partly full one
    b = a.fork("b")
    before = block_map(pool, [a, b])
    b.append(99)
    check_invariants(pool, [a, b])  # raises unless ref-counts equal block-table references
    where = "WROTE IN PLACE" if b.block_table[-1] == a.block_table[-1] else \
        "forked block" if pool.num_copies > 0 else "new block"  # a's blocks all full: no copy
    print(f"copy-on-write   : divergence {where}; refcounts correct")
    print(f"  a holds {n} tokens; b = a.fork('b'): both tables point at the same blocks "
          "[block:ref-count]", *before, sep="\n")
    print(f"  b.append(99) must not write into block {a.block_table[-1]}, which a still reads: "
          f"b copies it to block {b.block_table[-1]} first" if n % block_size > 0 else
          "  every block is full: b.append(99) takes a new block "
          f"({plural(pool.num_copies, 'copy', 'copies')})")
    print("\n".join(block_map(pool, [a, b])))


# ---------------------------------------------------------------------------------------
# Part 6. Extension: automatic prefix caching
# ---------------------------------------------------------------------------------------
# A server finds shared prefixes by itself: it remembers full blocks, a new prompt reuses the
# longest run of its leading blocks remembered, and freed cached blocks wait, KV and all, until
# memory is needed. The pool tells one index of each event once (the seam): vLLM's hash chain
# evicts one block at a time, by a block policy (6a, 6c); SGLang's radix tree, whole leaves (6b).

# 6a. The hash chain, LRU, the caching pool --------------------------------------------

NONE_HASH = bytes(32)  # a first block's parent hash (vLLM's name; NOTE: vLLM's: os.urandom(32))


def hash_block_tokens(parent_hash, token_ids):
    """A full block's hash: SHA-256 of (parent_hash or NONE_HASH, tuple(token_ids)) pickled at
    HIGHEST_PROTOCOL. Example, block_size 4: prompt 1..8 has h0 = hash_block_tokens(None,
    [1, 2, 3, 4]), h1 = hash_block_tokens(h0, [5, 6, 7, 8]); after 9, 9, 9, 9 the same second
    block does not hash to h1. NOTE: no token compare on a hit, as vLLM (after GHSA-rm76-4mrf-v9r8
    it seeded hash(), made SHA-256 the default in v0.10.2; its tuple adds LoRA, media, salt)."""
    pair = (NONE_HASH if parent_hash is None else parent_hash, tuple(token_ids))
    return hashlib.sha256(pickle.dumps(pair, pickle.HIGHEST_PROTOCOL)).digest()


class LRU:
    """A block policy: told of each block inserted, added to the evictable ones (its last reference
    freed; tail first) or removed from them (in use again), it names a victim and drops it (now:
    prompts admitted). len, `in`: self.evictable, least recently added first (vLLM's free queue)."""

    def __init__(self):
        self.evictable = OrderedDict()  # block -> None, least recently added first

    def __len__(self):
        return len(self.evictable)

    def __contains__(self, block):
        return block in self.evictable

    def insert(self, block, token_ids):  # LRU does not care when
        pass

    def add(self, blocks, now):
        for block in blocks:
            self.evictable[block] = None

    def remove(self, blocks):
        for block in blocks:
            del self.evictable[block]

    def victim(self, now):
        return self.evictable.popitem(last=False)[0]


POLICIES = {"lru": LRU}  # the block policies; 6c adds two


class HashIndex:
    """vLLM's index. block_of: hash -> {its cached blocks: None}, oldest first (vLLM's
    cached_block_hash_to_block); block_hash: cached block -> hash; the evictable blocks (len) and
    victims are policy's: a POLICIES name (else ValueError) or an object. check's in_use: the
    pool's ref_cnt. Its fields pickle (the fuzz snapshots them), a policy's too."""

    def __init__(self, block_size, policy="lru"):
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.block_size = block_size
        self.policy = POLICIES[policy]() if isinstance(policy, str) else policy
        self.block_of, self.block_hash = {}, {}  # hash -> {block: None}; block -> hash

    def __len__(self):
        return len(self.policy)

    def match(self, token_ids):
        """(the oldest cached block of each of the prompt's leading full blocks, hashes looked
        up); changes nothing. NOTE: vLLM's Request keeps its block_hashes; this hashes afresh."""
        size, blocks, parent = self.block_size, [], None
        for k in range(len(token_ids) // size):
            parent = hash_block_tokens(parent, token_ids[k * size:(k + 1) * size])
            if parent not in self.block_of:
                return blocks, k + 1
            blocks.append(next(iter(self.block_of[parent])))
        return blocks, len(blocks)

    def lock(self, blocks, revived, now):
        """A prompt uses blocks; revived ones were evictable (vLLM's touch)."""
        self.policy.remove(revived)

    def insert(self, table, tokens, first, last, now, decode):
        """Cache the full ones of blocks first..last-1 of table, which hold tokens; returns [] (no
        swap). NOTE: a duplicate is cached too, under its hash, as in vLLM v1; match: the oldest."""
        size, parent = self.block_size, self.block_hash[table[first - 1]] if first > 0 else None
        for k in range(first, min(last, len(tokens) // size)):
            chunk = tokens[k * size:(k + 1) * size]
            parent = hash_block_tokens(parent, chunk)
            self.cache(table[k], parent, chunk)
        return []

    def cache(self, block, block_hash, token_ids):  # one more copy under block_hash
        self.block_hash[block] = block_hash
        self.block_of.setdefault(block_hash, {})[block] = None
        self.policy.insert(block, token_ids)

    def release(self, blocks, free, now):
        """A table's blocks were freed (free: those nobody references now, tail first); the
        cached ones become evictable, the rest are returned."""
        cached, rest = [], []
        for block in free:  # NOTE: one pass, so one look-up a block where two comprehensions do two
            (cached if block in self.block_hash else rest).append(block)
        self.policy.add(cached, now)
        return rest

    def evict(self, n, now):
        victims = [self.policy.victim(now) for _ in range(n)]
        for block in victims:
            block_hash = self.block_hash.pop(block)
            del self.block_of[block_hash][block]
            if not self.block_of[block_hash]:
                del self.block_of[block_hash]
        return victims

    def check(self, in_use):  # the evictable blocks, checked against the policy's
        evictable = [block for block in self.block_hash if block not in in_use]
        expect(len(evictable) == len(self.policy) and all(b in self.policy for b in evictable),
               "cache: the policy's evictable blocks are not the cached blocks nobody uses")
        return evictable


INDEXES = {"hash": HashIndex}  # 6b adds the radix tree


@dataclass
class CacheStats:
    hits: int = 0       # full prompt blocks found in the cache at admission
    misses: int = 0     # full prompt blocks not found
    prompts: int = 0    # prompts admitted: the clock a policy is told
    evictions: int = 0  # times the pool had to evict to hand out blocks
    evicted: int = 0    # cached blocks those evictions freed
    beyond: int = 0     # of them, blocks freed beyond what the eviction needed
    work: int = 0       # the index's work: hashes looked up (hash) or children (radix)


class PrefixCachingAllocator(BlockAllocator):
    """A block pool that remembers full blocks, so later prompts with the same tokens reuse them.
    index: a name in INDEXES, made with policy (ValueError otherwise), told each event from one
    method: match, lock (allocate_prompt), insert (cache_blocks, the hook), release (free_blocks),
    evict(n) (allocate_many), check (list_free). num_free counts evictable blocks, as vLLM's."""

    def __init__(self, num_blocks, block_size=BLOCK_SIZE, policy="lru", index="hash"):
        super().__init__(num_blocks, block_size)
        if index not in INDEXES:
            raise ValueError(f"index must be one of {', '.join(INDEXES)}, got {index!r}")
        self.index, self.stats = INDEXES[index](block_size, policy), CacheStats()

    hits = property(lambda self: self.stats.hits)
    misses = property(lambda self: self.stats.misses)
    hit_rate = property(lambda self: self.hits / max(1, self.hits + self.misses))
    num_cached = property(lambda self: len(self.index))  # the evictable ones (the contract's)

    def allocate_prompt(self, token_ids):
        """Share the prompt's cached blocks and allocate the rest, if both fit (a revived block
        leaves num_free), else OutOfBlocksError, counters kept. Block size 4: "a" = 0..9 left
        [0, 1] cached; "b" = 0..7, 50..54 gets ([0, 1, x, y], 8), x, y new: 2 hits, 1 miss. Only
        tokens after the hits are checked: a hit's were, when written (radix: by match). NOTE:
        vLLM, SGLang, mini-sglang stop a token short, for its logits; here every hit is reused."""
        blocks, work = self.index.match(token_ids)
        reused, total = len(blocks) * self.block_size, cdiv(len(token_ids), self.block_size)
        check_tokens(token_ids[reused:])
        revived = [block for block in blocks if block not in self.ref_cnt]
        self.ensure_free(total - len(blocks) + len(revived))
        self.stats.hits += len(blocks)
        self.stats.misses += len(token_ids) // self.block_size - len(blocks)
        self.stats.prompts += 1
        self.stats.work += work
        self.share_blocks(blocks)
        self.index.lock(blocks, revived, self.stats.prompts)
        return blocks + self.allocate_many(total - len(blocks)), reused

    def cache_blocks(self, table, tokens, first, last, decode=False):
        """The hook; a block the index holds (radix): share the index's, free_blocks ours."""
        for k, block in self.index.insert(table, tokens, first, last, self.stats.prompts, decode):
            self.share_blocks([block])  # the index's copy of block k's tokens: a duplicate
            self.free_blocks([table[k]])  # ours goes back as any freed block (its index hears)
            table[k] = block

    def list_free(self):  # the index checks itself; its evictable blocks are free too
        return [*super().list_free(), *self.index.check(self.ref_cnt)]

    def free_blocks(self, blocks):  # a cached block losing its last reference stays, evictable
        self.free_block_ids += self.index.release(blocks, self.unref(blocks), self.stats.prompts)

    def allocate_many(self, n):
        """n blocks: an eviction's victims (in the order evicted), the free list's, the never used.
        It evicts the shortfall, n less the free blocks no cache entry holds, as SGLang's
        evict_from_tree_cache (mem_cache/common.py at 0057abe) and mini-sglang. NOTE: SGLang evicted
        the whole need (evict(num_tokens)) at commit 2752c82; vLLM pops one queue, victims last."""
        short = check_int(n, "n", 0) - (self.num_free - len(self.index))
        self.ensure_free(n)  # the check, before any eviction
        if short > 0:
            freed = self.index.evict(short, self.stats.prompts)
            self.stats.evictions += 1
            self.stats.evicted += len(freed)
            self.stats.beyond += len(freed) - short
            self.free_block_ids.extend(reversed(freed))  # the first victim is handed out first
        return super().allocate_many(n)


# 6b. The radix tree ---------------------------------------------------------------------

class LazyHeap:
    """Items by key: push(item, key), discard(item), pop() the least, peek() its (key, item). key:
    item -> its key; heap: (key, item) pairs, stale ones too, rebuilt past twice len (live ones)."""

    def __init__(self):
        self.key, self.heap = {}, []

    def __len__(self):
        return len(self.key)

    def __contains__(self, item):
        return item in self.key

    def push(self, item, key):
        if self.key.get(item) != key:
            self.key[item] = key
            heapq.heappush(self.heap, (key, item))
            if len(self.heap) > 2 * len(self.key):  # mostly stale: rebuild, O(1) amortized
                self.heap = [(key, item) for item, key in self.key.items()]
                heapq.heapify(self.heap)

    def discard(self, item):
        self.key.pop(item, None)

    def peek(self):
        while self.key.get(self.heap[0][1]) != self.heap[0][0]:
            heapq.heappop(self.heap)
        return self.heap[0]

    def pop(self):
        del self.key[self.peek()[1]]
        return heapq.heappop(self.heap)[1]


class RadixNode:
    """A run of cached blocks: tokens, blocks, children (by their first block's tokens), parent,
    depth (blocks above it), last_access (the tree's clock at its last touch), growing (a decode
    run), id (numbered as made, a decode run's at its end, as SGLang's creation_time: FIFO's)."""
    ids = itertools.count()

    def __init__(self, parent, depth, now, growing=False):
        self.parent, self.depth, self.tokens, self.blocks, self.children = parent, depth, [], [], {}
        self.last_access, self.id, self.growing = now, next(RadixNode.ids), growing


PRIORITIES = {"lru": lambda node: node.last_access,  # SGLang's evict_policy.py: the leaf of
              "fifo": lambda node: node.id}          # lowest priority goes first


class RadixIndex:
    """SGLang's index (RadixCache): a radix tree of cached blocks whose unused leaves go whole,
    lowest priority first (policy: a name in PRIORITIES, else ValueError). A node is used or not,
    whole: SGLang's lock_ref, the sequences using a node, is here its first block's ref-count (a
    sequence holds its path from the root), and where a use ends inside a node, it splits.
    Example, block_size 2, 6 blocks, LRU:
        a = [1 2 3 4 5 6], freed   root -> [1 2 3 4 5 6] (blocks 0 1 2), an unused leaf
        b = [1 2 3 4 7 8]          hits 0 1, which end inside the node: it splits (_split_node),
                                   root -> [1 2 3 4] -> {[5 6], [7 8]}
        c = [10 .. 15]             2 unused blocks, then evict(1): [5 6], the unused leaf
        b, c freed; d = [20 .. 25] evict(3): [7 8], touched before c's leaf; then its parent
    State (it pickles: policy is a name): root; node_of, block -> node; free, a set of blocks nobody
    uses; leaves, a LazyHeap of unused leaves by (priority, id); clock, ticks (now is unused)."""

    def __init__(self, block_size, policy="lru"):
        if policy not in PRIORITIES:
            raise ValueError(f"a leaf priority is one of {', '.join(PRIORITIES)}, got {policy!r}")
        self.block_size, self.policy, self.root = block_size, policy, RadixNode(None, 0, 0)
        self.node_of, self.free, self.leaves, self.clock = {}, set(), LazyHeap(), 0

    def __len__(self):  # SGLang's evictable_size_
        return len(self.free)

    def match(self, token_ids):
        """As HashIndex.match, in children looked up; it checks all tokens first (True == 1)."""
        token_ids = check_tokens(token_ids)  # a list: a tuple's slices never equal a node's
        size, node, blocks, work = self.block_size, self.root, [], 0
        for k in range(len(token_ids) // size):
            chunk, i = token_ids[k * size:(k + 1) * size], k - node.depth
            if i == len(node.blocks):  # at the end of a node: the child that starts so
                node, i, work = node.children.get(tuple(chunk)), 0, work + 1
            if node is None or node.tokens[i * size:(i + 1) * size] != chunk:
                break
            blocks.append(node.blocks[i])
        return blocks, work

    def lock(self, blocks, revived, now):
        """As SGLang's match_prefix and inc_lock_ref: touch the path, then split where the match
        ends; a match that ends where a node ends stops its decode run growing."""
        self.free.difference_update(revived)
        if len(blocks) > 0:
            node = self.touch(self.node_of[blocks[-1]])  # NOTE: SGLang: at every match_prefix
            if len(blocks) - node.depth < len(node.blocks):
                self.split(node, len(blocks) - node.depth)
            else:
                node.growing = False

    def insert(self, table, tokens, first, last, now, decode):
        """Hang the full ones of blocks first..last-1 of table after block first - 1 (none, or that
        block out of the tree: [], no tick), as SGLang's insert: a touch of the first node (the next
        tick), which each node on the way gets; a split inside a node where they branch off or where
        duplicates end (used or not); a new node holds the rest, or decode fills its growing leaf.
        Returns (k, the tree's block, now in use) for each duplicate k (the tree has its tokens)."""
        size, last = self.block_size, min(last, len(tokens) // self.block_size)
        node = self.root if first == 0 else self.node_of.get(table[first - 1])
        if first >= last or node is None:
            return []  # nothing to insert, or the block before stayed out
        node, i, dups = self.touch(node), first - node.depth, []
        for k in range(first, last):
            chunk = tokens[k * size:(k + 1) * size]
            if i < len(node.blocks) and node.tokens[i * size:(i + 1) * size] != chunk:
                node = self.split(node, i)  # it branches off inside a node
            if i == len(node.blocks) and tuple(chunk) in node.children:
                node, i = node.children[tuple(chunk)], 0
                node.last_access = self.clock
            if i < len(node.blocks):  # the tree holds these tokens already: a duplicate
                dups.append((k, node.blocks[i]))
                i += 1
                continue
            if not (decode and node.growing and len(node.children) == 0):
                node.children[tuple(chunk)] = node = RadixNode(
                    node, node.depth + len(node.blocks), self.clock, decode)
                self.update(node.parent)
            node.tokens += tokens[k * size:last * size]
            node.blocks += table[k:last]
            self.node_of.update(dict.fromkeys(table[k:last], node))
            break
        else:
            if i < len(node.blocks):
                self.split(node, i)  # the duplicates end inside a node
        self.free.difference_update(block for _, block in dups)  # the pool takes them
        for _, block in dups:
            self.update(self.node_of[block])
        return dups

    def touch(self, node):  # its path to the root gets the next tick (SGLang's last_access_time)
        self.clock += 1
        on_path = node
        while on_path is not self.root:
            on_path.last_access = self.clock
            self.update(on_path)
            on_path = on_path.parent
        return node

    def split(self, node, i):
        """SGLang's _split_node: a new parent gets blocks 0..i-1 and node's last_access."""
        size, head = self.block_size, RadixNode(node.parent, node.depth, node.last_access)
        head.tokens, head.blocks = node.tokens[:i * size], node.blocks[:i]
        node.parent.children[tuple(node.tokens[:size])] = head
        head.children[tuple(node.tokens[i * size:(i + 1) * size])] = node
        del node.tokens[:i * size], node.blocks[:i]
        node.parent, node.depth = head, node.depth + i
        self.node_of.update(dict.fromkeys(head.blocks, head))
        self.update(node)
        return head

    def release(self, blocks, free, now):
        """A table's blocks were freed (tail first; free: those nobody references now): as SGLang's
        cache_finished_req, its path is touched, its decode run renumbered (LRU, FIFO: by finish);
        the tree's free ones stay evictable (a node used at its start splits); returns the rest."""
        deepest = next((self.node_of[block] for block in blocks if block in self.node_of), None)
        if deepest is not None:  # NOTE: SGLang inserts a decode run at the finish: new now
            deepest.id = next(RadixNode.ids) if deepest.growing else deepest.id
            self.touch(deepest)
        kept = [block for block in free if block in self.node_of]
        self.free.update(kept)
        for node in {self.node_of[block]: None for block in kept}:
            used = len(node.blocks)
            while used > 0 and node.blocks[used - 1] in self.free:
                used -= 1
            if used > 0:
                self.split(node, used)  # NOTE: a fork uses its first blocks (SGLang has none)
            self.update(node)
        return [block for block in free if block not in self.node_of]

    def update(self, node):  # SGLang's _update_leaf_status: a candidate is an unused leaf
        if len(node.children) == 0 and node is not self.root and node.blocks[0] in self.free:
            self.leaves.push(node, (PRIORITIES[self.policy](node), node.id))
        else:
            self.leaves.discard(node)

    def evict(self, n, now):
        """SGLang's evict: unused leaves, lowest priority first, until n or more blocks are free."""
        freed = []
        while len(freed) < n:
            node = self.leaves.pop()
            freed += node.blocks
            del node.parent.children[tuple(node.tokens[:self.block_size])]
            self.update(node.parent)
        for block in freed:
            del self.node_of[block]
        self.free.difference_update(freed)
        return freed

    def check(self, in_use):  # each node used whole or not, the candidates; the evictable
        for node in set(self.node_of.values()):
            used = {block in in_use for block in node.blocks}
            leaf = not node.children and not any(used)
            expect(len(used) == 1 and (node in self.leaves) == leaf,
                   "radix: a node is used in part, or its candidacy disagrees with its use")
        expect(self.free == self.node_of.keys() - in_use.keys(),
               "radix: the free blocks are not the tree's blocks nobody uses")
        return list(self.free)


INDEXES["radix"] = RadixIndex


# 6c. More block policies --------------------------------------------------------------

class FIFO(LRU):
    """Evict the block cached longest ago, whatever its reuse since: a hit does not save it.
    evictable: a LazyHeap keyed by since[block], its latest insert's number (inserted: so far)."""

    def __init__(self):
        self.evictable, self.since, self.inserted = LazyHeap(), {}, 0

    def insert(self, block, token_ids):
        self.since[block], self.inserted = self.inserted, self.inserted + 1

    def add(self, blocks, now):
        for block in blocks:
            self.evictable.push(block, self.since[block])

    def remove(self, blocks):
        for block in blocks:
            self.evictable.discard(block)

    def victim(self, now):
        return self.evictable.pop()


class S3FIFO(LRU):
    """S3-FIFO (Yang et al., SOSP 2023): a new block waits in a small FIFO queue. The victim comes
    from small while it holds >= 10% of the evictable blocks: its head, unless hit twice, which
    moves to the main FIFO queue, hits reset; else its tokens join the ghost queue (as long as main,
    at least 1): a block cached while remembered leaves it for main. Main gives a block hit since
    another round, its hits (at most 3) less one. small, main: OrderedDicts of evictable blocks, a
    freed one at its tail; ghost: of token tuples. NOTE: 10%, 2 hits and the cap are libCacheSim's
    (S3FIFO.c; its ghost holds 90% of the cache). A policy never hears of hits on blocks in use."""

    def __init__(self):
        self.small, self.main, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()
        self.hits, self.in_main, self.content = {}, {}, {}  # per block

    def __len__(self):
        return len(self.small) + len(self.main)

    def __contains__(self, block):
        return block in self.small or block in self.main

    def insert(self, block, token_ids):
        self.content[block] = tuple(token_ids)
        self.in_main[block] = self.content[block] in self.ghost  # remembered: to main
        self.ghost.pop(self.content[block], None)
        self.hits[block] = 0

    def add(self, blocks, now):
        for block in blocks:
            (self.main if self.in_main[block] else self.small)[block] = None

    def remove(self, blocks):
        for block in blocks:
            del (self.main if self.in_main[block] else self.small)[block]
            self.hits[block] = min(3, self.hits[block] + 1)

    def victim(self, now):
        while True:  # ends: each pass evicts, or moves a block to main, or lowers a count
            if len(self.small) >= 0.1 * len(self):  # always, when main is empty
                block = self.small.popitem(last=False)[0]
                if self.hits[block] < 2:
                    self.ghost[self.content[block]] = None
                    while len(self.ghost) > max(1, len(self.main)):
                        self.ghost.popitem(last=False)
                    return block
                self.in_main[block] = True  # hit twice while new: it moves to main
                self.hits[block] = 0
            else:
                block = self.main.popitem(last=False)[0]
                if self.hits[block] == 0:
                    return block
                self.hits[block] -= 1
            self.main[block] = None  # main's tail


POLICIES.update(fifo=FIFO, s3fifo=S3FIFO)  # NOTE: S3-FIFO's queues rank blocks: no leaf priority


# The cache section --------------------------------------------------------------------

CHAT_SYSTEM_LEN = 200   # tokens of the system prompt every chat request starts with
CHAT_QUESTION_LEN = 40  # tokens a user adds each turn
CHAT_ANSWER_LEN = 60    # tokens the model answers each turn
CHAT_TURNS = 4          # turns per conversation
CHAT_CONVERSATIONS = 12
CACHE_POOLS = (8192, 4096, 2048, 1024)  # tokens of KV in the pools under pressure
WAITING = 12            # requests waiting together, in the cache-aware order
VLLM_EXAMPLE = [(1, 0, 15), (3, 0, 2), (4, 1, 14), (5, 0, 0), (6, 1, 0), (7, 2, 29)]
# docs/design/prefix_caching.md: (time, request, tokens); blocks of 4, 10 in the pool;
VLLM_SAME = {1: 10, 2: 12}  # requests 1 and 2 begin with 10 and 12 of request 0's tokens;
VLLM_TIME_7 = [0, 1, 2, 7, 8, 9, 4, 3]  # "the allocated blocks are 0 (cached), 1 (cached),
# 2 (cached), 7, 8, 9, 4, 3 (evicted)": one free queue, never-used blocks among the rest


def chat_stream(seed):
    """(prompt, answer) pairs, round robin over conversations: system prompt, history, question."""
    rng, stream = random.Random(seed), []
    histories = [random_tokens(rng, CHAT_SYSTEM_LEN)] * CHAT_CONVERSATIONS
    for _ in range(CHAT_TURNS):
        for i in range(CHAT_CONVERSATIONS):
            prompt = histories[i] + random_tokens(rng, CHAT_QUESTION_LEN)
            stream.append((prompt, random_tokens(rng, CHAT_ANSWER_LEN)))
            histories[i] = prompt + stream[-1][1]
    return stream


def serve(pool, stream):
    """Serve requests one at a time: admit the prompt, decode the answer, free. The pool."""
    for i, (prompt, answer) in enumerate(stream):
        seq = Sequence(i, pool, prompt)
        for token in answer:
            seq.append(token)
        seq.free()
    return pool


def demo_cache(block_size, seed):
    """The sharing demo cached, vLLM's example, chained hashes, both indexes, cache-aware order."""
    print("== cache: automatic prefix caching (an index of cached blocks, an eviction policy) ==")
    num_blocks, seed = POOL_TOKENS // block_size, 4 if seed is None else seed
    explicit = system_prompt_requests(BlockAllocator(num_blocks, block_size), True, seed)
    auto = system_prompt_requests(PrefixCachingAllocator(num_blocks, block_size), False, seed)
    print(f"1. the sharing demo's {NUM_REQUESTS} requests (seed {seed}), as Sequence(...) calls:")
    print(f"   explicit share_prefix : {explicit.num_used:>4} blocks used")
    print(f"   automatic cache       : {auto.num_used:>4} blocks used   hit rate "
          f"{auto.hit_rate:.1%} ({auto.hits} of {auto.hits + auto.misses} full prompt blocks)")
    cache_vllm_example()
    pool = PrefixCachingAllocator(16, block_size)  # 3. chained hashes
    x, y, z = (list(range(k * block_size, (k + 1) * block_size)) for k in range(3))
    a, b = Sequence("a", pool, x + y), Sequence("b", pool, z + y)  # the tokens y, twice
    chained = [pool.index.block_hash[seq.block_table[1]].hex()[:8] for seq in (a, b)]
    print(f"3. chained hashes: a = X+Y, b = Z+Y, the same {plural(block_size, 'token')} Y in both"
          f"\n   Y's tokens alone hash to {hash_block_tokens(None, y).hex()[:8]} in both: a per-"
          "block cache would give b a's KV")
    print(f"   chained, Y's hashes are {chained[0]} and {chained[1]}: "
          f"{'the same' if chained[0] == chained[1] else 'different'}, so b holds {b.block_table}")
    stream = chat_stream(seed)
    print(f"4. under pressure: {len(stream)} chat requests ({CHAT_CONVERSATIONS} conversations x "
          f"{CHAT_TURNS} turns, round robin), LRU")
    print_two_indexes([serve(PrefixCachingAllocator(tokens // block_size, block_size, "lru", index),
                           stream) for tokens in CACHE_POOLS for index in INDEXES])
    tokens = CACHE_POOLS[len(CACHE_POOLS) // 2]  # a pool under pressure
    print(f"5. cache-aware order: batches of {WAITING} waiting requests, {tokens}-token pool, LRU\n"
          "   order            index                 hits   blocks evicted")
    for order, name in itertools.product(("arrival", "longest prefix"), INDEXES):  # batches
        pool = PrefixCachingAllocator(tokens // block_size, block_size, "lru", name)
        for batch in (stream[i:i + WAITING] for i in range(0, len(stream), WAITING)):
            serve(pool, batch if order == "arrival" else  # SGLang's lpm: the longest match first
                  sorted(batch, key=lambda request: -len(pool.index.match(request[0])[0])))
        print(f"   {order:<16} {name:<20} {pool.hits:>5}   {pool.stats.evicted:>13}")


def print_two_indexes(pools):
    """A row per pool, hash and radix in turn; then one sentence on where the two differ."""
    print("   look-ups: hashes computed (hash), children looked up (radix)\n   pool blocks  index"
          "     hits  hit rate  evictions  blocks freed  beyond need  look-ups/prompt")
    for pool, kind in zip(pools, itertools.cycle(INDEXES)):
        st = pool.stats
        print(f"   {pool.num_blocks:>11,}  {kind:<5}  {pool.hits:>7,}  {pool.hit_rate:>8.1%}  "
              f"{st.evictions:>9,}  {st.evicted:>12,}  {st.beyond:>11,}  "
              f"{st.work / st.prompts:>15.1f}")
    beyond, freed = (sum(getattr(p.stats, k) for p in pools[1::2]) for k in ("beyond", "evicted"))
    chain, tree = (sum(p.hits for p in pools[i::2]) for i in (0, 1))  # hashed, radix
    print(f"   over these pools whole leaves freed {beyond:,} blocks beyond the need "
          f"({beyond / max(1, freed):.0%} of those they freed)\n   and hit {tree - chain:+,} "
          f"blocks against the hash chain ({(tree - chain) / max(1, chain):+.1%} of its hits)")


def cache_vllm_example():
    """vLLM's worked example, step by step; returns each step's block map."""
    pool, live, maps = PrefixCachingAllocator(10, 4), {}, []
    print(f"2. vLLM's worked example (docs/design/prefix_caching.md): {pool.num_blocks} blocks of "
          f"{pool.block_size} tokens;\n   requests 1 and 2 begin with {VLLM_SAME[1]} and "
          f"{VLLM_SAME[2]} of request 0's tokens; block:ref-count, * cached")
    for time_, request, count in VLLM_EXAMPLE:
        hits, same = pool.hits, VLLM_SAME.get(request, 0)
        if request not in live:  # a new prompt
            live[request] = Sequence(request, pool, [*range(same), *range(100 * request + same,
                                                                        100 * request + count)])
            event = f"request {request}: {count} tokens, {plural(pool.hits - hits, 'hit')}"
        elif count > 0:
            for token in range(len(live[request]), len(live[request]) + count):
                live[request].append(token)
            event = f"request {request}: {count} more decoded"
        else:
            live.pop(request).free()
            event = f"request {request} freed"
        cells = (f"{b}:{pool.refcount(b) or '-'}{'*' if b in pool.index.block_hash else ''}"
                 for b in range(pool.num_blocks))
        maps.append(" ".join(cell.ljust(4) for cell in cells).rstrip())
        print(f"   t{time_} {event:<32} {maps[-1]}")
    ours = list(live[2].block_table)
    print(f"   request 2's blocks: ours {ours} ({plural(pool.stats.evicted, 'block')} evicted);")
    print(f"   vLLM's, quoted: {VLLM_TIME_7}, block {VLLM_TIME_7[-1]} evicted")
    if ours != VLLM_TIME_7 and pool.stats.evicted == 0:  # the free blocks went first
        print("   ours differ: this pool hands out the free blocks no cache entry holds (its free "
              "list, last in\n   first out, then never-used ones) before it evicts; vLLM pops one "
              "queue of both")
    return maps


# ---------------------------------------------------------------------------------------
# Part 7. Extension: preemption by recompute or by swap
# ---------------------------------------------------------------------------------------
# Paging makes a full pool normal: a sequence that needs a block when none is free preempts
# another (the victim), resumed later by recompute (prefilled again) or swap (via a host pool).
# The cost model: OPT-13B on one A100-40GB, the paper's 7.3 setting (its Table 1). vLLM v0 copies
# K and V apart, layer by layer, a cudaMemcpyAsync a block (worker/cache_engine.py: swap_blocks per
# layer; csrc/cache_kernels.cu), each 5-7 us whatever its size (DualPath, arXiv 2602.21548, 5.2).
NUM_LAYERS, HIDDEN_SIZE, PARAMETERS = 40, 5120, 13e9
PCIE_BYTES_PER_S = 16e9 * 16 * 128 / 130 / 8  # PCIe 4.0 x16 each way (a peak), 128b/130b encoding
COPY_LATENCY_S = (5e-6, 7e-6)  # measured on NVIDIA Hopper GPUs, not an A100
PREFILL_EFFICIENCIES = (1.0, 0.9, 0.75)  # ours; the first (the fastest recompute) in Fig. 19b
PREFILL_TOKENS_PER_S = 312e12 / (2 * PARAMETERS)  # A100 fp16 peak, 2 FLOPs a parameter a token
DECODE_STEP_S = 26e9 / 1555e9  # Table 1's 26 GB of weights at the A100-40GB's 1,555 GB/s: a floor
KV_BYTES_PER_TOKEN = 2 * NUM_LAYERS * HIDDEN_SIZE * 2  # K and V, fp16: 800 KiB (paper: 800 KB)


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
    preempted_blocks: int = 0    # blocks the victims held when preempted
    steps: int = 0               # scheduler steps until every request finished


def next_token(req_id, position):
    """A stand-in for a model, deterministic: a preempted request ends with the same tokens."""
    return (req_id * 7919 + position * 104729) % 32_000


def swap_out(seq, host):
    """Copy every block of seq into new host blocks, contents included."""
    host_blocks = host.allocate_many(len(seq.block_table))
    for gpu_block, host_block in zip(seq.block_table, host_blocks, strict=True):
        host.kv_cache.write(host_block, 0, seq.allocator.read(gpu_block))
    return host_blocks


def swap_in(seq_id, tokens, host_blocks, host, gpu):
    """Copy host blocks back into new GPU blocks, freeing them, and rebuild the sequence (its
    full blocks told to gpu's cache_blocks hook, as a prefill's are)."""
    seq = Sequence(seq_id, gpu)
    seq.block_table.extend(gpu.allocate_many(len(host_blocks)))
    for host_block, gpu_block in zip(host_blocks, seq.block_table, strict=True):
        gpu.kv_cache.write(gpu_block, 0, host.read(host_block))
        host.free(host_block)
    seq.tokens.extend(tokens)
    gpu.cache_blocks(seq.block_table, seq.tokens, 0, len(seq.block_table))
    return seq


@dataclass
class Running:
    seq: Sequence
    request: Request
    stepped: int  # the last step it was admitted, resumed or given a token


@dataclass
class Preempted:
    request: Request
    tokens: list       # its tokens when preempted
    host_blocks: list  # where swap copied its blocks; None: recompute them


class Scheduler:
    """Each step on a GPU pool (caching or not): resume the preempted, then, if none waits, admit
    arrived ones, both by (arrival, req_id) while they fit, keeping 1% of blocks free (NOTE: vLLM
    v0's watermark; v1's is 0 unless set; at least 1 here); give each running one a token by req_id,
    preempting, when blocks run out, the least recently stepped other one (ties: latest arrival,
    then highest req_id) by "recompute" or "swap" to a host pool of its block size (else
    ValueError). running, preempted: req_id -> Running, Preempted; finished: req_id -> its tokens.
    NOTE: vLLM v1 preempts the last admitted (running.pop()), always recomputing; ours spares one
    resumed."""

    def __init__(self, gpu, host, policy):
        if policy not in ("recompute", "swap") or (policy == "swap" and host is None):
            raise ValueError(f"policy must be 'recompute', or 'swap' with a host pool: {policy!r}")
        self.gpu, self.host, self.policy = gpu, host, policy
        self.margin = max(1, gpu.num_blocks // 100)
        self.running, self.preempted, self.finished = {}, {}, {}
        self.stats = PreemptionStats()

    def run(self, requests):
        """Serve requests until every one finishes (an idle step jumps to the next arrival, counted
        in steps); return finished. Refused up front, changing nothing: a req_id given twice or
        finished before (ValueError), a bad prompt or max_tokens (an int >= 0; TypeError or
        ValueError naming it), one whose tokens never fit the free blocks less the margin."""
        requests, ids = list(requests), Counter(request.req_id for request in requests)
        for request in requests:
            if ids[request.req_id] > 1 or request.req_id in self.finished:
                raise ValueError(f"req_id {request.req_id} is given twice, or finished before")
            check_tokens(request.prompt)
            check_int(request.max_tokens, f"request {request.req_id}'s max_tokens", 0)
            if not self._fits(len(request.prompt) + request.max_tokens):
                raise ValueError(f"request {request.req_id} can never fit the free GPU blocks")
        queue = deque(sorted(requests, key=lambda r: (r.arrival, r.req_id)))  # not yet admitted
        step = 0
        while len(queue) + len(self.running) + len(self.preempted) > 0:
            if len(self.running) + len(self.preempted) == 0:
                step = max(step, queue[0].arrival)  # idle until the next arrival: skip
            for r in sorted(self.preempted, key=lambda r: (self.preempted[r].request.arrival, r)):
                if not self._fits(len(self.preempted[r].tokens)):
                    break  # nobody overtakes them
                out = self.preempted.pop(r)
                if out.host_blocks is None:
                    self.stats.recomputed_tokens += len(out.tokens)
                    seq = Sequence(r, self.gpu, out.tokens)
                else:
                    self.stats.swapped_in_blocks += len(out.host_blocks)
                    seq = swap_in(r, out.tokens, out.host_blocks, self.host, self.gpu)
                self._run(out.request, seq, step)
            while len(self.preempted) == 0 and len(queue) > 0 and queue[0].arrival <= step \
                    and self._fits(len(queue[0].prompt)):
                request = queue.popleft()
                self._run(request, Sequence(request.req_id, self.gpu, request.prompt), step)
            for req_id in sorted(self.running):
                if req_id in self.running:  # not preempted earlier in this step
                    self._decode(req_id, step)
            step += 1
        self.stats.steps = step
        return self.finished

    def _fits(self, num_tokens):
        return cdiv(num_tokens, self.gpu.block_size) + self.margin <= self.gpu.num_free

    def _run(self, request, seq, step):
        self.running[request.req_id] = Running(seq, request, step)
        if len(seq) == len(request.prompt) + request.max_tokens:  # done
            self.finished[request.req_id] = seq.read()
            seq.free()
            del self.running[request.req_id]

    def _decode(self, req_id, step):
        seq, request = self.running[req_id].seq, self.running[req_id].request
        while len(seq) % self.gpu.block_size == 0 and self.gpu.num_free == 0:  # needs a block
            self._preempt(min((r for r in self.running if r != req_id),  # run's check: r exists
                              key=lambda r: (self.running[r].stepped,
                                             -self.running[r].request.arrival, -r)))
        seq.append(next_token(req_id, len(seq)))
        self._run(request, seq, step)

    def _preempt(self, req_id):
        victim, host_blocks = self.running.pop(req_id), None
        self.stats.preemptions += 1
        self.stats.preempted_blocks += len(victim.seq.block_table)
        if self.policy == "swap":
            if self.host.num_free < len(victim.seq.block_table):
                self.stats.host_fallbacks += 1
            else:
                host_blocks = swap_out(victim.seq, self.host)
                self.stats.swapped_out_blocks += len(host_blocks)
        self.preempted[req_id] = Preempted(victim.request, list(victim.seq.tokens), host_blocks)
        victim.seq.free()


ALPACA = ("Alpaca", 19.31, 58.45)        # mean prompt / output tokens of the vLLM paper's
SHAREGPT = ("ShareGPT", 161.31, 337.99)  # traces (its Fig. 11)
MAX_SEQ_LEN = 2048     # tokens: OPT's context, the cap on drawn lengths
GPU_KV_TOKENS = 4096   # tokens of KV the GPU pool holds, whatever the block size
HOST_KV_TOKENS = 1024  # tokens of KV the host pool holds in part 1 of the section
EVICT_REQUESTS = 24    # requests per workload, one arriving per step
EVICT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the block sizes of the paper's Fig. 19
EVICT_SEEDS = 4        # workloads the end-to-end table ranges over
SWAP_TOKENS = 256      # tokens its artifact restores at every block size (benchmark_swap.py)
FIG19A_SCALE = 0.9     # plot_fig19_a.py plots recompute's latencies * 1000.0 * 0.9
MEDIUM_SIZES = (16, 64)  # the quote's "medium block sizes from 16 to 64"
PAPER_73 = ("recomputation is more efficient when the block size is small, while swapping is "
            "more efficient when the block size is large, though recomputation overhead is "
            "never higher than 20% of swapping's latency. For medium block sizes from 16 to "
            "64, the two methods exhibit comparable end-to-end performance.")
WRAP = textwrap.TextWrapper(96, initial_indent="   ", subsequent_indent="   ")  # under a table


def draw_length(rng, mean, cap):
    """A length in 1..cap, exponential of this mean, rounded. NOTE: the paper gives mean lengths
    (its Fig. 11: long tails); the exponential is the least-assuming law of a given mean."""
    return min(cap, max(1, round(rng.expovariate(1 / mean))))


def preemption_workload(seed):
    """EVICT_REQUESTS ShareGPT-like requests, one a step: prompt length (at most MAX_SEQ_LEN // 2),
    tokens, output length (at most MAX_SEQ_LEN less the prompt's)."""
    rng, queue = random.Random(seed), []
    for i in range(EVICT_REQUESTS):
        prompt = random_tokens(rng, draw_length(rng, SHAREGPT[1], MAX_SEQ_LEN // 2))
        queue += [Request(i, prompt, draw_length(rng, SHAREGPT[2], MAX_SEQ_LEN - len(prompt)), i)]
    return queue


def run_policy(policy, block_size, requests, host_tokens):
    """Serve requests under policy (plain pools, the host's at least a block); check every result
    and that both pools end whole; the Scheduler's stats."""
    gpu = BlockAllocator(GPU_KV_TOKENS // block_size, block_size)
    host = BlockAllocator(max(1, host_tokens // block_size), block_size)
    scheduler = Scheduler(gpu, host, policy)
    finished = scheduler.run(requests)
    for r in requests:
        want = r.prompt + [next_token(r.req_id, len(r.prompt) + k) for k in range(r.max_tokens)]
        expect(finished[r.req_id] == want, f"{policy}: request {r.req_id} ends with wrong tokens")
    expect(gpu.num_used == host.num_used == 0, f"{policy}: a pool is not whole at the end")
    return scheduler.stats


def swap_seconds(blocks, block_size, copies, latency_s):
    """Copying blocks one way: copies a block (each one cudaMemcpyAsync) and their bytes."""
    return blocks * (copies * latency_s + block_size * KV_BYTES_PER_TOKEN / PCIE_BYTES_PER_S)


def recompute_seconds(tokens, efficiency):  # prefilled at efficiency x the peak
    return tokens / (PREFILL_TOKENS_PER_S * efficiency)


def demo_evict(block_size, seed):
    """Recompute against swap at block_size (run_policy's stats; seed 5, or seed); Fig. 19a: at each
    EVICT_SIZES block, SWAP_TOKENS restored by swap out and in, at the lower copy latency, against
    recompute x FIG19A_SCALE at each efficiency; the quote's 20%: recompute / swap - 1 in the
    largest blocks, at both latencies. Fig. 19b, a row a size: recompute runs (host 0) on
    EVICT_SEEDS seeds, the first's preemptions, recomputed tokens and recovery ms (recompute at the
    fastest prefill, unscaled, or swap out and in of the blocks it preempted, at the lower latency);
    a run is its decode steps x DECODE_STEP_S plus recovery, end to end the range of recompute's /
    swap's; at MEDIUM_SIZES, the most |ratio - 1| and the largest share of a run's time the larger
    recovery takes."""
    first, copies, latency = 5 if seed is None else seed, 2 * NUM_LAYERS, COPY_LATENCY_S[0]
    print(f"== evict: preemption by recompute vs swap ({EVICT_REQUESTS} ShareGPT-like requests, "
          f"{GPU_KV_TOKENS // block_size * block_size}-token GPU pool) ==")
    low, high = (t * 1e6 for t in COPY_LATENCY_S)
    print(f"cost model, OPT-13B on an A100-40GB (sources in the code): a block is {copies} copies "
          f"of {low:g}-{high:g} us\n   (measured on Hopper), {PCIE_BYTES_PER_S / 1e9:.1f} GB/s; "
          f"prefill {PREFILL_TOKENS_PER_S:,.0f} tokens/s at the peak; a decode step "
          f"{DECODE_STEP_S * 1e3:.1f} ms")
    print(f"1. block size {block_size}, a {HOST_KV_TOKENS // block_size * block_size}-token host "
          "pool; every request ends with exactly its tokens\n"
          "   policy      preemptions  recomputed  swapped out/in  host full  steps")
    for policy in ("recompute", "swap"):
        st = run_policy(policy, block_size, preemption_workload(first), HOST_KV_TOKENS)
        print(f"   {policy:<10}  {st.preemptions:>11}  {st.recomputed_tokens:>10}  "
              f"{f'{st.swapped_out_blocks}/{st.swapped_in_blocks}':>14}  {st.host_fallbacks:>9}"
              f"  {st.steps:>5}")
    print(textwrap.fill(f'2. the paper (7.3), quoted: "{PAPER_73}"', 96, subsequent_indent="   "))
    seeds, fastest = range(first, first + EVICT_SEEDS), PREFILL_EFFICIENCIES[0]  # Fig. 19b's
    restore = {e: FIG19A_SCALE * recompute_seconds(SWAP_TOKENS, e) for e in PREFILL_EFFICIENCIES}
    print(f"   its Fig. 19a restores {SWAP_TOKENS} tokens at each block size (benchmark_swap.py) "
          f"and plots recompute\n   x {FIG19A_SCALE:g} (plot_fig19_a.py): "
          f"{restore[fastest] * 1e3:.1f} ms at {fastest:.0%} prefill; swap in ms at "
          f"{latency * 1e6:g} us a copy, recompute / swap:")
    print("   block   copies   swap out (= in)   in + out" + "".join(
        f"{eff:>7.0%} prefill" for eff in restore))
    for size in EVICT_SIZES:
        both = 2 * swap_seconds(SWAP_TOKENS // size, size, copies, latency)  # out and in
        print(f"   {size:>5}  {SWAP_TOKENS // size * copies:>7,}  {both / 2 * 1e3:>15.1f}  "
              f"{both * 1e3:>9.1f}" + "".join(f"{r / both:>14.2f}x" for r in restore.values()))
    big = max(EVICT_SIZES)  # swap is cheapest in the largest blocks
    over = [r / (2 * swap_seconds(SWAP_TOKENS // big, big, copies, t)) - 1
            for t in COPY_LATENCY_S for r in restore.values()]
    print(f"   in {big}-token blocks (swap at its cheapest), at {low:g}-{high:g} us a copy, the "
          f"quote's 20% is {min(over):.0%} to {max(over):.0%} here")
    print(f"   end to end on our scheduler (Fig. 19b's quantity): last column seeds "
          f"{first}-{seeds[-1]}, the others seed {first}")
    print("   block  preemptions  restored tokens  recompute ms  swap ms  end to end")
    gap = share = 0.0
    for size in EVICT_SIZES:  # a swap run with a GPU-sized host preempts the same victims (tested)
        runs = [run_policy("recompute", size, preemption_workload(s), 0) for s in seeds]
        costs = [(st.steps * DECODE_STEP_S, recompute_seconds(st.recomputed_tokens, fastest),
                  2 * swap_seconds(st.preempted_blocks, size, copies, latency)) for st in runs]
        ratios = [(decode + recompute) / (decode + swap) for decode, recompute, swap in costs]
        if MEDIUM_SIZES[0] <= size <= MEDIUM_SIZES[1]:
            gap = max(gap, *(abs(r - 1) for r in ratios))
            share = max(share, *(max(r, w) / (d + max(r, w)) for d, r, w in costs))
        print(f"   {size:>5}  {runs[0].preemptions:>11}  {runs[0].recomputed_tokens:>15}  "
              f"{costs[0][1] * 1e3:>12.1f}  {costs[0][2] * 1e3:>7.1f}  "
              f"{min(ratios):.3f}-{max(ratios):.3f}x")
    print(WRAP.fill(f"at {MEDIUM_SIZES[0]}-{MEDIUM_SIZES[1]} the two differ end to end by at most "
                    f"{gap:.1%}: recovery is at most {share:.1%} of a run's time. The paper served "
                    "ShareGPT at 2.01 requests/s for 600 s on 15.7K KV slots (fig19-b.sh, Table "
                    f"1); ours, a request a step on {GPU_KV_TOKENS:,} tokens"))


# ---------------------------------------------------------------------------------------
# Part 8. Extension: parallel sampling and beam search
# ---------------------------------------------------------------------------------------
# n samples of one prompt, or k beams, share a long past. Forked, it is stored once and each
# sequence pays where it diverges (and one copy of a shared last block, forked mid-block).
# Block-table entries (logical blocks) against blocks in use (physical) measure the saving.
# NOTE: vLLM v1 has neither fork nor beam search: its n samples share full blocks through
# the prefix cache; beam search runs above it.

NUM_SAMPLES = (2, 4, 6)  # parallel samples n, as in the paper's Fig. 15
BEAM_WIDTHS = (2, 4, 6)  # beam widths k, as in its Fig. 15
SHARING_SEEDS = 3        # serving runs per cell, from seed 6 (or --seed)
SERVING_KV_TOKENS = 15_700  # Table 1's 15.7K KV slots (OPT-13B, A100-40GB): 6 x 2048 tokens fit
SERVING_BLOCK_SIZE = 16  # tokens a block in a serving run: the artifact's (fig15.sh)
SERVING_LIFETIMES = 3     # a serving run's steps, in mean output lengths
PAPER_63 = ("We show 6.1% - 9.8% memory saving on parallel sampling and 37.6% - 55.2% on beam "
            "search. In the same experiments with the ShareGPT dataset, we saw 16.2% - 30.5% "
            "memory saving on parallel sampling and 44.3% - 66.3% on beam search.")


def parallel_sampling(pool, prompt, outputs, rng):
    """len(outputs) samples of one prompt (the first, and forks of it), each decoding its own
    number of tokens, as a generator: each step, sample by sample, one at its length is freed,
    one below it appends rng.randrange(32_000); then it yields the samples (a freed one holds no
    blocks), but not after the step that frees the last."""
    samples = [Sequence(0, pool, prompt)]
    samples += [samples[0].fork(i) for i in range(1, len(outputs))]
    for step in range(max(outputs) + 1):
        for sample, length in zip(samples, outputs, strict=True):
            if step == length:
                sample.free()  # done: its blocks go back (shared ones stay with the others)
            elif step < length:
                sample.append(rng.randrange(32_000))
        if step < max(outputs):  # the last step freed the last sample
            yield samples


def beam_search(pool, prompt, width, output_len, rng):
    """Beam search with pruning over seeded random scores (no model), as a generator: each
    step every beam proposes width candidates, each its beam's log-prob + log(1 - rng.random()),
    drawn beam by beam; the best width survive, best first; a parent chosen by several is
    forked (each fork a new seq_id, from 1; the parent itself goes on at its last pick), a parent
    chosen by none is freed first; then each beam appends rng.randrange(32_000), best first, and
    it yields the beams. Then it frees them."""
    beams, ids = [(0.0, Sequence(0, pool, prompt))], itertools.count(1)  # (log-prob, beam)
    for _ in range(output_len):
        best = sorted(((score + math.log(1 - rng.random()), i) for i, (score, _) in
                       enumerate(beams) for _ in range(width)), reverse=True)[:width]
        last = {i: k for k, (_, i) in enumerate(best)}  # a parent goes on itself at its last pick
        for i, (_, seq) in enumerate(beams):
            if i not in last:
                seq.free()  # pruned: the blocks it shares stay with the other beams
        beams = [(score, beams[i][1] if last[i] == k else beams[i][1].fork(next(ids)))
                 for k, (score, i) in enumerate(best)]  # its other picks are forks of it
        for _, seq in beams:  # forks first, then writes: copy-on-write where needed
            seq.append(rng.randrange(32_000))
        yield [seq for _, seq in beams]
    for _, seq in beams:
        seq.free()


def serving_saving(dataset, kind, width, seed, block_size):
    """The saving of one serving run, the artifact's way: 1 - 1 / mean(L / P), L the block-table
    entries and P the blocks in use after each step and its admissions, from step steps // 3 on
    (its plot_fig15.py keeps 300-900 s of 900 s), steps = round(SERVING_LIFETIMES x the mean
    output). Each step every group decodes, then the next request is admitted (its first next():
    prefill and a token) while all fit the pool unshared: each table's final entries, plus one
    each for a copy. A request draws from Random(seed) its prompt length (draw_length, capped at
    MAX_SEQ_LEN // 2), its output lengths (width of them for parallel, one for beam; capped at
    MAX_SEQ_LEN less the prompt), then its tokens; parallel_sampling or beam_search serves it,
    drawing from the same Random."""
    _, prompt_mean, output_mean = dataset
    rng, pool = random.Random(seed), BlockAllocator(SERVING_KV_TOKENS // block_size, block_size)
    groups, ratios, steps, ahead = {}, [], round(SERVING_LIFETIMES * output_mean), None
    for step in range(steps):
        live = []
        for group in list(groups):  # each group decodes a token
            sequences = next(group, None)
            if sequences is None:
                del groups[group]  # done: its blocks are back in the pool
            else:
                live += sequences
        while True:  # then admit the next request while every group's footprint fits
            if ahead is None:
                prompt = draw_length(rng, prompt_mean, MAX_SEQ_LEN // 2)
                outputs = [draw_length(rng, output_mean, MAX_SEQ_LEN - prompt)
                           for _ in range(width if kind == "parallel" else 1)]
                ahead = (random_tokens(rng, prompt), outputs * (1 if kind == "parallel" else width))
            need = sum(cdiv(len(ahead[0]) + output, block_size) + 1 for output in ahead[1])
            if sum(groups.values()) + need > pool.num_blocks:
                break
            group = parallel_sampling(pool, *ahead, rng) if kind == "parallel" else \
                beam_search(pool, ahead[0], width, ahead[1][0], rng)
            groups[group], ahead = need, None
            live += next(group)  # its prefill and first token
        if step >= steps // 3:
            ratios.append(sum(len(seq.block_table) for seq in live) / pool.num_used)
    return 1 - 1 / (sum(ratios) / len(ratios))


def demo_beam(block_size, seed):
    """Copies per fork, a beam search's block map (its last yield: prompt 10, width 4, 7 steps,
    Random(7), block size 4 whatever block_size), then the 6.3 table: each cell's saving for
    seeds 6.. (or seed..) beside the paper's span, at SERVING_BLOCK_SIZE whatever block_size."""
    first, samples = 6 if seed is None else seed, NUM_SAMPLES[len(NUM_SAMPLES) // 2]
    print("== beam: parallel sampling and beam search on forked sequences ==")
    decode = 8  # tokens each sample decodes
    print(f"1. a prompt forked into {samples} samples that each decode {decode} tokens:")
    for prompt_len in (6 * block_size + max(1, block_size // 4), 6 * block_size):
        pool = BlockAllocator(samples * cdiv(prompt_len + decode, block_size), block_size)
        list(parallel_sampling(pool, list(range(prompt_len)), [decode] * samples,
                               random.Random(first)))
        copies, where = pool.num_copies, "mid-block" if prompt_len % block_size else "on a boundary"
        verdict = " =" if copies == samples - 1 else f", not {samples - 1}:"
        print(f"   {prompt_len} tokens, ending {where}: {plural(copies, 'copy', 'copies')}"
              + (f"{verdict} one per writer but the last" if prompt_len % block_size else ""))
    prompt_len, width, size, steps = 10, 4, 4, 7
    print(f"2. the beams of a beam search after {steps} steps (prompt {prompt_len}, width {width}, "
          f"block size {size}), [block:ref-count]")
    pool = BlockAllocator(width * (cdiv(prompt_len + steps, size) + 1), size)
    for beams in beam_search(pool, list(range(prompt_len)), width, steps, random.Random(7)):
        picture = block_map(pool, beams)
    print("\n".join(picture))
    seeds = range(first, first + SHARING_SEEDS)
    print("3. memory saved by sharing vs the paper (6.3), quoted:")
    print(WRAP.fill(f'"{PAPER_63}" Its artifact computes each as 1 - 1 / mean(L / P), L and P '
                    "the logical and physical blocks in use at each step of a serving run "
                    f"(plot_fig15.py); ours the same, on a {SERVING_KV_TOKENS:,}-token pool kept "
                    f"full, {SERVING_BLOCK_SIZE} tokens a block as its:"))
    print("   dataset   kind      n or k  " + "".join(f"{f'seed {s}':>9}" for s in seeds)
          + "  paper, over n or k")
    spans, spread = [], 0.0
    quoted = iter(re.findall(r"(\S+%) - (\S+%)", PAPER_63))  # its spans, in our rows' order
    for dataset in (ALPACA, SHAREGPT):
        for kind, widths in (("parallel", NUM_SAMPLES), ("beam", BEAM_WIDTHS)):
            cells = [[serving_saving(dataset, kind, width, s, SERVING_BLOCK_SIZE) for s in seeds]
                     for width in widths]
            paper = "-".join(next(quoted))
            for row, (width, savings) in enumerate(zip(widths, cells, strict=True)):
                print(f"   {dataset[0]:<9} {kind:<9} {width:>6}  " + "".join(
                    f"{saving:>9.1%}" for saving in savings) + ("  " + paper if row == 0 else ""))
            spread = max(spread, max(max(c) - min(c) for c in cells))
            spans.append((dataset[0], kind, min(map(min, cells)), max(map(max, cells))))
    print(WRAP.fill("ours span " + ", ".join(f"{low:.1%}-{high:.1%} ({name} {kind})" for
                                             name, kind, low, high in spans) +
                    f"; a seed moves a cell by up to {spread * 100:.1f} points"))


# ---------------------------------------------------------------------------------------
# Part 9. Extension: the block-size sweep
# ---------------------------------------------------------------------------------------
# Small blocks waste little at the end of each sequence but make long block tables (more
# metadata, more indirection for the attention kernel, more and smaller copies); large blocks
# are the reverse, and lose more prefix reuse. Each measure runs the allocators at each size.

SWEEP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TABLE_ENTRY_BYTES = 4     # bytes per block-table entry: int32, as in vLLM's block_tables
SWEEP_SYSTEM_LEN = 501    # tokens of a shared system prompt: odd, so sizes > 1 split it
MAX_FRAGMENTATION = 0.05  # the sweet spot's waste budget: the lab's choice, not the paper's
SWEEP_SEEDS = 3           # workloads drawn per kind
SWEEP_REQUESTS = 16       # requests per workload
SWEEP_BUDGETS = {ALPACA: 512, SHAREGPT: 4096}  # tokens of KV that fit only some requests
PAPER_72 = ("In the ShareGPT trace, block sizes from 16 to 128 lead to the best performance. "
            "In the Alpaca trace, while the block size 16 and 32 work well, larger block sizes "
            "significantly degrade the performance since the sequences become shorter than "
            "the block sizes.")


def sweep_workload(dataset, seed):
    """SWEEP_REQUESTS (prompt tokens, output tokens) pairs: for each, both lengths drawn around
    dataset's means (each capped at MAX_SEQ_LEN // 2), then the prompt's tokens, the output's."""
    rng, requests = random.Random(seed), []
    for _ in range(SWEEP_REQUESTS):
        prompt, output = (draw_length(rng, mean, MAX_SEQ_LEN // 2) for mean in dataset[1:])
        requests.append((random_tokens(rng, prompt), random_tokens(rng, output)))
    return requests


def measure_block_size(requests, kv_tokens, block_size):
    """(fragmentation: unused slots / slots of blocks in use, over both pools; block-table entries
    per sequence; all tables' bytes; requests that fit): requests go in order into a kv_tokens pool,
    from the first it refuses on into one with room for all, so waste and tables count them all."""
    budget = BlockAllocator(kv_tokens // block_size, block_size)
    rest = BlockAllocator(sum(cdiv(len(p) + len(o), block_size) for p, o in requests), block_size)
    seqs, refused = [], False
    for prompt, output in requests:
        refused = refused or cdiv(len(prompt) + len(output), block_size) > budget.num_free
        seqs.append(Sequence(len(seqs), rest if refused else budget, prompt + output))
    slots = (budget.num_used + rest.num_used) * block_size
    entries = sum(len(seq.block_table) for seq in seqs)
    return (slots - sum(len(seq) for seq in seqs)) / slots, entries / len(seqs), \
        entries * TABLE_ENTRY_BYTES, sum(seq.allocator is budget for seq in seqs)


def prefix_reuse_lost(block_size):
    """Share of a shared system prompt that a second request cannot take from the cache."""
    system = list(range(SWEEP_SYSTEM_LEN))  # any tokens: only what the two requests share counts
    pool = PrefixCachingAllocator(2 * cdiv(SWEEP_SYSTEM_LEN + 50, block_size), block_size)
    Sequence("first", pool, system + [1] * 50)  # then a message of its own
    Sequence("second", pool, system + [2] * 50)
    return 1 - pool.hits * block_size / SWEEP_SYSTEM_LEN


def sweet_spot(fragmentation, budget):
    """Tables, copies and per-block work shrink as blocks grow, so grow them until the waste
    bites: the last size, going up, before fragmentation (size -> waste) reaches (>=) budget
    (None if the first)."""
    fits = list(itertools.takewhile(lambda s: fragmentation[s] < budget, sorted(fragmentation)))
    return fits[-1] if len(fits) > 0 else None


def demo_sweep(block_size, seed):
    """Prefix reuse lost; fragmentation, tables and fit by size (seed 8's, or seed's), then the
    sweet spots at MAX_FRAGMENTATION x 0.5, 1 and 2, over SWEEP_SEEDS seeds from there, beside
    the paper's 7.2 and a line of those at MAX_FRAGMENTATION ("at our 5% the sweet spots are 8,
    8, 4 (Alpaca-like); ..."); SWEEP_SIZES only."""
    first = 8 if seed is None else seed
    print("== sweep: block size against fragmentation, block-table size, capacity, prefix reuse ==")
    print(f"prefix reuse lost: the share of a {SWEEP_SYSTEM_LEN}-token shared system prompt that "
          "a prefix cache cannot reuse")
    print("   block  " + "".join(f"{size:>7}" for size in SWEEP_SIZES))
    print("   lost   " + "".join(f"{prefix_reuse_lost(size):>7.1%}" for size in SWEEP_SIZES))
    budgets = (MAX_FRAGMENTATION / 2, MAX_FRAGMENTATION, 2 * MAX_FRAGMENTATION)
    spots = {}  # (dataset name, budget) -> the sweet spot of each seed
    for dataset, kv_tokens in SWEEP_BUDGETS.items():
        print(f"{dataset[0]}-like, seed {first}: {SWEEP_REQUESTS} requests around the paper's "
              f"means {dataset[1]:.0f}/{dataset[2]:.0f}; fit: in {kv_tokens:,} tokens of KV")
        print("   block  fragmentation  entries/seq  tables KiB    fit")
        for s in range(first, first + SWEEP_SEEDS):
            rows = {size: measure_block_size(sweep_workload(dataset, s), kv_tokens, size)
                    for size in SWEEP_SIZES}
            for budget in budgets:
                spots.setdefault((dataset[0], budget), []).append(
                    sweet_spot({size: row[0] for size, row in rows.items()}, budget))
            if s == first:  # the table of the first seed
                for size, (waste, entries, table_bytes, fit) in rows.items():
                    print(f"   {size:>5}  {waste:>13.1%}  {entries:>11.1f}  "
                          f"{table_bytes / 1024:>10.1f}  {fit:>5}")
    print(f"sweet spot: grow the block until fragmentation would reach a budget; "
          f"{MAX_FRAGMENTATION * 100:g}% is ours, not the paper's")
    print((f"   {f'over {SWEEP_SEEDS} seeds':<17}" + "".join(f"budget {budget:<14.1%}"
                                                   for budget in budgets)).rstrip())
    for name in (ALPACA[0], SHAREGPT[0]):
        print((f"   {name + '-like':<17}" + "".join(
            f"{', '.join(map(str, spots[name, budget])):<21}" for budget in budgets)).rstrip())
    print("vs the paper (7.2), quoted:")
    print(WRAP.fill(f'"{PAPER_72}"'))
    print(WRAP.fill(f"at our {MAX_FRAGMENTATION:.0%} the sweet spots are " + "; ".join(
        f"{', '.join(map(str, spots[name, MAX_FRAGMENTATION]))} ({name}-like)"
        for name in (ALPACA[0], SHAREGPT[0])) + "; the paper ranks serving performance, which "
        "this lab does not time, and our spot weighs waste only"))


# ---------------------------------------------------------------------------------------
# Part 10. Benchmark: O(1) per operation, and admission against the hash
# ---------------------------------------------------------------------------------------
# vLLM calls its block manager for every token of every running sequence: it moved its free queue to
# a linked list and its evictor off an O(n) scan when they showed in latency. Each operation is
# timed at pool sizes far apart (flat rows: the point), and against the least work it could do.

BENCH_POOLS = (1_000, 100_000, 1_000_000)  # blocks
BENCH_REPEATS = 15
BENCH_FULL = 0.9  # the share of the pool in use when a free list and a scan are compared
BENCH_TARGETS = (2, 2, 1.5)  # ours, at most: caching append / plain, admission / floor, free


def ns_per_op(benches, repeats):
    """Best ns per operation of each (setup, *args) bench, setup(*args) giving (run, ops), in
    turns so that every bench sees the same machine; setup outside the clock (time.perf_counter),
    the collector off."""
    best = [math.inf] * len(benches)
    for _ in range(repeats):
        for i, (setup, *args) in enumerate(benches):
            run, ops = setup(*args)
            gc.disable()
            start = time.perf_counter()
            run()
            best[i] = min(best[i], (time.perf_counter() - start) / ops * 1e9)
            gc.enable()
    return best


def bench_append(num_blocks, num_tokens, block_size, pool_class=BlockAllocator):
    """Appends into a pool warm for them (the blocks they need handed out once, then freed); a
    prefix-caching pool also hashes each block that fills."""
    pool, tokens = pool_class(num_blocks, block_size), list(range(num_tokens))
    pool.free_blocks(pool.allocate_many(cdiv(num_tokens, block_size)))  # warm
    append = Sequence(0, pool).append
    return (lambda: [append(token) for token in tokens]), num_tokens


def bench_bare_append(num_blocks, num_tokens, block_size):
    """Only the unavoidable work: write the slot, take a block from a list at boundaries."""
    free, slots = list(range(num_blocks)), [None] * (num_blocks * block_size)
    def run(slot=0):
        for n in range(num_tokens):
            if n % block_size == 0:
                slot = free.pop() * block_size
            slots[slot + n % block_size] = n
    return run, num_tokens


def bench_allocate_free(num_blocks, count, full=0.0, scan=False):
    """allocate + free, count times, on a pool whose first full share is in use; or the
    slow way, for comparison: search a ref-count list for a free block (list.index, in C); its
    run returns the block it found, the first past the share in use."""
    if scan:
        ref_cnt = [1] * int(num_blocks * full) + [0] * (num_blocks - int(num_blocks * full))
        def run():
            for _ in range(count):
                block = ref_cnt.index(0)  # allocate: the first free block
                ref_cnt[block] = 1
                ref_cnt[block] = 0        # and free it
            return block
        return run, count
    pool = BlockAllocator(num_blocks)
    pool.allocate_many(int(num_blocks * full))
    return (lambda: [pool.free(pool.allocate()) for _ in range(count)]), count


def bench_fork_free(num_blocks, seq_blocks, block_size, forks=20):
    """forks forks of a sequence of seq_blocks full blocks, each freed at once: per block shared."""
    seq = Sequence(0, BlockAllocator(num_blocks, block_size), range(seq_blocks * block_size))
    return (lambda: [seq.fork(i).free() for i in range(forks)]), forks * seq_blocks


def bench_free(prompts, block_size, pool_class):
    """Free each of prompts' sequences, admitted beforehand, tail first: per block freed."""
    pool = pool_class(sum(cdiv(len(prompt), block_size) for prompt in prompts), block_size)
    sequences = [Sequence(i, pool, prompt) for i, prompt in enumerate(prompts)]
    return (lambda: [seq.free() for seq in sequences]), pool.num_blocks  # their tables' entries


def bench_admission(num_blocks, prompts, block_size, floor=False):
    """Admit prompts (each kept) on a warm prefix-caching pool (every block handed out once, then
    freed); or the floor, no pool: a block hash (hash_block_tokens: pickle, SHA-256) and a dict
    look-up a full block; ops: the full blocks."""
    ops = sum(len(prompt) // block_size for prompt in prompts)
    if floor:
        cached = {}
        def run():
            for prompt in prompts:
                parent = NONE_HASH
                for k in range(len(prompt) // block_size):
                    parent = hash_block_tokens(parent, prompt[k * block_size:(k + 1) * block_size])
                    cached.get(parent)
        return run, ops
    pool = PrefixCachingAllocator(num_blocks, block_size)
    pool.free_blocks(pool.allocate_many(num_blocks))  # warm: blocks come from the free list
    return (lambda: [Sequence(i, pool, prompt) for i, prompt in enumerate(prompts)]), ops


def demo_bench(block_size, seed):
    """Scaling rows, the free list against a scan, the ratios to the least work, memory. 1: a row
    an operation of rows, ns at each BENCH_POOLS size (sorted), then largest / smallest; a row a
    pool, the free list against a scan at BENCH_FULL. 2: the last three ratios judged as printed
    (two decimals) against BENCH_TARGETS. 3: memory at the largest pool. prompts: chat_stream(4,
    or seed)'s, in order, while each fits in the smallest pool with those before it kept."""
    pools, size, repeats = sorted(BENCH_POOLS), block_size, BENCH_REPEATS
    tokens, probe, prompts = pools[0] * size // 2, PrefixCachingAllocator(pools[0], size), []
    for prompt, _ in chat_stream(4 if seed is None else seed):  # admission keeps its prompts:
        if cdiv(len(prompt), size) > probe.num_free:             # as many as the smallest
            break                                                # pool holds
        Sequence(len(prompts), probe, prompt)
        prompts.append(prompt)
    print(f"== bench: ns per operation at pools of {', '.join(f'{n:,}' for n in pools)} blocks "
          f"(best of {repeats}) ==")
    rows = {"append, per token": (bench_append, tokens, size),  # (setup, its args after n)
            "append, prefix-caching pool": (bench_append, tokens, size, PrefixCachingAllocator),
            "allocate + free, per block": (bench_allocate_free, pools[0] // 2),
            "fork + free, per block shared": (bench_fork_free, pools[0] // 20, size),
            "cache admission, per prompt block": (bench_admission, prompts, size)}
    print(f"1. scaling {'':>31}" + "".join(f"{n:>11,}" for n in pools) + "   largest/smallest")
    for label, (setup, *args) in rows.items():
        times = ns_per_op([(setup, n, *args) for n in pools], repeats)
        print(f"   {label:<39}" + "".join(f"{t:>11.0f}" for t in times)
              + f"   {times[-1] / times[0]:>15.2f}x")
    print(f"   why a free list: allocate + free at a pool {BENCH_FULL:.0%} full, against a scan")
    for n in pools:
        free_list, scan = ns_per_op([(bench_allocate_free, n, 200, BENCH_FULL),
                                     (bench_allocate_free, n, 20, BENCH_FULL, True)], repeats)
        print(f"   {n:>11,} blocks: free list {free_list:>5.0f}, scan (list.index, in C) "
              f"{scan:>9.0f} ns: {scan / free_list:,.0f}x")
    ours, caching, bare = ns_per_op([(bench_append, pools[0], tokens, size),
                                     (bench_append, pools[0], tokens, size, PrefixCachingAllocator),
                                     (bench_bare_append, pools[0], tokens, size)], repeats)
    admission, floor, plain_free, cached_free = ns_per_op(  # short runs: more repeats
        [(bench_admission, pools[0], prompts, size, at_floor) for at_floor in (False, True)]
        + [(bench_free, prompts, size, cls) for cls in (BlockAllocator, PrefixCachingAllocator)],
        4 * repeats)
    print(f"2. against the least work, {platform.python_implementation()} "
          f"{platform.python_version()}")
    print(f"   append {ours:.0f} ns/token; a bare loop (write the slot, pop a block at each "
          f"boundary) {bare:.0f}: {ours / bare:.1f}x")
    print(f"   append on a prefix-caching pool {caching:.0f} ns/token: {caching / ours:.1f}x plain")
    print(f"   cache admission {admission:.0f} ns per prompt block ({len(prompts)} chat prompts); "
          f"block hash + a look-up {floor:.0f}: {admission / floor:.1f}x")
    print(f"   free {cached_free:.0f} ns per block of those prompts on a prefix-caching pool, "
          f"{plain_free:.0f} on a plain one: {cached_free / plain_free:.1f}x")
    ratios = (caching / ours, admission / floor, cached_free / plain_free)
    print("   the last three against their targets: " + ", ".join(
        f"{r:.2f}x {'<=' if round(r, 2) <= t else '>'} {t:g}x"  # judged as printed
        for r, t in zip(ratios, BENCH_TARGETS)))
    tracemalloc.start()
    pool = BlockAllocator(pools[-1], size)
    idle = tracemalloc.get_traced_memory()[0]
    pool.allocate_many(pools[-1])
    in_use = tracemalloc.get_traced_memory()[0] - idle
    tracemalloc.stop()
    print(f"3. memory at {pools[-1]:,} blocks (tracemalloc), {size} KV slots a block included:")
    print(f"   idle {idle:,} bytes; {in_use / pools[-1]:.0f} bytes a block in use")


# ---------------------------------------------------------------------------------------
# Part 11. Extension: a real trace, and online policies against the offline optimum
# ---------------------------------------------------------------------------------------
# A serving engineer asks: on my traffic, how big must the cache be, and how far is LRU from
# the best any policy could do? Mooncake's FAST'25 traces (kvcache-ai/Mooncake, FAST25-release/
# traces/, Apache-2.0) give one hash id per 512-token prompt block, equal ids an equal prefix;
# replayed a request at a time under several policies and Belady's offline optimum.

TRACE_ID_TOKENS = 512  # tokens each Mooncake hash id stands for
TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass
class TraceRequest:
    timestamp: float    # ms since the trace began
    input_length: int   # tokens of prompt
    output_length: int  # tokens generated
    hash_ids: list      # one id per 512-token block of the prompt, the last maybe partial


def load_trace(path, limit=None):
    """The first limit requests (all if None) of a Mooncake-format JSONL file, blank lines skipped;
    ValueError ("path:N: ...") for a line that is not a request (a file not UTF-8: Python's
    UnicodeDecodeError, a ValueError too), OSError if it cannot be read."""
    with open(path, encoding="utf-8") as lines:
        numbered = ((number, line) for number, line in enumerate(lines, 1) if line.strip() != "")
        return [parse_trace_line(line, f"{path}:{number}")
                for number, line in itertools.islice(numbered, limit)]  # read no further


def parse_trace_line(line, where):
    """A TraceRequest: TRACE_FIELDS, a timestamp a number >= 0, lengths ints >= 0 (0 too), hash
    ids ints >= 0, one per 512 tokens; else ValueError naming where."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg})") from None
    if not isinstance(record, dict) or any(field not in record for field in TRACE_FIELDS):
        raise ValueError(f"{where}: a request needs the fields {', '.join(TRACE_FIELDS)}")
    timestamp, input_length, output_length, hash_ids = (record[f] for f in TRACE_FIELDS)
    if type(timestamp) not in (int, float) or timestamp < 0:
        raise ValueError(f"{where}: timestamp must be a number >= 0, got {timestamp!r}")
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}: {name} must be an int >= 0, got {value!r}")
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of ints >= 0")
    if len(hash_ids) != cdiv(input_length, TRACE_ID_TOKENS):
        raise ValueError(f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}, "
                         f"one per {TRACE_ID_TOKENS} tokens")
    return TraceRequest(timestamp, input_length, output_length, hash_ids)


def trace_prompt(request, block_size):
    """The prompt the replay admits: hash id h becomes the block_size tokens h * block_size + k; a
    partial last id (rem = input_length % 512 > 0) keeps min(block_size - 1, max(1, rem *
    block_size // 512)) of them, never a full block. Example, block size 4: input_length 1100,
    hash_ids [7, 9, 3]: 28..31, 36..39; id 3's 76 tokens keep max(1, 76 * 4 // 512) = 1, token 12.
    Scaling changes no hit if all fit; under pressure, partial and decode blocks move a few."""
    full, rem = divmod(request.input_length, TRACE_ID_TOKENS)
    tokens = [h * block_size + k for h in request.hash_ids[:full] for k in range(block_size)]
    if rem > 0:
        keep = min(block_size - 1, max(1, rem * block_size // TRACE_ID_TOKENS))
        tokens += [request.hash_ids[-1] * block_size + k for k in range(keep)]
    return tokens


def trace_decode_len(request, block_size):
    """Fresh tokens appended after the prompt, at the prompt's scale (at least one)."""
    return max(1, request.output_length * block_size // TRACE_ID_TOKENS)


class Lookahead(LRU):
    """A scheduler that sees the next `window` prompts: evict the evictable block whose next
    use among them is farthest; blocks none of them uses go first, least recently added first.
    future maps a block's tokens (a tuple) to the prompt numbers using them; the replay builds
    it. Lookahead(0) is LRU; Lookahead(math.inf) is Belady's optimum (NOTE: a parent's next
    use is never after its child's, and the tie goes to the child, freed first).
    State: evictable, block -> (next use, when added); order, those used outside the window,
    LRU first; near, a LazyHeap of the rest, farthest use first; later, a LazyHeap of order's
    blocks with a use, nearest first, moved to near as the window reaches them."""

    def __init__(self, window, future=None):
        self.window, self.future, self.uses = window, future, {}  # block -> its tokens' uses
        self.evictable, self.order = {}, OrderedDict()
        self.near, self.later, self.added = LazyHeap(), LazyHeap(), 0  # added: blocks so far

    def insert(self, block, token_ids):
        self.uses[block] = self.future.get(tuple(token_ids), ())

    def add(self, blocks, now):
        for block in blocks:
            uses = self.uses[block]
            i = bisect.bisect_left(uses, now)  # the first use after the prompts admitted so far
            use, seq = uses[i] if i < len(uses) else math.inf, self.added
            self.evictable[block], self.added = (use, seq), self.added + 1
            if use < now + self.window:
                self.near.push(block, (-use, seq))
            else:
                self.order[block] = None
                if use < math.inf:
                    self.later.push(block, (use, seq))

    def remove(self, blocks):
        for block in blocks:
            del self.evictable[block]
            self.order.pop(block, None)
            self.near.discard(block)
            self.later.discard(block)

    def victim(self, now):
        while len(self.later) > 0 and self.later.peek()[0][0] < now + self.window:  # in view
            block = self.later.pop()
            del self.order[block]
            use, seq = self.evictable[block]
            self.near.push(block, (-use, seq))
        block = self.order.popitem(last=False)[0] if len(self.order) > 0 else self.near.pop()
        self.remove([block])
        return block


def trace_future(prompts, block_size):
    """Each full block's tokens (a tuple) -> the numbers of the prompts using it, in order (a
    number counts the non-empty prompts before it: the pool's clock). ValueError if a block's
    tokens follow two different blocks: Lookahead, as a Mooncake id, means a whole prefix."""
    future, before = {}, {}  # tokens -> the tokens of the block before them (None: first)
    for number, prompt in enumerate(prompt for prompt in prompts if len(prompt) > 0):
        previous = None
        for k in range(len(prompt) // block_size):
            tokens = tuple(prompt[k * block_size:(k + 1) * block_size])
            if before.setdefault(tokens, previous) != previous:
                raise ValueError(f"prompt {number}: block {k} follows another block than before")
            future.setdefault(tokens, []).append(number)
            previous = tokens
    return future


def replay_trace(requests, num_blocks, policy="lru", block_size=BLOCK_SIZE, index="hash",
                 prompts=None):
    """Replay requests in order on a fresh PrefixCachingAllocator(num_blocks, block_size, policy,
    index): admit the prompt (trace_prompt, unless prompts gives them all), append the decode
    tokens from a counter above every prompt token, free; returns the pool. "optimal" is
    Lookahead(math.inf); a Lookahead without a future is replaced by one of its window with this
    trace's (trace_future: ValueError for ids that do not stand for one prefix)."""
    if prompts is None:
        prompts = [trace_prompt(request, block_size) for request in requests]
    if policy == "optimal" or isinstance(policy, Lookahead) and policy.future is None:
        window = math.inf if policy == "optimal" else policy.window
        policy = Lookahead(window, trace_future(prompts, block_size))
    fresh = itertools.count(max((max(p) for p in prompts if len(p) > 0), default=-1) + 1)
    answers = [[next(fresh) for _ in range(trace_decode_len(r, block_size))] for r in requests]
    return serve(PrefixCachingAllocator(num_blocks, block_size, policy, index),
                 zip(prompts, answers, strict=True))  # Part 6's: admit, decode, free


TRACE_SIZES = 4  # pool sizes round(longest * r ** k), k = 0..3, r ** 3 = never evicts / longest
KNEE = 0.9       # the share of the ceiling where a hit-rate curve counts as flattened
WINDOWS = (100, 300, 1000)  # prompts a Lookahead policy sees ahead, in the gap table
THREE_M = 3_000_000 // TRACE_ID_TOKENS  # Mooncake's 3M-token local cache, in 512-token ids
MOONCAKE_RATIO = {"conversation": 0.40, "tool&agent": 0.59, "synthetic": 0.66}  # Table 2
MOONCAKE_3M = ("a local cache with a 3M token capacity does not achieve 50% of the theoretical "
               "maximum hit rate in most scenarios")  # FAST'25's 5.3.1, quoted


def progress(line):
    """A line on stderr: on a terminal, padded to 70 columns between two carriage returns, so
    each line rewrites the last and "" erases it; elsewhere as it is, a line each ("" none)."""
    if sys.stderr.isatty():  # back to column 0: what stdout prints next starts there
        print(f"\r{line:<70}\r", end="", file=sys.stderr, flush=True)
    elif line != "":
        print(line, file=sys.stderr, flush=True)


def demo_trace(path, limit, block_size, index="hash"):
    """Replay path's requests at each pool size and policy the tables print, each once; with
    index "radix", LRU on both indexes at every size too. ValueError if no hash id repeats. Each
    replay's progress line: "trace: replay N (policy, index, S blocks)", N from 1, erased after.
    Sizes: TRACE_SIZES - 1 geometric from the longest request's blocks (prompt and decode), then
    the smallest pool that never evicts (next_unused of one that holds every request), THREE_M
    among them if between; LRU against the optimum at each, the first at 50% and KNEE of the
    ceiling; trace_gap at THREE_M (else the optimum's KNEE pool) and its neighbours that evict."""
    requests = load_trace(path, limit)
    prompts = [trace_prompt(request, block_size) for request in requests]
    future, pools = trace_future(prompts, block_size), {}
    def replay(policy, size, with_index="hash"):  # each replay once; an int: a look-ahead
        if (policy, size, with_index) not in pools:
            progress(f"trace: replay {len(pools) + 1} ({'lookahead ' * (type(policy) is int)}"
                     f"{policy}, {with_index}, {size:,} blocks)")
            spec = Lookahead(math.inf if policy == "optimal" else policy, future) if type(
                policy) is int or policy == "optimal" else policy
            pools[policy, size, with_index] = replay_trace(requests, size, spec, block_size,
                                                           with_index, prompts)
            progress("")  # before stdout prints: on a terminal both share the screen
        return pools[policy, size, with_index]
    need = [cdiv(len(p) + trace_decode_len(r, block_size), block_size)
            for r, p in zip(requests, prompts, strict=True)]
    never = replay("lru", sum(need))
    ceiling, total = never.hits, never.hits + never.misses
    if ceiling == 0:  # no full prompt block (a hash id) comes twice
        raise ValueError(f"{path}: no {TRACE_ID_TOKENS}-token hash id repeats: no cache can hit")
    roomy, longest = never.next_unused, max(need)  # roomy: the smallest pool that never evicts
    ratio = (roomy / longest) ** (1 / (TRACE_SIZES - 1))
    sizes = sorted({round(longest * ratio ** k) for k in range(TRACE_SIZES - 1)} | {roomy}
                   | ({THREE_M} if longest < THREE_M < roomy else set()))
    def rate(policy, s):  # never evicting, every policy is one
        return (replay(policy, s) if s < roomy else never).hits / total
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    print(f"== trace: {len(requests):,} requests of {name} ==")
    print(f"{total:,} full prompt blocks (a {TRACE_ID_TOKENS}-token hash id each; block size "
          f"{block_size} in the replay); on {roomy:,}")
    print(f"blocks the replay never evicts and hits {ceiling / total:.1%}: the ceiling, which no "
          "cache passes")
    print("   pool blocks           tokens      LRU  optimal   LRU/optimal  optimal/ceiling")
    for s in sizes:
        lru_rate, optimal_rate = rate("lru", s), rate("optimal", s)
        print(f"   {s:>11,}  {s * TRACE_ID_TOKENS:>15,}  {lru_rate:>7.1%}  {optimal_rate:>7.1%}   "
              f"{lru_rate / max(optimal_rate, 1e-9):>11.0%}  "
              f"{optimal_rate * total / ceiling:>15.0%}")
    for share in (0.5, KNEE):  # the pool that never evicts reaches the ceiling
        lru_pool, optimal_pool = (min(s for s in sizes if rate(p, s) * total >= share * ceiling)
                                  for p in ("lru", "optimal"))
        print(f"   the first pool here at {share:.0%} of the ceiling: LRU's {lru_pool:,} blocks, "
              f"the optimum's {optimal_pool:,}")
    center = THREE_M if THREE_M in sizes else optimal_pool  # else the knee: the optimum's at KNEE
    near = sizes[max(0, sizes.index(center) - 1):sizes.index(center) + 2]  # and its neighbours
    trace_gap([s for s in near if s < roomy], rate)  # where policies differ: they evict
    if index == "radix":
        print("hash chain against radix tree, LRU: the chain evicts a block at a time, the tree "
              "whole leaves")
        print_two_indexes([replay("lru", s, i) for s in sizes for i in INDEXES])
    trace_vs_mooncake(name, ceiling / total, rate("lru", THREE_M) if THREE_M in sizes else None)


def trace_gap(sizes, rate):
    """Print online policies against LRU and the optimum, rate(policy, size) each (policy: a name,
    or a look-ahead's window, an int): lru, fifo, s3fifo, each of WINDOWS, optimal; hit rate, and
    the share of the optimum's lead over LRU recovered ("-" where LRU has the optimum's hits);
    then at the middle size with a lead, what the widest look-ahead and FIFO or S3-FIFO recover."""
    print("online policies: hit rate (the share of the optimum's lead over LRU recovered); "
          "lookahead W:")
    print("   evict the block whose next use in the next W prompts is farthest")
    print(f"   {'policy':<14}" + "".join(f"{s:>10,} blocks" for s in sizes))
    def recovered(policy, s):  # None where LRU already has the optimum's hits: no lead
        lead = rate("optimal", s) - rate("lru", s)
        return None if lead <= 0 else round((rate(policy, s) - rate("lru", s)) / lead, 2) + 0.0
    for policy in ("lru", "fifo", "s3fifo", *WINDOWS, "optimal"):
        label = f"lookahead {policy}" if type(policy) is int else policy
        shares = {s: "   -" if recovered(policy, s) is None else f"{recovered(policy, s):>4.0%}"
                  for s in sizes}
        print(f"   {label:<14}" + "".join(f"{rate(policy, s):>10.1%} ({shares[s]})" for s in sizes))
    leads = [s for s in sizes if recovered("lru", s) is not None]
    if len(leads) > 0:
        s = leads[len(leads) // 2]
        online = max(recovered(p, s) for p in ("fifo", "s3fifo"))
        print(f"   at {s:,} blocks a look-ahead of {WINDOWS[-1]} prompts recovers "
              f"{recovered(WINDOWS[-1], s):.0%} of the optimum's lead;")
        print(f"   FIFO or S3-FIFO, which see no future, at best {online:.0%}")


def trace_vs_mooncake(name, ceiling, lru_3m):
    """This trace's ceiling and LRU at 3M tokens beside Mooncake's Table 2 and its 5.3.1. The row:
    the Mooncake trace whose name (before any "&") is in name, else name, its ratio "-"; lru_3m
    None: "-" for the LRU cells."""
    trace = next((t for t in MOONCAKE_RATIO if t.split("&")[0] in name), None)
    print(textwrap.fill(f'vs Mooncake (FAST\'25), quoted: "{MOONCAKE_3M}" (5.3.1); its Table 2 '
                        'gives each trace\'s "cache ratio"', 96, subsequent_indent="   "))
    print("   trace          cache ratio   ours: ceiling   LRU at 3M tokens   LRU / ceiling")
    cells = ("-" if trace is None else f"{MOONCAKE_RATIO[trace]:.0%}", f"{ceiling:.1%}",
             *(("-", "-") if lru_3m is None else (f"{lru_3m:.1%}", f"{lru_3m / ceiling:.0%}")))
    print(f"   {trace or name:<13}" + "".join(f"{c:>{w}}" for c, w in zip(cells, (13, 16, 19, 16))))
    print("   (their ratio counts tokens; ours counts full blocks, a 512-token hash id each)")


# ---------------------------------------------------------------------------------------
# Part 12. Extension: a fleet of prefill instances, and where each request should go
# ---------------------------------------------------------------------------------------
# Spread requests for load and each instance's prefix cache stops hitting; send each to its longest
# cached prefix and hot prefixes pile onto one. An instance: a PrefixCachingAllocator (block size 1:
# a token a 512-token hash id), a FIFO prefill queue fed at the trace's timestamps; no decode
# (Mooncake's Fig. 10 neither). Mooncake (FAST'25) Eq. 1, Table 1 (LLaMA3-70B, 8 x A800): flops(n) =
# l (a n^2 d + b n d^2), at 8 x 312 TFLOP/s (bf16 peak) x an efficiency; a fetch moves l x 2 (K, V)
# x d / gqa x 2 bytes = 320 KB a token at min(128 GB/s host-to-device, 800 Gbps NIC).
FLEET_LAYERS, FLEET_DIM, FLEET_A, FLEET_B, FLEET_GQA, FLEET_FLOPS = 80, 8192, 4, 22, 8, 8 * 312e12
FLEET_EFFICIENCIES = (0.3, 0.2, 0.5)  # ours first, the one the tables use
FETCH_BYTES_PER_TOKEN = FLEET_LAYERS * 2 * FLEET_DIM // FLEET_GQA * 2
FETCH_BYTES_PER_S = min(128e9, 800e9 / 8)
FETCH_SECONDS = TRACE_ID_TOKENS * FETCH_BYTES_PER_TOKEN / FETCH_BYTES_PER_S  # a block, fetched
FETCH_RATIOS = (2.0, 1.0, 4.0)  # Algorithm 1's kvcache_balancing_threshold, unstated: ours 1st
TIE_RULES = ("round robin", "lowest index")  # pick's; round robin: HAProxy's leastconn (its manual)
TIE_RULE = "round robin"  # the tables'; their "ties moved" column runs the other
ROUTER = (0.3, 64, 1.5)  # SGLang's, vLLM's router_args.py: cache_threshold, balance_abs/rel
FLEET_SIZES = (16, 10)  # instances: Mooncake's Fig. 5 (16 nodes), its Fig. 10 (10)
MOONCAKE_TTFT = {"random": 19.65, "load": 5.27, "local": 3.58, "global": 3.07}  # Fig. 5, s
FIG10 = {"conversation": (0.169, 1.38, 0.375, 1.05), "tool&agent": (0.420, 0.70, 0.581, 0.52),
         "synthetic": (0.264, 1.50, 0.622, 0.78)}  # its bars: hit rate, prefill s, local, global


def flops(tokens):  # Eq. 1
    return FLEET_LAYERS * (FLEET_A * tokens ** 2 * FLEET_DIM + FLEET_B * tokens * FLEET_DIM ** 2)


@dataclass
class Instance:
    pool: PrefixCachingAllocator
    free_at: float = 0.0  # when its prefill queue empties, s
    work: float = 0.0     # GPU seconds of prefill it did
    done: deque = field(default_factory=deque)  # when each request it holds ends, in order
    seen: set = field(default_factory=set)    # hash ids routed to it: a router's tree


class Fleet:
    """Instances, their rules (ties: a TIE_RULES name, else ValueError), a Random, last (chosen
    last, which replay_fleet sets; -1 at first): what schedulers ask. A scheduler(fleet, request,
    prompt, now) returns (the instance, the prefix blocks it reuses there, or None: its own)."""

    def __init__(self, instances, cache_blocks, efficiency, seed, fetch_ratio=None, ties=None,
                 index="hash"):  # None: FETCH_RATIOS[0], TIE_RULE, read late
        self.ties, self.last = TIE_RULE if ties is None else ties, -1
        if self.ties not in TIE_RULES:
            raise ValueError(f"ties must be one of {', '.join(TIE_RULES)}, got {self.ties!r}")
        self.instances = [Instance(PrefixCachingAllocator(cache_blocks, 1, index=index))
                          for _ in range(check_int(instances, "instances"))]
        self.efficiency, self.rng = efficiency, random.Random(seed)
        self.fetch_ratio = FETCH_RATIOS[0] if fetch_ratio is None else fetch_ratio

    def pick(self, keys):
        """The instance of the least key; among equals, by "round robin" the first after last,
        wrapping to 0, else the lowest index. Example, keys [0, 5, 3, 0]: last 1: 3; last 3: 0."""
        least = min(keys)
        tied = [i for i, key in enumerate(keys) if key == least]
        return tied[0] if self.ties == "lowest index" else min(
            tied, key=lambda i: (i - self.last - 1) % len(keys))

    def prefill(self, tokens, cached):  # seconds to prefill tokens past the first cached tokens
        return (flops(tokens) - flops(cached)) / (FLEET_FLOPS * self.efficiency)

    def queue(self, i, now):
        return max(0.0, self.instances[i].free_at - now)

    def reuse(self, i, prompt):  # how many leading blocks of prompt instance i's index matches
        return len(self.instances[i].pool.index.match(prompt)[0])

    def load(self, i, now):  # requests not ended by now (end > now): what a router counts
        done = self.instances[i].done
        while len(done) > 0 and done[0] <= now:
            done.popleft()
        return len(done)


def schedule_random(fleet, request, prompt, now):
    """Any instance, drawn from fleet.rng: no ties."""
    return fleet.rng.randrange(len(fleet.instances)), None


def schedule_load(fleet, request, prompt, now):
    """The least queued work. Ties: fleet.pick (by fleet.ties among equals), as below."""
    return fleet.pick([fleet.queue(i, now) for i in range(len(fleet.instances))]), None


def schedule_cache_aware(fleet, request, prompt, now):
    """SGLang's and vLLM's routers: the least loaded once the busiest holds over 64 requests more
    than the idlest, and over 1.5x as many; else the longest leading run of hash_ids routed there
    (seen) if over 30% of them, else the one that has seen fewest ids (SGLang: the smallest tree).
    Ties: pick."""
    threshold, absolute, relative = ROUTER
    loads = [fleet.load(i, now) for i in range(len(fleet.instances))]
    if max(loads) - min(loads) > absolute and max(loads) > relative * min(loads):
        return fleet.pick(loads), None
    ids = request.hash_ids
    matched = [next((k for k, h in enumerate(ids) if h not in instance.seen), len(ids))
               for instance in fleet.instances]
    if max(matched) > threshold * len(ids):
        return fleet.pick([-m for m in matched]), None
    return fleet.pick([len(instance.seen) for instance in fleet.instances]), None


def schedule_ratio(fleet, request, prompt, now):
    """Fig. 10's local setup (FAST'25 5.3.2): the highest own cached prefix / prompt. Ties: pick."""
    return fleet.pick([-fleet.reuse(i, prompt) for i in range(len(fleet.instances))]), None


def schedule_local(fleet, request, prompt, now):
    """Algorithm 1 with each instance's own prefix: the least queue + prefill. Ties: pick."""
    return fleet.pick([fleet.queue(i, now) + fleet.prefill(request.input_length, TRACE_ID_TOKENS
                       * fleet.reuse(i, prompt)) for i in range(len(fleet.instances))]), None


def schedule_global(fleet, request, prompt, now):
    """Algorithm 1 (lines 5, 20): the least fetch (of b - p blocks) + queue + prefill, an instance
    with p blocks of its own fetching the best, b, if b / p > fleet.fetch_ratio (p = 0: any b > 0),
    returned with the blocks it reuses (b or p). Ties: pick."""
    cached = [fleet.reuse(i, prompt) for i in range(len(fleet.instances))]
    reuses = [max(cached) if max(cached) > fleet.fetch_ratio * own else own for own in cached]
    i = fleet.pick([(reuse - own) * FETCH_SECONDS + fleet.queue(i, now) + fleet.prefill(
        request.input_length, TRACE_ID_TOKENS * reuse) for i, (own, reuse) in enumerate(zip(
            cached, reuses, strict=True))])
    return i, reuses[i]


FLEET_SCHEDULERS = {"random": schedule_random, "load": schedule_load,
                    "cache_aware": schedule_cache_aware, "ratio": schedule_ratio,
                    "local": schedule_local, "global": schedule_global}
FIG5_ROWS = ("random", "load", "cache_aware", "local", "global")  # ratio: Fig. 10's only


@dataclass
class FleetRun:
    mean_ttft: float        # seconds from arrival to the end of the prefill
    p90_ttft: float
    hit_rate: float         # full prompt blocks reused (cached or fetched) / full ones, or 0
    prefill_seconds: float  # GPU seconds of prefill per request
    busiest_share: float    # the busiest instance's share of the prefill work
    instances: list


def replay_fleet(requests, instances, scheduler, cache_blocks=THREE_M, efficiency=None, seed=0,
                 **rules):
    """Replay requests on instances prefill instances of cache_blocks blocks, each sent where
    FLEET_SCHEDULERS[scheduler] says at its timestamp / 1000 s: prefilled past what it reuses from
    max(then + any fetch, the queue's end), cached there at once. rules: Fleet's. ValueError for no
    request, or a prompt (trace_prompt at block size 1) over the cache. p90: the nearest rank."""
    efficiency = FLEET_EFFICIENCIES[0] if efficiency is None else efficiency  # late-bound
    fleet, ttfts, reused = Fleet(instances, cache_blocks, efficiency, seed, **rules), [], 0
    prompts = [trace_prompt(request, 1) for request in requests]  # a token an id
    if len(prompts) == 0 or max(map(len, prompts)) > cache_blocks:
        raise ValueError(f"no request, or one longer than {cache_blocks} blocks, the cache")
    for number, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
        now = request.timestamp / 1000
        i, reuse = FLEET_SCHEDULERS[scheduler](fleet, request, prompt, now)
        own, instance, fleet.last = fleet.reuse(i, prompt), fleet.instances[i], i
        reuse = own if reuse is None else reuse
        work = fleet.prefill(request.input_length, TRACE_ID_TOKENS * reuse)
        instance.free_at = max(now + (reuse - own) * FETCH_SECONDS, instance.free_at) + work
        instance.work += work
        instance.done.append(instance.free_at)
        instance.seen.update(request.hash_ids)
        ttfts.append(instance.free_at - now)
        reused += reuse
        Sequence(number, instance.pool, prompt).free()  # its blocks stay cached there
        if number % 1000 == 999:
            progress(f"fleet: {scheduler}, {instances} instances, request {number + 1:,}")
    progress("")
    ttfts.sort()
    works = [instance.work for instance in fleet.instances]
    return FleetRun(sum(ttfts) / len(ttfts), ttfts[math.ceil(0.9 * len(ttfts)) - 1],
                    reused / max(1, sum(map(len, prompts))), sum(works) / len(requests),
                    max(works) / max(sum(works), 1e-300), fleet.instances)


def demo_fleet(path, limit):
    """Fig. 5's schedulers, global at each fetch ratio and efficiency, ties moved; Fig. 10."""
    requests, name = load_trace(path, limit), path.replace("\\", "/").rsplit("/", 1)[-1]
    many, other_rule = FLEET_SIZES[0], next(rule for rule in TIE_RULES if rule != TIE_RULE)
    print(f"== fleet: {len(requests):,} requests of {name} on prefill instances ==\n"
          f"each {THREE_M:,} blocks (3M tokens), LRU; prefill: Mooncake's Eq. 1, "
          f"{FLEET_EFFICIENCIES[0]:.0%} of 8 x A800; fetch {FETCH_BYTES_PER_S / 1e9:.0f} GB/s\n"
          f"ties go by {TIE_RULE}, to the first after the one chosen last; global fetches the best "
          f"prefix\nif over r x its own (r = {FETCH_RATIOS[0]:g} ours; with none, any)\n"
          f"1. where a request goes, {many} instances; Mooncake's Fig. 5 (16 nodes, conversation "
          f"trace), quoted;\n   ties moved: the mean TTFT with ties to the {other_rule}, less the "
          "table's\n   scheduler    mean TTFT  p90 TTFT  hit rate  prefill s/req  busiest  "
          "ties moved  Fig. 5")
    runs = {s: replay_fleet(requests, many, s) for s in FIG5_ROWS}
    for label, run in [*runs.items(), *((f"global r={r:g}", replay_fleet(
            requests, many, "global", fetch_ratio=r)) for r in FETCH_RATIOS[1:])]:
        moved, paper = "", MOONCAKE_TTFT.get(label)  # random has no ties to move
        if label in FIG5_ROWS[1:]:
            other = replay_fleet(requests, many, label, ties=other_rule)
            moved = f"{other.mean_ttft - run.mean_ttft:+.2f} s"
        print((f"   {label:<12}{run.mean_ttft:>8.2f} s{run.p90_ttft:>8.2f} s{run.hit_rate:>10.1%}"
               f"{run.prefill_seconds:>15.2f}{run.busiest_share:>9.1%}{moved:>12}"
               + ("" if paper is None else f"{paper:>7.2f} s")).rstrip())
    print("   global's mean TTFT at the other prefill efficiencies: " + "; ".join(
        f"at {e:.0%}, {replay_fleet(requests, many, 'global', efficiency=e).mean_ttft:.2f} s"
        for e in FLEET_EFFICIENCIES[1:]))
    demo_fig10(requests, name)


def demo_fig10(requests, name):
    """Fig. 10 on FLEET_SIZES[1] instances: three local setups beside their globals (the LRU's: one
    of FLEET_SIZES[1] x its blocks), its bars, "-" for both ratios where a local rate is 0; then
    the setup nearest the bars: by the farther of its two hit rates, a tie by the nearer."""
    few, trace = FLEET_SIZES[1], next((t for t in FIG10 if t.split("&")[0] in name), None)
    ratio, local, overall = (replay_fleet(requests, few, s) for s in ("ratio", "local", "global"))
    one, pooled = (replay_fleet(requests, 1, "load", cache_blocks=blocks)
                   for blocks in (THREE_M, few * THREE_M))  # one 3M-token LRU, one of 10 x 3M
    rows = {label: (mine.hit_rate, mine.prefill_seconds, pool.hit_rate, pool.prefill_seconds)
            for label, mine, pool in (("by prefix ratio (paper's rule)", ratio, overall),  # local,
                                      ("Algorithm 1: queue + prefill", local, overall),  # global
                                      (f"one {THREE_M:,}-block LRU", one, pooled))}
    print(f"2. local caches (each node its own) against global (Algorithm 1; for the LRU, one "
          f"{few * THREE_M:,}-block LRU),\n   {few} instances; Fig. 10's bars  hit rate  prefill "
          "s/req   global: hit rate  prefill  hits  prefill")
    for label, (hits, seconds, global_hits, global_seconds) in (rows | (
            {} if trace is None else {f"Fig. 10, {trace}": FIG10[trace]})).items():
        ratios = ("-", "-") if hits == 0 else (f"{global_hits / hits:.2f}x",
                                               f"{global_seconds / seconds:.2f}x")
        print(f"   {label:<30} {hits:>8.1%} {seconds:>14.2f} {global_hits:>18.1%} "
              f"{global_seconds:>8.2f} {ratios[0]:>5} {ratios[1]:>8}")
    if trace is not None:  # nearest both hit-rate bars: by the farther, a tie by the nearer
        bar, _, global_bar, _ = FIG10[trace]
        off = {k: sorted([abs(r[0] - bar), abs(r[2] - global_bar)])[::-1] for k, r in rows.items()}
        near = min(off, key=off.get)
        print(WRAP.fill(f"nearest Fig. 10's hit rates: {near}, {off[near][0]:.1%} off at most; "
                        f"by prefix ratio, the busiest had {ratio.busiest_share:.0%} of prefill"))


# ---------------------------------------------------------------------------------------
# Part 13. Extension: hybrid models, sliding-window and full-attention groups on one pool
# ---------------------------------------------------------------------------------------
# A sliding-window layer reads only the last W tokens' KV (gpt-oss: every other layer, W 128). vLLM
# v1 puts layers of one attention type in KV cache groups on one pool: a request holds a table per
# group, a window group frees the blocks behind its window, a hit must serve every group.


def skipped_tokens(window, n):  # vLLM's get_num_skipped_tokens; 0 for full. W 4, n 7 -> 4: 0..3
    return 0 if window is None else max(0, n - window + 1)


def group_key(block_hash, group):  # vLLM's make_block_hash_with_group_id: one entry per group
    return block_hash + group.to_bytes(4, "big")


class HybridSequence:
    """A request of a hybrid model: a block table per group, one pool; windows[g]: None (full) or
    W >= 1. Invariant: a table has cdiv(len(tokens), block_size) entries, entry i None (vLLM's null
    block, a pool block it sets aside) exactly when i < skipped_tokens(W, n) // block_size, n =
    num_cached_tokens before any append, len(tokens) - 1 after (vLLM's remove_skipped_blocks).
    Block size 16, windows [None, 32], 111 tokens: tables of 7, taken group by group (0..6, 7..13);
    append frees window blocks 4..0. State: seq_id, allocator, windows, tokens, block_tables,
    num_prompt_tokens, num_cached_tokens, hashes (each full block's, any pool), is_freed. A caching
    pool counts as allocate_prompt does, work aside; a hit: blocks every group serves, the oldest
    copy. Refusals, changing nothing: Sequence's; TypeError or ValueError for windows not a
    non-empty list of None or ints >= 1, ValueError for a pool off the hash index; OutOfBlocksError.
    NOTE: one prefill chunk, its window blocks held until the first append; vLLM frees behind the
    window between chunks and caps a window group's admission (max_admission_blocks_per_request).
    NOTE: no fork, so no copy-on-write: vLLM v1 shares full blocks only."""

    def __init__(self, seq_id, pool, tokens, windows):
        if not isinstance(pool, BlockAllocator):
            raise TypeError(f"pool must be a BlockAllocator, got {pool!r}")
        windows = [w if w is None else check_int(w, "a window") for w in windows]
        caching = isinstance(pool, PrefixCachingAllocator)
        if len(windows) == 0 or caching and not isinstance(pool.index, HashIndex):
            raise ValueError("windows: one per KV cache group; a caching pool: the hash index "
                             "(NOTE: the radix tree keeps no groups; SGLang's SWARadixCache does)")
        token_ids, size = check_tokens(tokens), pool.block_size
        self.seq_id, self.allocator, self.windows, self.is_freed = seq_id, pool, windows, False
        self.tokens, self.hashes, self.num_prompt_tokens = token_ids, [], len(token_ids)
        for k in range(len(token_ids) // size):  # chained, as vLLM's request.block_hashes
            self.hashes.append(hash_block_tokens(self.hashes[-1] if k > 0 else None, token_ids[
                k * size:(k + 1) * size]))
        hit = self._find_hit() if caching else 0
        self.num_cached_tokens, need = hit * size, cdiv(len(token_ids), size) - hit
        self.block_tables = [[None] * (skipped_tokens(w, hit * size) // size) for w in windows]
        for g, table in enumerate(self.block_tables):  # the hit's blocks inside the window
            table += [next(iter(pool.index.block_of[group_key(self.hashes[k], g)]))
                      for k in range(len(table), hit)]  # the oldest copy, as vLLM offers
        hits = [block for table in self.block_tables for block in table if block is not None]
        revived = [block for block in hits if block not in pool.ref_cnt]
        pool.ensure_free(need * len(windows) + len(revived))  # check, then act
        if caching:  # the counters allocate_prompt keeps
            pool.stats.hits, pool.stats.prompts = pool.stats.hits + hit, pool.stats.prompts + 1
            pool.stats.misses += len(self.hashes) - hit
            pool.index.lock(pool.share_blocks(hits), revived, pool.stats.prompts)
        for table in self.block_tables:
            table += pool.allocate_many(need)
            for k in range(hit, len(table)):
                pool.kv_cache.write(table[k], 0, token_ids[k * size:(k + 1) * size])
        for k in range(hit, len(self.hashes)):
            self._cache(k)

    def _find_hit(self):
        """How many blocks of the longest prefix all groups serve, at most len(tokens) - 1 tokens,
        as vLLM's HybridKVCacheCoordinator: from the right, W needs cdiv(W - 1, block_size) blocks
        before the end, full attention all, until none shortens it. NOTE: vLLM caches no window-1
        block (reachable_block_mask); here one serves any length."""
        index, size, hit = self.allocator.index, self.allocator.block_size, 0
        end = max(0, len(self.tokens) - 1) // size  # NOTE: vLLM recomputes the last token
        while hit != end:  # NOTE: vLLM looks up groups of one window together: the same hit
            hit = end
            for g, window in enumerate(self.windows):
                need, run = end if window is None else cdiv(window - 1, size), 0  # NOTE: vLLM
                # scans full attention from the left; the longest run from block 0 is the same
                for k in range(end - 1, -1, -1):
                    cached = group_key(self.hashes[k], g) in index.block_of
                    run = run + 1 if cached else 0
                    if cached and run >= need:
                        end = k + run
                        break
                else:
                    end = run  # no run long enough: the cached run from block 0
        return hit

    def _cache(self, k):
        """Cache full block k of each group (NOTE: not insert: a window frees blocks before)."""
        size = self.allocator.block_size
        if isinstance(self.allocator, PrefixCachingAllocator):
            for g, table in enumerate(self.block_tables):
                self.allocator.index.cache(table[k], group_key(self.hashes[k], g),
                                           self.tokens[k * size:(k + 1) * size])

    def append(self, token):
        """A decode step (vLLM's allocate_slots): window groups free the blocks now behind them,
        last first, into the one eviction order; each group takes a block if its last is full; a
        block it fills is cached in each group (_cache), its hash chained onto hashes. NOTE: the
        check counts the room that makes; refused, vLLM has freed them, the lab not."""
        self._check_live()
        check_tokens([token])
        pool, n, tables = self.allocator, len(self.tokens), self.block_tables
        size, offset = pool.block_size, n % pool.block_size
        behind = [list(itertools.takewhile(lambda j: t[j] is not None, range(
            skipped_tokens(w, n) // size - 1, -1, -1))) for w, t in zip(self.windows, tables)]
        room = sum(pool.ref_cnt[t[j]] == 1 for js, t in zip(behind, tables) for j in js)
        pool.ensure_free((len(tables) if offset == 0 else 0) - room)  # check, then act
        for js, table in zip(behind, tables):
            pool.free_blocks([table[j] for j in js])
            for j in js:
                table[j] = None
        for table in tables:
            table += [pool.allocate()] if offset == 0 else []
            pool.kv_cache.slots[table[-1] * size + offset] = token
        self.tokens.append(token)
        if offset == size - 1:
            self.hashes.append(hash_block_tokens(self.hashes[-1] if n >= size else None,
                                                 self.tokens[-size:]))
            self._cache(n // size)

    def check_windows(self):
        """check_invariants' part: entry i of a table is None exactly when i is behind its window
        ("window: ..."), and each group reads back the tokens its window keeps ("read-back")."""
        pool, size, n = self.allocator, self.allocator.block_size, len(self.tokens)
        n = n - 1 if n > self.num_prompt_tokens else self.num_cached_tokens  # the window rule
        for window, table in zip(self.windows, self.block_tables):
            behind = 0 if window is None else max(0, n - window + 1) // size  # restated
            expect(all((block is None) == (i < behind) for i, block in enumerate(table)),
                   f"window: sequence {self.seq_id!r} holds a block behind its window of "
                   f"{window}, or lost one inside it")
            got = [None if table[i // size] is None else pool.kv_cache.slots[
                table[i // size] * size + i % size] for i in range(len(self.tokens))]
            expect(got == [None if i // size < behind else t for i, t in enumerate(self.tokens)],
                   f"read-back: sequence {self.seq_id!r} reads back tokens it was not given")

    def free(self):
        """Release every block, group by group, each table tail first (vLLM's coordinator.free)."""
        self._check_live()
        for table in self.block_tables:
            self.allocator.free_blocks([block for block in reversed(table) if block is not None])
            table.clear()
        self.is_freed = True

    _check_live = Sequence._check_live  # ValueError once freed


# The hybrid section ---------------------------------------------------------------------

VLLM_HYBRID = ([None, 32, 32], 16, 111, 11)  # the doc's 10 full + 20 window layers: 112 tokens
# hold 11 blocks (docs/design/hybrid_kv_cache_manager.md)
VLLM_SLIDING = (4, 15, [2, 3, 4, 5, 11, 12, 13], [5, 6, 14])  # window, tokens, cached, hits: 14
HYBRID_MODELS = {"gpt-oss-120b": (36, 18, 128, 8, 64), "Gemma 3 27B": (62, 10, 1024, 16, 128)}
# (layers, full ones, window, KV heads, head dim), bf16. gpt-oss-120b: openai/gpt-oss ModelConfig,
# transformers' GptOssConfig defaults (36 layers, 8 KV heads of 64, window 128 on even layers).
# Gemma 3 27B: google/gemma-3-27b's text_config as public copies give it (62 layers, 16 KV heads
# of 128, sliding_window 1024, pattern 6: 5 local to 1 global), 52 + 10 as vLLM's doc counts
HYBRID_POOL_GIB, CONTEXTS = 64, (2048, 8192, 32768, 131072)  # GiB of KV (ours), tokens a request


def print_cache_table(stream, sizes, window, block_size):
    """Part 6's serve with hybrid sequences at each pool size: full + window, then full + full."""
    print("   pool blocks  groups        hit rate   evicted   blocks held a step, g0    g1")
    rows, steps = {}, sum(len(answer) for _, answer in stream)
    for size, windows in itertools.product(sizes, ([None, window], [None, None])):
        progress(f"hybrid: windows {windows}, {size:,} blocks")
        pool, held = PrefixCachingAllocator(size, block_size), [0, 0]
        for i, (prompt, answer) in enumerate(stream):
            seq = HybridSequence(i, pool, prompt, windows)
            for token in answer:
                seq.append(token)
                held = [h + len(t) - t.count(None) for h, t in zip(held, seq.block_tables)]
            seq.free()
        progress("")
        rows[size, windows[1]] = pool.hit_rate
        print(f"   {size:>11,}  full + {windows[1] or 'full':<6} {pool.hit_rate:>8.1%} "
              f"{pool.stats.evicted:>9,} {held[0] / steps:>22.1f} {held[1] / steps:>5.1f}")
    size = max(sizes, key=lambda s: abs(rows[s, window] - rows[s, None]))
    mixed, dense = rows[size, window], rows[size, None]
    print(f"   most at {size:,} blocks: the window moves the hit rate {100 * (mixed - dense):+.1f} "
          "points" if mixed != dense else "   the window moves no hit rate at these pool sizes")


def demo_hybrid(block_size, seed):
    """vLLM's two worked examples, the real-model table, the caching table on Part 6's chat."""
    print("== hybrid: sliding-window and full-attention KV cache groups on one pool (vLLM v1) ==")
    (windows, size, prompt, doc_held), pool = VLLM_HYBRID, BlockAllocator(64, VLLM_HYBRID[1])
    seq = HybridSequence("r", pool, range(prompt), windows)
    before, held = [list(table) for table in seq.block_tables], pool.num_used
    seq.append(prompt)
    print(f"1. vLLM's example (docs/design/hybrid_kv_cache_manager.md), windows {windows}, block "
          f"size {size}:\n   {prompt} tokens hold {held} blocks, a decode step {pool.num_used} "
          f"(the doc: {doc_held}); None: freed, vLLM's null block")
    for g, (window, table) in enumerate(zip(windows, seq.block_tables)):
        print(f"   group {g}, window {window or 'full'}: {before[g]} -> {table}")
    window, n, doc_cached, doc_hits = VLLM_SLIDING
    tokens, pool = list(range(100, 100 + n)), PrefixCachingAllocator(16, 1)
    first = HybridSequence("a", pool, tokens[:-1], [window])
    first.append(0)  # its window frees tokens 0..10, the least recently used
    HybridSequence("b", pool, tokens[:6], [window]).free()  # hits 2..4, caches 5 again
    HybridSequence("c", pool, range(8), [window]).free()  # evicts 8: 10..5, 1, 0
    first.free()
    keys = [group_key(h, 0) for h in HybridSequence(0, BlockAllocator(n, 1), tokens, [None]).hashes]
    cached = [k for k in range(n) if keys[k] in pool.index.block_of]
    hits = [h for h in range(1, n) if set(range(max(0, h - window + 1), h)) <= set(cached)]
    taken = HybridSequence("q", pool, tokens, [window]).num_cached_tokens
    print(f"2. vLLM's window-only example, window {window}, block size {pool.block_size}, {n} "
          "tokens:\n   cached "
          f"{cached}, hits possible {hits}, taken {taken}\n   the doc's: {doc_cached}, {doc_hits}")
    print(f"3. requests that fit in {HYBRID_POOL_GIB} GiB of KV, each a prompt and a decode step "
          f"(block size {block_size})\n   model          groups (full, window)  context   as is  "
          "all full    gain  bound")
    reach = []  # each model's gain at the longest context, against its bound
    for name, (layers, full, window, heads, dim) in HYBRID_MODELS.items():
        few, many = sorted((full, layers - full))  # vLLM's group size (kv_cache_utils.py):
        per_group = many if many < 1.5 * few else few  # the larger count if under 1.5x the other
        windows = [None] * cdiv(full, per_group) + [window] * cdiv(layers - full, per_group)
        for context in CONTEXTS:  # a layer's block: block_size tokens' K and V, 2 bytes each
            pool, layer_block = BlockAllocator(len(windows) * context, block_size), \
                block_size * 2 * heads * dim * 2
            HybridSequence(0, pool, [0] * (context - 1), windows).append(0)
            fit = [HYBRID_POOL_GIB * 2**30 // (blocks * layer_block) for blocks in (
                pool.num_used * per_group, cdiv(context, block_size) * layers)]  # all full
            print(f"   {name:<14} {windows.count(None)} + {len(windows) - windows.count(None)} x"
                  f" {window:<13} {context // 1024:>6}K {fit[0]:>7,} {fit[1]:>9,} "
                  f"{fit[0] / max(1, fit[1]):>6.1f}x {layers / full:>5.1f}x")
        reach.append(f"{fit[0] / max(1, fit[1]) / (layers / full):.0%}")
    print(f"   at {CONTEXTS[-1] // 1024}K the gain is {' and '.join(reach)} of the bound, layers / "
          "full-attention layers")
    stream, window = chat_stream(4 if seed is None else seed), HYBRID_MODELS["gpt-oss-120b"][2]
    print(f"4. prefix caching: Part 6's {len(stream)} chat requests, gpt-oss's groups (full, "
          f"window {window}) against two full")
    print_cache_table(stream, [t // block_size for t in CACHE_POOLS[:3]], window, block_size)


def demo_hybrid_trace(path, limit, block_size):
    """The caching table on a Mooncake trace: a block per hash id, as Part 11."""
    requests, fresh = load_trace(path, limit), itertools.count(10 ** 9)  # decode tokens: above all
    stream = [(trace_prompt(r, block_size), [next(fresh) for _ in range(trace_decode_len(
        r, block_size))]) for r in requests]
    window = max(1, HYBRID_MODELS["gpt-oss-120b"][2] * block_size // TRACE_ID_TOKENS)  # scaled
    print(f"== hybrid: {len(requests):,} requests of {path.rsplit('/', 1)[-1]}; gpt-oss's window "
          f"here: {window} tokens ==")
    print_cache_table(stream, [THREE_M // 2, THREE_M * 2, THREE_M * 8], window, block_size)


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------

CORE = {"checks": run_checks, "pitfalls": demo_pitfalls, "memory": demo_memory,
        "sharing": demo_sharing}  # the default run, in reading order
EXTENSIONS = {"cache": demo_cache, "evict": demo_evict, "beam": demo_beam, "sweep": demo_sweep,
              "hybrid": demo_hybrid}
SECTIONS = {**CORE, **EXTENSIONS, "bench": demo_bench}  # each f(block_size, seed)
TRACED = {"trace": (demo_trace, ("--block-size", "--index")), "fleet": (demo_fleet, ()),
          "hybrid-trace": (demo_hybrid_trace, ("--block-size",))}  # each
# f(path, limit, then its options in order); a new command is one line in one of these tables
MAX_BLOCK_SIZE = 256  # the largest block size every section is built for
STEPS = "1 2 3 4 5 6a 6b 6c 7 8 9 10 11 12 13".split()  # the banners' names; 1-5: the core


def knob_ranges(b):
    """The knobs a learner may edit whose bad values fail far from their cause (a hang, a
    ZeroDivisionError in a demo): name -> (value, low, high) at block size b; main refuses a value
    outside low..high, or an empty tuple. A knob that reaches a contract class is refused there."""
    widest = SERVING_KV_TOKENS // (MAX_SEQ_LEN + MAX_BLOCK_SIZE)  # samples or beams that fit
    counts = dict(CHAT_TURNS=CHAT_TURNS, CHAT_CONVERSATIONS=CHAT_CONVERSATIONS,
                  EVICT_REQUESTS=EVICT_REQUESTS, EVICT_SEEDS=EVICT_SEEDS, SWAP_TOKENS=SWAP_TOKENS,
                  SWEEP_SEEDS=SWEEP_SEEDS, SWEEP_SYSTEM_LEN=SWEEP_SYSTEM_LEN,
                  FLEET_SIZES=FLEET_SIZES, BENCH_REPEATS=BENCH_REPEATS)  # at least 1 each
    return {name: (value, 1, math.inf) for name, value in counts.items()} | dict(
        COPY_LATENCY_S=(COPY_LATENCY_S, 0, 1), PREFILL_EFFICIENCIES=(PREFILL_EFFICIENCIES, 0.01, 1),
        FLEET_EFFICIENCIES=(FLEET_EFFICIENCIES, 0.01, 1), FETCH_RATIOS=(FETCH_RATIOS, 0, math.inf),
        ACTUAL_LEN=(ACTUAL_LEN, 1, MAX_LEN),
        EVICT_SIZES=(EVICT_SIZES, 1, SWAP_TOKENS), NUM_SAMPLES=(NUM_SAMPLES, 1, widest),
        BEAM_WIDTHS=(BEAM_WIDTHS, 1, widest), SWEEP_SIZES=(SWEEP_SIZES, 1, MAX_BLOCK_SIZE),
        POOL_TOKENS=(POOL_TOKENS, MAX_LEN + b, math.inf), CACHE_POOLS=(CACHE_POOLS, b, math.inf),
        MAX_SEQ_LEN=(MAX_SEQ_LEN, 2, math.inf), BENCH_POOLS=(BENCH_POOLS, max(100, b), math.inf),
        SERVING_LIFETIMES=(SERVING_LIFETIMES, 0.1, math.inf))


def starter(step, path):
    """Write to path this file with step's function bodies (a core step N's: Parts N..5) made `raise
    NotImplementedError`; signatures, docstrings and comments stay. Run it on your own file too."""
    lines = pathlib.Path(__file__).read_text(encoding="utf-8").splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines, 1) if re.match(rf"# (Part )?{step}\. ", line))
    end = r"# Part 6\. " if step in STEPS[:5] else r"# (Part \d+\. |\d+[a-c]\. |The [a-z ]+-*$)"
    last = next(i for i, line in enumerate(lines, 1) if i > first and re.match(end, line))
    tree = ast.parse("".join(lines))  # functions, methods: a nested one goes with its outer body
    defs = [n for top in tree.body for n in (top.body if isinstance(top, ast.ClassDef) else [top])]
    for node in reversed(defs):  # from the bottom, so that a cut moves no line above it
        if isinstance(node, ast.FunctionDef) and first < node.lineno < last:
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if len(body) > 0:
                lines[body[0].lineno - 1:node.end_lineno] = [
                    " " * body[0].col_offset + "raise NotImplementedError\n"]
    pathlib.Path(path).write_text("".join(lines), encoding="utf-8")


def main(argv=None):
    """Parse argv (else sys.argv[1:]) with argparse: no command, the default run, else one command.
    Run it; a bad option exits 2 with argparse's usage, a bad knob or file with one line."""
    options = {"--block-size": dict(type=int, metavar="N",
                                    help=f"tokens per block, 1..{MAX_BLOCK_SIZE} (default 16)"),
               "--seed": dict(type=int, metavar="N", help="seeds workloads, >= 0 (default ours)"),
               "--requests": dict(type=int, metavar="N", dest="limit", help="the first N only"),
               "--index": dict(choices=list(INDEXES), default="hash", help="(default hash)")}
    parser = argparse.ArgumentParser(prog="solution.py", description="The paged KV-cache lab; "
                                     f"no command: the default run ({', '.join(CORE)}).")
    for flag in ("--block-size", "--seed"):
        parser.add_argument(flag, **options[flag])
    parser.set_defaults(block_size=BLOCK_SIZE, limit=None, sections=list(CORE), more=[])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    def command(name, about, *flags, **defaults):  # SUPPRESS: an option given before it stays
        sub = commands.add_parser(name, help=textwrap.shorten(about, 110, placeholder=" ..."),
                                  description=about, argument_default=argparse.SUPPRESS)
        for flag in flags:
            sub.add_argument(flag, **options[flag])
        sub.set_defaults(**defaults)
        return sub
    for name, run in SECTIONS.items():
        command(name, inspect.getdoc(run) or "", "--block-size", "--seed", sections=[name]
                ).add_argument("more", nargs="*", metavar="SECTION", help="more, run in order")
    command("all", f"the core and the extensions ({', '.join(EXTENSIONS)})", "--block-size",
            "--seed", sections=[*CORE, *EXTENSIONS])
    for name, (demo, flags) in TRACED.items():
        command(name, inspect.getdoc(demo) or "", "--requests", *flags, sections=[]).add_argument(
            "path", metavar="PATH", help="a Mooncake-format JSONL file (FAST25-release/traces/ "
            "of kvcache-ai/Mooncake)")
    steps = command("starter", inspect.getdoc(starter))
    steps.add_argument("step", choices=STEPS, help="the step to write")
    steps.add_argument("file", metavar="FILE", help="where it goes")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command in (*TRACED, "starter") and argv[0] != args.command:
        parser.error(f"{args.command}'s options go after it")  # those before are the sections'
    ranges = {"--block-size": (args.block_size, 1, MAX_BLOCK_SIZE), "--seed": (args.seed, 0,
              math.inf), "--requests": (args.limit, 1, math.inf)}  # type=int checks no range
    for flag, (value, low, high) in ranges.items():
        if value is not None and not low <= value <= high:
            parser.error(f"argument {flag}: {value} is not in {low}..{high}")
    if not set(args.more) <= SECTIONS.keys():  # not choices=: it refuses nargs="*" given none
        parser.error(f"argument SECTION: choose from {', '.join(SECTIONS)}")
    name = args.command  # what failed: the command, or the section running
    try:
        if args.command == "starter":  # before the knob checks: a starter's own parts may be empty
            return starter(args.step, args.file)
        for knob, (value, low, high) in knob_ranges(args.block_size).items():
            values = value if isinstance(value, tuple) else (value,)
            if len(values) == 0 or not all(low <= v <= high for v in values):
                parser.exit(2, f"solution.py: error: knob {knob}: {value} not in {low}..{high}\n")
        if args.command in TRACED:
            demo, flags = TRACED[args.command]
            demo(args.path, args.limit, *(getattr(args, f[2:].replace("-", "_")) for f in flags))
        for i, name in enumerate([*args.sections, *args.more]):
            print("" if i == 0 else "\n", end="")
            SECTIONS[name](args.block_size, args.seed)
        if args.command is None:
            print(f"\nthe extensions: python solution.py all ({', '.join(EXTENSIONS)}), bench;")
            print(f"on a trace: {', '.join(name + ' PATH' for name in TRACED)}")
        sys.stdout.flush()  # a reader that stopped early (| head) shows here, not at exit
    except BrokenPipeError:  # nothing more to write to: exit quietly
        sys.stdout = None
        sys.exit(1)
    except (OSError, ValueError, OutOfBlocksError) as error:  # no such file, a bad line, or
        parser.exit(2, f"solution.py: error: {name}: {type(error).__name__}: {error}\n")  # knob


if __name__ == "__main__":
    main()
