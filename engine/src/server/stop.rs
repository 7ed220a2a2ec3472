//! Stop strings over streamed text. A stop string can span several tokens, so text that could still
//! turn into one is held back until it either completes the match (everything from the match on is
//! dropped) or can no longer match (it is released).

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What one piece of text turned into.
#[derive(Debug, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text safe to send now.
    pub emit: String,
    /// A stop string was found: generation ends after `emit`.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome {
                emit: piece.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(piece);
        // The earliest complete match wins.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome {
                emit,
                stopped: true,
            };
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let emit = self.held[..keep].to_string();
        self.held.drain(..keep);
        StopOutcome {
            emit,
            stopped: false,
        }
    }

    /// The held-back text, when generation ended for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            if o.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces() {
        assert_eq!(
            feed(&["\n\n"], &["a", "b\n", "\nc"]),
            ("ab".to_string(), true)
        );
        assert_eq!(
            feed(&["END"], &["x E", "N", "D y"]),
            ("x ".to_string(), true)
        );
    }

    #[test]
    fn partial_match_is_released_when_it_breaks() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("x E").emit, "x ");
        assert_eq!(m.push("Nx").emit, "ENx");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_no_stops_passes_through() {
        assert_eq!(feed(&["b", "a"], &["xab"]), ("x".to_string(), true));
        assert_eq!(feed(&[], &["a", "b"]), ("ab".to_string(), false));
        assert_eq!(feed(&["zz"], &["a", "z"]), ("az".to_string(), false));
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        assert_eq!(feed(&["é!"], &["caf", "é", "!"]), ("caf".to_string(), true));
        assert_eq!(feed(&["éx"], &["é", "é"]), ("éé".to_string(), false));
    }
}
