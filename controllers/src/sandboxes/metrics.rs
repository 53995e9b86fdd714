//! What the reconciler counts and times, rendered in Prometheus' text format
//! by the server's `/metrics`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Upper bounds (seconds) of the duration histograms' buckets.
const BUCKETS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0];

/// A duration histogram: cumulative bucket counts, sum and count.
#[derive(Debug, Default)]
pub struct Histogram {
    state: Mutex<HistogramState>,
}

#[derive(Debug, Default)]
struct HistogramState {
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&self, duration: Duration) {
        let seconds = duration.as_secs_f64();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for (bucket, bound) in state.buckets.iter_mut().zip(BUCKETS) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        state.count += 1;
        state.sum += seconds;
    }

    pub fn count(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (count, bound) in state.buckets.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", state.count);
        let _ = writeln!(out, "{name}_sum {}", state.sum);
        let _ = writeln!(out, "{name}_count {}", state.count);
    }
}

/// The reconciler's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    pub creates: AtomicU64,
    pub checkpoint_seconds: Histogram,
    pub checkpoint_bytes: AtomicU64,
    pub restore_seconds: Histogram,
    /// Sandboxes handed to another instance, timed from noticing the intent
    /// to the release.
    pub handoff_out_seconds: Histogram,
    /// Sandboxes taken over from another instance (or a dead one), timed from
    /// the attach intent to running here.
    pub handoff_in_seconds: Histogram,
    pub lost: AtomicU64,
    pub deletes: AtomicU64,
    pub failures: AtomicU64,
    /// Sandboxes in a transition here right now, by phase.
    transitions: Mutex<std::collections::HashMap<String, &'static str>>,
}

/// Marks a sandbox as in a transition (`creating`, `restoring`,
/// `checkpointing`, `deleting`) until dropped.
#[derive(Debug)]
pub struct InTransition<'a> {
    metrics: &'a Metrics,
    sandbox: String,
}

impl Drop for InTransition<'_> {
    fn drop(&mut self) {
        self.metrics
            .transitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.sandbox);
    }
}

impl Metrics {
    /// Counts `sandbox` under `phase` while the guard lives.
    pub fn in_transition(&self, sandbox: &str, phase: &'static str) -> InTransition<'_> {
        self.transitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox.to_owned(), phase);
        InTransition {
            metrics: self,
            sandbox: sandbox.to_owned(),
        }
    }

    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    /// Prometheus text for every series.
    pub fn render(&self, held: usize) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, value: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        };
        let transitions = self
            .transitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let in_phase = |phase: &str| transitions.values().filter(|p| **p == phase).count();
        let running = held.saturating_sub(in_phase("checkpointing") + in_phase("deleting"));
        let _ = writeln!(
            out,
            "# HELP sandboxd_sandboxes Sandboxes on this instance by phase.\n# TYPE sandboxd_sandboxes gauge\nsandboxd_sandboxes{{phase=\"running\"}} {running}"
        );
        for phase in ["creating", "restoring", "checkpointing", "deleting"] {
            let _ = writeln!(
                out,
                "sandboxd_sandboxes{{phase=\"{phase}\"}} {}",
                in_phase(phase)
            );
        }
        counter(
            &mut out,
            "sandboxd_creates_total",
            "Sandboxes created here.",
            &self.creates,
        );
        counter(
            &mut out,
            "sandboxd_checkpoint_bytes_total",
            "Bytes of checkpoint images written.",
            &self.checkpoint_bytes,
        );
        counter(
            &mut out,
            "sandboxd_sandboxes_lost_total",
            "Sandboxes stopped because their lease was lost or they died.",
            &self.lost,
        );
        counter(
            &mut out,
            "sandboxd_deletes_total",
            "Sandboxes deleted here.",
            &self.deletes,
        );
        counter(
            &mut out,
            "sandboxd_start_failures_total",
            "Creates and restores that failed.",
            &self.failures,
        );
        self.checkpoint_seconds.render(
            &mut out,
            "sandboxd_checkpoint_seconds",
            "Checkpoint duration (runtime checkpoint, upload, record).",
        );
        self.restore_seconds.render(
            &mut out,
            "sandboxd_restore_seconds",
            "Restore duration (download, verify, runsc restore).",
        );
        self.handoff_out_seconds.render(
            &mut out,
            "sandboxd_handoff_out_seconds",
            "Handoffs to another instance: intent noticed to lease released.",
        );
        self.handoff_in_seconds.render(
            &mut out,
            "sandboxd_handoff_in_seconds",
            "Sandboxes taken over here: attach intent to running.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandboxes_are_counted_by_phase_and_histograms_are_cumulative() {
        let metrics = Metrics::default();
        let checkpointing = metrics.in_transition("a", "checkpointing");
        let _restoring = metrics.in_transition("b", "restoring");
        metrics
            .checkpoint_seconds
            .observe(Duration::from_millis(300));
        let text = metrics.render(3);
        assert!(
            text.contains("sandboxd_sandboxes{phase=\"running\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("sandboxd_sandboxes{phase=\"checkpointing\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sandboxd_sandboxes{phase=\"restoring\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sandboxd_checkpoint_seconds_bucket{le=\"0.25\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("sandboxd_checkpoint_seconds_bucket{le=\"0.5\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sandboxd_checkpoint_seconds_bucket{le=\"+Inf\"} 1"),
            "{text}"
        );
        drop(checkpointing);
        assert!(
            metrics
                .render(3)
                .contains("sandboxd_sandboxes{phase=\"running\"} 3")
        );
    }
}
