//! Seeded synthetic workloads shared by the index benchmarks: a cluster's cached blocks, the
//! lookup queries against it, and a steady-state stream of store/evict batches.
//!
//! Every hash is a pure function of its coordinates (a splitmix64 finaliser), so queries can
//! name blocks without keeping the 100M-block cluster in a second data structure.

#![allow(dead_code)] // each bench binary uses its own subset

use kinference_index::{Index, ReplicaId, WorkerId};
use kinference_vllm::{
    BlockHash, BlockRemoved, BlockStored, DpRank, GroupIdx, HashValue, KvEvent, KvEventBatch, Tier,
};

/// splitmix64's finaliser: a bijection on u64 with good avalanche, standing in for digests.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub const SYS_PROMPTS: u64 = 16;
pub const SYS_BLOCKS: usize = 16;
pub const SYS_PER_REPLICA: u64 = 8;
pub const CHAIN_BLOCKS: usize = 240;
/// One chain in `HOT_EVERY` is also cached on the next two replicas.
pub const HOT_EVERY: u64 = 20;
pub const QUERY_BLOCKS: usize = SYS_BLOCKS + CHAIN_BLOCKS;

pub fn worker(replica: u32) -> WorkerId {
    WorkerId::new(ReplicaId(replica), DpRank(0))
}

/// The cached state of a cluster of `replicas` replicas with about `blocks` blocks each:
/// - 16 system prompts of 16 blocks; each replica holds 8 of them, so each prompt block is
///   held by half the cluster (wide sharing, as with a common system prompt);
/// - per replica, conversation chains of 240 blocks that follow one of its system prompts;
///   every 20th chain is also on the next two replicas (a hot conversation).
#[derive(Clone, Copy, Debug)]
pub struct Cluster {
    pub replicas: u32,
    pub chains_per_replica: u64,
}

impl Cluster {
    pub fn new(replicas: u32, blocks: usize) -> Self {
        let sys = (SYS_PER_REPLICA as usize) * SYS_BLOCKS;
        let per_chain = CHAIN_BLOCKS as f64 * (1.0 + 2.0 / HOT_EVERY as f64);
        let chains = ((blocks.saturating_sub(sys)) as f64 / per_chain)
            .floor()
            .max(1.0) as u64;
        Cluster {
            replicas,
            chains_per_replica: chains,
        }
    }

    pub fn sys_block(prompt: u64, j: usize) -> BlockHash {
        BlockHash(mix(0x5157_0000_0000 | (prompt << 8) | j as u64))
    }

    /// Block `j` of global chain `chain` (chain ids are replica * chains_per_replica + i).
    pub fn chain_block(chain: u64, j: usize) -> BlockHash {
        BlockHash(mix((1 << 60) | (chain << 8) | j as u64))
    }

    /// A block no replica holds.
    pub fn fresh_block(n: u64) -> BlockHash {
        BlockHash(mix((2 << 60) | n))
    }

    pub fn sys_prompts_of(&self, replica: u32) -> impl Iterator<Item = u64> {
        (0..SYS_PER_REPLICA).map(move |i| (u64::from(replica) + i * 2) % SYS_PROMPTS)
    }

    /// The system prompt a chain follows: one its primary replica holds.
    pub fn prompt_of_chain(&self, chain: u64) -> u64 {
        let replica = (chain / self.chains_per_replica) as u32;
        (u64::from(replica) + (chain % SYS_PER_REPLICA) * 2) % SYS_PROMPTS
    }

    /// Chains replica `r` holds: its own, plus the hot ones of the two replicas before it.
    pub fn chains_of(&self, r: u32) -> Vec<u64> {
        let cpr = self.chains_per_replica;
        let mut chains: Vec<u64> = (0..cpr).map(|i| u64::from(r) * cpr + i).collect();
        for back in 1..=2u32 {
            if r >= back {
                let src = u64::from(r - back);
                chains.extend(
                    (0..cpr)
                        .filter(|i| i % HOT_EVERY == 0)
                        .map(|i| src * cpr + i),
                );
            }
        }
        chains
    }

    pub fn entries(&self) -> usize {
        (0..self.replicas)
            .map(|r| SYS_PER_REPLICA as usize * SYS_BLOCKS + self.chains_of(r).len() * CHAIN_BLOCKS)
            .sum()
    }

    pub fn distinct_blocks(&self) -> usize {
        (SYS_PROMPTS as usize * SYS_BLOCKS)
            + self.replicas as usize * self.chains_per_replica as usize * CHAIN_BLOCKS
    }

    /// Stores everything through `Index::store`, one call per chain (as vLLM's `BlockStored`
    /// for a prefill would).
    pub fn populate(&self, index: &mut Index) {
        let mut buf = Vec::with_capacity(CHAIN_BLOCKS);
        for r in 0..self.replicas {
            let w = worker(r);
            for p in self.sys_prompts_of(r) {
                buf.clear();
                buf.extend((0..SYS_BLOCKS).map(|j| Self::sys_block(p, j)));
                index.store(w, Tier::Gpu, GroupIdx(0), None, &buf);
            }
            for c in self.chains_of(r) {
                buf.clear();
                buf.extend((0..CHAIN_BLOCKS).map(|j| Self::chain_block(c, j)));
                let parent = Self::sys_block(self.prompt_of_chain(c), SYS_BLOCKS - 1);
                index.store(w, Tier::Gpu, GroupIdx(0), Some(parent), &buf);
            }
        }
    }

    fn random_chain(&self, n: u64) -> u64 {
        mix(n) % (u64::from(self.replicas) * self.chains_per_replica)
    }

    fn with_prompt(&self, chain: u64, tail: impl Iterator<Item = BlockHash>) -> Vec<BlockHash> {
        let p = self.prompt_of_chain(chain);
        (0..SYS_BLOCKS)
            .map(|j| Self::sys_block(p, j))
            .chain(tail)
            .collect()
    }

    /// System prompt + a whole cached conversation: 256 blocks held by its replica (three for
    /// hot chains), the first 16 by half the cluster.
    pub fn query_hit(&self, n: u64) -> Vec<BlockHash> {
        let c = self.random_chain(n);
        self.with_prompt(c, (0..CHAIN_BLOCKS).map(|j| Self::chain_block(c, j)))
    }

    /// 256 blocks held by one replica and no shared prefix: a chain plus the first blocks of
    /// the replica's next chain (the index does not care that they are not one conversation).
    pub fn query_hit_private(&self, n: u64) -> Vec<BlockHash> {
        let c = self.random_chain(n);
        let r = c / self.chains_per_replica;
        let i = c % self.chains_per_replica;
        let next = r * self.chains_per_replica + (i + 1) % self.chains_per_replica;
        (0..CHAIN_BLOCKS)
            .map(|j| Self::chain_block(c, j))
            .chain((0..SYS_BLOCKS).map(|j| Self::chain_block(next, j)))
            .collect()
    }

    /// System prompt + the first 112 blocks of a conversation + 128 new blocks.
    pub fn query_partial(&self, n: u64) -> Vec<BlockHash> {
        let c = self.random_chain(n);
        let held = (0..112).map(|j| Self::chain_block(c, j));
        let fresh = (0..128).map(|j| Self::fresh_block(n * 256 + j));
        self.with_prompt(c, held.chain(fresh))
    }

    /// A new conversation on a common system prompt: 16 blocks held by half the cluster.
    pub fn query_prompt_only(&self, n: u64) -> Vec<BlockHash> {
        let c = self.random_chain(n);
        self.with_prompt(
            c,
            (0..CHAIN_BLOCKS as u64).map(|j| Self::fresh_block(n * 256 + j)),
        )
    }

    /// 256 blocks nobody holds.
    pub fn query_miss(&self, n: u64) -> Vec<BlockHash> {
        (0..QUERY_BLOCKS as u64)
            .map(|j| Self::fresh_block((1 << 40) + n * 256 + j))
            .collect()
    }
}

/// Builds one lookup query from a cluster and a query number.
pub type QueryFn = fn(&Cluster, u64) -> Vec<BlockHash>;

/// The lookup cases every benchmark reports, by name.
pub const QUERY_CASES: [(&str, QueryFn); 5] = [
    ("hit", Cluster::query_hit),
    ("hit_private", Cluster::query_hit_private),
    ("partial", Cluster::query_partial),
    ("prompt_only", Cluster::query_prompt_only),
    ("miss", Cluster::query_miss),
];

/// A steady-state event stream: each batch stores `per_step` new chained blocks on one worker
/// (one `BlockStored`) and evicts the `per_step` blocks it stored `depth` steps earlier (one
/// `BlockRemoved` per hash, as vLLM emits them). Workers take turns. The index holds
/// `workers * depth * per_step` entries throughout.
#[derive(Debug)]
pub struct Churn {
    pub workers: u32,
    pub depth: u64,
    pub per_step: usize,
    step: u64,
    batch: KvEventBatch,
}

impl Churn {
    pub fn new(workers: u32, depth: u64, per_step: usize) -> Self {
        let mut events = vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![HashValue::Int(0); per_step],
            parent_block_hash: Some(HashValue::Int(0)),
            block_size: 16,
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        })];
        events.extend((0..per_step).map(|_| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![HashValue::Int(0)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..BlockRemoved::default()
            })
        }));
        Churn {
            workers,
            depth,
            per_step,
            step: 0,
            batch: KvEventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: Some(0),
            },
        }
    }

    fn hash(worker: u32, step: u64, j: usize) -> u64 {
        mix((3 << 60) | (u64::from(worker) << 40) | (step << 8) | j as u64)
    }

    /// Block hashes per batch (stored + removed).
    pub fn hashes_per_batch(&self) -> u64 {
        2 * self.per_step as u64
    }

    pub fn entries(&self) -> usize {
        self.workers as usize * self.depth as usize * self.per_step
    }

    /// Stores the first `depth` steps of every worker, without evictions.
    pub fn prefill(&self, index: &mut Index) {
        let mut buf = Vec::with_capacity(self.per_step);
        for w in 0..self.workers {
            for s in 0..self.depth {
                buf.clear();
                buf.extend((0..self.per_step).map(|j| BlockHash(Self::hash(w, s, j))));
                index.store(worker(w), Tier::Gpu, GroupIdx(0), None, &buf);
            }
        }
    }

    /// The next batch, rewritten in place (a few ns per hash), and its worker.
    pub fn next_batch(&mut self) -> (WorkerId, &KvEventBatch) {
        let w = (self.step % u64::from(self.workers)) as u32;
        let s = self.depth + self.step / u64::from(self.workers);
        let (per_step, depth) = (self.per_step, self.depth);
        let mut events = self.batch.events.iter_mut();
        if let Some(KvEvent::BlockStored(st)) = events.next() {
            for (j, h) in st.block_hashes.iter_mut().enumerate() {
                *h = HashValue::Int(Self::hash(w, s, j));
            }
            st.parent_block_hash = Some(HashValue::Int(Self::hash(w, s - 1, per_step - 1)));
        }
        for (j, ev) in events.enumerate() {
            if let KvEvent::BlockRemoved(r) = ev {
                r.block_hashes[0] = HashValue::Int(Self::hash(w, s - depth, j));
            }
        }
        self.step += 1;
        (worker(w), &self.batch)
    }
}
