//! Tests that need nothing outside the process but python3 and the binaries
//! this package builds: no root, no runsc, no emulator. The quick tier.

mod client_library;
mod deploy_files;
mod fuzz_protocol;
mod http_clients;
mod local_store_processes;
mod store_conformance;
mod workspace_release;
