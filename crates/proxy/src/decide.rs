//! Where a request goes, decided in one place: for an OpenAI completion or chat request,
//! body → pool → token ids → block hashes → candidates (index + load) → policy → ranked
//! [`Target`]s ([`route`]); for any other path, the pool's replicas by load ([`by_load`]); and
//! what a decision means when the request lands on a fallback ([`landed`]). Shared by the data
//! plane and `/debug/explain`.
//!
//! Invariants: the body is parsed, never changed; a prompt is tokenized once; the index read
//! lock is taken once (in [`candidates`]) and the policy lock once, for `select` and (on the
//! data plane) `apply` together, so concurrent requests see each other's speculative entries.
//! A prompt the router cannot tokenize (multimodal parts, a template it cannot render) is still
//! forwarded, routed by load only; only a body that is not a request is refused. A replica
//! known to be down is never a target, unless every replica of the pool is: then all are, so a
//! stale health mark costs a retry rather than an instant 503 ([`usable`]). Likewise a worker
//! with `max_in_flight_per_replica` requests in flight is never a candidate while another one
//! has room; [`admit`] makes a request wait for room before it is routed, so all being full at
//! routing time is only a race between requests, and then all stay candidates. With no limit
//! configured none of this costs more than a comparison.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

#[cfg(doc)]
use kinference_policy::Shadow;
use kinference_policy::{Applied, Candidate, Decision, RequestCtx};
use kinference_tokenize::{ChatRequest, CompletionRequest, Reuse, TokenizeError, Tokenizer};
use kinference_vllm::BlockHash;
use kinference_vllm::{BlockDigest, BlockHasher, HashAlgo, HashMemo, Lora, RequestExtras};
use serde::Deserialize;

use crate::api::{CandidateScore, ExplainResponse, Health};
use crate::config::WarmMode;
use crate::error::RequestError;
use crate::fleet::{Fleet, Pool, Replica, Rules};
use crate::heads::HeaderLookup;
use crate::limits::{Admitted, Shed, ShedLabels};
use crate::metrics::{KindLabel, PoolKind, RequestLabels};
use crate::savings::BaselineGuess;

/// Which OpenAI API a routed request uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    Completions,
    Chat,
}

impl Api {
    /// The name `/debug/explain` takes (`?api=`) and answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }

    /// The `route` label of the router's request metrics.
    pub fn route_label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat_completions",
        }
    }
}

/// The request fields read besides the prompt.
#[derive(Deserialize)]
struct Head {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// A parsed request, ready for a decision.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub pool: Arc<Pool>,
    /// The pool's rules when the request was prepared: its hashes are theirs.
    pub rules: Arc<Rules>,
    pub model: String,
    pub hashes: Vec<BlockHash>,
    pub prompt_tokens: u32,
    pub tokenize_error: Option<String>,
    pub session: Option<String>,
    pub ticket: u64,
    /// Only these replicas (`host:port` authorities) may be chosen: a gateway's subset hint.
    pub subset: Option<Vec<String>>,
    /// What a warm of the prompt's prefix is built from; kept only while the pool warms.
    pub warm: Option<WarmSource>,
}

impl Prepared {
    /// What the policy and the baselines read of the request.
    fn ctx(&self) -> RequestCtx<'_> {
        RequestCtx {
            hashes: &self.hashes,
            prompt_tokens: self.prompt_tokens,
            block_size: self.rules.block_size,
            session: self.session.as_deref(),
            ticket: self.ticket,
        }
    }
}

/// The parts of a request a warm repeats: its token ids (a warm sends a prefix of them) and
/// its `cache_salt` (which enters the block hashes).
#[derive(Debug)]
pub(crate) struct WarmSource {
    pub tokens: Vec<u32>,
    pub cache_salt: Option<String>,
}

/// A request body's pool, found from its `model` before any tokenizing (so that a request
/// can wait at its pool's gate first), and the body (`'b`) parsed as its API's request.
pub(crate) struct Looked<'f, 'b> {
    pub pool: &'f Arc<Pool>,
    lora: Option<&'f Lora>,
    head: Head,
    /// The parse, or why it failed: that error is the request's, answered after the pool's
    /// gate as before the body was read once.
    request: Result<Parsed<'b>, TokenizeError>,
}

/// A body parsed as its API's request; its texts without escapes borrow the body.
enum Parsed<'b> {
    /// Boxed: a chat request is large next to a completions one.
    Chat(Box<ChatRequest<'b>>),
    Completions(CompletionRequest<'b>),
}

/// Parses a request body once, as its API's request (which carries `model` and `cache_salt`
/// too), and finds its pool. A body that is no such request is read again for those two alone:
/// it is still routed, or refused, by them.
pub(crate) fn lookup<'f, 'b>(
    fleet: &'f Fleet,
    api: Api,
    body: &'b [u8],
) -> Result<Looked<'f, 'b>, RequestError> {
    let mut request = match api {
        Api::Chat => ChatRequest::from_json(body).map(|r| Parsed::Chat(Box::new(r))),
        Api::Completions => CompletionRequest::from_json(body).map(Parsed::Completions),
    };
    // Moved out: tokenizing reads neither.
    let head = match &mut request {
        Ok(Parsed::Chat(r)) => Head {
            model: r.model.take(),
            cache_salt: r.cache_salt.take(),
        },
        Ok(Parsed::Completions(r)) => Head {
            model: r.model.take(),
            cache_salt: r.cache_salt.take(),
        },
        Err(_) => serde_json::from_slice(body).map_err(|e| {
            RequestError::BadRequest(format!("the body is not a JSON request: {e}"))
        })?,
    };
    let (pool, lora) = fleet.lookup(head.model.as_deref())?;
    Ok(Looked {
        pool,
        lora,
        head,
        request,
    })
}

/// Parses and tokenizes a request body and hashes its prompt's full blocks.
/// With `peek`, the request does not take a ticket (explaining must not move the rotation).
pub(crate) fn prepare(
    fleet: &Fleet,
    api: Api,
    body: &[u8],
    headers: &impl HeaderLookup,
    peek: bool,
) -> Result<Prepared, RequestError> {
    let looked = lookup(fleet, api, body)?;
    prepare_looked(fleet, looked, headers, peek)
}

/// [`prepare`] for a body whose pool was already looked up.
pub(crate) fn prepare_looked(
    fleet: &Fleet,
    looked: Looked<'_, '_>,
    headers: &impl HeaderLookup,
    peek: bool,
) -> Result<Prepared, RequestError> {
    let Looked {
        pool,
        lora,
        head,
        request,
    } = looked;
    let model = head
        .model
        .or_else(|| pool.models.first().cloned())
        .unwrap_or_default();
    let rules = pool.rules();
    let (tokens, reuse, tokenize_error) = match request.and_then(|r| tokenize(&rules, &r)) {
        Ok((t, reuse)) => (t, reuse, None),
        Err(TokenizeError::InvalidRequest(m)) => return Err(RequestError::BadRequest(m)),
        Err(e) => {
            fleet
                .metrics
                .tokenize_fallbacks
                .get_or_create(&PoolKind {
                    pool: pool.name.clone(),
                    kind: e.metric_label(),
                })
                .inc();
            tracing::debug!(pool = %pool.name, kind = e.metric_label(), "routing by load only: the prompt could not be tokenized");
            (Arc::default(), Reuse::default(), Some(e.to_string()))
        }
    };
    let warms = rules.config.warm.mode != WarmMode::Off && !peek;
    let salt = if warms { head.cache_salt.clone() } else { None };
    let hashes = hash(&rules, &tokens, lora, head.cache_salt, &reuse);
    let warms = warms && !hashes.is_empty();
    let session = rules
        .session_header
        .as_ref()
        .and_then(|h| headers.header(h.as_str()))
        // Visible ASCII only, as `HeaderValue::to_str` takes it.
        .filter(|v| v.iter().all(|&b| b == b'\t' || (b' '..=b'~').contains(&b)))
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_owned);
    Ok(Prepared {
        pool: pool.clone(),
        rules,
        model,
        hashes,
        prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        tokenize_error,
        session,
        ticket: if peek {
            pool.peek_ticket()
        } else {
            pool.ticket()
        },
        subset: None,
        warm: warms.then(|| WarmSource {
            tokens: Arc::unwrap_or_clone(tokens),
            cache_salt: salt,
        }),
    })
}

/// The prompt's ids, shared with the prefix cache's entry where it held them.
fn tokenize(rules: &Rules, request: &Parsed<'_>) -> Result<(Arc<Vec<u32>>, Reuse), TokenizeError> {
    match request {
        Parsed::Chat(req) => rules.tokenizer.encode_chat_reuse(req),
        Parsed::Completions(req) => {
            // vLLM runs each prompt of a batch as its own request on the replica that got the
            // batch; the first prompt decides where the batch goes.
            let (prompts, reuse) = rules.tokenizer.encode_completion_request_reuse(req)?;
            Ok((
                Arc::new(prompts.into_iter().next().unwrap_or_default()),
                reuse,
            ))
        }
    }
}

fn hash(
    rules: &Rules,
    tokens: &[u32],
    lora: Option<&Lora>,
    cache_salt: Option<String>,
    reuse: &Reuse,
) -> Vec<BlockHash> {
    if tokens.len() < rules.hasher.block_size() {
        return Vec::new();
    }
    let extras = RequestExtras {
        lora: lora.cloned(),
        cache_salt,
        ..RequestExtras::default()
    };
    if extras.is_empty() {
        chain_hashes(&rules.hasher, &rules.tokenizer, tokens, reuse)
    } else {
        event_hashes(&memo_digests(&rules.hasher, tokens, &extras))
    }
}

fn event_hashes(digests: &[BlockDigest]) -> Vec<BlockHash> {
    digests.iter().map(BlockDigest::event_hash).collect()
}

fn memo_digests(hasher: &BlockHasher, tokens: &[u32], extras: &RequestExtras) -> Vec<BlockDigest> {
    HASH_MEMO.with(|memo| match memo.try_borrow_mut() {
        Ok(mut memo) => hasher.hash_blocks_memo(tokens, extras, &mut memo),
        Err(_) => hasher.hash_blocks(tokens, extras),
    })
}

/// The block hashes of a prompt without extra keys, taking the digests of the blocks whose ids
/// came from a prefix-cache entry from that entry ([`ChainDigests`]), and leaving the prompt's
/// own with the entry the cache stored for it: a conversation's new turn hashes only its new
/// blocks, and a prompt the cache held whole copies no digest.
fn chain_hashes(
    hasher: &BlockHasher,
    tokenizer: &Tokenizer,
    tokens: &[u32],
    reuse: &Reuse,
) -> Vec<BlockHash> {
    let bs = hasher.block_size();
    let key = HasherKey::of(hasher);
    // The special tokens in front of the entry's ids (a completions prompt's BOS) are part of
    // what the kept digests were computed from.
    let front = tokens.get(..reuse.at).unwrap_or_default();
    let reused = reuse.from.as_ref().and_then(|(entry, ids)| {
        let chain = entry.attached()?.downcast_ref::<ChainDigests>()?;
        (chain.key == key && chain.front == front).then_some((chain, reuse.at + *ids))
    });
    // Where the prompt's digests are to be kept: a stored entry without any yet.
    let store = reuse.stored.as_ref().filter(|s| s.attached().is_none());
    let extras = RequestExtras::default();
    let (hashes, digests) = match reused {
        Some((chain, ids)) if ids >= bs && !chain.digests.is_empty() => {
            // Blocks wholly inside the reused ids have the entry's tokens and parents.
            let k = (ids / bs).min(chain.digests.len()).min(tokens.len() / bs);
            let kept = chain.digests.get(..k).unwrap_or_default();
            let new = hasher.hash_blocks_from(kept.last(), tokens, k, &extras);
            let hashes = kept
                .iter()
                .chain(&new)
                .map(BlockDigest::event_hash)
                .collect();
            let digests = store.map(|_| {
                let mut d = Vec::with_capacity(k + new.len());
                d.extend_from_slice(kept);
                d.extend_from_slice(&new);
                d
            });
            (hashes, digests)
        }
        _ => {
            let d = memo_digests(hasher, tokens, &extras);
            (event_hashes(&d), Some(d))
        }
    };
    if let (Some(stored), Some(digests)) = (store, digests) {
        if !digests.is_empty() {
            let bytes = digests.len() * std::mem::size_of::<BlockDigest>() + 64;
            let chain = ChainDigests {
                key,
                front: front.to_vec(),
                digests,
            };
            tokenizer.attach(stored, Box::new(chain), bytes);
        }
    }
    hashes
}

/// What makes two hashers give the same digests to the same blocks without extra keys: the
/// algorithm, the block size, and NONE_HASH (which carries the seed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HasherKey {
    algo: HashAlgo,
    block_size: usize,
    none_hash: BlockDigest,
}

impl HasherKey {
    fn of(h: &BlockHasher) -> Self {
        HasherKey {
            algo: h.algo(),
            block_size: h.block_size(),
            none_hash: *h.none_hash(),
        }
    }
}

/// The digests of a prefix-cache entry's ids, as one pool's hasher computes them (a tokenizer
/// shared by pools with other hashing keeps the first one's).
struct ChainDigests {
    key: HasherKey,
    /// The ids in front of the entry's (special tokens) when these digests were computed.
    front: Vec<u32>,
    digests: Vec<BlockDigest>,
}

thread_local! {
    /// Block digests of the prefixes this thread hashed lately (a fixed 1.1 MiB): a request
    /// stays on its data-plane thread, and shared prefixes come back request after request.
    static HASH_MEMO: RefCell<HashMemo> = RefCell::new(HashMemo::default());
}

/// One replica (and DP rank) to try.
#[derive(Debug)]
pub(crate) struct Target {
    pub replica: Arc<Replica>,
    pub rank: usize,
    /// Send `X-data-parallel-rank` (the replica has several ranks and the policy chose one).
    pub pin_rank: bool,
    /// Prompt tokens the policy expects this worker to serve from cache.
    pub predicted_cached: u32,
}

/// A routed request: its decision and the replicas to try, best first.
#[derive(Debug)]
pub(crate) struct Routed {
    pub prepared: Prepared,
    pub decision: Decision,
    pub targets: Vec<Target>,
    /// The speculative entries the decision recorded, until the outcome is known.
    applied: Applied,
    /// The candidates the decision ranked, for [`observe`].
    candidates: Vec<Candidate>,
    /// When the decision was taken.
    now: Duration,
}

/// Decides where a prepared request goes and records the decision's effects on the policy
/// (speculative entries) under the same lock hold. Only the first `max_targets` of the ranked
/// workers become targets (a data plane tries at most `max_attempts`; at a thousand replicas
/// a target per candidate was a reference count taken and dropped a thousand times).
///
/// The baselines have not seen the request yet: the caller has them [`observe`] it once,
/// where it costs the request least (the data port while the request travels upstream).
pub(crate) fn route(fleet: &Fleet, prepared: Prepared, max_targets: usize) -> Routed {
    let now = fleet.now();
    // One read of the replica set for the ranking and its targets, so that both see the same
    // set (`count_unique_hit` relies on it). Reading it once instead of twice measured -2.1 %
    // router CPU per chat request (39a405e); taking that read off the shared lock as well
    // measured nothing (BENCHMARKS.md, 2026-12-07, midday).
    let all = prepared.pool.replicas();
    let (decision, applied, candidates) = select(&prepared, &all, true, now);
    let targets = decision
        .ranked
        .iter()
        .zip(&decision.scores)
        .take(max_targets)
        .filter_map(|(w, s)| {
            let replica = crate::fleet::find_replica(&all, w.replica)?.clone();
            let pin_rank = replica.dp_size() > 1;
            Some(Target {
                replica,
                rank: w.rank.0 as usize,
                pin_rank,
                predicted_cached: s.predicted_cached_tokens,
            })
        })
        .collect();
    Routed {
        prepared,
        decision,
        targets,
        applied,
        candidates,
        now,
    }
}

/// Shows a routed request to the pool's baselines, and counts the part of its prefix only the
/// chosen replica held (that replica's scale-in cost); answers what each baseline would have
/// found cached. Neither changes the decision, so they run after it, once per request, and
/// never under the policy's lock (they would hold up another request's decision).
pub(crate) fn observe(routed: &Routed) -> Vec<BaselineGuess> {
    let (p, now) = (&routed.prepared, routed.now);
    count_unique_hit(
        p,
        &routed.decision,
        &routed.candidates,
        &routed.targets,
        now,
    );
    let ctx = p.ctx();
    let mut shadows = p.rules.shadows.lock();
    let mut baselines = Vec::with_capacity(shadows.len());
    for s in shadows.iter_mut() {
        let guess = s.observe(&ctx, &routed.candidates, now);
        baselines.push(BaselineGuess {
            policy: s.name(),
            cached_tokens: guess
                .cached_blocks
                .saturating_mul(p.rules.block_size)
                .min(p.prompt_tokens),
        });
    }
    baselines
}

/// The outcome of a routed request: `Some(used)` when `targets[used]` answered with a response
/// head other than 503, `None` when every replica tried refused it (connect failure, 503) or
/// failed before a response head. The speculative entries follow: kept when the first choice
/// answered; taken back otherwise, and when a fallback answered, that worker, not the first
/// choice, now holds the prefix.
pub(crate) fn landed(fleet: &Fleet, routed: &mut Routed, used: Option<usize>) {
    if used == Some(0) {
        return;
    }
    let now = fleet.now();
    let p = &routed.prepared;
    let mut policy = p.rules.policy.lock();
    policy.undo(std::mem::take(&mut routed.applied), &p.hashes, now);
    let Some(t) = used.and_then(|i| routed.targets.get(i)) else {
        drop(policy);
        tracing::debug!(chosen = ?routed.decision.chosen(), "request refused; speculative entries taken back");
        return;
    };
    let mut landed = routed.decision.clone();
    landed.ranked = vec![t.replica.worker(t.rank)];
    // Kept: the fallback answered.
    let _kept = policy.apply(&landed, &p.hashes, now);
    drop(policy);
    tracing::debug!(chosen = ?routed.decision.chosen(), landed = %landed.ranked[0], "request fell back");
}

/// Replicas of `pool` for a request the policy does not rank: the least loaded first (by
/// in-flight requests), ties rotated so that they spread; only those in `subset` if given.
/// Replicas without room (`worker_cap`) are left out while another has some.
pub(crate) fn by_load(pool: &Pool, subset: Option<&[String]>) -> Vec<Target> {
    let ticket = pool.ticket() as usize;
    let cap = pool.worker_cap;
    let all = pool.replicas();
    let mut rs: Vec<_> = usable(&all, subset).collect();
    if cap > 0 {
        // One look at each replica, so that a room taken meanwhile cannot empty the list.
        let roomy: Vec<bool> = rs
            .iter()
            .map(|r| r.workers.iter().any(|w| w.has_room(cap)))
            .collect();
        if roomy.contains(&true) {
            let mut keep = roomy.into_iter();
            rs.retain(|_| keep.next().unwrap_or(true));
        }
    }
    if !rs.is_empty() {
        let n = rs.len();
        rs.rotate_left(ticket % n);
    }
    rs.sort_by_key(|r| r.workers.iter().map(|w| w.load().in_flight).sum::<u32>());
    rs.into_iter()
        .map(|r| {
            let dp = r.dp_size().max(1);
            let first = ticket % dp;
            let rank = (0..dp)
                .map(|i| (first + i) % dp)
                .find(|&k| r.workers.get(k).is_some_and(|w| w.has_room(cap)))
                .unwrap_or(first);
            Target {
                replica: r.clone(),
                rank,
                pin_rank: false,
                predicted_cached: 0,
            }
        })
        .collect()
}

/// The replicas a request may go to: of those in `subset` (all when `None`), every one not
/// known to be down, or all of them when every one is down.
fn usable<'r>(
    replicas: &'r [Arc<Replica>],
    subset: Option<&'r [String]>,
) -> impl Iterator<Item = &'r Arc<Replica>> {
    let allowed = move |r: &&Arc<Replica>| {
        subset.is_none_or(|s| s.iter().any(|a| a == r.endpoint.authority.as_str()))
    };
    let all_down = replicas
        .iter()
        .filter(allowed)
        .all(|r| r.health() == Health::Down);
    replicas
        .iter()
        .filter(allowed)
        .filter(move |r| all_down || r.health() != Health::Down)
}

/// The workers a request may go to, with their load and cached prefix.
fn candidates(
    pool: &Pool,
    all: &[Arc<Replica>],
    uses_index: bool,
    hashes: &[BlockHash],
    subset: Option<&[String]>,
) -> Vec<Candidate> {
    let matches =
        (uses_index && !hashes.is_empty()).then(|| pool.index.read().longest_prefix(hashes));
    let mut out = Vec::with_capacity(all.len());
    for r in usable(all, subset) {
        let scorable = r.is_scorable();
        for (rank, w) in r.workers.iter().enumerate() {
            let worker = r.worker(rank);
            let cache = matches
                .as_ref()
                .and_then(|m| m.get(worker))
                .unwrap_or_default();
            out.push(Candidate {
                worker,
                load: w.load(),
                cache,
                scorable,
            });
        }
    }
    let cap = pool.worker_cap;
    // Judged on the loads just read: when none has room (requests admitted at the same
    // moment took the last of it), every worker stays a candidate rather than none.
    if cap > 0 && out.iter().any(|c| c.load.in_flight < cap) {
        out.retain(|c| c.load.in_flight < cap);
    }
    out
}

/// Whether a replica the request may go to has room under `worker_cap`; true when the
/// request may go nowhere (the caller answers that, not the wait).
fn has_room(pool: &Pool, subset: Option<&[String]>) -> bool {
    let all = pool.replicas();
    let mut rs = usable(&all, subset).peekable();
    rs.peek().is_none() || rs.any(|r| r.workers.iter().any(|w| w.has_room(pool.worker_cap)))
}

/// Returns once a replica the request may go to has room (`max_in_flight_per_replica`),
/// after a wait in the pool's queue when none has.
async fn room(pool: &Pool, subset: Option<&[String]>) -> Result<(), Shed> {
    let Some(signal) = &pool.room else {
        return Ok(());
    };
    if has_room(pool, subset) {
        return Ok(());
    }
    pool.gate
        .wait_for_room(async {
            loop {
                // Registered before looking, so that a request ending in between still wakes
                // this one.
                let ended = signal.notified();
                tokio::pin!(ended);
                ended.as_mut().enable();
                if has_room(pool, subset) {
                    return;
                }
                ended.await;
            }
        })
        .await
}

/// Ranks the pool's workers for a prepared request. With `apply` (a routed request), the
/// decision's effects on the policy (speculative entries) are recorded under the same lock
/// hold. The candidates come back for [`observe`].
fn select(
    p: &Prepared,
    all: &[Arc<Replica>],
    apply: bool,
    now: Duration,
) -> (Decision, Applied, Vec<Candidate>) {
    let candidates = candidates(
        &p.pool,
        all,
        p.rules.uses_index,
        &p.hashes,
        p.subset.as_deref(),
    );
    let ctx = p.ctx();
    let mut policy = p.rules.policy.lock();
    let decision = policy.select(&ctx, &candidates, now);
    let applied = if apply {
        policy.apply(&decision, &p.hashes, now)
    } else {
        Applied::default()
    };
    drop(policy);
    (decision, applied, candidates)
}

/// Records, for the chosen replica's scale-in cost, the part of the request's prefix it holds
/// cached and no other replica does.
fn count_unique_hit(
    p: &Prepared,
    decision: &Decision,
    candidates: &[Candidate],
    targets: &[Target],
    now: Duration,
) {
    let Some(chosen) = decision.chosen() else {
        return;
    };
    let Some(span) = kinference_policy::unique_span(candidates, chosen.replica) else {
        return;
    };
    // The chosen replica is the first target: both come from the one read of the replica set
    // the ranking's candidates were taken from.
    let (Some(&first), Some(t)) = (
        p.hashes.get(span.start as usize),
        targets.first().filter(|t| t.replica.id == chosen.replica),
    ) else {
        return;
    };
    let r = &t.replica;
    let tokens = span
        .blocks()
        .saturating_mul(p.rules.block_size)
        .min(p.prompt_tokens);
    r.add_unique_hit(first, tokens, now);
}

/// The `/debug/explain` answer for a prepared request.
pub(crate) fn explain(fleet: &Fleet, api: Api, p: &Prepared) -> ExplainResponse {
    let (decision, _, _) = select(p, &p.pool.replicas(), false, fleet.now());
    let candidates = decision
        .scores
        .iter()
        .map(|s| CandidateScore {
            worker: s.worker.to_string(),
            replica: p
                .pool
                .replica(s.worker.replica)
                .map(|r| r.url().to_owned())
                .unwrap_or_default(),
            rank: s.worker.rank.0,
            gpu_blocks: s.gpu_blocks,
            offloaded_blocks: s.offloaded_blocks,
            speculative_blocks: s.speculative_blocks,
            predicted_cached_tokens: s.predicted_cached_tokens,
            load: s.load,
            over_cap: s.over_cap,
            scorable: s.scorable,
            value: s.value,
        })
        .collect();
    ExplainResponse {
        pool: p.pool.name.clone(),
        model: p.model.clone(),
        api: api.as_str().to_owned(),
        prompt_tokens: p.prompt_tokens,
        block_size: p.rules.block_size,
        blocks: p.hashes.len(),
        tokenize_error: p.tokenize_error.clone(),
        policy: decision.policy.to_owned(),
        reason: decision.reason.as_str().to_owned(),
        chosen: decision.chosen().map(|w| w.to_string()),
        candidates,
    }
}

/// A place at `pool`'s gate and room on a replica of `subset` (all when `None`), or the 429
/// (503 when the pool has no usable replica) to answer, counted.
pub(crate) async fn admit(
    fleet: &Fleet,
    pool: &Pool,
    subset: Option<&[String]>,
) -> Result<Admitted, RequestError> {
    let shed = match pool.gate.admit().await {
        Ok(a) => match room(pool, subset).await {
            Ok(()) => return Ok(a),
            Err(shed) => shed,
        },
        Err(shed) => shed,
    };
    let no_replica = pool.replicas().iter().all(|r| r.health() == Health::Down);
    let err = RequestError::Overloaded {
        pool: pool.name.clone(),
        reason: shed.as_str(),
        no_replica,
        retry_after_s: fleet.settings.limits.retry_after_s,
    };
    fleet
        .metrics
        .limits
        .shed
        .get_or_create(&ShedLabels {
            pool: pool.name.clone(),
            reason: shed.as_str(),
            status: err.status().as_u16(),
        })
        .inc();
    Err(err)
}

pub(crate) fn record_decision(fleet: &Fleet, routed: &Routed) {
    let (p, decision) = (&routed.prepared, &routed.decision);
    fleet.metrics.record_decision(
        &p.pool.name,
        decision.policy,
        decision.reason.as_str(),
        p.prompt_tokens,
    );
    tracing::debug!(
        pool = %p.pool.name,
        prompt_tokens = p.prompt_tokens,
        blocks = p.hashes.len(),
        reason = decision.reason.as_str(),
        chosen = ?decision.chosen(),
        "routing decision"
    );
}

/// Counts a request the router answers with its own error (`route` is the metric label).
pub(crate) fn count_rejected(fleet: &Fleet, route: &'static str, err: &RequestError) {
    let status = err.status();
    if status.is_server_error() {
        tracing::warn!(route, error = %err, "request failed");
    } else {
        tracing::debug!(route, error = %err, "request refused");
    }
    let m = &fleet.metrics;
    m.router_errors
        .get_or_create(&KindLabel { kind: err.label() })
        .inc();
    m.requests
        .get_or_create(&RequestLabels {
            route,
            replica: String::new(),
            status: status.as_u16(),
        })
        .inc();
}

#[cfg(test)]
mod tests {
    use kinference_tokenize::TokenizerOptions;
    use kinference_vllm::ExtraKeysFormat;

    use super::*;

    /// Conversations turn by turn (a long shared system prompt, growing histories, exact
    /// repeats, an edited earlier turn), through two hashers sharing one tokenizer, with a
    /// prefix cache small enough to evict: the digests taken from cache entries always equal
    /// the digests computed outright, and entries are reused.
    #[test]
    fn digests_kept_with_cache_entries_equal_computed_ones() {
        let options = TokenizerOptions {
            cache_capacity_bytes: 200_000,
            ..TokenizerOptions::default()
        };
        let dir = kinference_testkit::shared("data/tokenizers/qwen3");
        let tokenizer = Tokenizer::from_dir_with(dir, options).unwrap();
        let hashers = [
            BlockHasher::new(HashAlgo::Sha256, 16, None, ExtraKeysFormat::Tagged).unwrap(),
            BlockHasher::new(HashAlgo::Sha256Cbor, 4, Some("7"), ExtraKeysFormat::Tagged).unwrap(),
        ];
        let system = "You are a careful assistant. ".repeat(40);
        let (mut reused_from_entries, mut kept_checked) = (0, 0);
        let mut next = kinference_testkit::xorshift(0x9e37_79b9_7f4a_7c15u64);
        let mut step = |n: u64| next() % n;
        for conv in 0..12u64 {
            let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
            for turn in 0..6u64 {
                let words = 20 + step(200);
                let text: String = (0..words)
                    .map(|w| format!("w{}-{} ", conv * 7 + turn, (w * 31 + step(50)) % 97))
                    .collect();
                messages.push(serde_json::json!({"role": "user", "content": text}));
                if step(5) == 0 && messages.len() > 2 {
                    // An edited earlier turn: the cached entry shares less.
                    messages[1] =
                        serde_json::json!({"role": "user", "content": format!("edited {turn}")});
                }
                let repeats = 1 + step(2);
                for _ in 0..repeats {
                    let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
                    let req = ChatRequest::from_json(body.as_bytes()).unwrap();
                    let (tokens, reuse) = tokenizer.encode_chat_reuse(&req).unwrap();
                    let h = &hashers[step(2) as usize];
                    if reuse
                        .from
                        .as_ref()
                        .and_then(|(e, _)| e.attached()?.downcast_ref::<ChainDigests>())
                        .is_some_and(|c| c.key == HasherKey::of(h))
                    {
                        reused_from_entries += 1;
                    }
                    let got = chain_hashes(h, &tokenizer, &tokens, &reuse);
                    let want = h.hash_blocks(&tokens, &RequestExtras::default());
                    assert_eq!(got, event_hashes(&want), "conversation {conv} turn {turn}");
                    // What the entry now keeps for the next turn: this prompt's own digests.
                    let kept = reuse
                        .stored
                        .as_ref()
                        .and_then(|e| e.attached()?.downcast_ref::<ChainDigests>())
                        .filter(|c| c.key == HasherKey::of(h));
                    if let Some(c) = kept {
                        assert_eq!(c.digests, want, "conversation {conv} turn {turn}");
                        kept_checked += 1;
                    }
                }
                messages.push(serde_json::json!({"role": "assistant", "content": format!("reply {turn} ").repeat(30)}));
            }
        }
        assert!(
            reused_from_entries > 20 && kept_checked > 20,
            "{reused_from_entries} {kept_checked}"
        );
    }

    /// The same for completions prompts, whose ids carry a BOS in front of the cached ids
    /// (or not, with `add_special_tokens: false`): prompts that grow, share a document, or
    /// repeat with a short new tail, through two hashers and an evicting cache.
    #[test]
    fn completion_digests_kept_with_cache_entries_equal_computed_ones() {
        let options = TokenizerOptions {
            cache_capacity_bytes: 150_000,
            ..TokenizerOptions::default()
        };
        let dir = kinference_testkit::shared("data/tokenizers/llama3.1");
        let tokenizer = Tokenizer::from_dir_with(dir, options).unwrap();
        let hashers = [
            BlockHasher::new(HashAlgo::Sha256, 16, None, ExtraKeysFormat::Tagged).unwrap(),
            BlockHasher::new(HashAlgo::Sha256Cbor, 4, Some("7"), ExtraKeysFormat::Tagged).unwrap(),
        ];
        let mut next = kinference_testkit::xorshift(0x2545_f491_4f6c_dd1du64);
        let mut step = |n: u64| next() % n;
        let docs: Vec<String> = (0..4)
            .map(|d| format!("Document {d}. ") + &"The river runs past the old mill. ".repeat(60))
            .collect();
        let (mut reused_from_entries, mut with_bos) = (0, 0);
        for round in 0..60u64 {
            let mut prompt = docs[step(4) as usize].clone();
            for grow in 0..4u64 {
                let words = 5 + step(80);
                let more: String = (0..words)
                    .map(|w| format!("q{round}-{grow}-{} ", (w * 13 + step(40)) % 71))
                    .collect();
                prompt.push_str(&more);
                let add = step(4) != 0;
                let body =
                    serde_json::json!({"model": "m", "prompt": prompt, "add_special_tokens": add})
                        .to_string();
                let req = CompletionRequest::from_json(body.as_bytes()).unwrap();
                let (prompts, reuse) = tokenizer.encode_completion_request_reuse(&req).unwrap();
                let tokens = &prompts[0];
                assert_eq!(tokens, &tokenizer.encode_uncached(&prompt, add).unwrap());
                let h = &hashers[step(2) as usize];
                if reuse
                    .from
                    .as_ref()
                    .and_then(|(e, _)| e.attached()?.downcast_ref::<ChainDigests>())
                    .is_some_and(|c| c.key == HasherKey::of(h) && c.front == tokens[..reuse.at])
                {
                    reused_from_entries += 1;
                    with_bos += usize::from(reuse.at > 0);
                }
                let got = chain_hashes(h, &tokenizer, tokens, &reuse);
                let want = h.hash_blocks(tokens, &RequestExtras::default());
                assert_eq!(got, event_hashes(&want), "round {round} growth {grow}");
            }
        }
        assert!(
            reused_from_entries > 40 && with_bos > 20,
            "{reused_from_entries} {with_bos}"
        );
    }
}
