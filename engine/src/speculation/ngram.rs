//! Prompt-lookup (n-gram) drafts: when the last `n` tokens occurred earlier in the sequence, the
//! tokens that followed them then are the draft now. Free to compute, and strong on code, edits and
//! anything that quotes its prompt.

/// Up to `k` draft tokens for the sequence `tokens`: the continuation of the most recent earlier
/// occurrence of its longest suffix of `max_n` down to `min_n` tokens. Empty when nothing matches.
pub fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return Vec::new();
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Most recent occurrence first: recent context predicts best. The match must end before the
        // suffix itself starts, so at least one continuation token exists.
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == suffix {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_the_most_recent_match_of_the_longest_suffix() {
        // "1 2 3 4 ... 1 2 3" -> the earlier "1 2 3" was followed by "4 5".
        let t = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(propose(&t, 1, 3, 2), vec![4, 5]);
        // The more recent of two matches wins.
        let t = [7, 8, 1, 7, 8, 2, 7, 8];
        assert_eq!(propose(&t, 1, 2, 1), vec![2]);
        // A longer suffix match beats a shorter, more recent one.
        let t = [5, 6, 7, 1, 6, 7, 2, 9, 5, 6, 7];
        assert_eq!(propose(&t, 1, 3, 1), vec![1]);
    }

    #[test]
    fn drafts_stop_at_the_end_and_nothing_matches_nothing() {
        let t = [1, 2, 1, 2];
        // Suffix "1 2" matched at 0 continues with "1 2" (two tokens left).
        assert_eq!(propose(&t, 1, 2, 8), vec![1, 2]);
        assert!(propose(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose(&[], 1, 3, 4).is_empty());
        assert!(propose(&[1, 1], 1, 3, 0).is_empty());
    }
}
