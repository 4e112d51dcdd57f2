//! The event plane against a vLLM-like publisher over real ZMQ sockets: normal flow in both
//! socket directions, DP rank ports, backpressure, removal and shutdown.
//!
//! Every wait is on a condition (health watch, subscription arrival) with a generous timeout
//! that fails the test; nothing sleeps.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_events::testing::{all_cleared, fast_config, removed, stored, FakePublisher, Model};
use kinference_events::{
    DpRank, EventPlane, EventPlaneConfig, ReplicaId, SyncState, WorkerConfig, WorkerId,
};
use kinference_testkit::{unused_port, WAIT};

const TOPIC: &str = "kv-events";

fn worker(replica: u32, rank: u32) -> WorkerId {
    WorkerId::new(ReplicaId(replica), DpRank(rank))
}

/// Publishes a mix of stores and removals; returns the model of what the worker holds.
async fn publish_mix(publisher: &mut FakePublisher, rounds: u64, base: u64) -> Model {
    let mut model = Model::default();
    for i in 0..rounds {
        let h = base + i * 10;
        let batches = [stored(&[h, h + 1, h + 2], None), removed(&[h + 1])];
        for b in &batches {
            publisher.publish(b).await.unwrap();
            model.apply(b);
        }
    }
    model
}

async fn wait_applied(
    plane: &EventPlane,
    w: WorkerId,
    seq: u64,
) -> kinference_events::WorkerHealth {
    plane
        .wait_for(w, WAIT, |h| h.applied_seq >= Some(seq) && !h.stale)
        .await
        .unwrap_or_else(|e| panic!("{w}: waiting for seq {seq}: {e}; {:?}", plane.health(w)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_flow_subscriber_binds() {
    let plane = EventPlane::start(fast_config()).unwrap();
    let w = worker(1, 0);
    plane
        .add_worker(WorkerConfig::bind(w.replica, w.rank, "tcp://127.0.0.1:0").with_topic(TOPIC))
        .await
        .unwrap();
    let local = plane.health(w).unwrap().local_endpoint.unwrap();
    assert!(
        !local.ends_with(":0"),
        "bound endpoint reports the real port: {local}"
    );
    let mut publisher = FakePublisher::connect(&local, TOPIC, 100).await.unwrap();
    publisher.wait_subscribed(WAIT).await.unwrap();

    let model = publish_mix(&mut publisher, 20, 1000).await;
    let h = wait_applied(&plane, w, publisher.next_seq() - 1).await;

    assert!(model.matches(&plane.index().read(), w), "index == model");
    assert_eq!(h.entries, model.blocks.len());
    assert_eq!(
        (h.gaps, h.unrecoverable_gaps, h.resets, h.decode_errors),
        (0, 0, 0, 0)
    );
    assert_eq!(h.sync, SyncState::Synced);
    assert_eq!(h.batches_applied, 40);
    assert!(h.connected);
    assert!(h.last_event_at.is_some());
    plane.shutdown().await;
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_flow_subscriber_connects() {
    let mut publisher = FakePublisher::bind(TOPIC, 100).await.unwrap();
    let endpoint = publisher.events_endpoint().unwrap().to_owned();
    let plane = EventPlane::start(fast_config()).unwrap();
    let w = worker(2, 0);
    let config = WorkerConfig::auto(w.replica, w.rank, &endpoint, "tcp://*:5557")
        .with_replay(publisher.replay_endpoint())
        .with_topic(TOPIC);
    plane.add_worker(config).await.unwrap();
    publisher.wait_subscribed(WAIT).await.unwrap();

    let mut model = publish_mix(&mut publisher, 10, 5000).await;
    publisher.publish(&all_cleared()).await.unwrap();
    model.apply(&all_cleared());
    let after = stored(&[9, 8], None);
    publisher.publish(&after).await.unwrap();
    model.apply(&after);
    let h = wait_applied(&plane, w, publisher.next_seq() - 1).await;

    assert!(model.matches(&plane.index().read(), w));
    assert_eq!(model.blocks.len(), 2);
    assert_eq!((h.gaps, h.unrecoverable_gaps, h.resets), (0, 0, 0));
    assert_eq!(h.sync, SyncState::Synced);
    assert_eq!(h.local_endpoint, None);
    plane.shutdown().await;
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_rank_one_uses_base_port_plus_one() {
    // The subscriber binds base + 1 for rank 1; base itself is never bound.
    let port = unused_port();
    let base = format!("tcp://127.0.0.1:{}", port - 1);
    let plane = EventPlane::start(fast_config()).unwrap();
    let w = worker(3, 1);
    plane
        .add_worker(WorkerConfig::bind(w.replica, w.rank, &base).with_topic(TOPIC))
        .await
        .unwrap();
    let expected = format!("tcp://127.0.0.1:{port}");
    assert_eq!(plane.health(w).unwrap().endpoint, expected);
    assert_eq!(
        plane.health(w).unwrap().local_endpoint.as_deref(),
        Some(expected.as_str())
    );

    let mut publisher = FakePublisher::connect(&expected, TOPIC, 10).await.unwrap();
    publisher.wait_subscribed(WAIT).await.unwrap();
    let b = stored(&[31, 32], None);
    publisher.publish(&b).await.unwrap();
    wait_applied(&plane, w, 0).await;
    let mut model = Model::default();
    model.apply(&b);
    let index = plane.index();
    assert!(model.matches(&index.read(), w));
    assert_eq!(
        index.read().worker_entries(worker(3, 0)),
        0,
        "rank 0 holds nothing"
    );
    plane.shutdown().await;
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_writer_applies_everything_through_backpressure() {
    let config = EventPlaneConfig {
        channel_capacity: 4,
        reader_capacity: 4,
        writer_batch_max: 8,
        ..fast_config()
    };
    let plane = EventPlane::start(config).unwrap();
    let mut publisher = FakePublisher::bind(TOPIC, 10_000).await.unwrap();
    let w = worker(4, 0);
    let endpoint = publisher.events_endpoint().unwrap().to_owned();
    plane
        .add_worker(
            WorkerConfig::connect(w.replica, w.rank, &endpoint)
                .with_replay(publisher.replay_endpoint())
                .with_topic(TOPIC),
        )
        .await
        .unwrap();
    publisher.wait_subscribed(WAIT).await.unwrap();

    let pause = plane.pause_writer().await;
    let mut model = publish_mix(&mut publisher, 1500, 100_000).await;
    let last = publisher.next_seq() - 1;
    // The subscriber is blocked on the full channel: nothing can have been applied.
    let h = plane.health(w).unwrap();
    assert_eq!(h.applied_seq, None);
    assert!(
        h.last_seq < Some(last),
        "backpressure reached the socket: {:?}",
        h.last_seq
    );
    drop(pause);
    // Batches lost at the end of a burst show only when a later one arrives (a gap is seen on
    // the next sequence number, as with vLLM), and a PUB drops what it sends while the
    // subscriber's queue is still full. Seen in CI: the last 330 of 3,000 missing with nothing
    // after them to tell. So one more batch at a time, until one is applied: each makes any
    // loss before it a gap to replay.
    let mut last = last;
    for n in 0..40u64 {
        let fence = stored(&[99_999_000 + 2 * n, 99_999_001 + 2 * n], None);
        publisher.publish(&fence).await.unwrap();
        model.apply(&fence);
        last = publisher.next_seq() - 1;
        let applied = |h: &kinference_events::WorkerHealth| h.applied_seq >= Some(last) && !h.stale;
        if plane
            .wait_for(w, Duration::from_millis(500), applied)
            .await
            .is_ok()
        {
            break;
        }
    }

    let h = wait_applied(&plane, w, last).await;
    assert!(model.matches(&plane.index().read(), w));
    // Within the publisher's high-water mark nothing may be lost; a loss would be replayed.
    assert_eq!((h.unrecoverable_gaps, h.resets), (0, 0));
    assert_eq!(h.batches_applied, last + 1);
    plane.shutdown().await;
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_replica_clears_its_entries_at_once() {
    let plane = EventPlane::start(fast_config()).unwrap();
    let mut publishers = Vec::new();
    for (replica, base) in [(10u32, 1u64), (11, 100)] {
        let w = worker(replica, 0);
        plane
            .add_worker(
                WorkerConfig::bind(w.replica, w.rank, "tcp://127.0.0.1:0").with_topic(TOPIC),
            )
            .await
            .unwrap();
        let local = plane.health(w).unwrap().local_endpoint.unwrap();
        let mut p = FakePublisher::connect(&local, TOPIC, 10).await.unwrap();
        p.wait_subscribed(WAIT).await.unwrap();
        p.publish(&stored(&[base, base + 1, base + 2], None))
            .await
            .unwrap();
        wait_applied(&plane, w, 0).await;
        publishers.push(p);
    }
    let index = plane.index();
    assert_eq!(index.read().worker_entries(worker(10, 0)), 3);

    assert_eq!(plane.remove_replica(ReplicaId(10)).await.unwrap(), 1);
    assert_eq!(index.read().worker_entries(worker(10, 0)), 0);
    assert_eq!(
        index.read().worker_entries(worker(11, 0)),
        3,
        "other replica untouched"
    );
    assert!(plane.health(worker(10, 0)).is_none());
    assert_eq!(plane.workers(), vec![worker(11, 0)]);
    // Events still sent by the removed replica's publisher go nowhere.
    publishers[0].publish(&stored(&[7], None)).await.unwrap();
    assert_eq!(index.read().worker_entries(worker(10, 0)), 0);
    assert_eq!(plane.remove_replica(ReplicaId(10)).await.unwrap(), 0);

    plane.shutdown().await;
    for p in publishers {
        p.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_workers_and_bad_endpoints_are_refused() {
    let plane = EventPlane::start(fast_config()).unwrap();
    let w = worker(5, 0);
    plane
        .add_worker(WorkerConfig::bind(w.replica, w.rank, "tcp://127.0.0.1:0"))
        .await
        .unwrap();
    let again = plane
        .add_worker(WorkerConfig::bind(w.replica, w.rank, "tcp://127.0.0.1:0"))
        .await;
    assert!(matches!(
        again,
        Err(kinference_events::EventsError::DuplicateWorker(_))
    ));
    let ipc = plane
        .add_worker(WorkerConfig::connect(
            ReplicaId(6),
            DpRank(0),
            "ipc:///tmp/x",
        ))
        .await;
    assert!(ipc.is_err());
    let unknown = plane.wait_for(worker(9, 9), WAIT, |_| true).await;
    assert!(matches!(
        unknown,
        Err(kinference_events::EventsError::UnknownWorker(_))
    ));
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_prompt_while_dialing_a_dead_endpoint() {
    let plane = EventPlane::start(fast_config()).unwrap();
    let dead = format!("tcp://127.0.0.1:{}", unused_port());
    let w = worker(7, 0);
    plane
        .add_worker(WorkerConfig::connect(w.replica, w.rank, &dead).with_replay(&dead))
        .await
        .unwrap();
    plane
        .wait_for(w, WAIT, |h| h.socket_errors >= 1)
        .await
        .expect("connect failures are counted");
    let started = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(3), plane.shutdown())
        .await
        .expect("shutdown within 3 s");
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_connecting_to_one_bound_endpoint_are_told_apart_by_topic() {
    // vLLM pods configured with `endpoint: tcp://router:PORT` and their own `topic` (llm-d:
    // `kv@<pod-ip>@<model>`) all connect to one router endpoint.
    let plane = EventPlane::start(fast_config()).unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", unused_port());
    let topic = |i: u32| format!("kv@10.0.0.{i}@tiny");
    for i in 0..3 {
        let cfg = WorkerConfig::bind(ReplicaId(i), DpRank(0), &endpoint).with_topic(&topic(i));
        plane.add_worker(cfg).await.unwrap();
    }
    // One topic per replica, and no catch-all beside them.
    for (replica, t) in [(7, topic(1)), (8, String::new())] {
        let cfg = WorkerConfig::bind(ReplicaId(replica), DpRank(0), &endpoint).with_topic(&t);
        let err = plane.add_worker(cfg).await.unwrap_err();
        assert!(err.to_string().contains("topic"), "{err}");
    }
    let mut publishers = Vec::new();
    let mut models = Vec::new();
    for i in 0..3u32 {
        let mut p = FakePublisher::connect(&endpoint, &topic(i), 100)
            .await
            .unwrap();
        p.wait_subscribed(WAIT).await.unwrap();
        models.push(publish_mix(&mut p, 3 + u64::from(i), 1000 * u64::from(i + 1)).await);
        publishers.push(p);
    }
    let mut stranger = FakePublisher::connect(&endpoint, "kv@10.0.0.9@tiny", 10)
        .await
        .unwrap();
    stranger.wait_subscribed(WAIT).await.unwrap();
    stranger.publish(&stored(&[99], None)).await.unwrap();
    stranger.publish(&stored(&[98], None)).await.unwrap();
    for (i, (p, model)) in publishers.iter().zip(&models).enumerate() {
        let w = worker(i as u32, 0);
        let h = wait_applied(&plane, w, p.next_seq() - 1).await;
        assert!(model.matches(&plane.index().read(), w), "{w}");
        assert_eq!((h.gaps, h.resets, h.decode_errors), (0, 0, 0), "{h:?}");
        assert!(h.connected, "{h:?}");
    }
    // The stranger's batches are counted and reported, and went to nobody.
    let deadline = tokio::time::Instant::now() + WAIT;
    let bound = loop {
        let b = plane.bound_endpoints();
        if b.first().is_some_and(|b| b.unknown_messages == 2) {
            break b;
        }
        assert!(tokio::time::Instant::now() < deadline, "{b:?}");
        tokio::task::yield_now().await;
    };
    assert_eq!(bound.len(), 1);
    assert_eq!(bound[0].topics, vec![topic(0), topic(1), topic(2)]);
    assert_eq!(bound[0].unknown_topics.get("kv@10.0.0.9@tiny"), Some(&2));
    assert_eq!(
        plane.index().read().len(),
        models.iter().map(|m| m.blocks.len()).sum::<usize>()
    );

    // One replica restarts (its sequence starts over): only it is rebuilt.
    publishers.remove(1).close().await;
    let mut restarted = FakePublisher::connect(&endpoint, &topic(1), 100)
        .await
        .unwrap();
    restarted.wait_subscribed(WAIT).await.unwrap();
    let model = publish_mix(&mut restarted, 2, 50_000).await;
    let w1 = worker(1, 0);
    plane
        .wait_for(w1, WAIT, |h| {
            h.resets == 1 && h.applied_seq == Some(3) && !h.stale
        })
        .await
        .unwrap();
    assert!(model.matches(&plane.index().read(), w1));
    for i in [0, 2] {
        assert_eq!(plane.health(worker(i, 0)).unwrap().resets, 0);
        assert!(models[i as usize].matches(&plane.index().read(), worker(i, 0)));
    }
    // Removing one replica leaves the endpoint to the others; removing all closes it.
    plane.remove_replica(ReplicaId(0)).await.unwrap();
    assert_eq!(plane.bound_endpoints()[0].topics, vec![topic(1), topic(2)]);
    plane.remove_replica(ReplicaId(1)).await.unwrap();
    plane.remove_replica(ReplicaId(2)).await.unwrap();
    assert!(plane.bound_endpoints().is_empty());
    let again = WorkerConfig::bind(ReplicaId(0), DpRank(0), &endpoint).with_topic(&topic(0));
    plane
        .add_worker(again)
        .await
        .expect("the port was released");
    plane.shutdown().await;
    for p in publishers.into_iter().chain([restarted, stranger]) {
        p.close().await;
    }
}
