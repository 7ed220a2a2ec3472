//! A tensor-parallel group in one process: rank 0 is the caller's thread (the server's engine
//! thread, or `tp::greedy`), ranks 1..W are [`TpPeers`] threads, each with its own backend, weight
//! shard, KV store and workspace, fed every step's batch by rank 0 while it runs its own shard.
//! Block tables and positions are rank 0's: all ranks address the same KV blocks, each holding its
//! own heads' part of them. [`TpGroup::step`] is the one place a step crosses the group.
//!
//! Start-up order: every rank builds its backend on its own device (rank r on GPU r) and joins the
//! group's device communicator at once (NCCL's init is collective); the peers then load their
//! shards while rank 0 loads its own; the KV caches are sized last, once rank 0 knows how much
//! memory its weights left ([`TpGroup::size_caches`]).
//!
//! With an EAGLE-3 head each rank also holds a shard of it, captures the target's aux layers in
//! its own steps, and runs every draft step rank 0 runs ([`TpGroup::draft_step`]): the head's
//! weights are read 1/world per GPU, never whole on rank 0 while the others wait.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{CommError, Communicator, GroupOptions, MoeSplit, Shard, ThreadComm};
use crate::backend::{Backend, Precision, SeqSpan, TreeMask};
use crate::error::{Error, Result};
use crate::model::{
    DraftSource, DraftState, DraftStep, Eagle3Draft, ForwardBatch, Llama, Workspace,
};
use crate::runner::{Device, GraphStep, WithBackend, all_ranks_agree};

/// A sequence's span, owned (its tree mask too: a verify or draft step of tree speculation
/// masks every rank's attention alike), so it can cross to the rank threads.
struct OwnedSpan {
    first_token: usize,
    n_tokens: usize,
    start_pos: usize,
    block_table: Vec<u32>,
    /// The tree mask's base and bit rows.
    tree: Option<(usize, Vec<u64>)>,
}

impl OwnedSpan {
    fn all(spans: &[SeqSpan<'_>]) -> Vec<OwnedSpan> {
        spans
            .iter()
            .map(|s| OwnedSpan {
                first_token: s.first_token,
                n_tokens: s.n_tokens,
                start_pos: s.start_pos,
                block_table: s.block_table.to_vec(),
                tree: s.tree.as_ref().map(|t| (t.base, t.rows.to_vec())),
            })
            .collect()
    }

    fn view(spans: &[OwnedSpan]) -> Vec<SeqSpan<'_>> {
        spans
            .iter()
            .map(|s| SeqSpan {
                first_token: s.first_token,
                n_tokens: s.n_tokens,
                start_pos: s.start_pos,
                block_table: &s.block_table,
                tree: s
                    .tree
                    .as_ref()
                    .map(|(base, rows)| TreeMask { base: *base, rows }),
            })
            .collect()
    }
}

/// A step's batch, owned, so it can cross to the rank threads.
struct OwnedBatch {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    spans: Vec<OwnedSpan>,
    logit_rows: Vec<usize>,
    /// A padded decode step's graph phase, which every rank runs on its own backend.
    graph: Option<GraphStep>,
}

impl OwnedBatch {
    fn from(b: &ForwardBatch<'_>, graph: Option<GraphStep>) -> OwnedBatch {
        OwnedBatch {
            tokens: b.tokens.to_vec(),
            positions: b.positions.to_vec(),
            spans: OwnedSpan::all(b.spans),
            logit_rows: b.logit_rows.to_vec(),
            graph,
        }
    }
}

/// A draft step, owned: token ids and row indices only (each rank holds the states it reads).
struct OwnedDraftStep {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    spans: Vec<OwnedSpan>,
    source: DraftSource,
    input_rows: Vec<usize>,
    rows: Vec<usize>,
}

impl OwnedDraftStep {
    fn from(s: &DraftStep<'_>) -> OwnedDraftStep {
        OwnedDraftStep {
            tokens: s.tokens.to_vec(),
            positions: s.positions.to_vec(),
            spans: OwnedSpan::all(s.spans),
            source: s.source,
            input_rows: s.input_rows.to_vec(),
            rows: s.rows.to_vec(),
        }
    }
}

/// What a peer reports: joined, loaded, cache sized, or one step done (its logits are rank 0's
/// too, so only errors matter).
type Report = (usize, Result<()>);

/// Work rank 0 hands a peer.
enum PeerJob {
    /// Allocate the KV cache (and the draft head's) with this many blocks (once, before the
    /// first step), and one more that padded decode steps write to.
    SizeCache(usize),
    Step(Arc<OwnedBatch>),
    /// One step of the EAGLE-3 head over this rank's shard of it.
    Draft(Arc<OwnedDraftStep>),
    /// Tree speculation's accepted path to consecutive KV slots, as rank 0 moved its own: a
    /// sequence's block table and (from, to) positions. Reports only a failure (the peer then
    /// leaves), which the next step's collect reads in place of that step's report.
    MoveKv(Arc<KvMoves>),
}

/// A sequence's block table and the (from, to) positions of its KV entries to move.
struct KvMoves {
    block_table: Vec<u32>,
    moves: Vec<(usize, usize)>,
}

pub struct TpPeers {
    jobs: Vec<Sender<PeerJob>>,
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
    pub block_size: usize,
    /// How the device collectives are set up (every rank the same).
    pub group: GroupOptions,
    /// How the routed experts are split (rank 0's shard the same).
    pub moe: MoeSplit,
    /// The EAGLE-3 head each rank holds a shard of, when the runner drafts with one.
    pub draft_model: Option<PathBuf>,
}

fn peer_main(
    cfg: &PeerConfig,
    comm: &ThreadComm,
    jobs: Receiver<PeerJob>,
    reports: &Sender<Report>,
) {
    let peer = Peer {
        cfg,
        comm,
        jobs,
        reports,
    };
    let rank = comm.rank();
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        cfg.device
            .with_backend_on(rank, Some(cfg.threads_per_rank), peer)
    }));
    // Rank 0 waits for a report per phase: a rank that cannot run, or panics, still sends one.
    let failure = match run {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(_) => Error::Parallel(CommError::Device {
            rank,
            what: "the rank's thread panicked".into(),
        }),
    };
    comm.abort();
    let _ = reports.send((rank, Err(failure)));
}

/// One peer rank's life over the backend its device gives: load, then a step per job.
struct Peer<'a> {
    cfg: &'a PeerConfig,
    comm: &'a ThreadComm,
    jobs: Receiver<PeerJob>,
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
        let host = comm;
        let rank = comm.rank();
        let fail = |e: Error| {
            comm.abort();
            let _ = reports.send((rank, Err(e)));
        };
        let device_comm = match backend.group_communicator(comm, &cfg.group) {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        let _ = reports.send((rank, Ok(())));
        let comm: &dyn Communicator = device_comm.as_deref().unwrap_or(comm);
        let loaded = (|| -> Result<_> {
            let (store, config) = crate::load::open_weights(&cfg.model)?;
            let shard = Shard {
                rank,
                world: comm.world(),
                moe: cfg.moe,
            };
            let model =
                Llama::load_shard(&backend, config, &store, cfg.precision, shard, |_, _| {})?;
            let mut ws = Workspace::new(&backend)?;
            let draft = match &cfg.draft_model {
                Some(dir) => {
                    let d = Eagle3Draft::load_shard(
                        &backend,
                        dir,
                        &model.config,
                        cfg.precision,
                        shard,
                    )?;
                    // This rank's steps keep what its draft steps read, as rank 0's do.
                    ws.capture_layers = d.aux_layers().to_vec();
                    Some(d)
                }
                None => None,
            };
            Ok((model, ws, draft))
        })();
        let (model, mut ws, draft) = match loaded {
            Ok(l) => {
                let _ = reports.send((rank, Ok(())));
                l
            }
            Err(e) => return fail(e),
        };
        let mut kv = None;
        let mut draft_state = None;
        let early = |what: &str| {
            Err(Error::Device(format!(
                "tensor-parallel rank {rank} got a {what} before its KV cache"
            )))
        };
        // Until the engine drops its senders (shutdown) or a step fails.
        while let Ok(job) = jobs.recv() {
            let out = match job {
                PeerJob::SizeCache(n_blocks) => (|| -> Result<()> {
                    kv = Some(backend.kv_store(
                        model.config.n_layers,
                        n_blocks + 1,
                        cfg.block_size,
                        model.local_kv_width(),
                        model.config.kv_layout(),
                        cfg.precision,
                    )?);
                    if let Some(d) = &draft {
                        draft_state = Some(DraftState::new(&backend, d, n_blocks, cfg.block_size)?);
                    }
                    Ok(())
                })(),
                PeerJob::Step(job) => match kv.as_mut() {
                    Some(kv) => step(&backend, &model, kv, &mut ws, &job, comm, host),
                    None => early("step"),
                },
                PeerJob::Draft(job) => match (&draft, draft_state.as_mut()) {
                    (Some(d), Some(state)) => {
                        let spans = OwnedSpan::view(&job.spans);
                        let step = DraftStep {
                            tokens: &job.tokens,
                            positions: &job.positions,
                            spans: &spans,
                            source: job.source,
                            input_rows: &job.input_rows,
                            rows: &job.rows,
                        };
                        state
                            .run(
                                &backend,
                                d,
                                model.embedding(),
                                &ws.captured,
                                &step,
                                Some(comm),
                            )
                            .map(|_| ())
                    }
                    (None, _) => Err(Error::Device(format!(
                        "tensor-parallel rank {rank} got a draft step without a draft head"
                    ))),
                    (Some(_), None) => early("draft step"),
                },
                PeerJob::MoveKv(job) => {
                    let moved = match kv.as_mut() {
                        Some(kv) => backend.move_kv(kv, &job.block_table, &job.moves),
                        None => early("KV move"),
                    };
                    if moved.is_ok() {
                        continue;
                    }
                    moved
                }
            };
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

/// One step of a peer's shard over the batch rank 0 handed out.
fn step<B: Backend>(
    backend: &B,
    model: &Llama<B>,
    kv: &mut B::KvStore,
    ws: &mut Workspace<B>,
    job: &OwnedBatch,
    comm: &dyn Communicator,
    host: &ThreadComm,
) -> Result<()> {
    let spans = OwnedSpan::view(&job.spans);
    let batch = ForwardBatch {
        tokens: &job.tokens,
        positions: &job.positions,
        spans: &spans,
        logit_rows: &job.logit_rows,
        fill: None,
    };
    match job.graph {
        None => model
            .forward_sharded(backend, kv, &batch, ws, comm)
            .map(|_| ()),
        Some(graph) => {
            // Every rank decides alike whether this replays or records (see `GraphStep::run`).
            graph.run(
                backend,
                |mine| all_ranks_agree(host, mine),
                || model.forward_sharded_in_place(backend, kv, &batch, ws, comm),
            )?;
            if graph.computes() {
                // Its part of the logits gather (and the verdict on the step's collectives).
                model.sharded_logits(backend, ws, batch.logit_rows.len(), comm)?;
            }
            Ok(())
        }
    }
}

impl TpPeers {
    /// Starts one thread per communicator (ranks 1..W), waits until each has joined the group
    /// and loaded its shard; a rank that fails fails the whole start with its error. (A group
    /// whose rank 0 joins a device communicator starts with [`TpGroup::spawn`], which joins
    /// rank 0 while the peers wait for it.)
    pub fn spawn(cfg: PeerConfig, comms: Vec<ThreadComm>) -> Result<TpPeers> {
        let peers = Self::start(cfg, comms)?;
        peers.wait_for_each()?; // joined
        peers.wait_for_each()?; // loaded
        Ok(peers)
    }

    fn start(cfg: PeerConfig, comms: Vec<ThreadComm>) -> Result<TpPeers> {
        let cfg = Arc::new(cfg);
        let (report_tx, reports) = channel();
        let mut jobs = Vec::new();
        let mut handles = Vec::new();
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
        Ok(TpPeers {
            jobs,
            reports,
            handles,
        })
    }

    /// One report from every peer, all of them read (a report left behind would be taken for
    /// the next phase's); the first failure (a peer's own, over echoes of it) wins.
    fn wait_for_each(&self) -> Result<()> {
        let errors: Vec<Error> = (0..self.jobs.len())
            .filter_map(|_| self.next_report().err())
            .collect();
        match cause(errors) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Sizes every peer's KV cache to `n_blocks` blocks (before the first step).
    pub fn size_caches(&self, n_blocks: usize) -> Result<()> {
        self.send(|| PeerJob::SizeCache(n_blocks))?;
        self.wait_for_each()
    }

    fn send(&self, job: impl Fn() -> PeerJob) -> Result<()> {
        for (i, tx) in self.jobs.iter().enumerate() {
            tx.send(job())
                .map_err(|_| Error::Parallel(super::CommError::PeerFailed { rank: i + 1 }))?;
        }
        Ok(())
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
        let job = Arc::new(OwnedBatch::from(batch, None));
        self.send(|| PeerJob::Step(job.clone()))
    }

    /// The failure a peer has already reported, if any, without waiting: a peer that failed a
    /// job no one waited for (a KV move) reported it and left, and a later send finds it gone.
    fn reported_failure(&self) -> Option<Error> {
        cause(std::iter::from_fn(|| self.reports.try_recv().ok()).filter_map(|(_, r)| r.err()))
    }

    /// Waits for every peer's step; a peer's own error wins over the echoes of it.
    pub fn collect(&self) -> Result<()> {
        self.wait_for_each()
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

/// Rank 0's side of a group: its communicators and the peer threads.
pub struct TpGroup {
    comm: ThreadComm,
    /// Rank 0's device communicator, when its backend sums on the device (NCCL).
    device_comm: Option<Box<dyn Communicator>>,
    peers: TpPeers,
}

impl TpGroup {
    /// A group of `world` ranks over `cfg`'s model, rank 0 on `rank0`'s backend; returns once
    /// every rank has joined the group and ranks 1.. have loaded their shards (rank 0 loads its
    /// own, `Shard { rank: 0, world, moe }`, then calls [`TpGroup::size_caches`]). A collective waiting
    /// longer than `timeout` for a stalled rank fails the group.
    pub fn spawn<B: Backend>(
        cfg: PeerConfig,
        world: usize,
        timeout: Duration,
        rank0: &B,
    ) -> Result<TpGroup> {
        let mut comms = ThreadComm::group(world, timeout);
        let comm = comms.remove(0);
        let group = cfg.group;
        let peers = TpPeers::start(cfg, comms)?;
        // Joining is collective on a device communicator: rank 0 joins while the peers do.
        let device_comm = match rank0.group_communicator(&comm, &group) {
            Ok(d) => d,
            Err(e) => {
                comm.abort();
                let peers = peers.wait_for_each().err();
                return Err(cause(std::iter::once(e).chain(peers))
                    .unwrap_or(Error::Parallel(CommError::PeerFailed { rank: 0 })));
            }
        };
        peers.wait_for_each()?; // joined
        peers.wait_for_each()?; // loaded
        Ok(TpGroup {
            comm,
            device_comm,
            peers,
        })
    }

    /// Sizes the peers' KV caches (rank 0 sizes its own the same).
    pub fn size_caches(&self, n_blocks: usize) -> Result<()> {
        self.peers.size_caches(n_blocks)
    }

    /// The communicator rank 0's shard sums over.
    fn rank0_comm(&self) -> &dyn Communicator {
        self.device_comm.as_deref().unwrap_or(&self.comm)
    }

    /// One step across the group: the batch to the peers, `rank0` (rank 0's own shard, through
    /// the communicator it is given) meanwhile, then every peer's outcome. Any rank's failure
    /// fails the step with its cause, and the group stays down.
    pub fn step(
        &self,
        batch: &ForwardBatch<'_>,
        rank0: impl FnOnce(&dyn Communicator) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        self.step_in(batch, None, rank0)
    }

    /// [`TpGroup::step`] for a padded decode step (`graph`: its graph phase, which every rank
    /// runs on its own backend: the graphs hold each rank's collectives, so the ranks' replays
    /// meet in them as eager steps do).
    pub fn step_in(
        &self,
        batch: &ForwardBatch<'_>,
        graph: Option<GraphStep>,
        rank0: impl FnOnce(&dyn Communicator) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        let job = Arc::new(OwnedBatch::from(batch, graph));
        self.across(|| PeerJob::Step(job.clone()), rank0)
    }

    /// Moves KV entries on every peer as rank 0 moves its own ([`Backend::move_kv`]: a tree's
    /// accepted path), ahead of the next step, without waiting: the peers take jobs in order.
    pub fn move_kv(&self, block_table: &[u32], moves: &[(usize, usize)]) -> Result<()> {
        let job = Arc::new(KvMoves {
            block_table: block_table.to_vec(),
            moves: moves.to_vec(),
        });
        self.peers
            .send(|| PeerJob::MoveKv(job.clone()))
            .map_err(|e| self.send_failed(e))
    }

    /// A job that could not reach every peer: the group goes down, with the cause a peer
    /// reported before it left when there is one (the send's own error only says which peer's
    /// channel was closed).
    fn send_failed(&self, e: Error) -> Error {
        // The peers that got the job must not wait out the deadline for rank 0.
        self.comm.abort();
        let e = self.peers.reported_failure().unwrap_or(e);
        Self::group_down(e)
    }

    /// An error in the type the engine exits on (its service manager restarts the whole
    /// server): whatever failed, the group is down.
    fn group_down(e: Error) -> Error {
        if e.backend_lost() {
            e
        } else {
            Error::Parallel(CommError::GroupDown(e.to_string()))
        }
    }

    /// The group's host communicator (the threads behind the device one), for the ranks to
    /// agree on what a graph step does ([`crate::runner::all_ranks_agree`]).
    pub fn host_comm(&self) -> &ThreadComm {
        &self.comm
    }

    /// One EAGLE-3 draft step across the group, as [`TpGroup::step`]: every peer runs `step`
    /// over its shard of the head while `rank0` runs rank 0's.
    pub fn draft_step(
        &self,
        step: &DraftStep<'_>,
        rank0: impl FnOnce(&dyn Communicator) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        let job = Arc::new(OwnedDraftStep::from(step));
        self.across(|| PeerJob::Draft(job.clone()), rank0)
    }

    fn across(
        &self,
        job: impl Fn() -> PeerJob,
        rank0: impl FnOnce(&dyn Communicator) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        if let Err(e) = self.peers.send(job) {
            return Err(self.send_failed(e));
        }
        let mine = rank0(self.rank0_comm());
        if mine.is_err() {
            self.comm.abort();
        }
        let peers = self.peers.collect();
        match (mine, peers) {
            (Ok(logits), Ok(())) => Ok(logits),
            (mine, peers) => {
                let e = cause(mine.err().into_iter().chain(peers.err()))
                    .unwrap_or(Error::Parallel(CommError::PeerFailed { rank: 0 }));
                self.comm.abort();
                Err(Self::group_down(e))
            }
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
