//! `/metrics`: one `prometheus-client` registry per server, built by the
//! composition root ([`crate::server::Server`]) from what the instance has
//! (storage counts, the controller, workspace sync), encoded in the
//! OpenMetrics text format at each scrape. The library writes the exposition
//! format; this module only says which series exist and where their values
//! come from.

use std::sync::Arc;

use controllers::sandboxes::SandboxController;
use controllers::store::{Operation, OperationCounts};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::api::admission::Admission;
use crate::runtime::GvisorRuntime;
use crate::workspace::WorkspaceHooks;

/// The `Content-Type` of [`encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The registry of every series this instance reports.
pub fn registry(
    store_operations: &Arc<OperationCounts>,
    controller: Option<&Arc<SandboxController>>,
    workspace_hooks: Option<&Arc<WorkspaceHooks>>,
) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StoreOperations(Arc::clone(store_operations))));
    registry.register_collector(Box::new(Controller(controller.cloned())));
    if let Some(controller) = controller {
        let held = Arc::downgrade(controller);
        controller.metrics().register(&mut registry, move || {
            held.upgrade()
                .map(|controller| controller.census())
                .unwrap_or_default()
        });
    }
    if let Some(hooks) = workspace_hooks {
        registry.register_collector(Box::new(Workspace(Arc::clone(hooks))));
    }
    registry
}

/// Adds the warm pool's series (`sandboxd_warm_pool_*`) of `runtime`.
pub fn register_warm_pool(registry: &mut Registry, runtime: &Arc<GvisorRuntime>) {
    registry.register_collector(Box::new(WarmPool(Arc::downgrade(runtime))));
}

/// Adds the memory ledger's series (`sandboxd_memory_*`, `sandboxd_admission_*`).
pub fn register_admission(registry: &mut Registry, admission: &Arc<Admission>) {
    registry.register_collector(Box::new(Headroom(Arc::downgrade(admission))));
}

/// The registry's series as OpenMetrics text.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    Ok(text)
}

/// A series' value of the family's label (`None`: the family's only,
/// unlabelled series) and its count.
type Series<'a> = (Option<&'a str>, u64);

/// One counter family whose values are read at scrape time: `name` gets the
/// `_total` suffix, each value its `label` (none for `None`).
fn counter_family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    values: &[Series<'_>],
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(name, help, None, ConstCounter::new(0_u64).metric_type())?;
    for (value, count) in values {
        let counter = ConstCounter::new(*count);
        match value {
            Some(value) => counter.encode(family.encode_family(&[(label, *value)])?)?,
            // A series without labels is the family's only one.
            None => return counter.encode(family),
        }
    }
    Ok(())
}

/// `sandboxd_store_operations_total{op}`.
#[derive(Debug)]
struct StoreOperations(Arc<OperationCounts>);

impl Collector for StoreOperations {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let values: Vec<Series<'_>> = Operation::ALL
            .iter()
            .map(|operation| (Some(operation.as_str()), self.0.count(*operation)))
            .collect();
        counter_family(
            &mut encoder,
            "sandboxd_store_operations",
            "Storage operations (GCS requests) made by this instance.",
            "op",
            &values,
        )
    }
}

/// `sandboxd_reconcile_errors_total` and `sandboxd_sandboxes_held` (zero on
/// an instance without a runtime).
#[derive(Debug)]
struct Controller(Option<Arc<SandboxController>>);

impl Collector for Controller {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let errors = self.0.as_ref().map_or(0, |c| c.reconcile_errors());
        let held = self.0.as_ref().map_or(0, |c| c.held_sandboxes().len());
        counter_family(
            &mut encoder,
            "sandboxd_reconcile_errors",
            "Failed reconcile passes (storage errors, invalid documents; each is logged with its reason).",
            "",
            &[(None, errors)],
        )?;
        let gauge = ConstGauge::new(i64::try_from(held).unwrap_or(i64::MAX));
        gauge.encode(encoder.encode_descriptor(
            "sandboxd_sandboxes_held",
            "Sandboxes running on this instance.",
            None,
            gauge.metric_type(),
        )?)
    }
}

/// The workspace sync counters (`docs/workspaces.md`).
#[derive(Debug)]
struct Workspace(Arc<WorkspaceHooks>);

impl Collector for Workspace {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::workspace::WorkspaceMetrics as M;
        let m = self.0.metrics();
        let families: [(&str, &str, &str, Vec<Series<'_>>); 6] = [
            (
                "sandboxd_workspace_syncs",
                "Workspace syncs by direction.",
                "direction",
                vec![
                    (Some("down"), M::get(&m.syncs_down)),
                    (Some("up"), M::get(&m.syncs_up)),
                    (Some("up_unchanged"), M::get(&m.syncs_unchanged)),
                ],
            ),
            (
                "sandboxd_workspace_files",
                "Workspace files moved or examined.",
                "op",
                vec![
                    (Some("uploaded"), M::get(&m.files_uploaded)),
                    (Some("downloaded"), M::get(&m.files_downloaded)),
                    (Some("deleted"), M::get(&m.files_deleted)),
                    (Some("hashed"), M::get(&m.files_hashed)),
                    (Some("refused"), M::get(&m.files_refused)),
                    (Some("missing"), M::get(&m.missing_contents)),
                ],
            ),
            (
                "sandboxd_workspace_bytes",
                "Workspace bytes moved.",
                "op",
                vec![
                    (Some("uploaded"), M::get(&m.bytes_uploaded)),
                    (Some("downloaded"), M::get(&m.bytes_downloaded)),
                ],
            ),
            (
                "sandboxd_workspace_objects_deleted",
                "Unreferenced workspace contents deleted.",
                "",
                vec![(None, M::get(&m.objects_deleted))],
            ),
            (
                "sandboxd_workspace_releases_kept",
                "Contents a sync would have deleted that another writer's commit named again.",
                "",
                vec![(None, M::get(&m.releases_kept))],
            ),
            (
                "sandboxd_workspace_hook_failures",
                "Lifecycle hooks that failed (each is logged).",
                "point",
                vec![
                    (Some("cold_start"), M::get(&m.cold_start_failures)),
                    (Some("after_exec"), M::get(&m.after_exec_failures)),
                    (Some("terminate"), M::get(&m.terminate_failures)),
                ],
            ),
        ];
        for (name, help, label, values) in &families {
            counter_family(&mut encoder, name, help, label, values)?;
        }
        Ok(())
    }
}

/// The warm pool (`runtime/gvisor/pool.rs`): what it keeps and holds, the
/// memory that costs, and how creates fared.
#[derive(Debug)]
struct WarmPool(std::sync::Weak<GvisorRuntime>);

impl Collector for WarmPool {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self
            .0
            .upgrade()
            .map(|runtime| runtime.warm_pool())
            .unwrap_or_default();
        let (staged_ready, staged_taken) = self
            .0
            .upgrade()
            .map_or((0, 0), |runtime| runtime.staged_restores());
        let gauges = [
            (
                "sandboxd_warm_pool_target",
                "Warm sandboxes the pool keeps ready (--warm-pool, less after a shrink).",
                stats.target as u64,
            ),
            (
                "sandboxd_warm_pool_ready",
                "Warm sandboxes ready now.",
                stats.ready as u64,
            ),
            (
                "sandboxd_warm_pool_memory_bytes",
                "Memory the ready warm sandboxes use.",
                stats.memory_bytes,
            ),
            (
                "sandboxd_staged_restores_ready",
                "Handoffs' restores run ahead of their transfers, waiting for them (decision 26).",
                staged_ready as u64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let counters = [
            (
                "sandboxd_warm_pool_hits",
                "Creates that took a warm sandbox.",
                stats.hits,
            ),
            (
                "sandboxd_warm_pool_misses",
                "Creates of the pool's image and network that found none ready (booted cold).",
                stats.misses,
            ),
            (
                "sandboxd_warm_pool_boots",
                "Warm sandboxes booted.",
                stats.boots,
            ),
            (
                "sandboxd_warm_pool_boot_failures",
                "Warm sandbox boots that failed (each is logged).",
                stats.boot_failures,
            ),
            (
                "sandboxd_staged_restores_taken",
                "Handoffs whose restore took up the container restored ahead of the transfer.",
                staged_taken as u64,
            ),
        ];
        for (name, help, value) in counters {
            counter_family(&mut encoder, name, help, "", &[(None, value)])?;
        }
        Ok(())
    }
}

/// The memory ledger (`api/admission`): capacity, what is committed, the
/// headroom, and what admission did.
#[derive(Debug)]
struct Headroom(std::sync::Weak<Admission>);

impl Collector for Headroom {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(headroom) = self.0.upgrade().map(|admission| admission.headroom()) else {
            return Ok(());
        };
        let gauges = [
            (
                "sandboxd_memory_capacity_bytes",
                "Memory sandboxes and the warm pool may commit (the instance's memory minus the reserve).",
                headroom.capacity_bytes,
            ),
            (
                "sandboxd_memory_committed_bytes",
                "Memory committed: each sandbox's limit, and what the warm pool uses.",
                headroom.committed_bytes,
            ),
            (
                "sandboxd_memory_free_bytes",
                "Capacity not committed (the headroom).",
                headroom.free_bytes,
            ),
            (
                "sandboxd_sandbox_memory_limit_bytes",
                "What one sandbox commits (its memory limit).",
                headroom.sandbox_bytes,
            ),
            (
                "sandboxd_admission_evicting",
                "Idle sandboxes asked to leave to make room, not gone yet.",
                headroom.evicting as u64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        counter_family(
            &mut encoder,
            "sandboxd_admission_refusals",
            "Starts refused because the instance was at capacity.",
            "",
            &[(None, headroom.refusals)],
        )?;
        counter_family(
            &mut encoder,
            "sandboxd_admission_evictions",
            "Idle sandboxes checkpointed and released to make room.",
            "",
            &[(None, headroom.evictions)],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_operations_and_held_sandboxes_are_openmetrics_counters_and_gauges() {
        let counts = Arc::new(OperationCounts::default());
        let text = encode(&registry(&counts, None, None)).unwrap();
        for series in [
            "# TYPE sandboxd_store_operations counter",
            "sandboxd_store_operations_total{op=\"put\"} 0",
            "sandboxd_store_operations_total{op=\"get\"} 0",
            "sandboxd_reconcile_errors_total 0",
            "# TYPE sandboxd_sandboxes_held gauge",
            "sandboxd_sandboxes_held 0",
            "# EOF",
        ] {
            assert!(text.contains(series), "{series} missing in:\n{text}");
        }
    }
}
