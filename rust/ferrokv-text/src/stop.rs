//! Stop strings: the per-request text parameters ([`StopStrings`]) and one sequence's search
//! state ([`StopScan`]), mirroring `IncrementalDetokenizer._emit` in python/ferrokv/detokenizer.py.
//!
//! Invariants (all lengths in characters, as in Python):
//! * Empty stop strings are ignored; reported indices are positions in the caller's list.
//! * Searched only once `num_tokens > min_tokens`, and only for matches that end inside the new
//!   delta: the search covers `tail + delta`, where `tail` is the last `max_stop - 1` characters
//!   already decoded. The match that ends first wins (as if the delta came one character at a
//!   time, so the text never holds a stop string), the caller's list order breaking ties.
//! * Without `include_stop_str_in_output` the last `max_stop - 1` characters are held back from
//!   the emitted text (`held`, always a suffix of `tail`), so a partial stop string is never
//!   emitted and then retracted; on a stop the text is cut just before the match (or just after
//!   it with `include_stop_str_in_output`).
//!
//! Costs per delta: O(len(delta) + max_stop) per stop string (`str::find` over the searched
//! window), independent of how long the output already is; no allocation once `tail` has grown.

/// The text parameters of one request, built once and shared by its sequences (`Arc`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStrings {
    stop: Vec<String>,
    /// Character length of each stop string.
    stop_chars: Vec<usize>,
    include_stop_str_in_output: bool,
    min_tokens: u32,
    skip_special_tokens: bool,
    /// Characters of search context kept: max_stop - 1.
    tail_len: usize,
    /// Characters withheld from the emitted text: `tail_len`, or 0 with include_stop_str_in_output.
    holdback: usize,
    /// Some stop string is non-empty (read for every token: kept apart from `stop_chars`).
    any_stop: bool,
}

impl StopStrings {
    pub fn new(stop: Vec<String>, include_stop_str_in_output: bool, min_tokens: u32, skip_special_tokens: bool) -> Self {
        let stop_chars: Vec<usize> = stop.iter().map(|s| s.chars().count()).collect();
        let tail_len = stop_chars.iter().max().copied().unwrap_or(0).saturating_sub(1);
        let holdback = if include_stop_str_in_output { 0 } else { tail_len };
        let any_stop = stop_chars.iter().any(|&n| n > 0);
        StopStrings {
            stop,
            stop_chars,
            include_stop_str_in_output,
            min_tokens,
            skip_special_tokens,
            tail_len,
            holdback,
            any_stop,
        }
    }

    pub fn stop(&self) -> &[String] {
        &self.stop
    }
    pub fn include_stop_str_in_output(&self) -> bool {
        self.include_stop_str_in_output
    }
    pub fn min_tokens(&self) -> u32 {
        self.min_tokens
    }
    pub fn skip_special_tokens(&self) -> bool {
        self.skip_special_tokens
    }
    /// Whether any non-empty stop string is set.
    pub fn has_stop(&self) -> bool {
        self.any_stop
    }
}

/// One sequence's stop-string search state: `tail` (search context) and its held-back suffix.
#[derive(Debug, Default, Clone)]
pub(crate) struct StopScan {
    tail: String,
    tail_chars: usize,
    /// Bytes / chars of `tail`'s suffix not emitted yet.
    held_bytes: usize,
    held_chars: usize,
}

/// Byte offset of the char `n` chars before the end of `s` (0 when `s` has fewer chars).
fn back_chars(s: &str, n: usize) -> usize {
    if n == 0 {
        return s.len();
    }
    s.char_indices().rev().nth(n - 1).map_or(0, |(i, _)| i)
}

impl StopScan {
    /// Takes one newly decoded `delta` (made final by the detokenizer after `num_tokens` tokens);
    /// appends what may be emitted to `out`. Returns the index of the stop string found, if any
    /// (the scan is then cleared and the caller must stop the sequence).
    pub(crate) fn emit(&mut self, p: &StopStrings, num_tokens: u32, delta: &str, out: &mut String) -> Option<u32> {
        if !p.has_stop() {
            out.push_str(delta);
            return None;
        }
        let (base_bytes, base_chars) = (self.tail.len(), self.tail_chars);
        let delta_chars = delta.chars().count();
        self.tail.push_str(delta); // now s = tail + delta
        self.tail_chars += delta_chars;
        if num_tokens > p.min_tokens {
            if let Some((pos, idx)) = self.find(p, base_bytes, base_chars) {
                let cut = if p.include_stop_str_in_output {
                    pos + p.stop[idx].len()
                } else {
                    pos
                };
                let start = base_bytes - self.held_bytes;
                if cut > start {
                    out.push_str(&self.tail[start..cut]);
                }
                self.clear();
                return Some(idx as u32);
            }
        }
        let keep = p.holdback;
        if keep == 0 {
            out.push_str(delta);
        } else {
            let pending_start = base_bytes - self.held_bytes;
            let pending_chars = self.held_chars + delta_chars;
            if pending_chars > keep {
                let held_start = back_chars(&self.tail, keep);
                out.push_str(&self.tail[pending_start..held_start]);
                self.held_bytes = self.tail.len() - held_start;
                self.held_chars = keep;
            } else {
                self.held_bytes = self.tail.len() - pending_start;
                self.held_chars = pending_chars;
            }
        }
        // Keep the last tail_len chars as context (held, at most holdback == tail_len chars, is
        // a suffix of it).
        if self.tail_chars > p.tail_len {
            let from = back_chars(&self.tail, p.tail_len);
            self.tail.drain(..from);
            self.tail_chars = p.tail_len;
        }
        None
    }

    /// The match ending after `base` that ends first, ties to the earlier stop string in the
    /// list: (its byte position, the stop string's index).
    fn find(&self, p: &StopStrings, base_bytes: usize, base_chars: usize) -> Option<(usize, usize)> {
        let s = self.tail.as_str();
        let mut best: Option<(usize, usize)> = None;
        for (idx, (stop, &n)) in p.stop.iter().zip(&p.stop_chars).enumerate() {
            if n == 0 {
                continue;
            }
            // Python: s.find(stop, max(0, base - len(stop) + 1)).
            let back = (n - 1).min(base_chars);
            let from = back_chars(&s[..base_bytes], back);
            if let Some(i) = s[from..].find(stop.as_str()) {
                let end = from + i + stop.len();
                if best.is_none_or(|(pos, j)| end < pos + p.stop[j].len()) {
                    best = Some((from + i, idx));
                }
            }
        }
        best
    }

    /// Releases the held-back text into `out` (end of sequence) and clears the scan.
    pub(crate) fn flush(&mut self, out: &mut String) {
        out.push_str(&self.tail[self.tail.len() - self.held_bytes..]);
        self.clear();
    }

    fn clear(&mut self) {
        self.tail.clear();
        self.tail_chars = 0;
        self.held_bytes = 0;
        self.held_chars = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn of_several_stops_completed_by_one_delta_the_first_to_end_wins_the_list_breaking_ties() {
        let emit = |stop: &[&str], include: bool| {
            let p = StopStrings::new(stop.iter().map(|s| s.to_string()).collect(), include, 0, true);
            let (mut scan, mut out) = (StopScan::default(), String::new());
            let idx = scan.emit(&p, 1, "abcdxyz", &mut out);
            (idx, out)
        };
        assert_eq!(emit(&["xyz", "bc"], true), (Some(1), "abc".to_string()));
        assert_eq!(emit(&["xyz", "bc"], false), (Some(1), "a".to_string()));
        assert_eq!(emit(&["bc", "xyz"], false), (Some(0), "a".to_string()));
        assert_eq!(emit(&["", "q", "dx"], false), (Some(2), "abc".to_string()));
        // "abcd" ends before "bc"'s later match could matter; equal ends go to the list's first.
        assert_eq!(emit(&["cdxy", "abcd"], false), (Some(1), "".to_string()));
        assert_eq!(emit(&["bcd", "cd"], false), (Some(0), "a".to_string()));
        assert_eq!(emit(&["cd", "bcd"], true), (Some(0), "abcd".to_string()));
    }
}
