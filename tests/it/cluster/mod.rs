//! Tests of several `sandboxd` processes sharing a bucket on fake-gcs-server
//! (handoffs, crashes, faults, chaos): runsc, root, the emulator.

mod bench_handoff;
mod chaos;
mod e2e_executions;
mod e2e_instances;
mod e2e_proxy;
mod fault_handoff;
mod fault_partition;
mod handoff_gcs_latency;
mod versions;
