//! The interop harness: drives a real vLLM and holds kinference's core to what the engine did.
//!
//! ```text
//!  test ──HTTP──▶ vLLM ──PUB (connects)──▶ EventPlane (binds) ──▶ Index      (under test)
//!    │             │
//!    │             └──ROUTER (replay)◀──DEALER── EventLog ──▶ CacheModel      (ground truth)
//!    └──/tokenize──▶ token ids ──▶ BlockHasher ──▶ request chains             (under test)
//! ```
//!
//! After every step the harness waits, event-driven and with a deadline, until the replayed log
//! shows the step's effect and the plane has applied that far; then, with the index writer
//! paused, it compares the index with the model folded from the log up to the index's applied
//! sequence number. Disagreements are collected as problems (the test asserts there are none);
//! infrastructure failures (HTTP, timeouts) are errors.
//!
//! Invariant: requests use `max_tokens = 1`, so vLLM caches prompt blocks only, and every
//! cached block is reproducible from `/tokenize` output.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use kinference_events::{
    EventPlane, EventPlaneConfig, SyncState, WorkerConfig, WorkerHealth, WorkerId,
};
use kinference_index::{Index, ReplicaId};
use kinference_vllm::{
    BlockHash, BlockHasher, DpRank, ExtraKeysFormat, HashAlgo, KvEvent, RequestExtras, Tier,
};
use tokio::time::Instant;

use crate::env::{RealVllmEnv, MODEL, TOPIC};
use crate::error::InteropError;
use crate::http::{ChatMessage, Completion, Prompt, ServerCacheConfig, VllmHttp};
use crate::model::{CacheModel, EventLog};
use crate::replay::fetch_replay;

/// Upper bound for one step to show up in the replay log and in the index. Generous: the
/// machine's cores are shared, and a miss here is a failure, not a retry.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the publisher may take to connect to the freshly bound SUB socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// Per-message bound of one replay fetch.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Between replay polls when no live message wakes the harness earlier.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// What one request sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// A completions prompt as text (vLLM adds BOS).
    Text(String),
    /// A completions prompt as token ids (used as given).
    Ids(Vec<u32>),
    /// A chat conversation (template applied, generation prompt added).
    Chat(Vec<ChatMessage>),
}

/// What one step did, for the test's summary table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepReport {
    pub name: String,
    pub prompt_tokens: usize,
    /// Full blocks of the prompt (the request's chain length).
    pub blocks: usize,
    /// Blocks the index said this worker held, before the request.
    pub predicted_blocks: u32,
    /// Tokens vLLM served from its prefix cache.
    pub cached_tokens: u32,
    /// Chain blocks not cached before the request (vLLM had to announce them).
    pub announced: usize,
    /// `BlockRemoved` hashes published during the step.
    pub removed: usize,
    /// The index's applied sequence number when it was compared.
    pub applied_seq: Option<u64>,
    /// Entries the index held for the worker after the step.
    pub entries: usize,
    /// The generated text.
    pub reply: String,
}

/// The result of reproducing every announced block from `/tokenize` output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HashCheck {
    /// Blocks in `BlockStored` events.
    pub stored_blocks: usize,
    /// Of those, blocks whose hash, parent and tokens matched a request chain.
    pub reproduced: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct KnownBlock {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    request: String,
}

/// One replica (DP rank 0) of a real vLLM, its event plane, and the ground truth.
#[derive(Debug)]
pub struct Harness {
    env: RealVllmEnv,
    http: VllmHttp,
    hasher: BlockHasher,
    server: ServerCacheConfig,
    plane: Option<EventPlane>,
    worker: WorkerId,
    log: EventLog,
    known: HashMap<BlockHash, KnownBlock>,
    chains: Vec<(String, Vec<BlockHash>)>,
    problems: Vec<String>,
    /// The first seq this harness saw happen; earlier blocks came from requests it did not send.
    first_seq: u64,
}

impl Harness {
    /// Checks the server's cache settings, builds the hasher for them and subscribes.
    pub async fn connect(env: RealVllmEnv) -> Result<Harness, InteropError> {
        let http = VllmHttp::new(&env.url, MODEL)?;
        if !http.healthy().await? {
            return Err(InteropError::Server(format!("{} is not healthy", env.url)));
        }
        let server = http.cache_config().await?;
        if server.hash_algo != env.hash_algo || !server.prefix_caching {
            return Err(InteropError::Server(format!(
                "server reports {server:?}, the test expects prefix caching with {}",
                env.hash_algo
            )));
        }
        let algo: HashAlgo = env.hash_algo.parse()?;
        let block_size = server.block_size as usize;
        // The server runs without PYTHONHASHSEED (scripts/real-vllm.sh unsets it): default seed.
        let hasher = BlockHasher::new(algo, block_size, None, ExtraKeysFormat::Tagged)?;
        let worker = WorkerId::new(ReplicaId(1), DpRank(0));
        let plane = start_plane(&env, worker).await?;
        let mut harness = Harness {
            env,
            http,
            hasher,
            server,
            plane: Some(plane),
            worker,
            log: EventLog::new(),
            known: HashMap::new(),
            chains: Vec::new(),
            problems: Vec::new(),
            first_seq: 0,
        };
        harness.refresh_log().await?;
        harness.first_seq = harness.log.next_seq();
        Ok(harness)
    }

    pub fn server(&self) -> &ServerCacheConfig {
        &self.server
    }

    pub fn http(&self) -> &VllmHttp {
        &self.http
    }

    pub fn log(&self) -> &EventLog {
        &self.log
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Everything that disagreed so far, one line each.
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    fn plane(&self) -> Result<&EventPlane, InteropError> {
        self.plane
            .as_ref()
            .ok_or_else(|| InteropError::Log("the event plane is not running".into()))
    }

    /// The plane's current health snapshot of the worker.
    pub fn health(&self) -> Result<WorkerHealth, InteropError> {
        self.plane()?
            .health(self.worker)
            .ok_or_else(|| InteropError::Log("worker not subscribed".into()))
    }

    /// Sends one request and checks the index before (its prediction) and after (its content).
    pub async fn request(&mut self, name: &str, req: &Request) -> Result<StepReport, InteropError> {
        self.step(name, req, None).await
    }

    /// Resets vLLM's prefix cache, then sends `probe`: vLLM publishes `AllBlocksCleared` only
    /// with its next engine step, so the probe both flushes and follows the clear.
    pub async fn reset_and_probe(
        &mut self,
        name: &str,
        probe: &Request,
    ) -> Result<StepReport, InteropError> {
        let clears_before = self.log.clear_seqs().len();
        self.http.reset_prefix_cache().await?;
        let report = self.step(name, probe, Some(clears_before)).await?;
        // The probe is the only request since the reset, so it is all the engine can hold.
        let held = self.log.model().held();
        let probe: BTreeSet<BlockHash> = self
            .chains
            .last()
            .map(|(_, c)| c.iter().copied().collect())
            .unwrap_or_default();
        if held != probe {
            self.problem(format!(
                "{name}: after AllBlocksCleared the log holds {} blocks, expected only the probe's {}",
                held.len(),
                probe.len()
            ));
        }
        Ok(report)
    }

    async fn step(
        &mut self,
        name: &str,
        req: &Request,
        clears_before: Option<usize>,
    ) -> Result<StepReport, InteropError> {
        let tokens = self.tokens_of(req).await?;
        let chain = self.remember(name, &tokens);
        let before = self.log.model();
        let predicted = self.predict(&chain)?;
        let mark = self.log.next_seq();
        let completion = self.send(req).await?;
        self.check_usage(name, &tokens, predicted, &completion);
        let want = chain.clone();
        let done = move |log: &EventLog| {
            let cleared = clears_before.is_none_or(|n| log.clear_seqs().len() > n);
            let model = log.model();
            cleared && want.iter().all(|h| model.contains(*h))
        };
        let (applied_seq, entries) = self.settle(name, done).await?;
        let removed = self.removed_since(mark);
        Ok(StepReport {
            name: name.to_owned(),
            prompt_tokens: tokens.len(),
            blocks: chain.len(),
            predicted_blocks: predicted,
            cached_tokens: completion.usage.cached_tokens,
            announced: chain.iter().filter(|h| !before.contains(**h)).count(),
            removed,
            applied_seq,
            entries,
            reply: completion.text,
        })
    }

    async fn tokens_of(&self, req: &Request) -> Result<Vec<u32>, InteropError> {
        match req {
            Request::Text(t) => self.http.tokenize_text(t).await,
            Request::Ids(ids) => Ok(ids.clone()),
            Request::Chat(m) => self.http.tokenize_chat(m).await,
        }
    }

    async fn send(&self, req: &Request) -> Result<Completion, InteropError> {
        match req {
            Request::Text(t) => self.http.complete(&Prompt::Text(t.clone()), 1).await,
            Request::Ids(ids) => self.http.complete(&Prompt::Ids(ids.clone()), 1).await,
            Request::Chat(m) => self.http.chat(m, 1).await,
        }
    }

    /// Hashes the request's full blocks and records them as known blocks.
    fn remember(&mut self, name: &str, tokens: &[u32]) -> Vec<BlockHash> {
        let digests = self.hasher.hash_blocks(tokens, &RequestExtras::default());
        let chain: Vec<BlockHash> = digests.iter().map(|d| d.event_hash()).collect();
        let bs = self.hasher.block_size();
        let mut parent = None;
        for (hash, block) in chain.iter().zip(tokens.chunks_exact(bs)) {
            self.known.entry(*hash).or_insert_with(|| KnownBlock {
                parent,
                tokens: block.to_vec(),
                request: name.to_owned(),
            });
            parent = Some(*hash);
        }
        self.chains.push((name.to_owned(), chain.clone()));
        chain
    }

    /// Blocks from the start of `chain` the index says this worker holds on GPU.
    fn predict(&self, chain: &[BlockHash]) -> Result<u32, InteropError> {
        let index = self.plane()?.index();
        let index = index.read();
        Ok(index
            .longest_prefix(chain)
            .get(self.worker)
            .map_or(0, |c| c.gpu))
    }

    /// vLLM reuses at most `prompt_tokens - 1` tokens (it always computes the last one), in
    /// whole blocks; the index's prediction must give exactly what vLLM served.
    fn check_usage(&mut self, name: &str, tokens: &[u32], predicted: u32, c: &Completion) {
        let bs = self.hasher.block_size();
        if c.usage.prompt_tokens as usize != tokens.len() {
            self.problem(format!(
                "{name}: vLLM counted {} prompt tokens, /tokenize gave {}",
                c.usage.prompt_tokens,
                tokens.len()
            ));
        }
        let reusable = tokens.len().saturating_sub(1) / bs;
        let expected = (predicted as usize).min(reusable) * bs;
        if c.usage.cached_tokens as usize != expected {
            self.problem(format!(
                "{name}: the index predicted {predicted} cached blocks ({expected} tokens), \
                 vLLM served {} cached tokens",
                c.usage.cached_tokens
            ));
        }
    }

    fn removed_since(&self, mark: u64) -> usize {
        let start = usize::try_from(mark).unwrap_or(usize::MAX);
        self.log
            .batches()
            .iter()
            .skip(start)
            .flat_map(|b| &b.batch.events)
            .map(|e| match e {
                KvEvent::BlockRemoved(r) => r.block_hashes.len(),
                _ => 0,
            })
            .sum()
    }

    /// Appends every batch the replay socket has beyond the log; returns how many.
    async fn refresh_log(&mut self) -> Result<usize, InteropError> {
        let batches = fetch_replay(&self.env.replay, self.log.next_seq(), REPLAY_TIMEOUT).await?;
        self.log.extend(batches)
    }

    /// Waits until `done(log)` holds and the plane has applied the whole log, then compares.
    async fn settle(
        &mut self,
        what: &str,
        done: impl Fn(&EventLog) -> bool,
    ) -> Result<(Option<u64>, usize), InteropError> {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        let mut health = self
            .plane()?
            .watch_health(self.worker)
            .ok_or_else(|| InteropError::Log("worker not subscribed".into()))?;
        loop {
            self.refresh_log().await?;
            if done(&self.log) {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(InteropError::Timeout {
                    after: SETTLE_TIMEOUT,
                    what: format!("{what}: its blocks in vLLM's replayed event log"),
                });
            }
            // A live message (health change) wakes us at once; otherwise poll the replay again.
            let _ = tokio::time::timeout(left.min(POLL_INTERVAL), health.changed()).await;
        }
        let target = self.log.latest_seq();
        let left = deadline.saturating_duration_since(Instant::now());
        let waited = self
            .plane()?
            .wait_for(self.worker, left, |h| {
                h.applied_seq >= target && h.sync == SyncState::Synced
            })
            .await;
        if let Err(e) = waited {
            let h = self.health()?;
            return Err(InteropError::Log(format!(
                "{what}: the plane did not apply seq {target:?} in sync ({e}); health: {h:?}"
            )));
        }
        self.compare(what).await
    }

    /// With the writer paused: index content for the worker == model at its applied seq.
    async fn compare(&mut self, what: &str) -> Result<(Option<u64>, usize), InteropError> {
        let pause = self.plane()?.pause_writer().await;
        let health = self.health()?;
        if health.applied_seq > self.log.latest_seq() {
            self.refresh_log().await?;
        }
        let model = match health.applied_seq {
            Some(seq) => self.log.model_through(seq),
            None => CacheModel::default(),
        };
        let handle = self.plane()?.index();
        let (entries, mut diffs) = {
            let index = handle.read();
            let entries = index.worker_entries(self.worker);
            let mut diffs = self.content_diffs(&index, &model);
            diffs.extend(self.prefix_diffs(&index, &model));
            (entries, diffs)
        };
        drop(pause);
        if entries != model.len() {
            diffs.insert(
                0,
                format!(
                    "index holds {entries} entries, the engine's log {} blocks",
                    model.len()
                ),
            );
        }
        self.check_health(what, &health);
        for d in diffs {
            self.problem(format!("{what} (seq {:?}): {d}", health.applied_seq));
        }
        Ok((health.applied_seq, entries))
    }

    /// Cached blocks the index lacks, and announced blocks it holds although they are gone.
    fn content_diffs(&self, index: &Index, model: &CacheModel) -> Vec<String> {
        let holds = |h: BlockHash| index.holds(self.worker, h, Tier::Gpu);
        let missing: Vec<BlockHash> = model.held().into_iter().filter(|h| !holds(*h)).collect();
        let extra: Vec<BlockHash> = self
            .candidate_hashes()
            .into_iter()
            .filter(|h| holds(*h) && !model.contains(*h))
            .collect();
        let mut diffs = Vec::new();
        if !missing.is_empty() {
            let blocks = self.describe(&missing, model);
            diffs.push(format!(
                "index misses {} cached blocks: {blocks:?}",
                missing.len()
            ));
        }
        if !extra.is_empty() {
            let blocks = self.describe(&extra, model);
            diffs.push(format!(
                "index holds {} evicted blocks: {blocks:?}",
                extra.len()
            ));
        }
        diffs
    }

    /// Every request chain so far: the index's cached prefix must be the engine's.
    fn prefix_diffs(&self, index: &Index, model: &CacheModel) -> Option<String> {
        let wrong: Vec<String> = self
            .chains
            .iter()
            .filter_map(|(request, chain)| {
                let got = index
                    .longest_prefix(chain)
                    .get(self.worker)
                    .map_or(0, |c| c.gpu);
                let want = model.prefix_len(chain);
                (got as usize != want).then(|| format!("{request}: index {got}, engine {want}"))
            })
            .collect();
        (!wrong.is_empty()).then(|| {
            let first: Vec<&str> = wrong.iter().take(4).map(String::as_str).collect();
            format!(
                "cached prefix of {} request chains differs: {}",
                wrong.len(),
                first.join("; ")
            )
        })
    }

    fn check_health(&mut self, what: &str, h: &WorkerHealth) {
        if h.decode_errors > 0 || h.unrecoverable_gaps > 0 || h.resets > 0 {
            self.problem(format!(
                "{what}: health shows decode_errors {}, unrecoverable_gaps {}, resets {}",
                h.decode_errors, h.unrecoverable_gaps, h.resets
            ));
        }
    }

    /// Every hash the index could wrongly hold: all announced or computed ones.
    fn candidate_hashes(&self) -> BTreeSet<BlockHash> {
        let mut all: BTreeSet<BlockHash> = self.known.keys().copied().collect();
        for b in self.log.batches() {
            for e in &b.batch.events {
                let hashes = match e {
                    KvEvent::BlockStored(s) => &s.block_hashes,
                    KvEvent::BlockRemoved(r) => &r.block_hashes,
                    KvEvent::AllBlocksCleared => continue,
                };
                all.extend(hashes.iter().map(|h| h.block_hash()));
            }
        }
        all
    }

    fn describe(&self, hashes: &[BlockHash], model: &CacheModel) -> Vec<String> {
        hashes
            .iter()
            .take(8)
            .map(|h| {
                let from = self.known.get(h).map_or("?", |k| k.request.as_str());
                format!(
                    "{h:?} of {from} ({} copies in the engine)",
                    model.copies(*h)
                )
            })
            .collect()
    }

    fn problem(&mut self, p: String) {
        println!("PROBLEM: {p}");
        self.problems.push(p);
    }

    /// Checks that every block vLLM announced since the harness connected is a block of some
    /// request, computed by `BlockHasher` from `/tokenize` output: same hash, parent and tokens.
    pub fn check_hashes(&mut self) -> Result<HashCheck, InteropError> {
        let mut stored = self.log.stored_blocks()?;
        stored.retain(|b| b.seq >= self.first_seq);
        let mut check = HashCheck {
            stored_blocks: stored.len(),
            reproduced: 0,
        };
        let mut bad = Vec::new();
        for b in &stored {
            match self.known.get(&b.hash) {
                Some(k) if k.parent == b.parent && k.tokens == b.tokens => check.reproduced += 1,
                Some(k) => bad.push(format!(
                    "seq {}: block {:?} matches {}'s hash but parent {:?} vs {:?} or tokens differ",
                    b.seq, b.hash, k.request, b.parent, k.parent
                )),
                None => bad.push(format!(
                    "seq {}: block {:?} (parent {:?}) is not reproduced by any request",
                    b.seq, b.hash, b.parent
                )),
            }
        }
        for p in bad {
            self.problem(p);
        }
        Ok(check)
    }

    /// Stops the event plane and starts a fresh one on the same endpoint: it joins the stream
    /// mid-way and must rebuild the index from vLLM's replay buffer.
    pub async fn restart_plane(&mut self) -> Result<(), InteropError> {
        if let Some(plane) = self.plane.take() {
            plane.shutdown().await;
        }
        self.plane = Some(start_plane(&self.env, self.worker).await?);
        Ok(())
    }

    pub async fn shutdown(mut self) {
        if let Some(plane) = self.plane.take() {
            plane.shutdown().await;
        }
    }
}

/// Binds the events endpoint (vLLM's PUB connects to it) and waits for the publisher.
async fn start_plane(env: &RealVllmEnv, worker: WorkerId) -> Result<EventPlane, InteropError> {
    let plane = EventPlane::start(EventPlaneConfig::default())?;
    let config = WorkerConfig::bind(worker.replica, worker.rank, &env.events)
        .with_replay(&env.replay)
        .with_topic(TOPIC);
    plane.add_worker(config).await?;
    plane
        .wait_for(worker, CONNECT_TIMEOUT, |h| h.connected)
        .await
        .map_err(|e| {
            InteropError::Server(format!(
                "vLLM's publisher did not connect to {} ({e})",
                env.events
            ))
        })?;
    Ok(plane)
}
