//! One EAGLE-3 draft step as every tensor-parallel rank runs it. A step names where its input
//! hidden states come from instead of carrying them: each rank holds its own copy of the three
//! sources (the target's captured streams, the last extend's outputs, the previous draft step's
//! outputs), identical on every rank because each rank's residual stream is whole after every
//! all-reduce. So rank 0 hands its peers token ids and row indices, never activations.

use super::eagle3::{DraftBatch, DraftInput, DraftWorkspace, Eagle3Draft};
use crate::backend::{Backend, KvLayout, Precision, SeqSpan};
use crate::error::Result;
use crate::parallel::Communicator;

/// Where a draft step's input rows come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSource {
    /// The target's captured aux-layer streams of the step just run (an extend); the step's
    /// outputs become the extended states.
    Captured,
    /// The last extend's output states (a chain's or tree's first draft step).
    Extended,
    /// The previous draft step's output states (every later draft step).
    Previous,
}

/// One draft step: `tokens[t]` follows the token whose hidden state is row `input_rows[t]` of
/// `source`; `rows` are the rows whose logits and states the step keeps.
#[derive(Clone, Copy)]
pub struct DraftStep<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    pub spans: &'a [SeqSpan<'a>],
    pub source: DraftSource,
    pub input_rows: &'a [usize],
    pub rows: &'a [usize],
}

/// One rank's draft state: the KV of the head's one layer (this rank's KV heads), activations,
/// and the output states later steps read.
pub struct DraftState<B: Backend> {
    kv: B::KvStore,
    ws: DraftWorkspace<B>,
    extended: B::Buffer,
    previous: B::Buffer,
}

impl<B: Backend> DraftState<B> {
    pub fn new(
        backend: &B,
        draft: &Eagle3Draft<B>,
        n_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        // f32 in every mode: the draft only proposes, and its cache is one layer.
        let kv = backend.kv_store(
            1,
            n_blocks,
            block_size,
            draft.kv_width(),
            KvLayout::KeysAndValues,
            Precision::Exact,
        )?;
        Ok(DraftState {
            kv,
            ws: DraftWorkspace::new(backend)?,
            extended: backend.buffer(0, 0)?,
            previous: backend.buffer(0, 0)?,
        })
    }

    /// Runs `step` on this rank (`comm`: the group's, when the draft is one rank's shard) and
    /// returns its logits, `rows.len()` rows of the draft vocabulary. `captured` is the target
    /// step's aux-layer streams (read by a [`DraftSource::Captured`] step only).
    pub fn run(
        &mut self,
        backend: &B,
        draft: &Eagle3Draft<B>,
        target_embed: &B::Matrix,
        captured: &[B::Buffer],
        step: &DraftStep<'_>,
        comm: Option<&dyn Communicator>,
    ) -> Result<Vec<f32>> {
        let batch = DraftBatch {
            tokens: step.tokens,
            positions: step.positions,
            spans: step.spans,
            rows: step.rows,
        };
        let (aux, own);
        let input = match step.source {
            DraftSource::Captured => {
                aux = captured
                    .iter()
                    .map(|c| backend.gather_rows(c, step.input_rows))
                    .collect::<Result<Vec<_>>>()?;
                DraftInput::Target(&aux)
            }
            DraftSource::Extended => {
                own = backend.gather_rows(&self.extended, step.input_rows)?;
                DraftInput::Own(&own)
            }
            DraftSource::Previous => {
                own = backend.gather_rows(&self.previous, step.input_rows)?;
                DraftInput::Own(&own)
            }
        };
        let (kv, ws) = (&mut self.kv, &mut self.ws);
        let out = draft.forward_batch(backend, target_embed, kv, &batch, input, ws, comm)?;
        match step.source {
            DraftSource::Captured => self.extended = out.hidden,
            DraftSource::Extended | DraftSource::Previous => self.previous = out.hidden,
        }
        Ok(out.logits)
    }
}
