//! What the modelled bucket saw: one record per request, and the figures a
//! benchmark takes from a window of them: the total, how many were
//! SEQUENTIAL (the longest chain of requests each starting after the
//! previous ended: a lower bound on the round trips the path waited for one
//! after another), the 429s, and the dollar cost.

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
    pub start: Instant,
    pub end: Instant,
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
}
