//! Prefix-aware tokenization cache: a new turn of a long conversation costs only its new text.
//!
//! Each entry is a tokenized text (a rendered chat or a prompt) with its ids and split points
//! (see the `encoder` module): ends of added tokens and, where the tokenizer allows, word
//! boundaries (a letter then a space) in plain text, so a plain completions prompt restarts
//! too. A new text is matched against the entries sharing its first bytes;
//! with `L` the longest common prefix, tokenization restarts at the last split point `p` where
//! every match decision before `p` reads only shared bytes: `p + max_added_len + 4 <= L` after
//! an added token, `p < L` at a word split (only byte `p` itself, a space, must be shared). The
//! result is `cached_ids[..token(p)] ++ encode(text[p..])`, equal to `encode(text)`. The result
//! becomes an entry of its own only if `text[p..]` is long enough to be worth one.
//!
//! ```text
//!  cached:  |<s>system ...<eot>|<s>user ...<eot>|<s>assistant\n|            (turn N)
//!  new:     |<s>system ...<eot>|<s>user ...<eot>|<s>assistant\n ... <eot>|<s>user ...|
//!                                               ^p                ^L
//!           ids reused ------------------------>| re-encoded ------------------------->
//! ```
//!
//! Lookup: entries are indexed by keys of their first `256 * 4^k` bytes for every such length
//! they cover; the deepest level the new text shares holds the best candidates, of which the
//! most recent few are compared. Bounded: total
//! bytes (text + ids + split points) stay under the capacity, least recently used entries go
//! first, and each index bucket keeps its most recent entries only. Thread-safe: the lock is
//! held for index updates only, never while comparing or encoding, and a hit does not take it
//! (it stamps its entry's last use and counts in atomics; eviction reads the stamps).
//!
//! An entry can carry one value a caller computed from its ids ([`PrefixCache::attach`]: the
//! router keeps the prompt's block digests there), counted against the capacity; a lookup says
//! which entry's ids it reused and how many ([`Reuse`]), so a new turn of a conversation is
//! neither tokenized nor hashed again up to where it restarted.
//!
//! Copies: an entry's ids are shared with the callers that get them (a text the cache holds
//! whole copies none), and a text handed over owned (a rendered chat) is stored as it is.

use std::any::Any;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};

use crate::encoder::Encoder;
use crate::error::Result;
use crate::pretok::SplitPoint;

/// Texts shorter than this are encoded directly (cheap, and not worth an entry).
const MIN_LEVEL: usize = 256;
/// A text that reused an entry and encoded fewer new bytes than this is not stored: its entry
/// would copy the whole text, ids and split points (and evict another) to save a later text
/// extending it at most these bytes of encoding. A prompt that differs from its neighbours only
/// in a short tail (a shared document or system prompt with a question) thus costs a lookup and
/// the tail's encoding, not an entry per request.
const MIN_NEW_BYTES: usize = 256;
/// Entries kept per index bucket (texts sharing the same first bytes).
const BUCKET_CAP: usize = 32;
/// Most recent candidates compared per lookup (each comparison may scan the whole prefix).
const CANDIDATES: usize = 4;
/// Bytes an entry costs beyond its text, ids and split points.
const ENTRY_OVERHEAD: usize = 256;

/// Counters, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that reused cached ids.
    pub hits: u64,
    /// Lookups that encoded the whole text.
    pub misses: u64,
    /// Bytes of text encoded on hits (the new part).
    pub bytes_encoded_on_hits: u64,
    /// Bytes of text encoded on misses (all of each text). Of the texts looked up, every byte
    /// is counted once: reused, encoded on a hit, or encoded on a miss.
    pub bytes_encoded_on_misses: u64,
    /// Bytes of text whose ids were reused on hits.
    pub bytes_reused: u64,
    /// Hits that restarted at a word split point (the rest restarted after an added token or
    /// were exact repeats).
    pub word_split_hits: u64,
    /// Entries now held.
    pub entries: u64,
    /// Bytes now held.
    pub bytes: u64,
    /// Entries evicted to stay under the capacity.
    pub evictions: u64,
}

struct Entry {
    /// As the caller gave it (a rendered chat is not copied); its capacity is what it costs.
    text: String,
    /// Shared with the callers its text was asked of: a hit on the whole text copies none.
    ids: Arc<Vec<u32>>,
    splits: Vec<SplitPoint>,
    /// Its index keys (see [`level_keys`]), kept so eviction need not recompute them.
    keys: Vec<u64>,
    /// What a caller computed from `ids` (see [`PrefixCache::attach`]) and its size in bytes;
    /// set under the cache's lock, once.
    attached: OnceLock<(Box<dyn Any + Send + Sync>, usize)>,
    /// The tick of its last use: never below its key in the LRU order, which eviction moves up
    /// to it (see [`Inner::evict`]).
    used: AtomicU64,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("text_bytes", &self.text.len())
            .field("ids", &self.ids.len())
            .field("attached", &self.attached.get().map(|a| a.1))
            .finish()
    }
}

impl Entry {
    fn cost(&self) -> usize {
        self.text.capacity()
            + self.ids.len() * 4
            + std::mem::size_of_val(self.splits.as_slice())
            + self.attached.get().map_or(0, |a| a.1)
            + ENTRY_OVERHEAD
    }
}

/// A cache entry seen from outside: something computed from its ids (block digests) can be
/// kept with it ([`PrefixCache::attach`]) and found again when a later text reuses them.
#[derive(Clone, Debug)]
pub struct EntryRef {
    entry: Arc<Entry>,
    id: u64,
}

impl EntryRef {
    /// What was attached to the entry, if anything.
    pub fn attached(&self) -> Option<&(dyn Any + Send + Sync)> {
        self.entry.attached.get().map(|a| a.0.as_ref())
    }
}

/// What the cache did for one text: the entry whose ids it reused, with how many ids of the
/// result, from index `at`, are that entry's ids, and the entry that now holds the text (a new
/// one, or the one it repeats). `at` is 0 unless special tokens were added in front of the
/// cached ids (a completions prompt's BOS). Both `None` when the text bypassed the cache; `stored` alone is `None` when
/// the text reused an entry but added too little to be stored itself (see `MIN_NEW_BYTES`) or
/// did not fit.
#[derive(Clone, Debug, Default)]
pub struct Reuse {
    pub from: Option<(EntryRef, usize)>,
    pub stored: Option<EntryRef>,
    /// Where the entry's ids begin in the result: the number of special tokens added in front.
    pub at: usize,
}

#[derive(Debug, Default)]
struct Inner {
    // ahash, not SipHash: a lookup probes several buckets and entries on every request.
    /// id -> the entry and its key in `lru`.
    entries: ahash::AHashMap<u64, (Arc<Entry>, u64)>,
    /// tick -> entry id, oldest first. An entry's key is the tick it was stored or last moved
    /// at; hits since then only stamp the entry (`Entry::used`).
    lru: BTreeMap<u64, u64>,
    buckets: ahash::AHashMap<u64, Vec<u64>>,
    bytes: usize,
    next_id: u64,
    evictions: u64,
}

/// The counters of hits and misses, updated without the lock (evictions are counted under it).
#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_encoded_on_hits: AtomicU64,
    bytes_encoded_on_misses: AtomicU64,
    bytes_reused: AtomicU64,
    word_split_hits: AtomicU64,
}

/// The cache. Share it across threads by reference (it locks inside).
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    inner: Mutex<Inner>,
    /// The clock of last uses: every store and hit takes the next tick, so ticks are unique.
    tick: AtomicU64,
    counters: Counters,
}

impl PrefixCache {
    /// A cache holding at most `capacity_bytes` (texts + ids + split points).
    pub fn new(capacity_bytes: usize) -> Self {
        PrefixCache {
            capacity: capacity_bytes,
            inner: Mutex::new(Inner::default()),
            tick: AtomicU64::new(0),
            counters: Counters::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked mid-update of plain maps; the
        // data is still consistent enough to keep serving (worst case: a stale entry).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        let (entries, bytes, evictions) = {
            let g = self.lock();
            (g.entries.len() as u64, g.bytes as u64, g.evictions)
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            hits: get(&c.hits),
            misses: get(&c.misses),
            bytes_encoded_on_hits: get(&c.bytes_encoded_on_hits),
            bytes_encoded_on_misses: get(&c.bytes_encoded_on_misses),
            bytes_reused: get(&c.bytes_reused),
            word_split_hits: get(&c.word_split_hits),
            entries,
            bytes,
            evictions,
        }
    }

    fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Ids of the text without special tokens (= `enc.encode(text, false)`), reusing cached
    /// work, and which entries it reused and stored. A text given owned becomes the new entry's
    /// without a copy.
    pub(crate) fn encode_reuse(
        &self,
        enc: &Encoder,
        owned: Cow<'_, str>,
    ) -> Result<(Arc<Vec<u32>>, Reuse)> {
        let text: &str = &owned;
        if !enc.split_safe || text.len() < MIN_LEVEL || self.capacity == 0 {
            return Ok((Arc::new(enc.encode(text, false)?), Reuse::default()));
        }
        let keys = level_keys(text);
        let found = self.best_match(text, &keys);
        let restarted = match found {
            Some((entry, id, lcp)) if lcp == text.len() && lcp == entry.text.len() => {
                self.touch(&entry, 0, lcp, false);
                let ids = entry.ids.clone();
                let here = EntryRef { entry, id };
                let reuse = Reuse {
                    from: Some((here.clone(), ids.len())),
                    stored: Some(here),
                    at: 0,
                };
                return Ok((ids, reuse));
            }
            Some((entry, id, lcp)) => match restart_point(&entry, lcp, enc.max_added_len) {
                Some(sp) if text.len() - (sp.byte as usize) < MIN_NEW_BYTES => {
                    let t = sp.token as usize;
                    let suffix = text.get(sp.byte as usize..).unwrap_or_default();
                    let new_ids = enc.encode(suffix, false)?;
                    let mut ids = Vec::with_capacity(t + new_ids.len());
                    ids.extend_from_slice(entry.ids.get(..t).unwrap_or_default());
                    ids.extend_from_slice(&new_ids);
                    self.touch(&entry, suffix.len(), sp.byte as usize, sp.word);
                    let reuse = Reuse {
                        from: Some((EntryRef { entry, id }, t)),
                        stored: None,
                        at: 0,
                    };
                    return Ok((Arc::new(ids), reuse));
                }
                Some(sp) => {
                    let (mut ids, mut splits) = extend(&entry, sp, text, enc)?;
                    ids.shrink_to_fit();
                    splits.shrink_to_fit();
                    self.touch(
                        &entry,
                        text.len() - sp.byte as usize,
                        sp.byte as usize,
                        sp.word,
                    );
                    let superseded = (lcp == entry.text.len()).then_some(id);
                    let from = (EntryRef { entry, id }, sp.token as usize);
                    Some((ids, splits, superseded, from))
                }
                None => None,
            },
            None => None,
        };
        let (ids, splits, superseded, from) = match restarted {
            Some((ids, splits, superseded, from)) => (ids, splits, superseded, Some(from)),
            None => {
                let (ids, splits) = self.miss(enc, text)?;
                (ids, splits, None, None)
            }
        };
        let ids = Arc::new(ids);
        let out = ids.clone();
        let entry = Entry {
            text: owned.into_owned(),
            ids,
            splits,
            keys,
            attached: OnceLock::new(),
            used: AtomicU64::new(0),
        };
        let stored = self.insert(entry, superseded);
        Ok((
            out,
            Reuse {
                from,
                stored,
                at: 0,
            },
        ))
    }

    /// Keeps `value` (`bytes` of memory, counted against the capacity) with `entry`, unless
    /// something is attached already or the entry has left the cache. `value` must be a
    /// function of the entry's ids (and of anything it carries to check that, such as the
    /// special tokens in front of them): a later text reusing them reads it back.
    pub fn attach(&self, entry: &EntryRef, value: Box<dyn Any + Send + Sync>, bytes: usize) {
        let mut g = self.lock();
        let present = g
            .entries
            .get(&entry.id)
            .is_some_and(|(e, _)| Arc::ptr_eq(e, &entry.entry));
        if !present || entry.entry.attached.set((value, bytes)).is_err() {
            return;
        }
        g.bytes += bytes;
        g.evict(self.capacity);
    }

    fn miss(&self, enc: &Encoder, text: &str) -> Result<(Vec<u32>, Vec<SplitPoint>)> {
        let c = &self.counters;
        c.misses.fetch_add(1, Ordering::Relaxed);
        c.bytes_encoded_on_misses
            .fetch_add(text.len() as u64, Ordering::Relaxed);
        enc.encode_with_splits(text)
    }

    /// Counts a hit on `entry` and stamps its use. Without the lock, which every data-plane
    /// thread took on every hit to move the entry in the LRU order: 2.4 % of the router's CPU
    /// per chat request (BENCHMARKS.md, 2026-12-07, late morning).
    fn touch(&self, entry: &Entry, encoded: usize, reused: usize, word: bool) {
        let c = &self.counters;
        c.hits.fetch_add(1, Ordering::Relaxed);
        if word {
            c.word_split_hits.fetch_add(1, Ordering::Relaxed);
        }
        c.bytes_encoded_on_hits
            .fetch_add(encoded as u64, Ordering::Relaxed);
        c.bytes_reused.fetch_add(reused as u64, Ordering::Relaxed);
        entry.used.fetch_max(self.next_tick(), Ordering::Relaxed);
    }

    /// The entry sharing the longest prefix with `text`, its id and that prefix's length.
    fn best_match(&self, text: &str, keys: &[u64]) -> Option<(Arc<Entry>, u64, usize)> {
        for key in keys.iter().rev() {
            // On the stack: a lookup runs on every request.
            let mut candidates: [Option<(u64, Arc<Entry>)>; CANDIDATES] = Default::default();
            {
                let g = self.lock();
                let Some(bucket) = g.buckets.get(key) else {
                    continue;
                };
                let found = bucket
                    .iter()
                    .rev()
                    .take(CANDIDATES)
                    .filter_map(|id| g.entries.get(id).map(|(e, _)| (*id, e.clone())));
                for (slot, c) in candidates.iter_mut().zip(found) {
                    *slot = Some(c);
                }
            }
            // Most recent first. A later candidate can only share more than the best so far if
            // it agrees at the byte where the best one stopped: one byte read rejects most, so
            // siblings of a long shared prefix are not each scanned to its end.
            let mut best: Option<(Arc<Entry>, u64, usize)> = None;
            for (id, e) in candidates.into_iter().flatten() {
                if let Some((_, _, l)) = &best {
                    if e.text.as_bytes().get(*l) != text.as_bytes().get(*l) || *l == text.len() {
                        continue;
                    }
                }
                let l = common_prefix(text.as_bytes(), e.text.as_bytes());
                if best.as_ref().is_none_or(|(_, _, b)| l > *b) {
                    best = Some((e, id, l));
                }
            }
            if best.is_some() {
                return best;
            }
        }
        None
    }

    fn insert(&self, entry: Entry, superseded: Option<u64>) -> Option<EntryRef> {
        let cost = entry.cost();
        if cost > self.capacity {
            return None;
        }
        let keys = entry.keys.clone();
        let entry = Arc::new(entry);
        let mut g = self.lock();
        if let Some(old) = superseded {
            g.remove(old);
        }
        // Not findable before this, so no hit has stamped it yet.
        let tick = self.next_tick();
        entry.used.store(tick, Ordering::Relaxed);
        g.next_id += 1;
        let id = g.next_id;
        g.entries.insert(id, (entry.clone(), tick));
        g.lru.insert(tick, id);
        g.bytes += cost;
        for key in keys {
            let bucket = g.buckets.entry(key).or_default();
            bucket.push(id);
            if bucket.len() > BUCKET_CAP {
                bucket.remove(0);
            }
        }
        g.evict(self.capacity);
        g.entries
            .contains_key(&id)
            .then_some(EntryRef { entry, id })
    }
}

impl Inner {
    /// Removes least recently used entries until the bytes held fit `capacity`. The first
    /// key of `lru` is not always the least recently used entry: one used since it got its
    /// key moves up to its stamp and the next is tried. Every entry's stamp is at least its
    /// key, so an entry whose key equals its stamp is used no later than any other.
    fn evict(&mut self, capacity: usize) {
        while self.bytes > capacity {
            let Some((key, victim)) = self.lru.pop_first() else {
                break;
            };
            if let Some((e, k)) = self.entries.get_mut(&victim) {
                let used = e.used.load(Ordering::Relaxed);
                if used > key {
                    *k = used;
                    self.lru.insert(used, victim);
                    continue;
                }
            }
            self.remove(victim);
            self.evictions += 1;
        }
    }

    fn remove(&mut self, id: u64) {
        let Some((entry, tick)) = self.entries.remove(&id) else {
            return;
        };
        self.lru.remove(&tick);
        self.bytes = self.bytes.saturating_sub(entry.cost());
        for key in &entry.keys {
            if let Some(bucket) = self.buckets.get_mut(key) {
                bucket.retain(|x| *x != id);
                if bucket.is_empty() {
                    self.buckets.remove(key);
                }
            }
        }
    }
}

/// Keys of the first `256 * 4^k` bytes of `text`, shortest first. A key hashes the first and
/// the last 256 bytes of its prefix (O(1) per level): it only selects candidates, and every
/// candidate is compared byte for byte, so a collision costs a comparison, never correctness.
fn level_keys(text: &str) -> Vec<u64> {
    let bytes = text.as_bytes();
    let mut keys = Vec::new();
    let mut len = MIN_LEVEL;
    while len <= bytes.len() {
        keys.push(LEVEL_HASH.hash_one((len, &bytes[..MIN_LEVEL], &bytes[len - MIN_LEVEL..len])));
        len = len.saturating_mul(4);
    }
    keys
}

/// The level keys' hash: seeded at random per process (a client cannot aim texts at one
/// bucket), and several times faster than SipHash over the 512 bytes each key reads.
static LEVEL_HASH: LazyLock<ahash::RandomState> = LazyLock::new(ahash::RandomState::new);

/// The last split point whose match decisions read only the shared `lcp` bytes. A word split
/// `b` needs only bytes `0..=b` shared (see the `encoder` module), so `b < lcp`; the end `p` of an
/// added token needs `p + max_added_len + 4 <= lcp`, since matching added tokens at positions
/// before `p` may read that far ahead. The backward scan passes only added-token ends inside
/// that margin, so it is short.
fn restart_point(entry: &Entry, lcp: usize, max_added_len: usize) -> Option<SplitPoint> {
    let added_limit = lcp.checked_sub(max_added_len + 4);
    let shared = entry.splits.partition_point(|s| (s.byte as usize) < lcp);
    entry
        .splits
        .get(..shared)?
        .iter()
        .rev()
        .find(|s| s.word || added_limit.is_some_and(|l| s.byte as usize <= l))
        .copied()
}

fn extend(
    entry: &Entry,
    sp: SplitPoint,
    text: &str,
    enc: &Encoder,
) -> Result<(Vec<u32>, Vec<SplitPoint>)> {
    let (p, t) = (sp.byte as usize, sp.token as usize);
    let suffix = text.get(p..).unwrap_or_default();
    let (new_ids, new_splits) = enc.encode_with_splits(suffix)?;
    let mut ids = Vec::with_capacity(t + new_ids.len());
    ids.extend_from_slice(entry.ids.get(..t).unwrap_or_default());
    ids.extend_from_slice(&new_ids);
    let keep = entry.splits.partition_point(|s| s.byte as usize <= p);
    let mut splits = Vec::with_capacity(keep + new_splits.len());
    splits.extend_from_slice(entry.splits.get(..keep).unwrap_or_default());
    splits.extend(new_splits.into_iter().map(|s| SplitPoint {
        byte: s.byte + sp.byte,
        token: s.token + sp.token,
        word: s.word,
    }));
    Ok((ids, splits))
}

/// Length of the common prefix of `a` and `b`, in bytes, cut back to a UTF-8 boundary of both.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 256;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    // Both are valid UTF-8 and equal up to `i`, so a boundary in one is a boundary in the other.
    while i > 0 && i < a.len() && (a[i] & 0xC0) == 0x80 {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text handed over owned is the new entry's own text (a long conversation's rendered
    /// chat is not copied to be stored); a borrowed one is copied.
    #[test]
    fn an_owned_text_is_stored_without_a_copy() {
        let path = kinference_testkit::shared("data/tokenizers/qwen3/tokenizer.json");
        let enc = Encoder::from_file(&path).unwrap();
        let cache = PrefixCache::new(1 << 20);
        let stored_text = |reuse: &Reuse| reuse.stored.as_ref().unwrap().entry.text.as_ptr();
        let owned = "The kettle sings on the stove. ".repeat(40);
        let (at, want) = (owned.as_ptr(), enc.encode(&owned, false).unwrap());
        let (ids, reuse) = cache.encode_reuse(&enc, Cow::Owned(owned)).unwrap();
        assert_eq!(stored_text(&reuse), at);
        assert_eq!(*ids, want);
        let borrowed = "A different text about rain on the roof. ".repeat(40);
        let (other, reuse) = cache.encode_reuse(&enc, Cow::Borrowed(&borrowed)).unwrap();
        assert_ne!(stored_text(&reuse), borrowed.as_ptr());
        assert_eq!(*other, enc.encode(&borrowed, false).unwrap());
    }

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix("héllo".as_bytes(), "hèllo".as_bytes()), 1);
        assert_eq!(common_prefix(b"abc", b"abd"), 2);
        assert_eq!(common_prefix(b"abc", b"abc"), 3);
        let long_a = "x".repeat(1000) + "a";
        let long_b = "x".repeat(1000) + "b";
        assert_eq!(common_prefix(long_a.as_bytes(), long_b.as_bytes()), 1000);
    }

    /// Stores and hits in a seeded random order, each followed by a check of which entries the
    /// cache holds against a list kept in order of use: eviction removes exactly the least
    /// recently used entries, hits (which only stamp their entry) included.
    #[test]
    fn eviction_follows_the_order_of_use() {
        use rand::{Rng, SeedableRng};

        let cache = PrefixCache::new(20_000);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        // Entries by last use, oldest first: (id, cost).
        let mut model: Vec<(u64, usize)> = Vec::new();
        let (mut hits, mut evicted) = (0, 0);
        for step in 0..5_000 {
            if model.is_empty() || rng.gen_bool(0.4) {
                let len = rng.gen_range(300..3_000);
                let entry = Entry {
                    text: format!("{step:06}").repeat(len / 6),
                    ids: Arc::new(vec![7; len / 4]),
                    splits: Vec::new(),
                    keys: Vec::new(),
                    attached: OnceLock::new(),
                    used: AtomicU64::new(0),
                };
                let cost = entry.cost();
                let stored = cache.insert(entry, None).unwrap();
                model.push((stored.id, cost));
                let mut total: usize = model.iter().map(|m| m.1).sum();
                while total > cache.capacity {
                    total -= model.remove(0).1;
                    evicted += 1;
                }
            } else {
                let at = rng.gen_range(0..model.len());
                let (id, cost) = model.remove(at);
                let entry = cache.lock().entries.get(&id).unwrap().0.clone();
                cache.touch(&entry, 0, 0, false);
                model.push((id, cost));
                hits += 1;
            }
            let mut held: Vec<u64> = cache.lock().entries.keys().copied().collect();
            let mut want: Vec<u64> = model.iter().map(|m| m.0).collect();
            held.sort_unstable();
            want.sort_unstable();
            assert_eq!(held, want, "step {step}");
        }
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.evictions), (hits, evicted));
        assert!(evicted > 1_000 && hits > 2_000, "{evicted} {hits}");
    }

    #[test]
    fn level_keys_are_prefix_stable() {
        let a = "a".repeat(5000);
        let b = "a".repeat(4096) + &"b".repeat(900);
        let (ka, kb) = (level_keys(&a), level_keys(&b));
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[..3], kb[..3]);
        assert!(level_keys("short").is_empty());
    }
}
