//! Loss and restarts against a vLLM-like publisher over real ZMQ sockets: gaps replayed in both
//! reply layouts, gaps beyond the replay buffer, replay timeouts, publisher restarts (sequence
//! reset, and a restarted stream that overtook the old sequence), and garbage messages.
//!
//! Every wait is on a condition with a generous timeout that fails the test; nothing sleeps.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_events::testing::{
    all_cleared, fast_config, stored, FakePublisher, Model, ReplayLayout, ReplayMode,
};
use kinference_events::{
    DpRank, EventPlane, EventPlaneConfig, ReplicaId, SyncState, WorkerConfig, WorkerHealth,
    WorkerId,
};
use kinference_testkit::WAIT;
use kinference_vllm::KvEventBatch;

const TOPIC: &str = "kv-events";

struct Rig {
    plane: EventPlane,
    publisher: FakePublisher,
    worker: WorkerId,
}

/// A publisher that binds (with a replay socket unless `replay` is false) and a subscribed
/// plane; the subscription has arrived when this returns.
async fn rig(buffer_steps: usize, replay: bool, config: EventPlaneConfig) -> Rig {
    let mut publisher = FakePublisher::bind(TOPIC, buffer_steps).await.unwrap();
    let plane = EventPlane::start(config).unwrap();
    let worker = WorkerId::new(ReplicaId(1), DpRank(0));
    let endpoint = publisher.events_endpoint().unwrap().to_owned();
    let mut cfg = WorkerConfig::connect(worker.replica, worker.rank, &endpoint).with_topic(TOPIC);
    if replay {
        cfg = cfg.with_replay(publisher.replay_endpoint());
    }
    plane.add_worker(cfg).await.unwrap();
    publisher.wait_subscribed(WAIT).await.unwrap();
    Rig {
        plane,
        publisher,
        worker,
    }
}

impl Rig {
    async fn publish(&mut self, batch: &KvEventBatch, model: &mut Model) -> u64 {
        model.apply(batch);
        self.publisher.publish(batch).await.unwrap()
    }

    fn drop_live(&mut self, batch: &KvEventBatch, model: &mut Model) -> u64 {
        model.apply(batch);
        self.publisher.publish_dropped(batch)
    }

    async fn wait(&self, what: &str, pred: impl FnMut(&WorkerHealth) -> bool) -> WorkerHealth {
        let w = self.worker;
        self.plane
            .wait_for(w, WAIT, pred)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}; {:?}", self.plane.health(w)))
    }

    async fn wait_applied(&self, seq: u64) -> WorkerHealth {
        self.wait(&format!("applied {seq}"), |h| {
            h.applied_seq >= Some(seq) && !h.stale
        })
        .await
    }

    fn assert_index(&self, model: &Model) {
        let index = self.plane.index();
        let index = index.read();
        assert!(
            model.matches(&index, self.worker),
            "index holds {} entries, model {:?}",
            index.worker_entries(self.worker),
            model.blocks
        );
    }

    async fn close(self) {
        self.plane.shutdown().await;
        self.publisher.close().await;
    }
}

fn chain(i: u64) -> KvEventBatch {
    stored(&[i * 100, i * 100 + 1], None)
}

async fn dropped_seqs_are_replayed(layout: ReplayLayout) {
    let mut rig = rig(100, true, fast_config()).await;
    rig.publisher.set_replay_mode(ReplayMode::Answer(layout));
    let mut model = Model::default();
    for i in 0..5 {
        rig.publish(&chain(i), &mut model).await;
    }
    rig.wait_applied(4).await;
    for i in 5..10 {
        rig.drop_live(&chain(i), &mut model);
    }
    let mut last = 0;
    for i in 10..15 {
        last = rig.publish(&chain(i), &mut model).await;
    }
    let h = rig.wait_applied(last).await;
    rig.assert_index(&model);
    assert_eq!(h.gaps, 1);
    assert_eq!((h.replays_attempted, h.replays_succeeded), (1, 1));
    assert_eq!((h.unrecoverable_gaps, h.resets, h.decode_errors), (0, 0, 0));
    assert!(h.replayed_batches >= 5, "{h:?}");
    assert_eq!(h.batches_applied, 15, "each batch applied exactly once");
    assert_eq!(h.sync, SyncState::Synced);
    // The replay started one early, at the last applied batch, to verify the publisher.
    assert_eq!(rig.publisher.replay_log()[0].start, 4);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_seqs_are_replayed_v034_layout() {
    dropped_seqs_are_replayed(ReplayLayout::V034).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_seqs_are_replayed_legacy_layout() {
    dropped_seqs_are_replayed(ReplayLayout::Legacy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_subscriber_replays_from_zero() {
    let mut rig = rig(100, true, fast_config()).await;
    let mut model = Model::default();
    // The first messages went out before the subscriber was listening (slow joiner).
    for i in 0..3 {
        rig.drop_live(&chain(i), &mut model);
    }
    let last = rig.publish(&chain(3), &mut model).await;
    let h = rig.wait_applied(last).await;
    rig.assert_index(&model);
    assert_eq!(rig.publisher.replay_log()[0].start, 0);
    assert_eq!(
        (h.gaps, h.replays_succeeded, h.unrecoverable_gaps),
        (1, 1, 0)
    );
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_beyond_the_replay_buffer_clears_and_resyncs() {
    let mut rig = rig(4, true, fast_config()).await;
    let mut before = Model::default();
    for i in 0..3 {
        rig.publish(&chain(i), &mut before).await;
    }
    rig.wait_applied(2).await;
    // Ten batches lost; the publisher keeps only the last four.
    let mut all = Vec::new();
    for i in 3..13 {
        let b = chain(i);
        all.push((rig.publisher.publish_dropped(&b), b));
    }
    let mut after = Vec::new();
    for i in 13..16 {
        let b = chain(i);
        after.push((rig.publisher.publish(&b).await.unwrap(), b));
    }
    let last = after.last().unwrap().0;
    let h = rig.wait_applied(last).await;

    // The index holds exactly what was applied after the clear: the buffered tail onwards.
    let first_kept = rig.publisher.replay_log()[0].sent[0];
    assert!(first_kept > 3, "the buffer had lost the start of the gap");
    let mut model = Model::default();
    for (seq, b) in all.iter().chain(after.iter()) {
        if *seq >= first_kept {
            model.apply(b);
        }
    }
    rig.assert_index(&model);
    assert!(before.blocks.iter().all(|b| !model.blocks.contains(b)));
    assert_eq!((h.gaps, h.unrecoverable_gaps, h.resets), (1, 1, 0));
    assert_eq!(h.replays_succeeded, 0);
    assert_eq!(h.sync, SyncState::Resynced);

    // New blocks keep flowing correctly; an AllBlocksCleared makes the view exact again.
    let mut fresh = Model::default();
    let seq = rig.publish(&all_cleared(), &mut fresh).await;
    let seq2 = rig.publish(&chain(50), &mut fresh).await;
    assert_eq!(seq2, seq + 1);
    let h = rig.wait_applied(seq2).await;
    rig.assert_index(&fresh);
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_endpoint_is_unrecoverable() {
    let mut rig = rig(100, false, fast_config()).await;
    let mut model = Model::default();
    rig.publish(&chain(0), &mut model).await;
    rig.wait_applied(0).await;
    rig.drop_live(&chain(1), &mut model);
    let mut tail = Model::default();
    let last = rig.publish(&chain(2), &mut tail).await;
    let h = rig.wait_applied(last).await;
    rig.assert_index(&tail);
    assert_eq!(
        (h.gaps, h.unrecoverable_gaps, h.replays_attempted),
        (1, 1, 0)
    );
    assert_eq!(h.sync, SyncState::Resynced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_replay_server_times_out_with_retries() {
    let config = EventPlaneConfig {
        replay_attempts: 3,
        replay_idle_timeout: Duration::from_millis(200),
        ..fast_config()
    };
    let mut rig = rig(100, true, config).await;
    rig.publisher.set_replay_mode(ReplayMode::Silent);
    let mut model = Model::default();
    rig.publish(&chain(0), &mut model).await;
    rig.wait_applied(0).await;
    rig.drop_live(&chain(1), &mut model);
    let mut tail = Model::default();
    let last = rig.publish(&chain(2), &mut tail).await;
    // Live messages that arrive while the replay hangs are buffered and applied afterwards.
    let last = last.max(rig.publish(&chain(3), &mut tail).await);
    let h = rig.wait_applied(last).await;
    rig.assert_index(&tail);
    assert_eq!((h.replays_attempted, h.replays_succeeded), (3, 0));
    assert_eq!(h.unrecoverable_gaps, 1);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_clears_and_rebuilds() {
    let mut rig = rig(100, true, fast_config()).await;
    let mut old = Model::default();
    for i in 0..10 {
        rig.publish(&chain(i), &mut old).await;
    }
    rig.wait_applied(9).await;

    rig.publisher.restart();
    let mut new = Model::default();
    let mut last = 0;
    for i in 20..25 {
        last = rig.publish(&chain(i), &mut new).await;
    }
    assert_eq!(last, 4);
    let h = rig
        .wait("rebuilt after restart", |h| {
            h.resets == 1 && h.applied_seq == Some(4) && !h.stale
        })
        .await;
    rig.assert_index(&new);
    assert_eq!((h.unrecoverable_gaps, h.gaps), (0, 0));
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_late_arrivals_are_skipped_once_the_overlap_proves_the_same_publisher() {
    let mut rig = rig(100, true, fast_config()).await;
    let mut model = Model::default();
    for i in 0..5 {
        rig.publish(&chain(i), &mut model).await;
    }
    rig.wait_applied(4).await;
    // A copy of the last message, then a reordered pair: 6 arrives live before 5.
    assert!(rig.publisher.resend(4).await.unwrap());
    rig.wait("the copy proven", |h| h.repeats == 1).await;
    let five = rig.drop_live(&chain(5), &mut model);
    rig.publish(&chain(6), &mut model).await;
    rig.wait_applied(6).await;
    assert!(rig.publisher.resend(five).await.unwrap());
    rig.wait("the late arrival proven", |h| h.repeats == 2)
        .await;
    let last = rig.publish(&chain(7), &mut model).await;
    let h = rig.wait_applied(last).await;
    rig.assert_index(&model);
    assert_eq!((h.resets, h.unrecoverable_gaps, h.gaps), (0, 0, 1), "{h:?}");
    assert_eq!(
        h.batches_applied, 8,
        "each batch applied exactly once: {h:?}"
    );
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_going_back_without_a_replay_endpoint_is_a_restart() {
    let mut rig = rig(100, false, fast_config()).await;
    let mut model = Model::default();
    for i in 0..5 {
        rig.publish(&chain(i), &mut model).await;
    }
    rig.wait_applied(4).await;
    assert!(rig.publisher.resend(4).await.unwrap());
    let h = rig
        .wait("the copy taken for a restart", |h| h.resets == 1)
        .await;
    assert_eq!(h.repeats, 0);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_with_lost_first_messages_replays_from_zero() {
    let mut rig = rig(100, true, fast_config()).await;
    let mut old = Model::default();
    for i in 0..10 {
        rig.publish(&chain(i), &mut old).await;
    }
    rig.wait_applied(9).await;

    rig.publisher.restart();
    let mut new = Model::default();
    for i in 30..33 {
        rig.drop_live(&chain(i), &mut new);
    }
    let last = rig.publish(&chain(33), &mut new).await;
    let h = rig
        .wait("rebuilt", |h| {
            h.resets == 1 && h.applied_seq == Some(last) && !h.stale
        })
        .await;
    rig.assert_index(&new);
    assert_eq!(rig.publisher.replay_log().last().unwrap().start, 0);
    assert_eq!(
        (h.gaps, h.replays_succeeded, h.unrecoverable_gaps),
        (1, 1, 0)
    );
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_stream_ahead_of_the_old_one_is_detected_by_the_replay_overlap() {
    let mut rig = rig(100, true, fast_config()).await;
    let mut old = Model::default();
    for i in 0..5 {
        rig.publish(&chain(i), &mut old).await;
    }
    rig.wait_applied(4).await;

    // The engine restarted and published 0..7 while we were not listening: seq 7 looks like an
    // ordinary gap after 4, but seq 4 now has different content.
    rig.publisher.restart();
    let mut new = Model::default();
    for i in 40..47 {
        rig.drop_live(&chain(i), &mut new);
    }
    let last = rig.publish(&chain(47), &mut new).await;
    assert_eq!(last, 7);
    let h = rig
        .wait("rebuilt", |h| {
            h.resets == 1 && h.applied_seq == Some(7) && !h.stale
        })
        .await;
    rig.assert_index(&new);
    let starts: Vec<u64> = rig.publisher.replay_log().iter().map(|l| l.start).collect();
    assert_eq!(starts, vec![4, 0]);
    assert_eq!(h.unrecoverable_gaps, 0);
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_wrong_frame_counts_are_counted_and_skipped() {
    let mut rig = rig(100, true, fast_config()).await;
    let mut model = Model::default();
    rig.publish(&chain(0), &mut model).await;
    rig.wait_applied(0).await;

    // A payload that is not msgpack, under a real sequence number.
    rig.publisher.publish_payload(b"\xc1garbage").await.unwrap();
    // Four frames with a readable sequence number: skipped, but the sequence advances.
    let seq = rig.publisher.take_seq();
    let four = vec![
        TOPIC.into(),
        seq.to_be_bytes().to_vec(),
        b"x".to_vec(),
        b"y".to_vec(),
    ];
    rig.publisher.send_frames(four).await.unwrap();
    // A lone frame carries no sequence number: skipped without touching the sequence.
    rig.publisher.send_frames(vec![TOPIC.into()]).await.unwrap();
    // A short sequence frame.
    rig.publisher
        .send_frames(vec![TOPIC.into(), vec![1, 2, 3], b"p".to_vec()])
        .await
        .unwrap();
    let last = rig.publish(&chain(1), &mut model).await;
    assert_eq!(last, 3);

    let h = rig.wait_applied(last).await;
    rig.assert_index(&model);
    assert_eq!(h.decode_errors, 4, "{h:?}");
    assert_eq!((h.gaps, h.unrecoverable_gaps, h.resets), (0, 0, 0));
    assert_eq!(h.messages, 6);
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_publisher_process_on_the_same_ports_is_resynced() {
    // The publisher binds (we dial); the engine restarts: new sockets on the same ports.
    let mut rig = rig(100, true, fast_config()).await;
    let mut old = Model::default();
    for i in 0..5 {
        rig.publish(&chain(i), &mut old).await;
    }
    rig.wait_applied(4).await;
    let events = rig.publisher.events_endpoint().unwrap().to_owned();
    let replay = rig.publisher.replay_endpoint().to_owned();

    let Rig {
        plane,
        publisher,
        worker,
    } = rig;
    publisher.close().await;
    let h = plane
        .wait_for(worker, WAIT, |h| !h.connected)
        .await
        .expect("the disconnect is visible in health");
    // Messages are counted in bursts, but always before a later change such as this one.
    assert_eq!((h.messages, h.last_seq), (5, Some(4)), "{h:?}");
    let mut publisher = FakePublisher::bind_at(&events, &replay, TOPIC, 100)
        .await
        .unwrap();
    publisher.wait_subscribed(WAIT).await.unwrap();
    let mut rig = Rig {
        plane,
        publisher,
        worker,
    };
    let mut new = Model::default();
    let mut last = 0;
    for i in 60..63 {
        last = rig.publish(&chain(i), &mut new).await;
    }
    let h = rig
        .wait("rebuilt", |h| {
            h.resets == 1 && h.applied_seq == Some(last) && !h.stale
        })
        .await;
    rig.assert_index(&new);
    assert!(h.connected);
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnecting_publisher_in_bind_mode_is_resynced() {
    // We bind; the engine's PUB connects, goes away, and a restarted one connects again.
    let plane = EventPlane::start(fast_config()).unwrap();
    let worker = WorkerId::new(ReplicaId(2), DpRank(0));
    let cfg =
        WorkerConfig::bind(worker.replica, worker.rank, "tcp://127.0.0.1:0").with_topic(TOPIC);
    plane.add_worker(cfg).await.unwrap();
    let local = plane.health(worker).unwrap().local_endpoint.unwrap();

    let mut first = FakePublisher::connect(&local, TOPIC, 10).await.unwrap();
    first.wait_subscribed(WAIT).await.unwrap();
    for i in 0..4 {
        first.publish(&chain(i)).await.unwrap();
    }
    plane
        .wait_for(worker, WAIT, |h| h.applied_seq == Some(3))
        .await
        .unwrap();
    first.close().await;
    plane
        .wait_for(worker, WAIT, |h| !h.connected)
        .await
        .expect("the disconnect is visible in health");

    let mut second = FakePublisher::connect(&local, TOPIC, 10).await.unwrap();
    second.wait_subscribed(WAIT).await.unwrap();
    let mut model = Model::default();
    for i in 70..72 {
        model.apply(&chain(i));
        second.publish(&chain(i)).await.unwrap();
    }
    let h = plane
        .wait_for(worker, WAIT, |h| {
            h.resets == 1 && h.applied_seq == Some(1) && !h.stale
        })
        .await
        .unwrap();
    assert!(model.matches(&plane.index().read(), worker));
    assert!(h.connected);
    plane.shutdown().await;
    second.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_worker_frees_its_port_for_a_new_subscription() {
    // The router closes a live connection first, which leaves it in TIME_WAIT on the bound
    // port; binding that port again must work at once (libzmq sets SO_REUSEADDR).
    let plane = EventPlane::start(fast_config()).unwrap();
    let worker = WorkerId::new(ReplicaId(3), DpRank(0));
    let cfg =
        WorkerConfig::bind(worker.replica, worker.rank, "tcp://127.0.0.1:0").with_topic(TOPIC);
    plane.add_worker(cfg).await.unwrap();
    let local = plane.health(worker).unwrap().local_endpoint.unwrap();
    let mut first = FakePublisher::connect(&local, TOPIC, 10).await.unwrap();
    first.wait_subscribed(WAIT).await.unwrap();
    first.publish(&chain(1)).await.unwrap();
    plane
        .wait_for(worker, WAIT, |h| h.applied_seq == Some(0))
        .await
        .unwrap();
    assert!(plane.remove_worker(worker).await.unwrap());
    first.close().await;
    let again = WorkerConfig::bind(worker.replica, worker.rank, &local).with_topic(TOPIC);
    plane
        .add_worker(again)
        .await
        .expect("the port was released");
    let mut second = FakePublisher::connect(&local, TOPIC, 10).await.unwrap();
    second.wait_subscribed(WAIT).await.unwrap();
    let mut model = Model::default();
    model.apply(&chain(2));
    second.publish(&chain(2)).await.unwrap();
    plane
        .wait_for(worker, WAIT, |h| h.applied_seq == Some(0) && !h.stale)
        .await
        .unwrap();
    assert!(model.matches(&plane.index().read(), worker));
    plane.shutdown().await;
    second.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_that_continues_at_the_expected_number_is_caught_after_reconnect() {
    // The restarted engine's first live message has exactly the number we expect next; only
    // the replay overlap (different content at the last applied number) reveals the restart.
    let mut rig = rig(100, true, fast_config()).await;
    let mut old = Model::default();
    for i in 0..5 {
        rig.publish(&chain(i), &mut old).await;
    }
    rig.wait_applied(4).await;
    let events = rig.publisher.events_endpoint().unwrap().to_owned();
    let replay = rig.publisher.replay_endpoint().to_owned();
    let Rig {
        plane,
        publisher,
        worker,
    } = rig;
    publisher.close().await;
    plane
        .wait_for(worker, WAIT, |h| !h.connected)
        .await
        .unwrap();
    let mut publisher = FakePublisher::bind_at(&events, &replay, TOPIC, 100)
        .await
        .unwrap();
    let mut rig = Rig {
        plane,
        publisher: {
            publisher.wait_subscribed(WAIT).await.unwrap();
            publisher
        },
        worker,
    };
    let mut new = Model::default();
    for i in 80..85 {
        rig.drop_live(&chain(i), &mut new);
    }
    let last = rig.publish(&chain(85), &mut new).await;
    assert_eq!(last, 5);
    let h = rig
        .wait("rebuilt", |h| {
            h.resets == 1 && h.applied_seq == Some(5) && !h.stale
        })
        .await;
    rig.assert_index(&new);
    let starts: Vec<u64> = rig.publisher.replay_log().iter().map(|l| l.start).collect();
    assert_eq!(starts, vec![4, 0]);
    assert_eq!((h.gaps, h.unrecoverable_gaps), (0, 0));
    assert_eq!(h.sync, SyncState::Synced);
    rig.close().await;
}

/// A 99-batch gap whose replies hold only `keep` batches each (with their end marker when
/// `end`); returns the plane's health once it has applied the live batch that revealed it,
/// and the starts of the replay rounds asked for.
async fn gap_with_short_replies(
    config: EventPlaneConfig,
    keep: usize,
    end: bool,
) -> (WorkerHealth, Vec<u64>, Rig, Model) {
    let mut rig = rig(5_000, true, config).await;
    let mut model = Model::default();
    rig.publish(&chain(0), &mut model).await;
    rig.wait_applied(0).await;
    rig.publisher.set_replay_mode(ReplayMode::TailDropped {
        layout: ReplayLayout::V034,
        keep,
        end,
    });
    for i in 1..100 {
        rig.drop_live(&chain(i), &mut model);
    }
    let last = rig.publish(&chain(100), &mut model).await;
    let h = rig.wait_applied(last).await;
    let starts = rig.publisher.replay_log().iter().map(|l| l.start).collect();
    (h, starts, rig, model)
}

/// Replies of 40 batches (with their end marker when `end`) fill the 99-batch gap in three
/// rounds, nothing lost and nothing cleared.
async fn short_replies_fill_the_gap_in_rounds(config: EventPlaneConfig, end: bool) {
    let (h, starts, rig, model) = gap_with_short_replies(config, 40, end).await;
    assert_eq!((h.unrecoverable_gaps, h.resets), (0, 0), "{h:?}");
    assert_eq!(h.batches_applied, 101, "{h:?}");
    rig.assert_index(&model);
    // Each round starts at the last batch applied (the overlap that proves the publisher).
    assert_eq!(starts, vec![0, 39, 78]);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_tail_was_dropped_before_its_end_marker_is_asked_again() {
    // libzmq's ROUTER drops replies while its queue to the peer is full; when the queue has
    // drained by the time the end marker is sent, the reply ends cleanly but short.
    short_replies_fill_the_gap_in_rounds(fast_config(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_lost_its_tail_and_end_marker_is_asked_again_once_it_stalls() {
    // The first message may be slow to come (the idle timeout, longer than this test's
    // wait); a reply that has begun and pauses has lost the rest.
    let config = EventPlaneConfig {
        replay_idle_timeout: 2 * WAIT,
        replay_total_timeout: 4 * WAIT,
        ..fast_config()
    };
    short_replies_fill_the_gap_in_rounds(config, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_ends_without_anything_new_leaves_the_gap_unrecoverable() {
    // Asked again only while rounds move forward: a reply of the overlap alone ends the gap.
    let (h, starts, rig, _) = gap_with_short_replies(fast_config(), 1, true).await;
    assert_eq!((h.unrecoverable_gaps, h.resets), (1, 0), "{h:?}");
    assert_eq!(h.sync, SyncState::Resynced, "{h:?}");
    assert_eq!(starts, vec![0]);
    rig.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_longer_than_the_publishers_send_limit_is_fetched_in_rounds() {
    // vLLM's replay ROUTER keeps libzmq's default send limit (1,000 queued messages) and drops
    // what exceeds it, end marker included: a replay of more batches arrives truncated.
    let mut rig = rig(5_000, true, fast_config()).await;
    let mut model = Model::default();
    rig.publish(&chain(0), &mut model).await;
    rig.wait_applied(0).await;
    for i in 1..2_600 {
        rig.drop_live(&chain(i), &mut model);
    }
    let last = rig.publish(&chain(2_600), &mut model).await;
    let h = rig.wait_applied(last).await;
    assert_eq!(h.unrecoverable_gaps, 0, "{h:?}");
    assert_eq!(h.resets, 0, "{h:?}");
    rig.assert_index(&model);
    assert_eq!(h.resets, 0, "{h:?}");
    assert_eq!(h.batches_applied, 2_601, "{h:?}");
    rig.close().await;
}
