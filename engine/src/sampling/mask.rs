//! The token mask of structured outputs: which vocabulary ids a sequence may sample at one step.

/// Tokens a sequence may sample at one step (structured outputs): a bit per vocabulary id.
/// Disallowed tokens get `-inf` before sampling, so verification rejects any draft they carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    bits: Vec<u64>,
}

impl TokenMask {
    /// A mask over `vocab` ids allowing exactly `allowed` (ids past `vocab` are ignored).
    pub fn allowing(vocab: usize, allowed: impl IntoIterator<Item = u32>) -> TokenMask {
        let mut bits = vec![0u64; vocab.div_ceil(64)];
        for t in allowed {
            if (t as usize) < vocab {
                bits[t as usize / 64] |= 1 << (t % 64);
            }
        }
        TokenMask { bits }
    }

    /// A mask from its 64-bit words (see [`TokenMask::words`]); bits at or past `vocab` are
    /// cleared.
    pub fn from_words(mut bits: Vec<u64>, vocab: usize) -> TokenMask {
        bits.resize(vocab.div_ceil(64), 0);
        if !vocab.is_multiple_of(64)
            && let Some(last) = bits.last_mut()
        {
            *last &= (1u64 << (vocab % 64)) - 1;
        }
        TokenMask { bits }
    }

    /// Allows `token` too (ids past the mask are ignored).
    pub fn allow(&mut self, token: u32) {
        let t = token as usize;
        if let Some(w) = self.bits.get_mut(t / 64) {
            *w |= 1 << (t % 64);
        }
    }

    /// The mask as 64-bit words, bit `t % 64` of word `t / 64` for token `t` (a device upload).
    pub fn words(&self) -> &[u64] {
        &self.bits
    }

    pub fn allows(&self, token: u32) -> bool {
        let t = token as usize;
        self.bits
            .get(t / 64)
            .is_some_and(|w| w & (1 << (t % 64)) != 0)
    }

    /// Sets every disallowed entry of `logits` (one vocabulary row) to `-inf`.
    pub fn apply(&self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if !self.allows(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// A sequence's output constraint as the runner consults it while it drafts and samples
/// (structured outputs). It answers for the sequence's tokens so far plus a path of draft tokens,
/// and whatever it is asked it ends where it began: drafts the target rejects are never taken
/// back from it, because it never took them.
pub trait TokenGuide: Sync + std::fmt::Debug {
    /// How many of `drafts`, in order, the constraint admits.
    fn admits(&self, drafts: &[u32]) -> usize;
    /// The tokens allowed after `path` (drafts it admits; anything else: a mask allowing none,
    /// for a row verification never reaches).
    fn mask_after(&self, path: &[u32]) -> TokenMask;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_allows_exactly_its_tokens_and_blanks_the_rest() {
        let m = TokenMask::allowing(130, [0, 63, 64, 129, 500]);
        let allowed: Vec<u32> = (0..200).filter(|&t| m.allows(t)).collect();
        assert_eq!(allowed, [0, 63, 64, 129]);
        let mut logits = vec![1.0f32; 130];
        m.apply(&mut logits);
        assert_eq!(logits[63], 1.0);
        assert_eq!(logits[1], f32::NEG_INFINITY);
        assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), 4);
    }
}
