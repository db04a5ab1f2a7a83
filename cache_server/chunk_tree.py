"""The chunk tree of a namespace whose engine declared its layout: which stored prefixes a
lookup can actually resume, kept incrementally.

Bytes held say nothing about whether a session still holds the snapshot it needs, so a
tracked namespace gets a tree: one node per chunk hash, linked to the previous chunk by the
``parent`` its objects were put with. A node is *resumable* when it and every ancestor
hold all their attention objects and it holds every state object (what a lookup needs to
stop there); ``covered`` counts the resumable nodes at or below each node, kept
incrementally (a walk up the path when a state completes or breaks, a walk down the
subtree only when a path's attention breaks or heals). From it, per namespace and O(1) to
read: resumable tokens (chunks on some resumable path, times the chunk size), resumable
states, states held, and states evicted while still the newest of their path.

The tree also feeds the eviction order (:mod:`cache_server.eviction`): a node that was
covered once and no longer is holds *worthless* objects, and each object's value is read
here. A state's value is the prefill its resume saves, over its own bytes (the attention
above it is shared and counted with the attention objects); an attention object's value is
the largest ``saved`` of the resumable states at or below its chunk (kept on the walk up
the path that already counts them; not lowered when a deeper state goes while a shallower
one below stays, only when the chunk stops being covered), so a path's attention (small,
worth its deepest state) outlives its states, and once the last state below goes it is
worthless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cache_server.eviction import saved_prefill
from cache_server.layout import Layout, StoreKey

UNKNOWN_PARENT = b""  # ``parent`` of an object whose writer did not say which chunk precedes it


@dataclass(slots=True)
class ChunkNode:
    """One chunk of the tree."""

    parent_chunk: bytes | None = None  # previous chunk's hash; None: the first chunk
    parent_known: bool = False
    child_chunks: set[bytes] = field(default_factory=set)  # nodes whose parent_chunk is this one
    attn: int = 0  # resident attention objects
    state: int = 0  # resident state objects
    chain_ok: bool = False  # this node and every ancestor hold all their attention
    covered: int = 0  # resumable nodes at or below this one
    claimed: bool = False  # was covered once: losing that makes its objects worthless
    resumable: bool = False
    depth: int = 0  # chunks from the first to this one, inclusive; valid while chain_ok
    value: float = 0.0  # largest saved prefill of a resumable node at or below


@dataclass
class NamespaceUsage:
    """Incremental usable-prefix figures of one tracked namespace."""

    covered_nodes: int = 0  # chunks on at least one resumable path
    resumable_states: int = 0  # nodes a lookup can stop at
    states_held: int = 0  # nodes with every state object
    states_evicted_newest: int = 0  # complete states evicted with no newer state on their path
    worthless_objects: int = 0  # objects of claimed, uncovered nodes (eviction class 0)


class ChunkTree:
    """The tree of one namespace. ``requeue(key)`` puts a resident object back into its
    eviction heap at its current class and priority (returning False if the object is not
    resident): the tree calls it for every object whose class or value it changes. Not
    thread-safe: the store calls it under its lock."""

    def __init__(self, namespace: str, layout: Layout, value_alpha: float,
                 requeue: Callable[[StoreKey], bool]) -> None:
        self.namespace = namespace
        self.layout = layout
        self.value_alpha = value_alpha
        self._requeue = requeue
        self._attn_copies = layout.copies(layout.attn_groups)
        self._state_copies = layout.copies(layout.state_groups)
        self.nodes: dict[bytes, ChunkNode] = {}
        self.usage = NamespaceUsage()

    # --- what the store asks ---------------------------------------------------------------

    def worthless(self, digest: bytes) -> bool:
        """Whether the objects of chunk ``digest`` are in eviction class 0."""
        node = self.nodes.get(digest)
        return node is not None and node.claimed and not node.covered

    def value_per_byte(self, digest: bytes, group: int, nbytes: int) -> float:
        """Saved prefill per byte of one object of chunk ``digest`` (0 off a whole path)."""
        node = self.nodes.get(digest)
        if node is None or not node.chain_ok:
            return 0.0
        if group in self.layout.state_groups:
            return self._saved(node.depth) / (self._state_copies * nbytes)
        value = node.value or self._saved(node.depth)  # pending: at least its own depth
        return value / (self._attn_copies * nbytes)

    def figures(self) -> dict[str, int]:
        """The usable-prefix figures, O(1)."""
        usage = self.usage
        return {"resumable_tokens": usage.covered_nodes * self.layout.chunk_tokens,
                "resumable_chunks": usage.covered_nodes, "resumable_states": usage.resumable_states,
                "states_held": usage.states_held, "states_evicted_newest": usage.states_evicted_newest,
                "worthless_objects": usage.worthless_objects}

    # --- objects come and go ---------------------------------------------------------------

    def add(self, digest: bytes, group: int, parent_chunk: bytes | None) -> None:
        """An object of ``group`` at chunk ``digest`` was stored (``parent_chunk`` as put)."""
        layout, nodes = self.layout, self.nodes
        if group not in layout.attn_groups and group not in layout.state_groups:
            return  # a group the engine did not declare: plain LRU, outside the tree
        node = nodes.get(digest)
        if node is None:
            node = nodes[digest] = ChunkNode()
        if not node.parent_known and parent_chunk != UNKNOWN_PARENT and parent_chunk != digest:
            node.parent_chunk, node.parent_known = parent_chunk, True
        if node.parent_known and node.parent_chunk is not None:  # (again: a pruned parent is made anew)
            up = nodes.get(node.parent_chunk)
            if up is None:
                up = nodes[node.parent_chunk] = ChunkNode()  # structure only, until its objects come
            up.child_chunks.add(digest)
        if group in layout.attn_groups:
            node.attn += 1
        else:
            node.state += 1
            if node.state == self._state_copies:
                self.usage.states_held += 1
        if node.claimed and not node.covered:
            self.usage.worthless_objects += 1
        self._refresh(digest, node)

    def remove(self, digest: bytes, group: int, evicted_newest: bool) -> None:
        """An object of ``group`` at chunk ``digest`` left the store; ``evicted_newest``: it
        was evicted with no newer state linked to it."""
        layout, usage = self.layout, self.usage
        node = self.nodes.get(digest)
        if node is None:
            return
        if group in layout.attn_groups:
            node.attn -= 1
        elif group in layout.state_groups:
            if node.state == self._state_copies:
                usage.states_held -= 1
                if evicted_newest:
                    usage.states_evicted_newest += 1
            node.state -= 1
        else:
            return
        if node.claimed and not node.covered:
            usage.worthless_objects -= 1
        self._refresh(digest, node)
        self._prune(digest)

    def forget_objects(self) -> None:
        """Every object of the namespace is being removed at once: drop the tree wholesale
        (no walk per object), keeping the monotonic eviction figure."""
        self.nodes = {}
        self.usage = NamespaceUsage(states_evicted_newest=self.usage.states_evicted_newest)

    # --- upkeep --------------------------------------------------------------------------

    def _saved(self, depth: int) -> float:
        return saved_prefill(depth * self.layout.chunk_tokens, self.value_alpha)

    def _prune(self, digest: bytes) -> None:
        """Forget nodes with no objects and no child holding any, from ``digest`` up the path.
        An empty node is kept only as the parent of a node with objects (a put that fills it
        again finds that child and heals its chain); the empty chunks behind the resident
        tail of a long conversation go, so the tree is bounded by the objects held, not by
        every chunk ever put (160,000 puts along one chain kept 160,000 nodes before)."""
        nodes = self.nodes
        node = nodes.get(digest)
        if node is None or node.attn or node.state:
            return
        while True:  # ``node`` holds no object
            parent = node.parent_chunk if node.parent_known else None
            if not any((c := nodes.get(child)) is not None and (c.attn or c.state) for child in node.child_chunks):
                del nodes[digest]
                if parent is not None and parent in nodes:
                    nodes[parent].child_chunks.discard(digest)
            if parent is None:
                return
            up = nodes.get(parent)
            if up is None or up.attn or up.state:
                return
            digest, node = parent, up  # empty, perhaps kept only for this one

    def _chain_ok(self, node: ChunkNode) -> bool:
        if not node.parent_known or node.attn < self._attn_copies:
            return False
        if node.parent_chunk is None:
            return True
        up = self.nodes.get(node.parent_chunk)
        return up is not None and up.chain_ok

    def _refresh(self, digest: bytes, node: ChunkNode) -> None:
        """Bring ``node`` (whose object counts just changed) and the nodes it affects up to date."""
        chain_ok = self._chain_ok(node)
        if chain_ok and not node.chain_ok:
            self._reroot(digest, node)
        elif node.chain_ok and not chain_ok:
            self._unroot(digest, node)
        elif chain_ok:
            resumable = node.state == self._state_copies
            if resumable != node.resumable:
                node.resumable = resumable
                self.usage.resumable_states += 1 if resumable else -1
                self._add_cover(digest, 1 if resumable else -1)
                if resumable:
                    self._raise_value(digest, self._saved(node.depth))

    def _set_cover(self, digest: bytes, node: ChunkNode, covered: int) -> None:
        """Change a node's cover, keeping the namespace figures and its objects' classes right."""
        was_worthless = node.claimed and not node.covered
        if bool(covered) != bool(node.covered):
            self.usage.covered_nodes += 1 if covered else -1
        node.covered = covered
        if covered:
            node.claimed = True
        else:
            node.value = 0.0  # nothing at or below resumes: the value walk starts afresh
        worthless = node.claimed and not node.covered
        if worthless != was_worthless:
            n = self._requeue_node(digest)
            self.usage.worthless_objects += n if worthless else -n

    def _add_cover(self, digest: bytes | None, delta: int) -> None:
        """Add ``delta`` resumable nodes to ``digest`` and every ancestor: O(depth)."""
        nodes = self.nodes
        while digest is not None:
            node = nodes.get(digest)
            if node is None:
                return
            self._set_cover(digest, node, node.covered + delta)
            if not node.parent_known:
                return
            digest = node.parent_chunk

    def _requeue_node(self, digest: bytes, attention_only: bool = False) -> int:
        """Requeue a node's objects at their (new) class and priority; returns how many
        are resident."""
        layout = self.layout
        groups = (*layout.attn_groups, *(() if attention_only else layout.state_groups))
        return sum(self._requeue(StoreKey(self.namespace, digest, group, rank)) for group, rank in layout.ranks(groups))

    def _unroot(self, digest: bytes, node: ChunkNode) -> None:
        """``node`` lost attention (its own or an ancestor's): nothing at or below it can be
        resumed. O(depth + the part of its subtree that was resumable-rooted)."""
        if node.covered and node.parent_known and node.parent_chunk is not None:
            self._add_cover(node.parent_chunk, -node.covered)
        nodes, usage = self.nodes, self.usage
        stack = [(digest, node)]
        while stack:
            d, n = stack.pop()
            n.chain_ok = False
            if n.resumable:
                n.resumable = False
                usage.resumable_states -= 1
            self._set_cover(d, n, 0)
            self._requeue_node(d)  # off the tree: value 0
            stack.extend((c, nodes[c]) for c in n.child_chunks if c in nodes and nodes[c].chain_ok)

    def _reroot(self, digest: bytes, node: ChunkNode) -> None:
        """``node``'s path to the first chunk is whole again (a missing attention object was
        put back): recount its subtree's resumable nodes bottom-up and add them above it."""
        nodes, usage = self.nodes, self.usage
        order: list[tuple[bytes, ChunkNode]] = []
        stack = [(digest, node)]
        node.chain_ok = True
        node.depth = 1 if node.parent_chunk is None else nodes[node.parent_chunk].depth + 1
        while stack:
            d, n = stack.pop()
            order.append((d, n))
            for c in n.child_chunks:
                child = nodes.get(c)
                if child is not None and not child.chain_ok and child.parent_known \
                        and child.attn >= self._attn_copies:
                    child.chain_ok = True
                    child.depth = n.depth + 1
                    stack.append((c, child))
        for d, n in reversed(order):  # children before parents
            n.resumable = n.state == self._state_copies
            usage.resumable_states += n.resumable
            live = [nodes[c] for c in n.child_chunks if c in nodes and nodes[c].chain_ok]
            self._set_cover(d, n, sum(c.covered for c in live) + n.resumable)
            n.value = max([c.value for c in live] + [self._saved(n.depth) if n.resumable else 0.0])
            self._requeue_node(d)  # new depth and value: new priorities
        if node.covered and node.parent_chunk is not None:
            self._add_cover(node.parent_chunk, node.covered)
            self._raise_value(node.parent_chunk, node.value)

    def _raise_value(self, digest: bytes | None, value: float) -> None:
        """A resumable node worth ``value`` appeared at or below ``digest``: raise the value
        of the path above it (and its attention objects' priorities) up to the first node
        already worth as much. O(depth log n), on the walk the cover count takes anyway."""
        nodes = self.nodes
        while digest is not None:
            node = nodes.get(digest)
            if node is None or node.value >= value:
                return
            node.value = value
            self._requeue_node(digest, attention_only=True)
            if not node.parent_known:
                return
            digest = node.parent_chunk
