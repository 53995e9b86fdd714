//! What the modelled bucket saw: one record per request, and the figures a
//! benchmark takes from a window of them: the total, how many were
//! SEQUENTIAL (the longest chain of requests each starting after the
//! previous ended: a lower bound on the round trips the path waited for one
//! after another), the 429s, and the dollar cost.
//!
//! A poll that found its object as the same instance's previous read had
//! left it (the same generation, or missing again) learnt nothing: a path
//! that polls while another instance works is not waiting on those reads
//! but on the write the poll is for, and then on the one read that saw it.
//! The chain is therefore also counted without them
//! ([`Tally::sequential_news`]), beside the plain count, which keeps them.

use std::collections::HashMap;
use std::time::Instant;

/// How the model treats a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// GET or HEAD of one object (GCS Class B).
    Read,
    /// Any other method: uploads, deletes, rewrites (Class A).
    Write,
    /// A listing (Class A).
    List,
}

/// One request through an instance's proxy.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// The instance whose proxy it went through.
    pub instance: String,
    pub method: String,
    /// The object's name, or `""` (a listing, a bucket request).
    pub object: String,
    pub kind: RequestKind,
    /// The status the client got; 0 when its connection was cut.
    pub status: u16,
    /// A fault the model made: a 429 or 503 answered in the store's place,
    /// or an answer lost after the request was passed on.
    pub injected: bool,
    /// The object's generation the answer named (`x-goog-generation`), if
    /// it named one.
    pub generation: Option<i64>,
    pub start: Instant,
    pub end: Instant,
}

impl RequestRecord {
    /// A read that found the object as `earlier` (the same instance's
    /// previous read of it) had: the same generation, or missing again.
    /// An answer without a generation is never taken for a repeat.
    fn repeats(&self, earlier: &RequestRecord) -> bool {
        self.kind == RequestKind::Read
            && earlier.kind == RequestKind::Read
            && self.status == earlier.status
            && match self.status {
                404 => true,
                200..=299 => self.generation.is_some() && self.generation == earlier.generation,
                _ => false,
            }
    }
}

/// GCS Class A (writes, lists): $0.005 per 1,000.
pub const CLASS_A_DOLLARS: f64 = 0.005 / 1000.0;
/// GCS Class B (reads): $0.0004 per 1,000.
pub const CLASS_B_DOLLARS: f64 = 0.0004 / 1000.0;

/// The figures of a set of requests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tally {
    pub total: usize,
    pub reads: usize,
    pub writes: usize,
    pub lists: usize,
    /// The longest chain of non-overlapping requests.
    pub sequential: usize,
    /// The same, without the reads that found their object as the same
    /// instance's previous read of it had (module docs).
    pub sequential_news: usize,
    /// Requests answered 429 (the mutation rate, or injected).
    pub throttled: usize,
    /// Requests that got a 429 or 503 the model injected at random.
    pub injected: usize,
}

impl Tally {
    pub fn of<'a>(records: impl IntoIterator<Item = &'a RequestRecord>) -> Self {
        let records: Vec<&RequestRecord> = records.into_iter().collect();
        let count = |kind| records.iter().filter(|r| r.kind == kind).count();
        Self {
            total: records.len(),
            reads: count(RequestKind::Read),
            writes: count(RequestKind::Write),
            lists: count(RequestKind::List),
            sequential: sequential(&records),
            sequential_news: sequential(&without_repeated_reads(&records)),
            throttled: records.iter().filter(|r| r.status == 429).count(),
            injected: records.iter().filter(|r| r.injected).count(),
        }
    }

    /// What the requests cost on GCS (every request is billed, 429s too).
    pub fn dollars(&self) -> f64 {
        (self.writes + self.lists) as f64 * CLASS_A_DOLLARS + self.reads as f64 * CLASS_B_DOLLARS
    }
}

/// The largest set of pairwise non-overlapping requests (earliest end
/// first, the optimal interval schedule): requests that followed one another
/// without overlap, so at least this many round trips were waited for one
/// after another. Requests that touch count as overlapping.
pub fn sequential(records: &[&RequestRecord]) -> usize {
    let mut by_end: Vec<(Instant, Instant)> = records.iter().map(|r| (r.end, r.start)).collect();
    by_end.sort();
    let mut chain = 0;
    let mut free_from: Option<Instant> = None;
    for (end, start) in by_end {
        if free_from.is_none_or(|after| start > after) {
            chain += 1;
            free_from = Some(end);
        }
    }
    chain
}

/// `records` without the reads that found their object as the same
/// instance's previous read of it (in the order the reads started) had.
pub fn without_repeated_reads<'a>(records: &[&'a RequestRecord]) -> Vec<&'a RequestRecord> {
    let mut ordered = records.to_vec();
    ordered.sort_by_key(|r| r.start);
    let mut last_read: HashMap<(&str, &str), &RequestRecord> = HashMap::new();
    let mut kept = Vec::with_capacity(ordered.len());
    for record in ordered {
        if record.kind == RequestKind::Read && !record.object.is_empty() {
            let key = (record.instance.as_str(), record.object.as_str());
            let repeat = last_read
                .get(&key)
                .is_some_and(|earlier| record.repeats(earlier));
            last_read.insert(key, record);
            if repeat {
                continue;
            }
        }
        kept.push(record);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn request(base: Instant, from_ms: u64, to_ms: u64, kind: RequestKind) -> RequestRecord {
        RequestRecord {
            instance: "a".to_owned(),
            method: "GET".to_owned(),
            object: "o".to_owned(),
            kind,
            status: 200,
            injected: false,
            generation: None,
            start: base + Duration::from_millis(from_ms),
            end: base + Duration::from_millis(to_ms),
        }
    }

    #[test]
    fn parallel_requests_count_once_in_the_chain() {
        let t = Instant::now();
        let records = [
            // Three in a row...
            request(t, 0, 30, RequestKind::Read),
            request(t, 31, 110, RequestKind::Write),
            request(t, 111, 140, RequestKind::Read),
            // ... two alongside them ...
            request(t, 5, 100, RequestKind::Write),
            request(t, 32, 60, RequestKind::Read),
            // ... and a long one over all.
            request(t, 0, 200, RequestKind::List),
        ];
        let tally = Tally::of(&records);
        assert_eq!(tally.total, 6);
        assert_eq!(tally.sequential, 3);
        assert_eq!((tally.reads, tally.writes, tally.lists), (3, 2, 1));
        let dollars = 3.0 * 0.005 / 1000.0 + 3.0 * 0.0004 / 1000.0;
        assert!((tally.dollars() - dollars).abs() < 1e-12);
        assert_eq!(Tally::of(&[]).sequential, 0);
    }

    #[test]
    fn polls_that_found_nothing_new_are_left_out_of_the_second_chain() {
        let t = Instant::now();
        let poll = |from, to, status, generation| RequestRecord {
            object: "lock.json".to_owned(),
            status,
            generation,
            ..request(t, from, to, RequestKind::Read)
        };
        let records = [
            poll(0, 30, 200, Some(1)),
            poll(55, 85, 200, Some(1)),
            poll(110, 140, 200, Some(1)),
            // The other instance's write lands; the next poll sees it.
            RequestRecord {
                instance: "b".to_owned(),
                object: "lock.json".to_owned(),
                ..request(t, 60, 150, RequestKind::Write)
            },
            poll(165, 195, 200, Some(2)),
            // An answer without a generation is never a repeat.
            poll(220, 250, 200, None),
            poll(275, 305, 200, None),
            // Missing, then missing again: one.
            RequestRecord {
                object: "image".to_owned(),
                ..request(t, 310, 340, RequestKind::Read)
            },
        ];
        let mut missing = records[7].clone();
        missing.status = 404;
        let mut again = missing.clone();
        (again.start, again.end) = (
            t + Duration::from_millis(350),
            t + Duration::from_millis(380),
        );
        let records = [&records[..7], &[missing, again]].concat();
        let tally = Tally::of(&records);
        assert_eq!(tally.sequential, 8);
        // Left: the first poll, the write, the poll that saw it, the two
        // without a generation and the first 404.
        assert_eq!(tally.sequential_news, 6);
    }
}
