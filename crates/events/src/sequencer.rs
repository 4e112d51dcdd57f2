//! Sequence tracking for one (replica, DP rank) stream: pure state, no I/O.
//!
//! Invariants: `next` is the sequence number the index needs next (`None` until the first
//! message is accepted, and again after a reset); live messages of one publisher instance are
//! strictly increasing, so a live number at or below the previous live number means the
//! publisher restarted, or that a copy or a late arrival of a message already held came in
//! (ZMQ over TCP never does this, but a relay or a faulty network can). The payload of the last
//! accepted message is kept so that a replay starting there can prove it comes from the same
//! publisher instance: that proof tells the two cases apart.

use bytes::Bytes;

/// What to do with a live message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Live {
    /// It is the next one: apply it.
    Apply,
    /// Already applied (it arrived live after a replay delivered it).
    Duplicate,
    /// Messages are missing before it; replay from `from`.
    Gap { from: u64 },
    /// The publisher restarted (its numbers went back): clear the worker, then start afresh.
    Reset,
    /// A number at or below the last live one and older than the stream's position: a
    /// restarted publisher, or a copy or late arrival of a message already held. Only the
    /// replay overlap ([`Sequencer::overlap`]) can tell; without that proof it is a restart.
    Behind,
}

/// What a replayed message means for the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Replayed {
    /// The next one: apply it.
    Apply,
    /// Already applied (the overlap, or a repeat); skip it.
    Skip,
    /// The message before the expected one has different content: a different publisher
    /// instance answered, so the stream restarted.
    Mismatch,
    /// Messages between the expected one and this one are gone from the publisher's buffer.
    Hole { missing_from: u64 },
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Sequencer {
    next: Option<u64>,
    last_live: Option<u64>,
    last_accepted: Option<(u64, Option<Bytes>)>,
}

impl Sequencer {
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Whether nothing has been accepted since the start or the last reset.
    pub fn is_fresh(&self) -> bool {
        self.next.is_none()
    }

    /// Where a replay should start: at the last accepted message (one early, to verify the
    /// publisher instance through the overlap), else at the expected one after a resync, else 0.
    pub fn replay_start(&self) -> u64 {
        match (&self.last_accepted, self.next) {
            (Some((seq, _)), _) => *seq,
            (None, Some(next)) => next,
            (None, None) => 0,
        }
    }

    /// The last accepted message with its content, which a replay from its number must repeat
    /// byte for byte if the publisher is the same instance.
    pub fn overlap(&self) -> Option<(u64, Bytes)> {
        match &self.last_accepted {
            Some((seq, Some(payload))) => Some((*seq, payload.clone())),
            _ => None,
        }
    }

    pub fn classify_live(&mut self, seq: u64) -> Live {
        if self.last_live.is_some_and(|last| seq <= last) {
            let behind = self.next.is_some_and(|next| seq < next);
            if behind && self.overlap().is_some() {
                // The last live number stands until a restart is proven.
                return Live::Behind;
            }
            self.last_live = Some(seq);
            return Live::Reset;
        }
        self.last_live = Some(seq);
        match self.next {
            None if seq == 0 => Live::Apply,
            None => Live::Gap { from: 0 },
            Some(next) if seq == next => Live::Apply,
            Some(next) if seq < next => Live::Duplicate,
            Some(_) => Live::Gap {
                from: self.replay_start(),
            },
        }
    }

    pub fn classify_replayed(&self, seq: u64, payload: &[u8]) -> Replayed {
        if let Some((last, last_payload)) = &self.last_accepted {
            if seq == *last {
                // An unreadable message cannot prove anything either way.
                let differs = last_payload.as_ref().is_some_and(|p| p.as_ref() != payload);
                return if differs {
                    Replayed::Mismatch
                } else {
                    Replayed::Skip
                };
            }
        }
        let next = self.next.unwrap_or(0);
        match seq.cmp(&next) {
            std::cmp::Ordering::Less => Replayed::Skip,
            std::cmp::Ordering::Equal => Replayed::Apply,
            std::cmp::Ordering::Greater => Replayed::Hole { missing_from: next },
        }
    }

    /// Records `seq` as applied (or skipped as undecodable: either way it is behind us);
    /// `payload` is `None` when the message's frames were unreadable.
    pub fn accept(&mut self, seq: u64, payload: Option<Bytes>) {
        self.next = Some(seq.saturating_add(1));
        self.last_accepted = Some((seq, payload));
    }

    /// Gives up on what came before `seq`: the index was cleared and continues from `seq`.
    pub fn resync_at(&mut self, seq: u64) {
        self.next = Some(seq);
        self.last_accepted = None;
    }

    /// Records a live number without classifying it (it is being handled out of band).
    pub fn note_live(&mut self, seq: u64) {
        self.last_live = Some(seq);
    }

    /// Forgets the stream (publisher restarted). The live message that revealed the restart is
    /// then classified again, as the first of a fresh stream.
    pub fn reset(&mut self) {
        self.next = None;
        self.last_live = None;
        self.last_accepted = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Option<Bytes> {
        Some(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn in_order_stream() {
        let mut s = Sequencer::default();
        for seq in 0..5 {
            assert_eq!(s.classify_live(seq), Live::Apply);
            s.accept(seq, b("x"));
        }
        assert_eq!(s.next(), Some(5));
    }

    #[test]
    fn fresh_start_above_zero_replays_from_zero() {
        let mut s = Sequencer::default();
        assert_eq!(s.classify_live(4), Live::Gap { from: 0 });
        assert_eq!(s.classify_replayed(0, b"a"), Replayed::Apply);
        s.accept(0, b("a"));
        assert_eq!(s.classify_replayed(1, b"b"), Replayed::Apply);
    }

    #[test]
    fn gap_replays_from_last_accepted_and_verifies_overlap() {
        let mut s = Sequencer::default();
        for seq in 0..3 {
            s.classify_live(seq);
            s.accept(seq, b(&format!("p{seq}")));
        }
        assert_eq!(s.classify_live(6), Live::Gap { from: 2 });
        assert_eq!(s.classify_replayed(2, b"p2"), Replayed::Skip);
        assert_eq!(s.classify_replayed(2, b"other"), Replayed::Mismatch);
        let mut unreadable = s.clone();
        unreadable.accept(2, None);
        assert_eq!(unreadable.classify_replayed(2, b"other"), Replayed::Skip);
        assert_eq!(s.classify_replayed(1, b"p1"), Replayed::Skip);
        assert_eq!(s.classify_replayed(3, b"p3"), Replayed::Apply);
        assert_eq!(
            s.classify_replayed(5, b"p5"),
            Replayed::Hole { missing_from: 3 }
        );
    }

    #[test]
    fn live_after_replay_is_duplicate_not_reset() {
        let mut s = Sequencer::default();
        s.classify_live(0);
        s.accept(0, b("a"));
        assert_eq!(s.classify_live(3), Live::Gap { from: 0 });
        for seq in 1..6 {
            s.accept(seq, b("r"));
        }
        assert_eq!(s.classify_live(4), Live::Duplicate);
        assert_eq!(s.classify_live(6), Live::Apply);
    }

    #[test]
    fn going_back_is_behind_until_the_overlap_proves_a_restart() {
        let mut s = Sequencer::default();
        for seq in 0..10 {
            s.classify_live(seq);
            s.accept(seq, b("x"));
        }
        assert_eq!(s.classify_live(1), Live::Behind);
        assert_eq!(s.classify_live(9), Live::Behind, "a repeat of the last one");
        assert_eq!(s.overlap(), Some((9, Bytes::from_static(b"x"))));
        assert_eq!(s.classify_live(10), Live::Apply, "a copy moved nothing");
        let mut unreadable = s.clone();
        unreadable.accept(10, None);
        assert_eq!(
            unreadable.classify_live(1),
            Live::Reset,
            "nothing to prove the instance with"
        );
        s.reset();
        assert!(s.is_fresh());
        assert_eq!(s.replay_start(), 0);
        assert_eq!(s.classify_live(1), Live::Gap { from: 0 });
        assert_eq!(
            s.classify_live(1),
            Live::Reset,
            "a repeated live number is a restart"
        );
    }

    #[test]
    fn resync_continues_from_hole() {
        let mut s = Sequencer::default();
        s.classify_live(0);
        s.accept(0, b("a"));
        s.resync_at(50);
        assert_eq!(s.replay_start(), 50);
        assert_eq!(s.classify_replayed(50, b"z"), Replayed::Apply);
    }
}
