//! Latency series: samples of one operation, their median and p90, printed
//! as a table for people and as JSON for tools.

use std::time::Duration;

use serde_json::json;

/// Samples of one measured operation.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub samples: Vec<Duration>,
}

impl Series {
    /// An empty series called `name`.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            samples: Vec::new(),
        }
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.samples.clone();
        sorted.sort();
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        let index = ((sorted.len() - 1) as f64 * q).round() as usize;
        sorted[index]
    }

    pub fn median(&self) -> Duration {
        self.quantile(0.5)
    }

    pub fn p90(&self) -> Duration {
        self.quantile(0.9)
    }
}

/// A table with median, p90, min and the sample count.
pub fn render(results: &[Series]) -> String {
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1000.0);
    let mut out = format!(
        "{:<48} {:>10} {:>10} {:>10} {:>5}\n",
        "operation", "median ms", "p90 ms", "min ms", "n"
    );
    for series in results {
        let min = series.samples.iter().min().copied().unwrap_or_default();
        out.push_str(&format!(
            "{:<48} {:>10} {:>10} {:>10} {:>5}\n",
            series.name,
            ms(series.median()),
            ms(series.p90()),
            ms(min),
            series.samples.len()
        ));
    }
    out
}

/// The same figures as JSON.
pub fn to_json(results: &[Series]) -> serde_json::Value {
    json!(
        results
            .iter()
            .map(|s| json!({
                "operation": s.name,
                "median_ms": s.median().as_secs_f64() * 1000.0,
                "p90_ms": s.p90().as_secs_f64() * 1000.0,
                "samples": s.samples.len(),
            }))
            .collect::<Vec<_>>()
    )
}
