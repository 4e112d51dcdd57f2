//! Sending hot-prefix warms (`warm` of a pool; what and when: `crate::warm`): when the fair-share
//! cap spills a hot prefix, the prefix alone goes to the planned worker from a task of its own.
//!
//! Invariants: a warm never delays the client's request: it is planned from the decision
//! already made, sent from its own task, and nothing waits for it. A warm counts in its worker's
//! in-flight load like a request, and its blocks are recorded as speculative entries for that
//! worker from the moment it is sent (taken back if it fails). Nothing here runs, and no token
//! ids are kept, while a pool's mode is `off`.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::Method;
use http_body_util::{BodyExt, Limited};
use kinference_vllm::BlockHash;

use crate::decide::Routed;
use crate::fleet::{Fleet, InFlight};
use crate::heads::Headers;
use crate::metrics::{PoolKind, PoolLabel};
use crate::upstream::{error_chain, Outgoing, Upstream};
use crate::usage::UsageScanner;
use crate::warm::{body, plan, Skip};

/// The largest warm response read (a completion of one token).
const RESPONSE_LIMIT: usize = 1 << 20;

/// Plans a warm for a routed request and, if one is due, sends it from a task of its own.
/// `client` are the request's headers: its `Authorization` goes with the warm (replicas that
/// check an API key would refuse it otherwise). The request's token ids are let go here, so
/// they are not held while its response streams.
pub(crate) fn spawn(
    fleet: &Arc<Fleet>,
    upstream: &Upstream,
    routed: &mut Routed,
    client: &Headers,
) {
    let Some(src) = routed.prepared.warm.take() else {
        return;
    };
    let p = &routed.prepared;
    let cfg = &p.rules.config.warm;
    let Some(plan) = plan(cfg.mode, &routed.decision, cfg.min_blocks) else {
        return;
    };
    let block_size = p.rules.block_size as usize;
    let blocks = (plan.blocks as usize)
        .min(p.hashes.len())
        .min(src.tokens.len() / block_size.max(1));
    let Some(&last) = blocks.checked_sub(1).and_then(|i| p.hashes.get(i)) else {
        return;
    };
    let pool = &p.pool;
    let skipped = |why: Skip| {
        fleet
            .metrics
            .warms_skipped
            .get_or_create(&PoolKind {
                pool: pool.name.clone(),
                kind: why.as_str(),
            })
            .inc();
    };
    let rank = plan.worker.rank.0 as usize;
    let Some(replica) = pool.replica(plan.worker.replica).filter(|r| {
        r.workers
            .get(rank)
            .is_some_and(|w| w.has_room(pool.worker_cap))
    }) else {
        return skipped(Skip::NoRoom);
    };
    let now = fleet.now();
    let place = match pool
        .warmer
        .admit((last, plan.worker), now, cfg.cooldown(), cfg.max_in_flight)
    {
        Ok(place) => place,
        Err(why) => return skipped(why),
    };
    let tokens = blocks * block_size;
    let prompt = &src.tokens[..tokens];
    let json = body(&p.model, prompt, src.cache_salt.as_deref(), cfg);
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(auth) = client
        .get("authorization")
        .and_then(|v| HeaderValue::from_bytes(v).ok())
    {
        headers.insert(header::AUTHORIZATION, auth);
    }
    let body = Bytes::from(json.to_string());
    let pinned = (replica.dp_size() > 1).then_some(rank);
    let hashes: Vec<BlockHash> = p.hashes[..blocks].to_vec();
    let rules = p.rules.clone();
    let applied = rules.policy.lock().apply_to(plan.worker, &hashes, now);
    let pl = PoolLabel {
        pool: pool.name.clone(),
    };
    let m = &fleet.metrics;
    m.warms_sent.get_or_create(&pl).inc();
    m.warm_prompt_tokens
        .get_or_create(&pl)
        .inc_by(tokens as u64);
    let uncached = tokens.saturating_sub(plan.cached_blocks as usize * block_size);
    let guard = InFlight::new(
        replica.clone(),
        rank,
        uncached as u64,
        fleet.changed.clone(),
    );
    tracing::debug!(pool = %pool.name, worker = %plan.worker, tokens, "warming a hot prefix");
    let (fleet, upstream, pool) = (fleet.clone(), upstream.clone(), pool.clone());
    let prompt_tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
    tokio::spawn(async move {
        let timeout = fleet.settings.timeouts.first_byte();
        let sent = tokio::time::timeout(timeout, async {
            let req = Outgoing {
                method: &Method::POST,
                path_and_query: &PathAndQuery::from_static("/v1/completions"),
                headers: &Headers::Map(headers),
                body: &body,
                rank: pinned,
            };
            let resp = upstream
                .send(&replica.endpoint, &req, || ())
                .await
                .map_err(|e| error_chain(&e))?;
            let status = resp.status;
            let bytes = Limited::new(resp.body, RESPONSE_LIMIT)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("answered {status}"));
            }
            let mut usage = UsageScanner::default();
            usage.feed(&bytes);
            Ok(usage.cached_tokens())
        })
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} ms", timeout.as_millis())));
        drop(guard);
        drop(place);
        let m = &fleet.metrics;
        match sent {
            Ok(cached) => {
                let cached = cached.unwrap_or(0);
                m.warm_cached_tokens.get_or_create(&pl).inc_by(cached);
                m.warm_prefill_gpu_seconds
                    .get_or_create(&pl)
                    .inc_by(pool.savings.prefill_gpu_seconds(prompt_tokens, cached));
            }
            Err(e) => {
                m.warms_failed.get_or_create(&pl).inc();
                rules.policy.lock().undo(applied, &hashes, fleet.now());
                tracing::debug!(pool = %pool.name, replica = %replica.url(), error = %e, "warm failed");
            }
        }
    });
}
