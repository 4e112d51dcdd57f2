//! vLLM's `FreeKVCacheBlockQueue`: a doubly linked list of free block ids threaded through
//! two index arrays, so that popping the front, appending, prepending and removing any block
//! are all O(1).
//!
//! Order is eviction order: allocation takes from the front. Invariant: `queued[b]` is true
//! exactly for the blocks on the list, and `len` counts them.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue over ids `0..n` holding `first..n` in increasing order.
    pub(crate) fn new(n: usize, first: usize) -> Self {
        let mut q = FreeQueue {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            queued: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in first..n {
            // Ids fit u32: the pool refuses larger sizes.
            q.push_back(id as u32);
        }
        q
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.queued.get(id as usize).copied().unwrap_or(false)
    }

    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }

    /// Appends at the back (evicted last); false if `id` is already queued or out of range.
    pub(crate) fn push_back(&mut self, id: u32) -> bool {
        let i = id as usize;
        if i >= self.queued.len() || self.queued[i] {
            return false;
        }
        self.queued[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.len += 1;
        true
    }

    /// Puts `ids` at the front so that `ids[0]` is popped first (vLLM's `prepend_n`).
    pub(crate) fn push_front_all(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            self.push_front(id);
        }
    }

    fn push_front(&mut self, id: u32) -> bool {
        let i = id as usize;
        if i >= self.queued.len() || self.queued[i] {
            return false;
        }
        self.queued[i] = true;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.len += 1;
        true
    }

    /// Unlinks `id`; false if it was not queued.
    pub(crate) fn remove(&mut self, id: u32) -> bool {
        let i = id as usize;
        if i >= self.queued.len() || !self.queued[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.queued[i] = false;
        self.len -= 1;
        true
    }

    /// Front to back.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.next.get(id as usize).copied().unwrap_or(NIL);
            Some(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_of_pop_append_prepend_remove() {
        let mut q = FreeQueue::new(6, 1);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
        assert_eq!(q.pop_front(), Some(1));
        assert_eq!(q.pop_front(), Some(2));
        assert!(q.remove(4));
        assert!(!q.remove(4));
        assert!(q.push_back(2));
        assert!(!q.push_back(2));
        q.push_front_all(&[4, 1]);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![4, 1, 3, 5, 2]);
        assert_eq!(q.len(), 5);
        assert!(q.contains(3) && !q.contains(0));
        while q.pop_front().is_some() {}
        assert_eq!(q.len(), 0);
        assert!(q.push_back(5));
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![5]);
        assert!(!q.push_back(99));
    }
}
