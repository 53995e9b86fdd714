//! What the reconciler counts and times, as `prometheus-client` metrics the
//! server registers ([`Metrics::register`]) in the registry `/metrics` encodes.

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Upper bounds (seconds) of the duration histograms' buckets.
const BUCKETS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0];

/// The phases a sandbox passes through here, besides running.
const TRANSITIONS: [&str; 4] = ["creating", "restoring", "checkpointing", "deleting"];

/// A duration histogram in seconds (the library's, with our buckets).
#[derive(Debug, Clone)]
pub struct Histogram(prometheus_client::metrics::histogram::Histogram);

impl Default for Histogram {
    fn default() -> Self {
        Self(prometheus_client::metrics::histogram::Histogram::new(
            BUCKETS,
        ))
    }
}

impl Histogram {
    pub fn observe(&self, duration: Duration) {
        self.0.observe(duration.as_secs_f64());
    }
}

/// What `sandboxd_sandboxes{phase}` counts, from the slots at each scrape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Census {
    pub held: usize,
    pub in_transition: Vec<&'static str>,
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub creates: Counter,
    pub checkpoint_seconds: Histogram,
    pub checkpoint_bytes: Counter,
    pub restore_seconds: Histogram,
    /// Handoffs to another instance, from noticing the intent to the release.
    pub handoff_out_seconds: Histogram,
    /// Takeovers (from a live or dead instance), from attach intent to running.
    pub handoff_in_seconds: Histogram,
    pub lost: Counter,
    pub deletes: Counter,
    pub failures: Counter,
}

impl Metrics {
    pub fn add(counter: &Counter, value: u64) {
        counter.inc_by(value);
    }

    /// Registers every series in `registry`; `census` gives the held count and
    /// transitions at each scrape (held, not checkpointing or deleting: running).
    pub fn register(
        &self,
        registry: &mut Registry,
        census: impl Fn() -> Census + Send + Sync + 'static,
    ) {
        registry.register_collector(Box::new(ByPhase {
            census: Box::new(census),
        }));
        let counters = [
            ("sandboxd_creates", "Sandboxes created here", &self.creates),
            (
                "sandboxd_checkpoint_bytes",
                "Bytes of checkpoint images written",
                &self.checkpoint_bytes,
            ),
            (
                "sandboxd_sandboxes_lost",
                "Sandboxes stopped because their lease was lost or they died",
                &self.lost,
            ),
            ("sandboxd_deletes", "Sandboxes deleted here", &self.deletes),
            (
                "sandboxd_start_failures",
                "Creates and restores that failed",
                &self.failures,
            ),
        ];
        // The registry ends each help text with a period.
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        let histograms = [
            (
                "sandboxd_checkpoint_seconds",
                "Checkpoint duration (runtime checkpoint, upload, record)",
                &self.checkpoint_seconds,
            ),
            (
                "sandboxd_restore_seconds",
                "Restore duration (download, verify, runsc restore)",
                &self.restore_seconds,
            ),
            (
                "sandboxd_handoff_out_seconds",
                "Handoffs to another instance: intent noticed to lease released",
                &self.handoff_out_seconds,
            ),
            (
                "sandboxd_handoff_in_seconds",
                "Sandboxes taken over here: attach intent to running",
                &self.handoff_in_seconds,
            ),
        ];
        for (name, help, histogram) in histograms {
            registry.register(name, help, histogram.0.clone());
        }
    }
}

/// `sandboxd_sandboxes{phase}`, computed at each scrape.
struct ByPhase {
    census: Box<dyn Fn() -> Census + Send + Sync>,
}

impl std::fmt::Debug for ByPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByPhase").finish_non_exhaustive()
    }
}

impl Collector for ByPhase {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let census = (self.census)();
        let in_phase = |phase: &str| census.in_transition.iter().filter(|p| **p == phase).count();
        let running = census
            .held
            .saturating_sub(in_phase("checkpointing") + in_phase("deleting"));
        let gauge = ConstGauge::new(0_i64);
        let mut family = encoder.encode_descriptor(
            "sandboxd_sandboxes",
            "Sandboxes on this instance by phase.",
            None,
            gauge.metric_type(),
        )?;
        let phases = std::iter::once(("running", running)).chain(
            TRANSITIONS
                .into_iter()
                .map(|phase| (phase, in_phase(phase))),
        );
        for (phase, count) in phases {
            let labels = [("phase", phase)];
            ConstGauge::new(count as i64).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn render(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn sandboxes_are_counted_by_phase_and_histograms_are_cumulative() {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        let census = Arc::new(std::sync::Mutex::new(Census {
            held: 3,
            in_transition: vec!["checkpointing", "restoring"],
        }));
        let scraped = Arc::clone(&census);
        metrics.register(&mut registry, move || scraped.lock().unwrap().clone());
        metrics
            .checkpoint_seconds
            .observe(Duration::from_millis(300));
        Metrics::add(&metrics.creates, 2);
        let text = render(&registry);
        for series in [
            "sandboxd_sandboxes{phase=\"running\"} 2",
            "sandboxd_sandboxes{phase=\"checkpointing\"} 1",
            "sandboxd_sandboxes{phase=\"restoring\"} 1",
            "sandboxd_checkpoint_seconds_bucket{le=\"0.25\"} 0",
            "sandboxd_checkpoint_seconds_bucket{le=\"0.5\"} 1",
            "sandboxd_checkpoint_seconds_bucket{le=\"+Inf\"} 1",
            "sandboxd_checkpoint_seconds_count 1",
            "sandboxd_creates_total 2",
            "# HELP sandboxd_creates Sandboxes created here.\n",
        ] {
            assert!(text.contains(series), "{series} missing in:\n{text}");
        }
        census.lock().unwrap().in_transition = vec!["restoring"];
        assert!(render(&registry).contains("sandboxd_sandboxes{phase=\"running\"} 3"));
    }
}
