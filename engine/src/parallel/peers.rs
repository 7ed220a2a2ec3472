//! A tensor-parallel group in one process: rank 0 is the caller's thread (the server's engine
//! thread, or `tp::greedy`), ranks 1..W are [`TpPeers`] threads, each with its own backend, weight
//! shard, KV store and workspace, fed every step's batch by rank 0 while it runs its own shard.
//! Block tables and positions are rank 0's: all ranks address the same KV blocks, each holding its
//! own heads' part of them. [`TpGroup::step`] is the one place a step crosses the group.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{CommError, Communicator, Shard, ThreadComm};
use crate::backend::{Backend, Precision, SeqSpan};
use crate::error::{Error, Result};
use crate::model::{ForwardBatch, Llama, Workspace};
use crate::runner::{Device, WithBackend};

/// A step's batch, owned, so it can cross to the rank threads.
struct OwnedBatch {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    /// (first_token, n_tokens, start_pos, block_table) per sequence.
    spans: Vec<(usize, usize, usize, Vec<u32>)>,
    logit_rows: Vec<usize>,
}

impl OwnedBatch {
    fn from(b: &ForwardBatch<'_>) -> OwnedBatch {
        OwnedBatch {
            tokens: b.tokens.to_vec(),
            positions: b.positions.to_vec(),
            spans: b
                .spans
                .iter()
                .map(|s| {
                    (
                        s.first_token,
                        s.n_tokens,
                        s.start_pos,
                        s.block_table.to_vec(),
                    )
                })
                .collect(),
            logit_rows: b.logit_rows.to_vec(),
        }
    }
}

/// What a peer reports: loaded, or one step done (its logits are rank 0's too, so only errors matter).
type Report = (usize, Result<()>);

pub struct TpPeers {
    jobs: Vec<Sender<Arc<OwnedBatch>>>,
    reports: Receiver<Report>,
    handles: Vec<JoinHandle<()>>,
}

/// Where the peers load from and how big their caches are (the engine's numbers).
pub struct PeerConfig {
    /// Each rank builds its own backend on this device.
    pub device: Device,
    pub model: PathBuf,
    pub precision: Precision,
    pub threads_per_rank: usize,
    pub n_blocks: usize,
    pub block_size: usize,
}

fn peer_main(
    cfg: &PeerConfig,
    comm: &ThreadComm,
    jobs: Receiver<Arc<OwnedBatch>>,
    reports: &Sender<Report>,
) {
    let peer = Peer {
        cfg,
        comm,
        jobs,
        reports,
    };
    if let Err(e) = cfg.device.with_backend(Some(cfg.threads_per_rank), peer) {
        comm.abort();
        let _ = reports.send((comm.rank(), Err(e)));
    }
}

/// One peer rank's life over the backend its device gives: load, then a step per job.
struct Peer<'a> {
    cfg: &'a PeerConfig,
    comm: &'a ThreadComm,
    jobs: Receiver<Arc<OwnedBatch>>,
    reports: &'a Sender<Report>,
}

impl WithBackend for Peer<'_> {
    type Output = ();

    fn run<B: Backend + 'static>(self, backend: B) {
        let Peer {
            cfg,
            comm,
            jobs,
            reports,
        } = self;
        let rank = comm.rank();
        let loaded = (|| -> Result<_> {
            let (store, config) = crate::load::open_weights(&cfg.model)?;
            let shard = Shard {
                rank,
                world: comm.world(),
            };
            let model =
                Llama::load_shard(&backend, config, &store, cfg.precision, shard, |_, _| {})?;
            let kv = backend.kv_store(
                model.config.n_layers,
                cfg.n_blocks,
                cfg.block_size,
                model.local_kv_width(),
                model.config.kv_layout(),
                cfg.precision,
            )?;
            let ws = Workspace::new(&backend)?;
            Ok((model, kv, ws))
        })();
        let (model, mut kv, mut ws) = match loaded {
            Ok(l) => {
                let _ = reports.send((rank, Ok(())));
                l
            }
            Err(e) => {
                comm.abort();
                let _ = reports.send((rank, Err(e)));
                return;
            }
        };
        // Until the engine drops its senders (shutdown) or a step fails.
        while let Ok(job) = jobs.recv() {
            let spans: Vec<SeqSpan> = job
                .spans
                .iter()
                .map(|(first, n, start, table)| SeqSpan {
                    first_token: *first,
                    n_tokens: *n,
                    start_pos: *start,
                    block_table: table,
                    tree: None,
                })
                .collect();
            let batch = ForwardBatch {
                tokens: &job.tokens,
                positions: &job.positions,
                spans: &spans,
                logit_rows: &job.logit_rows,
                fill: None,
            };
            let out = model
                .forward_sharded(&backend, &mut kv, &batch, &mut ws, comm)
                .map(|_| ());
            let failed = out.is_err();
            if failed {
                comm.abort();
            }
            let _ = reports.send((rank, out));
            if failed {
                return;
            }
        }
    }
}

impl TpPeers {
    /// Starts one thread per communicator (ranks 1..W) and waits until each has loaded its shard;
    /// a rank that fails to load fails the whole start with its error.
    pub fn spawn(cfg: PeerConfig, comms: Vec<ThreadComm>) -> Result<TpPeers> {
        let cfg = Arc::new(cfg);
        let (report_tx, reports) = channel();
        let mut jobs = Vec::new();
        let mut handles = Vec::new();
        let n = comms.len();
        for comm in comms {
            let (job_tx, job_rx) = channel();
            jobs.push(job_tx);
            let (cfg, report_tx) = (cfg.clone(), report_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("kiln-tp-rank{}", comm.rank()))
                .spawn(move || peer_main(&cfg, &comm, job_rx, &report_tx))
                .map_err(|e| Error::io(Path::new("kiln-tp thread"), e))?;
            handles.push(handle);
        }
        let peers = TpPeers {
            jobs,
            reports,
            handles,
        };
        for _ in 0..n {
            peers.next_report()?;
        }
        Ok(peers)
    }

    fn next_report(&self) -> Result<()> {
        match self.reports.recv() {
            Ok((_, r)) => r,
            // Every peer thread is gone without a word: one panicked.
            Err(_) => Err(Error::Parallel(super::CommError::PeerFailed { rank: 1 })),
        }
    }

    /// Hands this step's batch to every peer (rank 0 then runs its own shard).
    pub fn submit(&self, batch: &ForwardBatch<'_>) -> Result<()> {
        let job = Arc::new(OwnedBatch::from(batch));
        for (i, tx) in self.jobs.iter().enumerate() {
            tx.send(job.clone())
                .map_err(|_| Error::Parallel(super::CommError::PeerFailed { rank: i + 1 }))?;
        }
        Ok(())
    }

    /// Waits for every peer's step; a peer's own error wins over the echoes of it.
    pub fn collect(&self) -> Result<()> {
        let errors = (0..self.jobs.len()).filter_map(|_| self.next_report().err());
        match cause(errors) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The error that explains a failed step: a rank's own failure, not another rank's `PeerFailed`
/// report of it (the echo), unless echoes are all there is.
fn cause(errors: impl IntoIterator<Item = Error>) -> Option<Error> {
    let mut echo = None;
    for e in errors {
        if matches!(e, Error::Parallel(CommError::PeerFailed { .. })) {
            echo.get_or_insert(e);
        } else {
            return Some(e);
        }
    }
    echo
}

/// Rank 0's side of a group: its communicator and the peer threads.
pub struct TpGroup {
    comm: ThreadComm,
    peers: TpPeers,
}

impl TpGroup {
    /// A group of `world` ranks over `cfg`'s model; returns once ranks 1.. have loaded their shards
    /// (rank 0 loads its own, `Shard { rank: 0, world }`). A collective waiting longer than
    /// `timeout` for a stalled rank fails the group.
    pub fn spawn(cfg: PeerConfig, world: usize, timeout: Duration) -> Result<TpGroup> {
        let mut comms = ThreadComm::group(world, timeout);
        let comm = comms.remove(0);
        let peers = TpPeers::spawn(cfg, comms)?;
        Ok(TpGroup { comm, peers })
    }

    /// One step across the group: the batch to the peers, `rank0` (rank 0's own shard, through
    /// the communicator it is given) meanwhile, then every peer's outcome. Any rank's failure
    /// fails the step with its cause, and the group stays down.
    pub fn step(
        &self,
        batch: &ForwardBatch<'_>,
        rank0: impl FnOnce(&dyn Communicator) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        self.peers.submit(batch)?;
        let mine = rank0(&self.comm);
        if mine.is_err() {
            self.comm.abort();
        }
        let peers = self.peers.collect();
        match (mine, peers) {
            (Ok(logits), Ok(())) => Ok(logits),
            (mine, peers) => Err(cause(mine.err().into_iter().chain(peers.err()))
                .unwrap_or(Error::Parallel(CommError::PeerFailed { rank: 0 }))),
        }
    }
}

impl Drop for TpPeers {
    fn drop(&mut self) {
        self.jobs.clear(); // closes the channels: the peers' loops end
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
