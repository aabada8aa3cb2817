"""The page pool: which KV-cache pages are free, and (prefix caching) which hold a known prefix.

Prefix caching: a full page holds the keys and values of ``page_size`` tokens, and they depend
only on those tokens and every token before them. So once a page is full, a later sequence whose
tokens start the same way can read that page instead of computing it again (a chat's system
prompt, a few-shot preamble, the turns of a conversation so far). The pool keeps an index from
"(the prefix before this page, this page's tokens)" to the page, where the prefix before is named
by the id the pool gave the previous page's entry; before the first page it is 0, or the
request's cache salt (vLLM's ``cache_salt``: requests share cached pages only with requests of
the same salt, so one tenant cannot learn from timing what another's prompts were). Entries are
compared by their tokens, never by a hash alone, and ids are never reused, so a match is exact:
the page holds what computing the tokens would write.

Tail pages: a sequence's last page is rarely full, and the next request often goes on from
exactly where it stopped (a beam search's next step, a conversation's next turn: the prompt is
the last prompt, its answer and more). So when a sequence ends, a partly filled last page it
alone holds keeps a *tail entry* (the prefix before it, its computed tokens). A later sequence
that matched the whole pages before it and goes on with the first ``k`` of those tokens gets a
page of its own with the tail page's contents copied in (``match_tail``), and computes from
position ``k`` on: a position's keys and values depend only on the tokens up to it, so the first
``k`` are right whatever followed them (it overwrites the rest, so the tail page stays as it was
for others). The same prompt sent again thus computes only its last token. An unheld tail page is
handed out again before any cached whole page (least recently released first): most sequences
are never continued, and a whole page serves every request sharing the prefix.

Whole tails (``whole_tails``, models with state caches): a state summarises every token so far and
cannot be rewound, so a tail serves only a sequence that goes on with *all* its tokens, and only
while a copy of the state after them is kept (``match_tail``'s ``usable``, keyed by the tail's
id, which ``keep_tail`` returns and which, like entry ids, is never reused).

Pages are reference-counted: a matched page is shared, read-only (a sequence writes only past
its matched pages, into pages of its own). A page nobody holds any more keeps its contents and
its entry, and is handed out again (its entry dropped) only when no never-used page is left,
least recently released first; a sequence's pages are released tail first, so the head of a
shared prefix outlives its tails. ``num_free`` counts both kinds: a cached page costs a new
sequence nothing.
"""

import itertools
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple, Union

# (id of the previous page's entry, for the first page 0 or the cache salt (a str: never an id); this page's tokens)
Key = Tuple[Union[int, str], Tuple[int, ...]]
MAX_TAILS_PER_PREFIX = 64  # tail entries after one prefix (a beam search leaves 2 x beam width per step)
# the fewest tokens a tail page is copied for: one token computes about as cheaply as a page copies,
# and every prompt shares its first token (BOS) with every other
MIN_TAIL_TOKENS = 2


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False, tail_pages: bool = False,
                 whole_tails: bool = False):
        """``tail_pages`` (with ``prefix_caching``): keep the partly filled last pages of ended
        sequences for ``match_tail`` (module docstring); the caller copies matched ones.
        ``whole_tails``: a tail is matched only in full (state-cache models)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.tail_pages = prefix_caching and tail_pages
        self.whole_tails = whole_tails
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs: List[int] = [0] * num_pages
        self._page_of: Dict[Key, int] = {}  # entry -> the page holding it
        self._entry_of: Dict[int, Tuple[Key, int]] = {}  # page -> (its entry, the entry's id)
        self._cached: "OrderedDict[int, None]" = OrderedDict()  # unheld pages with an entry, least recent first
        self._ids = itertools.count(1)
        # tail entries: prefix before -> {computed tokens of the page: page}, and page -> its entry
        self._tails: Dict[Union[int, str], "OrderedDict[Tuple[int, ...], int]"] = {}
        self._tail_of: Dict[int, Key] = {}
        self._tail_id: Dict[int, int] = {}  # tail page -> its entry's id (from the entry ids' counter)
        self._cached_tails: "OrderedDict[int, None]" = OrderedDict()  # unheld tail pages, least recent first
        self.num_tail_hits = 0  # tail pages matched (for tests and logs)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached) + len(self._cached_tails)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages nobody holds that keep a prefix (free to take, reused when matched)."""
        return len(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> List[int]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} pages with {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            elif self._cached_tails:  # then the least recently released tail page: its entry goes
                page, _ = self._cached_tails.popitem(last=False)
                self._drop_tail(page)
            else:  # then the least recently released cached page: its entry goes
                page, _ = self._cached.popitem(last=False)
                key, _ = self._entry_of.pop(page)
                del self._page_of[key]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: List[int]) -> None:
        for page in reversed(pages):  # tail first: the head of a prefix stays cached longest
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if page in self._entry_of:
                self._cached[page] = None
            elif page in self._tail_of:
                self._cached_tails[page] = None
            else:
                self._free.append(page)

    # ---- prefix caching --------------------------------------------------------------------
    def _tokens(self, token_ids: List[int], index: int) -> Tuple[int, ...]:
        return tuple(token_ids[index * self.page_size:(index + 1) * self.page_size])

    def match(self, token_ids: List[int], salt: Optional[str] = None) -> Tuple[List[int], List[int]]:
        """The cached pages holding the longest prefix of ``token_ids`` that leaves at least one
        token to compute (its logits pick the next token), now held by the caller; and their
        entry ids (``register``'s ``ids``). Only pages registered with the same ``salt`` match."""
        pages: List[int] = []
        ids: List[int] = []
        for index in range((len(token_ids) - 1) // self.page_size):
            page = self._page_of.get((ids[-1] if ids else (salt or 0), self._tokens(token_ids, index)))
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
            pages.append(page)
            ids.append(self._entry_of[page][1])
        return pages, ids

    def register(self, token_ids: List[int], pages: List[int], num_computed: int, ids: List[int],
                 salt: Optional[str] = None) -> None:
        """Give an entry to each page of a sequence that is full and computed (its first
        ``num_computed`` tokens are in the cache) and has none yet; ``ids`` (the entry ids of its
        pages so far, in order) grows by one per page. A page whose tokens another page already
        holds (computed side by side) keeps no entry and takes the other's id."""
        for index in range(len(ids), num_computed // self.page_size):
            key: Key = (ids[-1] if ids else (salt or 0), self._tokens(token_ids, index))
            holder = self._page_of.get(key)
            if holder is None:
                holder = pages[index]
                self._page_of[key] = holder
                self._entry_of[holder] = (key, next(self._ids))
            ids.append(self._entry_of[holder][1])

    # ---- tail pages --------------------------------------------------------------------------
    def keep_tail(self, token_ids: List[int], pages: List[int], num_computed: int, ids: List[int],
                  salt: Optional[str] = None) -> Optional[int]:
        """Before an ending sequence's pages are freed: give its partly filled last computed page
        a tail entry, when it alone holds that page and every whole page before has an entry.
        Returns the id of the tail entry holding its tokens (None: none was kept); with whole
        tails, also that of an equal one kept before (the caller keeps its state under it)."""
        whole, filled = divmod(num_computed, self.page_size)
        if not self.tail_pages or filled == 0 or len(ids) != whole or len(pages) <= whole:
            return None
        page = pages[whole]
        prefix: Union[int, str] = ids[-1] if ids else (salt or 0)
        tokens = tuple(token_ids[whole * self.page_size:num_computed])
        kept = self._tails.get(prefix, {})
        if self.whole_tails and tokens in kept:
            return self._tail_id[kept[tokens]]
        if self._refs[page] != 1 or page in self._entry_of or page in self._tail_of:
            return None
        # a kept tail that starts so serves as well (not with whole tails: a longer one's state is not this one's)
        if not self.whole_tails and any(other[:len(tokens)] == tokens for other in kept):
            return None
        tails = self._tails.setdefault(prefix, OrderedDict())
        tails[tokens] = page
        self._tail_of[page] = (prefix, tokens)
        self._tail_id[page] = tail_id = next(self._ids)
        if len(tails) > MAX_TAILS_PER_PREFIX:
            oldest = next(iter(tails.values()))
            if self._refs[oldest] == 0:  # unheld: back to the never-used pages
                del self._cached_tails[oldest]
                self._free.append(oldest)
            self._drop_tail(oldest)
        return tail_id if page in self._tail_of else None

    def match_tail(self, token_ids: List[int], ids: List[int], salt: Optional[str] = None,
                   usable: Optional[Callable[[int], bool]] = None) -> Optional[Tuple[int, int]]:
        """After ``match`` gave the whole pages ``ids``: the tail page whose tokens start with the
        most of the tokens that follow (leaving at least one to compute), now held by the caller
        until its contents are copied (then ``free`` it), and how many of its tokens are used;
        None: no tail shares ``MIN_TAIL_TOKENS`` tokens. With whole tails only a tail whose tokens
        all follow counts, and only one whose id ``usable`` accepts (a state copy is kept)."""
        if not self.tail_pages:
            return None
        start = len(ids) * self.page_size
        tails = self._tails.get(ids[-1] if ids else (salt or 0))
        if not tails:
            return None
        best: Optional[Tuple[int, int]] = None
        wanted = token_ids[start:start + min(self.page_size - 1, len(token_ids) - 1 - start)]
        for tokens, page in tails.items():
            shared = 0
            for have, want in zip(tokens, wanted):
                if have != want:
                    break
                shared += 1
            if self.whole_tails and (shared < len(tokens) or usable is None or not usable(self._tail_id[page])):
                continue
            if shared >= MIN_TAIL_TOKENS and (best is None or shared > best[1]):
                best = (page, shared)
        if best is not None:
            self.num_tail_hits += 1
            page = best[0]
            if self._refs[page] == 0:
                del self._cached_tails[page]
            self._refs[page] += 1
            tails.move_to_end(self._tail_of[page][1])
        return best

    def tail_id(self, page: int) -> int:
        """The id of the tail entry of ``page`` (a page ``match_tail`` returned)."""
        return self._tail_id[page]

    def _drop_tail(self, page: int) -> None:
        del self._tail_id[page]
        prefix, tokens = self._tail_of.pop(page)
        del self._tails[prefix][tokens]
        if not self._tails[prefix]:
            del self._tails[prefix]
